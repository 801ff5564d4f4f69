"""The native kernels' edge cases on every path, on this CPU and under QEMU's aarch64 emulator.

A small C++ driver (tests/native_edges: the kernels' own sources, compiled per path with the
library's flags) runs cases written here and the outputs are compared, bit for bit, with the
spec's interpreter (gemma_jax.spec.binary32): the elementwise multiply, divide and FMA and the
spec's exp and tanh (through each path's vectors and its scalar tail), the panel and stream
chains, and attention. The cases sit where the hardware's rules and the spec's can part: results
whose exact value lies in [2^-126 - 2^-151, 2^-126) (2^-126 in the spec, 0 under Arm's FZ, which
flushes by tininess before rounding), just below it ([2^-126 - 2^-150, 2^-126 - 2^-151): 2^-126
on the subnormal grid, 0 in the spec), ties, signed zeros, subnormal inputs, operands whose
scaling by 2^24 overflows, and attention whose output is such a product or chain.

On x86 every path this CPU has runs natively, and the portable path again with glibc's software
fmaf (GLIBC_TUNABLES masks FMA: the routine a CPU without FMA runs). On aarch64 (NEON and
portable) the driver is built by Debian's aarch64-linux-gnu-g++ (static) and run under
`qemu-aarch64 -cpu max`, whose software floating point flushes by tininess before rounding as
Arm documents; a machine without the cross compiler or QEMU skips that test, saying why (.ci/run
installs both).
"""

import fractions
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from gemma_jax.checkpoints.param_cache import cache_root
from gemma_jax.kernels import native_build
from gemma_jax.spec import binary32 as b32
from gemma_jax.spec import functions as fn
from gemma_jax.spec import interpreter

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'native_edges')
F32 = np.float32
TWO = fractions.Fraction(2)
TINY = TWO ** -126
WINDOW = (TINY * (1 - TWO ** -25), TINY)  # rounds up to 2^-126 at 24 bits: kept by the spec
BELOW = (TINY * (1 - TWO ** -24), TINY * (1 - TWO ** -25))  # 2^-126 on the subnormal grid only
OPS = ('mul', 'div', 'fma', 'exp', 'tanh')
GLIBC_NO_FMA = 'glibc.cpu.hwcaps=-AVX2,-FMA,-FMA4'


def bits(x):
  return np.ascontiguousarray(np.asarray(x, F32)).view(np.uint32)


def exact(op, a, b, c=0.0):
  a, b, c = (fractions.Fraction(float(v)) for v in (a, b, c))
  return a * b + c if op != 'div' else a / b


def where(x: fractions.Fraction) -> str | None:
  """'window' or 'below' for an exact result in those ranges (either sign), else None."""
  for name, (lo, hi) in (('window', WINDOW), ('below', BELOW)):
    if lo <= abs(x) < hi:
      return name
  return None


def steps(x, n):
  """x and its n float32 neighbours either side."""
  out, up, down = [F32(x)], F32(x), F32(x)
  for _ in range(n):
    up, down = np.nextafter(up, F32(np.inf)), np.nextafter(down, F32(-np.inf))
    out += [up, down]
  return out


@functools.lru_cache(maxsize=None)
def edge_operands(op: str, count: int = 12) -> list[tuple]:
  """Operands (a, b, c) of `op` ('mul', 'fma') whose exact result lies in the window, then
  `count` just below it, with both signs (a search over neighbours of the value that hits
  2^-126). A quotient of normal binary32 numbers never lies in the window (a = 2^-126 b (1 - e)
  with e >= 2^-24, the spacing of a's significand), so for 'div' the closest ones: the ties
  2^-126 (1 - 2^-24) (a power of two b) and, for random b, the largest a below 2^-126 b."""
  if op == 'div':
    ties = [(F32((-1) ** k * 2.0 ** (k - 126) * (1 - 2.0 ** -24)), F32(2.0 ** k), F32(0))
            for k in range(1, count + 1)]
    rng = np.random.default_rng(2)
    nearest = []
    for k in range(count):
      b = F32(rng.uniform(1.0, 2.0))
      a = F32(float(TINY) * float(b))
      while exact('div', a, b) >= TINY:
        a = np.nextafter(a, F32(0))
      nearest.append(((-1) ** k * a, b, F32(0)))
    return ties + nearest
  rng = np.random.default_rng({'mul': 1, 'fma': 3}[op])
  found = {'window': [], 'below': []}
  while min(map(len, found.values())) < count:
    a = F32(rng.uniform(0.5, 1.0))
    if op == 'mul':
      candidates = [(a, b, F32(0)) for b in steps(float(TINY) / float(a), 3)]
    else:  # a b + c with c = -2^-125 u: the sum cancels into the edge
      c = -F32(2.0 ** -125 * rng.uniform(1.0, 1.9))
      candidates = [(a, b, c) for b in steps((float(TINY) - float(c)) / float(a), 3)]
    for a, b, c in candidates:
      kind = where(exact(op, a, b, c))
      if kind and len(found[kind]) < count:
        sign = F32(-1) if len(found[kind]) % 2 else F32(1)
        found[kind].append((sign * a, b, sign * c))
  return found['window'] + found['below']


