"""The native contraction kernels (gemma_jax/kernels/csrc, gemma_jax/kernels/native_dot.py).

Each output must be the written arithmetic's chain bit for bit (gemma_jax.spec.binary32, an
independent NumPy implementation), on every instruction-set path this CPU runs and at every
split of the work over threads: the claim is that neither decides a bit. Shapes are chosen to
cross every loop boundary of the kernels (one row, the register tile's 4 rows and their
remainders, the 16-row limit of the row-streaming loops, the 64-row work items; column
remainders below one vector; chunks of the contraction that are and are not multiples of the
4-term unroll). Special values: ties at the rounding midpoint, signed zeros, subnormal inputs
(read as zero) and results (flushed), and the edge just below 2^-126 where IEEE's two tininess
rules part. Equality is of raw bits.

Every path gives the same bits, so no output tells which path ran: each test also reads the
paths' own work counters (native_dot.path_calls) and requires that the path asked for, and only
it, ran. The work split is crossed as well: row-streaming widths of one 64-column panel and of
several, a last item narrower than the rest, more items than parts in uneven shares, and more
parts than items.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma_jax.kernels import native_build, native_dot
from gemma_jax.spec import binary32 as b32

PATHS = native_dot.available_paths()
# Work items at once: one, even and uneven shares, and more than some calls have items.
PARTS = (1, 2, 3, 4, 8)


def bits(x):
  return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.int32)


def chunked(x, w, chunk):
  """The spec's chunked contraction, with the chunk given (binary32.chunked_dot derives it)."""
  acc = None
  for j in range(x.shape[1] // chunk):
    part = b32.dot(x[:, j * chunk:(j + 1) * chunk], w[j * chunk:(j + 1) * chunk])
    acc = part if acc is None else b32.OPS.add(acc, part)
  return acc


def random(seed, shape, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def on_path(path, compute):
  """compute()'s result as a NumPy array, after checking that the kernels' work ran on `path`
  and on no other path (every path gives the same bits: only their counters tell)."""
  before = native_dot.path_calls()
  out = np.asarray(compute())
  after = native_dot.path_calls()
  ran = {p: after[p] - before[p] for p in after if after[p] != before[p]}
  assert set(ran) == {path}, f'asked for the {path} path, the work ran on {ran}'
  return out


# Matmul shapes (M, K, N, chunk). At most 16 rows stream B row by row in column items whose
# width (a multiple of 64) follows the rows and the parts: 2 x 1000 streams 256 columns per item
# on one part (3 whole items and one of 232), 128 on two to four; 16 x 1100 streams 256 at the
# 16-row limit. More rows are cut into 64 x 128 items: 200 x 130 is 4 x 2 items, shared unevenly
# by 3 parts. 3 x 100 (2 items) and 17 x 65 (1 item) have fewer items than 4 and 8 parts.
@pytest.mark.parametrize('path', PATHS)
@pytest.mark.parametrize('m,k,n,chunk', [(1, 640, 130, 160), (3, 96, 7, 32), (8, 256, 64, 256),
                                         (17, 48, 200, 24), (70, 30, 65, 10), (5, 6, 1, 6),
                                         (2, 96, 1000, 32), (16, 40, 1100, 40), (200, 24, 130, 8),
                                         (3, 32, 100, 16), (17, 64, 65, 32)])
def test_every_path_and_split_gives_the_chain(path, m, k, n, chunk):
  x, w = random(m + k, (m, k)), random(n + k, (k, n))
  want = bits(chunked(x, w, chunk))
  for parts in PARTS:
    dot = native_dot.make_native_dot(path, parts)
    got = on_path(path, lambda: jax.jit(lambda a, b: dot.matmul(a, b, chunk))(x, w))
    assert np.array_equal(bits(got), want), (path, parts)


@pytest.mark.parametrize('path', PATHS)
@pytest.mark.parametrize('m', [1, 4, 9, 16, 33])
def test_packed_panels_give_the_same_bits(path, m):
  k, n, chunk = 160, 192, 40
  x, w = random(m, (m, k)), random(k, (k, n))
  want = bits(chunked(x, w, chunk))
  for parts in PARTS:
    dot = native_dot.make_native_dot(path, parts)
    got = on_path(path, lambda: jax.jit(
        lambda a, b: dot.matmul_packed(a, native_dot.pack(b), chunk))(x, w))
    assert np.array_equal(bits(got), want), (path, parts)


@pytest.mark.parametrize('path', PATHS)
def test_attention_tile_dots_give_the_chain(path):
  b, kv, r, h, tiles, s = 2, 2, 5, 48, 3, 20
  q, keys = random(1, (b, kv, r, h)), random(2, (b, kv, tiles, s, h), 0.5)
  p, v = np.abs(random(3, (b, kv, tiles, r, s))), random(4, (b, kv, tiles, s, h))
  want_s = np.stack([[[chunked(q[i, j], keys[i, j, t].T, 16) for t in range(tiles)]
                      for j in range(kv)] for i in range(b)])
  want_v = np.stack([[[b32.dot(p[i, j, t], v[i, j, t]) for t in range(tiles)]
                      for j in range(kv)] for i in range(b)])
  for parts in PARTS:
    dot = native_dot.make_native_dot(path, parts)
    scores = on_path(path, lambda: jax.jit(lambda a, c: dot.tile_scores(a, c, 16))(q, keys))
    values = on_path(path, lambda: jax.jit(dot.tile_values)(p, v))
    assert np.array_equal(bits(scores), bits(want_s)), (path, parts)
    assert np.array_equal(bits(values), bits(want_v)), (path, parts)


def from_bits(*words):
  return np.array(words, np.uint32).view(np.float32)


# One-term and two-term chains whose exact results sit where rounding and flushing decide:
# (x terms, w terms) of each.
EDGES = {
    # 1 + 2^-24 lies on a midpoint: ties to even (1); a hair above rounds up.
    'tie to even': ([1.0, 2.0 ** -12], [1.0, 2.0 ** -12]),
    'just above a tie': ([1.0, 2.0 ** -12 + 2.0 ** -35], [1.0, 2.0 ** -12]),
    # -2^-70 * 2^-70 underflows to -0 (flushed), and -0 * 0 + -0 is -0: the chunk's result.
    'negative zero': (list(from_bits(0x9C800000, 0x80000000)),
                      list(from_bits(0x1C800000, 0x00000000))),
    # Subnormal inputs read as zero: both products vanish (read as numbers, they are 2^-45).
    'subnormal inputs': (list(from_bits(0x00000010, 0x71800000)),
                         list(from_bits(0x71800000, 0x00000010))),
    # A subnormal result is flushed: 2^-126 * (1 - 2^-23) / 1.
    'subnormal result': (list(from_bits(0x3F7FFFFE, 0x00000000)),
                         list(from_bits(0x00800000, 0x00000000))),
    # (1 - 2^-24) 2^-126 = 2^-126 - 2^-150: on the subnormal grid a tie that rounds up to 2^-126,
    # at 24 bits with an unbounded exponent exact and tiny, so flushed (x86's FTZ, measured).
    'tiny after rounding': (list(from_bits(0x3F7FFFFF, 0x00000000)),
                            list(from_bits(0x00800000, 0x00000000))),
    # (1 - 2^-23)(1 + 2^-23) 2^-126 rounds at 24 bits up to 2^-126: not tiny, kept.
    'rounds up to normal': (list(from_bits(0x3F7FFFFE, 0x00000000)),
                            list(from_bits(0x00800001, 0x00000000))),
}


@pytest.mark.parametrize('path', PATHS)
def test_edges_of_rounding_and_flushing(path):
  # Output (c, c) of xs [cases, 2] @ ws [2, cases] is case c's two-term chain.
  xs = np.array([x for x, _ in EDGES.values()], np.float32)
  ws = np.array([w for _, w in EDGES.values()], np.float32).T
  want = b32.dot(b32.flush(xs), b32.flush(ws))
  got = on_path(path, lambda: jax.jit(
      lambda a, b: native_dot.make_native_dot(path).matmul(a, b, xs.shape[1]))(xs, ws))
  diagonal = np.diagonal(np.asarray(got)), np.diagonal(want)
  assert np.array_equal(bits(diagonal[0]), bits(diagonal[1])), dict(zip(EDGES, zip(*map(
      lambda d: [hex(v) for v in bits(d).view(np.uint32)], diagonal))))
  # The cases are what their names say (so the test cannot pass on easy inputs).
  named = dict(zip(EDGES, bits(diagonal[1]).view(np.uint32)))
  assert named['tie to even'] == 0x3F800000 and named['just above a tie'] == 0x3F800001
  assert named['negative zero'] == 0x80000000 and named['subnormal inputs'] == 0
  assert named['subnormal result'] == 0 and named['tiny after rounding'] == 0
  assert named['rounds up to normal'] == 0x00800000


def test_a_path_this_cpu_lacks_is_refused_by_name():
  missing = [p for p in native_dot.ISAS[1:] if p not in PATHS]
  assert missing  # no CPU has both NEON and AVX
  with pytest.raises(ValueError, match=f'cannot run the native kernel path {missing[0]!r}'):
    native_dot.make_native_dot(missing[0])
  with pytest.raises(ValueError, match="unknown native kernel path 'sse9'"):
    native_dot.make_native_dot('sse9')


def test_the_variable_and_xlas_cap_choose_the_path(monkeypatch):
  x, w = random(1, (4, 32)), random(2, (32, 70))
  monkeypatch.delenv(native_dot.ISA_VARIABLE, raising=False)
  monkeypatch.delenv('XLA_FLAGS', raising=False)
  dot = native_dot.make_native_dot()
  assert dot.isa == PATHS[-1]  # the best this CPU has (the paths run in ISAS order)
  on_path(PATHS[-1], lambda: jax.jit(lambda a, b: dot.matmul(a, b, 32))(x, w))
  monkeypatch.setenv(native_dot.ISA_VARIABLE, 'portable')
  dot = native_dot.make_native_dot()
  assert dot.isa == 'portable'
  on_path('portable', lambda: jax.jit(lambda a, b: dot.matmul(a, b, 32))(x, w))
  monkeypatch.delenv(native_dot.ISA_VARIABLE)
  monkeypatch.setenv('XLA_FLAGS', '--xla_cpu_max_isa=SSE4_2')
  assert native_dot.default_isa() == 'portable'
  monkeypatch.setenv('XLA_FLAGS', '--xla_cpu_max_isa=AVX2')
  assert native_dot.default_isa() == 'avx2'


def test_no_compiler_is_one_line_naming_it(tmp_path):
  env = {**os.environ, 'CXX': '', 'PATH': str(tmp_path), 'GEMMA_JAX_CACHE': str(tmp_path)}
  code = ('from gemma_jax.kernels import native_build\n'
          'try:\n  native_build.library()\nexcept native_build.BuildError as e:\n  print(e)\n')
  done = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True)
  lines = done.stdout.strip().splitlines()
  assert len(lines) == 1 and 'C++17 compiler' in lines[0] and 'eigen' in lines[0], done


def test_the_build_is_keyed_by_its_sources(tmp_path, monkeypatch):
  before = native_build.build_key()
  source = tmp_path / 'csrc'
  source.mkdir()
  for name in native_build.SOURCES:
    (source / name).write_bytes(open(os.path.join(native_build.SOURCE_DIR, name), 'rb').read())
  with open(source / 'chains.h', 'a') as f:
    f.write('\n// an edit\n')
  monkeypatch.setattr(native_build, 'SOURCE_DIR', str(source))
  assert native_build.build_key() != before

def test_a_killed_build_or_a_folder_without_its_library_is_built_over(tmp_path, monkeypatch):
  """What a killed build leaves (a staging folder; a key's folder with objects and no library)
  breaks no later run: the library is built into place and kept."""
  monkeypatch.setenv('GEMMA_JAX_CACHE', str(tmp_path))
  built = []

  def compile_(directory):  # a stand-in for the compiler: the build itself is tested above
    built.append(directory)
    with open(os.path.join(directory, native_build.LIBRARY), 'wb') as f:
      f.write(b'the library')

  monkeypatch.setattr(native_build, '_compile', compile_)
  target = tmp_path / 'native' / native_build.build_key()[:32]
  leftover = tmp_path / 'native' / '.build-killed'
  leftover.mkdir(parents=True)
  (leftover / native_build.LIBRARY).write_bytes(b'half written')
  target.mkdir()
  (target / 'ffi.o').write_bytes(b'an object')
  native_build.library.cache_clear()
  try:
    path = native_build.library()
    assert path == str(target / native_build.LIBRARY) and len(built) == 1
    assert open(path, 'rb').read() == b'the library' and os.listdir(target) == [
        native_build.LIBRARY]
    native_build.library.cache_clear()
    assert native_build.library() == path and len(built) == 1  # kept: not built again
  finally:
    native_build.library.cache_clear()