def from_bits(*words):
  return np.array(words, np.uint32).view(F32)


def special_operands() -> list[tuple]:
  """Ties, signed zeros, subnormal inputs (read as zero), an exactly tiny product, and operands
  whose scaling by 2^24 overflows (the exact operations must still give the plain result)."""
  big, sub = F32(2.0 ** 110), from_bits(0x00000010)[0]
  return [
      (F32(1.0), F32(1.0 + 2.0 ** -23), F32(2.0 ** -24)),  # fma: a tie, to even
      (F32(1.0 + 2.0 ** -23), F32(1.0 + 2.0 ** -23), F32(0)),  # mul: rounds
      (F32(-2.0 ** -70), F32(2.0 ** -70), F32(-0.0)),  # -2^-140: flushed to -0
      (F32(-0.0), F32(1.0), F32(-0.0)),
      (sub, F32(2.0 ** 100), F32(0)),  # a subnormal input reads as zero
      (F32(2.0 ** 100), sub, sub),
      (F32(1.0 - 2.0 ** -24), F32(2.0 ** -126), F32(0)),  # exact, tiny: flushed
      (big, F32(0.0), F32(1.5)),  # a 2^24 overflows, times zero
      (big, F32(2.0 ** -120), F32(0)),
      (F32(2.0 ** 60), F32(2.0 ** 50), -F32(2.0 ** 110)),  # fma: c 2^24 overflows, exact 0
      (big, F32(2.0 ** 10), -F32(2.0 ** 120)),  # fma: both overflow when scaled, exact 0
      (F32(2.0 ** 120), F32(2.0 ** -10), F32(0)),  # div overflows to inf
      (F32(2.0 ** -20), F32(2.0 ** 110), F32(0)),  # div: 2^-130, tiny
      (F32(3.0), F32(0.0), F32(0)),  # div by zero: inf
  ]


def op_case(op: str) -> tuple:
  """(kind, ints, floats, n, want) of one elementwise operation over edge and random operands,
  41 values (NEON's 4 lanes, AVX2's 8 and AVX-512's 16 leave scalar tails)."""
  with np.errstate(all='ignore'):  # the overflowing cases
    return _op_case(op)


def _op_case(op):
  if op in ('exp', 'tanh'):
    rng = np.random.default_rng(5)
    x = np.concatenate([np.linspace(-88.5, -86.0, 12), np.linspace(43.9, 44.2, 8),
                        rng.uniform(-12, 12, 14), [0.0, -0.0, 0.625]]).astype(F32)
    a, b, c = x, np.ones_like(x), np.zeros_like(x)
    want = getattr(fn, op)(b32.OPS, x)
  else:
    rng = np.random.default_rng(len(op))
    rows = edge_operands(op) + special_operands()
    assert len(rows) <= 41
    rows += [tuple(F32(v) for v in rng.uniform(-4, 4, 3)) for _ in range(41 - len(rows))]
    a, b, c = (np.array(col, F32) for col in zip(*rows))
    fa, fb, fc = b32.flush(a), b32.flush(b), b32.flush(c)
    want = {'mul': lambda: b32.OPS.mul(fa, fb), 'div': lambda: b32.OPS.div(fa, fb),
            'fma': lambda: b32.fma(fa, fb, fc)}[op]()
  return 0, [OPS.index(op)], np.concatenate([a, b, c]), len(a), np.asarray(want, F32)


def chain_case(kind: int, rows: int, cols: int, chunk: int, seed: int) -> tuple:
  """x [rows, 2 chunk] @ w [2 chunk, cols] by the panel (1) or stream (2) entry, with edge
  chains placed on the diagonal: one FMA landing in (or just below) the window, as a chain's
  first term and as a later term of a chain from a normal accumulator."""
  rng = np.random.default_rng(seed)
  terms = 2 * chunk
  x = rng.standard_normal((rows, terms)).astype(F32)
  w = rng.standard_normal((terms, cols)).astype(F32)
  edges = edge_operands('fma') + edge_operands('mul')
  for i in range(min(rows, cols)):
    a, b, c = edges[(i + seed) % len(edges)]
    x[i], w[:, i] = 0, 0
    k = (i % 3) * (chunk // 2)  # the chunk's first term, a middle one, or the second chunk's
    if c != 0:  # a term before makes the accumulator c: c * 1, exactly
      x[i, k], w[k, i], k = c, 1, k + 1
    x[i, k], w[k, i] = a, b
  x[-1, :3] = from_bits(0x00000010, 0x80000000, 0x00800000)  # a subnormal, -0, 2^-126
  fx, fw = b32.flush(x), b32.flush(w)
  want = b32.OPS.add(b32.dot(fx[:, :chunk], fw[:chunk]), b32.dot(fx[:, chunk:], fw[chunk:]))
  ints = [rows, terms, cols, chunk]
  return kind, ints, np.concatenate([x.ravel(), w.ravel()]), rows * cols, want.ravel()


def attention_case(heads: int, kv: int, h: int, tile: int, n: int, softcap, window) -> tuple:
  """One sequence of 5 tokens against a cache of n tiles, random but for two rows whose output
  is an edge: with scores 0 and -17 (p = exp(-17) < 2^-24, so l = 1) a chain p v in the window;
  with seven equal scores acc (1 / 7) in the window (no binary32 acc puts acc (1 / l) there for
  l from 3 to 6)."""
  rng = np.random.default_rng(heads * h + tile)
  t_len, s_len = 5, n * tile
  q = (rng.standard_normal((1, t_len, heads, h)) * 0.3).astype(F32)
  k = (rng.standard_normal((1, s_len, kv, h)) * 0.5).astype(F32)
  v = rng.standard_normal((1, s_len, kv, h)).astype(F32)
  k_pos = np.where(np.arange(s_len) < s_len - 2, np.arange(s_len), -1).astype(np.int32)[None]
  q_pos = np.arange(s_len - 2 - t_len, s_len - 2, dtype=np.int32)[None]
  if softcap is None and window is None:
    e = fn.exp(b32.OPS, F32(-17.0))
    assert e < 2.0 ** -24
    p_v = next(b for b in steps(float(TINY) / float(e), 4) if where(exact('mul', e, b)) == 'window')
    seventh = fn.reciprocal(b32.OPS, F32(7.0))
    acc = next(a for a in steps(float(TINY) / float(seventh), 8)
               if where(exact('mul', a, seventh)) == 'window')
    # Token 0 (query head 0) sees slots 0, 1 with scores 0 and -17 (q = e0, k[1] = -17 e0), and
    # v[1] = p_v in dim 0. Token 1 sees slots 0 .. 6 (two tiles), each with score 0 (q = e1),
    # and v[0] = acc in dim 1, the others zero there.
    q[0, :2, 0] = 0
    q[0, 0, 0, 0] = q[0, 1, 0, 1] = 1
    k[0, :7, 0] = 0
    k[0, 1, 0, 0] = -17
    v[0, :7, 0, :2] = 0
    v[0, 1, 0, 0], v[0, 0, 0, 1] = p_v, acc
    q_pos[0, :2] = [1, 6]
  want = interpreter.tiled_attention(q[0], k[0], v[0], q_pos[0], k_pos[0], window=window,
                                     softcap=softcap, tile=tile, k_chunk=256)[None]
  if softcap is None and window is None:
    assert bits(want[0, 0, 0, 0]) == 0x00800000 and bits(want[0, 1, 0, 1]) == 0x00800000
  ints = [1, t_len, heads, kv, h, s_len, tile, h, window or 0, *q_pos.ravel(), *k_pos.ravel()]
  floats = np.concatenate([[softcap or 0.0], q.ravel(), k.ravel(), v.ravel()]).astype(F32)
  return 3, ints, floats, want.size, want.ravel()


@functools.lru_cache(maxsize=1)
def cases() -> dict[str, tuple]:
  out = {f'op {op}': op_case(op) for op in OPS}
  for kind, name in ((1, 'panel'), (2, 'stream')):
    for rows, cols, chunk in ((7, 37, 12), (16, 70, 40), (3, 5, 8)):
      out[f'{name} {rows}x{cols}, chunk {chunk}'] = chain_case(kind, rows, cols, chunk,
                                                               rows + cols)
  attention = {'edge outputs': attention_case(2, 1, 5, 6, 2, None, None),
               'soft-cap': attention_case(4, 2, 20, 8, 3, 30.0, None),
               'window': attention_case(2, 2, 9, 4, 4, None, 6),
               # Whole 16 x 16 blocks of keys and edges past them (the transposition's).
               'wide keys': attention_case(2, 1, 36, 34, 2, None, None)}
  for name, case in attention.items():
    out[f'attention, {name}'] = case
    # Kind 4: each work item transposes the tiles it reads itself (a decode step's way).
    out[f'attention, {name}, keys transposed per tile'] = (4, *case[1:])
  return out


def write_cases(path: str) -> None:
  with open(path, 'wb') as f:
    for kind, ints, floats, n_out, _ in cases().values():
      floats = np.asarray(floats, F32)
      np.array([kind, len(ints), floats.size, n_out], np.int64).tofile(f)
      np.asarray(ints, np.int64).tofile(f)
      floats.tofile(f)


SOURCES = [os.path.join(native_build.SOURCE_DIR, name)
           for name in ('chains.h', 'attention.h', 'isa.cc')] + [
               os.path.join(HERE, name) for name in ('path.cc', 'driver.cc')]


def build(cxx: str, arch: str) -> str:
  """The driver for `arch` ('x86_64', 'aarch64') built by `cxx` with the library's flags (static
  for aarch64, so QEMU needs no sysroot), cached by the sources, compiler and flags."""
  flags = [*native_build.COMMON_FLAGS, f'-I{native_build.SOURCE_DIR}']
  constants = native_build.constants_header()  # generated, as the library's build writes it
  h = hashlib.sha256(repr((flags, arch, subprocess.run(
      [cxx, '--version'], capture_output=True, text=True).stdout, constants)).encode())
  for source in SOURCES:
    with open(source, 'rb') as f:
      h.update(f.read())
  folder = os.path.join(cache_root(), 'native_edges', h.hexdigest()[:32])
  driver = os.path.join(folder, 'driver')
  if os.path.exists(driver):
    return driver
  os.makedirs(os.path.dirname(folder), exist_ok=True)
  staging = tempfile.mkdtemp(dir=os.path.dirname(folder))
  flags.append(f'-I{staging}')
  with open(os.path.join(staging, 'constants.h'), 'w') as f:
    f.write(constants)
  try:
    objects = []
    for name, path_flags in native_build.PATHS[arch].items():
      objects.append(os.path.join(staging, f'{name}.o'))
      subprocess.run([cxx, *flags, *path_flags, f'-DGEMMA_SPEC_ISA_{name}=1', '-c',
                      os.path.join(HERE, 'path.cc'), '-o', objects[-1]], check=True)
    subprocess.run([cxx, *flags, os.path.join(HERE, 'driver.cc'), *objects, '-o',
                    os.path.join(staging, 'driver'), *(['-static'] if arch == 'aarch64' else [])],
                   check=True)
    try:
      os.rename(staging, folder)
    except OSError:
      if not os.path.exists(driver):
        raise
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return driver


def run(command: list[str], tmp_path, env=None) -> dict[str, np.ndarray]:
  """Every case through every path the driver runs: {path: outputs of all cases, concatenated}."""
  inputs, outputs = str(tmp_path / 'cases.bin'), str(tmp_path / 'out.bin')
  write_cases(inputs)
  done = subprocess.run([*command, inputs, outputs], capture_output=True, text=True,
                        timeout=600, env={**os.environ, **(env or {})})
  assert done.returncode == 0, done.stderr[-2000:]
  paths = done.stdout.split()
  out = np.fromfile(outputs, F32).reshape(len(paths), -1)
  return dict(zip(paths, out))


def differences(got: np.ndarray) -> list[str]:
  """The cases whose outputs differ from the spec's, each with its first differing value."""
  failures, at = [], 0
  for name, (_, _, _, n, want) in cases().items():
    g, w = bits(got[at:at + n]), bits(want)
    at += n
    if not np.array_equal(g, w):
      i = int(np.flatnonzero(g != w)[0])
      failures.append(f'{name}: {np.sum(g != w)} of {n} differ (first at {i}: {g[i]:#010x}, '
                      f'the spec {w[i]:#010x})')
  return failures


def test_the_cases_are_at_the_edges():
  # The search found what it says, and the interpreter keeps the window and flushes below it.
  for op in ('mul', 'fma'):
    kinds = [where(exact(op, a, b, c)) for a, b, c in edge_operands(op)]
    assert kinds == ['window'] * 12 + ['below'] * 12
    assert list(bits(op_case(op)[4][:24]) & 0x7FFFFFFF) == [0x00800000] * 12 + [0] * 12, op
  quotients = [exact('div', a, b) for a, b, _ in edge_operands('div')]
  assert [where(q) for q in quotients[:12]] == ['below'] * 12  # the ties
  assert all(abs(q) < WINDOW[0] for q in quotients)
  assert not (bits(op_case('div')[4][:24]) & 0x7FFFFFFF).any()


def host_compiler() -> str:
  try:
    return native_build.compiler()
  except native_build.BuildError as e:
    pytest.skip(str(e))


def test_every_path_of_this_cpu_computes_the_spec_at_the_edges(tmp_path):
  driver = build(host_compiler(), native_build._architecture())
  outputs = run([driver], tmp_path)
  assert 'portable' in outputs
  for path, got in outputs.items():
    failures = differences(got)
    assert not failures, f'{path}: ' + '; '.join(failures)


def test_glibcs_software_fmaf_computes_the_spec_at_the_edges(tmp_path):
  # The portable path's std::fma is glibc's fmaf: on a CPU without FMA its software routine
  # (binary64 arithmetic with round-to-odd), which keeps MXCSR's FTZ and DAZ. Masking FMA in
  # glibc's CPU features makes this CPU pick that routine.
  if native_build._architecture() != 'x86_64':
    pytest.skip('glibc picks fmaf by CPU features on x86-64 only')
  driver = build(host_compiler(), 'x86_64')
  env = {'GLIBC_TUNABLES': GLIBC_NO_FMA}
  hardware = subprocess.run([driver, '--fmaf'], capture_output=True, text=True).stdout.split()
  software = subprocess.run([driver, '--fmaf'], capture_output=True, text=True,
                            env={**os.environ, **env}).stdout.split()
  assert software[0] != hardware[0], (software, hardware)  # another routine
  assert not software[1].startswith('c4'), software  # not one VEX-encoded FMA instruction
  failures = differences(run([driver], tmp_path, env)['portable'])
  assert not failures, '; '.join(failures)


def test_the_self_checks_edge_probes_pass_on_glibcs_software_fmaf():
  # The engine's own probes of the edge (selfcheck.underflow_failures: the product, and a
  # contraction chain on the native kernels' portable path) in a process whose fmaf is glibc's
  # software routine.
  if native_build._architecture() != 'x86_64':
    pytest.skip('glibc picks fmaf by CPU features on x86-64 only')
  host_compiler()
  code = ('import json; from gemma_jax import numerics; from gemma_jax.kernels import native_dot; '
          'from gemma_jax.spec import selfcheck; print(json.dumps(selfcheck.underflow_failures('
          'numerics.Spec(kernel=native_dot.make_native_dot("portable")), None)))')
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=repo,
                        timeout=600, env={**os.environ, 'PYTHONPATH': repo,
                                          'GLIBC_TUNABLES': GLIBC_NO_FMA})
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split('\n')[-2] == '[]', done.stdout[-2000:]


def test_aarch64_paths_compute_the_spec_at_the_edges_under_qemu(tmp_path):
  cxx, qemu = shutil.which('aarch64-linux-gnu-g++'), shutil.which('qemu-aarch64')
  if not (cxx and qemu):
    pytest.skip('needs aarch64-linux-gnu-g++ and qemu-aarch64 (apt-get install '
                'g++-aarch64-linux-gnu qemu-user)')
  outputs = run([qemu, '-cpu', 'max', build(cxx, 'aarch64')], tmp_path)
  assert sorted(outputs) == ['neon', 'portable']
  for path, got in outputs.items():
    failures = differences(got)
    assert not failures, f'{path}: ' + '; '.join(failures)
