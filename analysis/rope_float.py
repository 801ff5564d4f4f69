r"""The floating-point account of RoPE: why own-position graft is the only exact point.

A shifted graft moves a cached key from position p to p + δ. Two ways exist: re-rotate the cached
(already rotated) key by δ, as llama.cpp's K-shift does, or keep keys before RoPE and rotate them
at p + δ. The second applies the same function to the same pre-RoPE key as a fresh computation
at p + δ, so layer 0's keys come out exact; deeper layers' keys were computed from hidden states
that attended at the old positions and still differ (experiments/position_sweep measures that).
The first is exact only if R(δ) R(p) x == R(p + δ) x bit for bit. This module measures, with the
model's own float32 `gemma_jax.rope.apply_rope` path, how often that holds and how large the
error is when it does not. `python -m experiments.rope_float` runs it and writes
results/rope_float.json; the README quotes its numbers.

Four layer types (see gemma_jax/config.py):
  local             θ = 10k, H = 256 (Gemma 2/3/4 local layers)
  global            θ = 1M,  H = 256 (Gemma 3 270M/1B global layers)
  global_scale8     θ = 1M,  H = 256, linear scale 8 (Gemma 3 4B+ global layers)
  gemma4_global     θ = 1M,  H = 512, only 25% of the pairs rotate (Gemma 4 global layers)

What is measured, and why:

* Angle rounding (`angle_error`). Pair 0 has timescale exactly 1, so its angle is the position
  itself, exact, with float32 spacing 2^(floor(log2 p) - 23) (docs/gemma.md). Every other pair's
  angle p / θ^(2i/H) is rounded, and the rounding grows linearly with the position; the error
  is compared with the float32 spacing at the position's largest angle. Linear scale 8 divides
  by a power of two, exactly.
* The jitted program is what counts. XLA's algebraic simplifier turns the reference's
  `p / base**f` into `p * base**(-f)` (a multiplication by an inverse frequency) and CPU loop
  fusions contract `x1 * cos - x2 * sin` into a fused multiply-add, so apply_rope has other
  bits eagerly than under jit; the analysis measures the jitted path by default (the model's)
  and `execution='eager'` the other.
* The rotation against float64 (`rotation_error`): per component and in ulps of the pair's norm
  (a rotation keeps the norm, so that is its natural unit; per-component ulps explode where a
  component crosses zero).
* Composition (`composition_error`): R(δ) R(p) x against R(p + δ) x, per position and pair,
  for float RoPE and the quarter-turn control, whose sin and cos are exactly 0 or ±1 so that it
  composes bit for bit (R(0) is the identity for every mode, so δ = 0 is exact and position 0
  is left out of the grid). `find_composition_witness` returns one differing case as plain
  values that reproduce it alone.
* Partial rotary (Gemma 4 global): the unrotated 75% of the pairs must stay bit-identical under
  any shift; only the rotated 25% can carry error.
* Propagation through the layers (`summarize_layer_propagation`), from position-sweep results.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import pathlib
import platform
from typing import Any, Iterable, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from gemma_jax import config as config_lib
from gemma_jax import rope
from gemma_jax.compare import bits_equal, ulp_distance

# Offsets δ of the composition measurement: δ = 0 (must be exact), the smallest shifts (where a
# rounding coincidence is likeliest), a few powers of two up to 2^16. Fewer than the position
# sweep's (experiments/position_sweep.py): every offset here costs per-pair curves in the JSON.
DEFAULT_OFFSETS = (0, 1, 2, 3, 5, 7, 16, 64, 1024, 4096, 2**16)
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
COMPOSITION_MODES = ('float', 'quarter_turn')


# --------------------------------------------------------------------------------------------
# Layer types and grids
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerRope:
  """The RoPE of one kind of layer."""

  name: str
  head_dim: int  # H
  base: float  # θ
  scale: float = 1.0  # linear position scale (angle = p / timescale / scale)
  rotary_fraction: float = 1.0  # fraction of the H/2 pairs that rotate

  @property
  def num_pairs(self) -> int:
    return self.head_dim // 2

  @property
  def rotated_pairs(self) -> int:
    return rope.num_rotated_pairs(self.head_dim, self.rotary_fraction)

  def models(self) -> list[str]:
    """Registered (non-tiny) models that have a layer with exactly this RoPE."""
    found = []
    for name in config_lib.names():
      if name.startswith('tiny'):
        continue
      cfg = config_lib.get_config(name)
      for i in range(cfg.num_layers):
        spec = cfg.layer_spec(i)
        if (spec.head_dim, spec.rope_base, spec.rope_scale, spec.rotary_fraction) == (
            self.head_dim, self.base, self.scale, self.rotary_fraction):
          found.append(name)
          break
    return found

  def as_dict(self) -> dict[str, Any]:
    return dict(name=self.name, head_dim=self.head_dim, base=self.base, scale=self.scale,
                rotary_fraction=self.rotary_fraction, num_pairs=self.num_pairs,
                rotated_pairs=self.rotated_pairs, models=self.models())


def layer_types(head_dims: Sequence[int] = (256,)) -> list[LayerRope]:
  """The layer types analysed. Local/global/global-scale-8 for each head dim (the default 256 is
  what Gemma 2 2B/9B and Gemma 3 use; 128 is Gemma 2/3 27B); Gemma 4 global keeps its 512."""
  types = []
  for h in head_dims:
    suffix = '' if h == 256 else f'_h{h}'
    types += [LayerRope(f'local{suffix}', h, 10_000.0),
              LayerRope(f'global{suffix}', h, 1_000_000.0),
              LayerRope(f'global_scale8{suffix}', h, 1_000_000.0, scale=8.0)]
  types.append(LayerRope('gemma4_global', 512, 1_000_000.0, rotary_fraction=0.25))
  return types


def position_grid(max_position: int, points: int = 48) -> np.ndarray:
  """[P] int32: 0, a log grid from 1 to max_position, and every power of two up to it."""
  grid = np.round(np.geomspace(1, max_position, points)).astype(np.int64)
  powers = 2 ** np.arange(int(math.log2(max_position)) + 1)
  grid = np.unique(np.concatenate([[0], grid, powers[powers <= max_position]]))
  return grid.astype(np.int32)


def frequency_indices(layer: LayerRope) -> list[int]:
  """A few rotated pairs spread over the spectrum: 0, powers of four, the last rotated pair."""
  n = layer.rotated_pairs
  return sorted({0, n - 1, *(4**k for k in range(int(math.log(n, 4)) + 1) if 4**k < n)})


# --------------------------------------------------------------------------------------------
# Float helpers
# --------------------------------------------------------------------------------------------


def ulp_of(x: np.ndarray, dtype) -> np.ndarray:
  """[...] float64: the spacing of `dtype` floats at |x| (x given in float64), i.e. the size of
  one unit in the last place of the dtype value nearest x (subnormal spacing near 0)."""
  info = jnp.finfo(dtype)
  x = np.abs(np.asarray(x, np.float64))
  _, exponent = np.frexp(x)  # x = m * 2^exponent, 0.5 <= m < 1 (exponent 0 for x = 0)
  exponent = np.where(x == 0, info.minexp, np.maximum(exponent - 1, info.minexp))
  return np.ldexp(1.0, exponent - info.nmant)


def _pairs_equal(a: np.ndarray, b: np.ndarray, half: int) -> np.ndarray:
  """[..., H/2] bool: both components of each rotation pair are bit-identical."""
  eq = bits_equal(a, b)
  return eq[..., :half] & eq[..., half:]


def _pair_max(x: np.ndarray, half: int) -> np.ndarray:
  """[..., H] -> [..., H/2]: the larger of each pair's two components."""
  return np.maximum(x[..., :half], x[..., half:])


def _loglog_slope(positions: np.ndarray, values: np.ndarray,
                  min_position: int = 16) -> float | None:
  """Least-squares slope of log(value) against log(position) over positive values; None if
  fewer than three points (a slope of 1 means the value grows linearly with the position)."""
  keep = (positions >= min_position) & (values > 0)
  if keep.sum() < 3:
    return None
  return float(np.polyfit(np.log(positions[keep]), np.log(values[keep]), 1)[0])


def _floats(x) -> list[float]:
  """A JSON list of measured values, rounded to 6 significant digits (keeps the file small;
  scalar results are written unrounded)."""
  return [float(f'{v:.6g}') for v in np.asarray(x, np.float64).ravel()]


def _pair_norm_ulp(reference: np.ndarray, half: int, dtype) -> np.ndarray:
  """[..., H/2] float64: the dtype spacing at each pair's norm sqrt(x_i^2 + x_{i+H/2}^2). A
  rotation keeps the norm, so this is the natural unit of a rotation's error; per-component ulps
  explode where a component crosses zero."""
  reference = np.asarray(reference, np.float64)
  return ulp_of(np.hypot(reference[..., :half], reference[..., half:]), dtype)


# --------------------------------------------------------------------------------------------
# Our RoPE, jitted the way the model runs it (or eagerly)
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _angles_fn(layer: LayerRope, execution: str):
  def fn(positions):
    return rope.rotation_angles(positions, layer.head_dim, base=layer.base, scale=layer.scale,
                                rotary_fraction=layer.rotary_fraction)
  return jax.jit(fn) if execution == 'jit' else fn


@functools.lru_cache(maxsize=None)
def _rope_fn(layer: LayerRope, mode: str, execution: str):
  def fn(x, positions):  # x [B, T, N, H], positions [B, T]
    return rope.apply_rope(x, positions, base=layer.base, scale=layer.scale,
                           rotary_fraction=layer.rotary_fraction, mode=mode)
  return jax.jit(fn) if execution == 'jit' else fn


def apply(layer: LayerRope, x: np.ndarray, positions: np.ndarray, *, mode: str = 'float',
          execution: str = 'jit') -> np.ndarray:
  """apply_rope on x [P, V, H] at positions [P] (one batch row); returns a numpy array."""
  fn = _rope_fn(layer, mode, execution)
  out = fn(jnp.asarray(x)[None], jnp.asarray(positions, jnp.int32)[None])
  return np.asarray(out[0])


def float32_angles(positions: np.ndarray, layer: LayerRope, execution: str = 'jit') -> np.ndarray:
  """[P, H/2] float32 angles from our rotation_angles (unrotated pairs 0)."""
  return np.asarray(_angles_fn(layer, execution)(jnp.asarray(positions, jnp.int32)))


def reference_angles(positions: np.ndarray, layer: LayerRope) -> np.ndarray:
  """[P, H/2] float64 angles p / θ^(2i/H) / scale, unrotated pairs 0."""
  i = np.arange(layer.num_pairs, dtype=np.float64)
  angles = np.asarray(positions, np.float64)[:, None] / layer.base ** (2.0 * i / layer.head_dim)
  angles = angles / layer.scale
  angles[:, layer.rotated_pairs:] = 0.0
  return angles


def reference_rotation(x: np.ndarray, positions: np.ndarray, layer: LayerRope) -> np.ndarray:
  """[P, V, H] float64 rotation of x (any float dtype, taken exactly) by the exact angles."""
  x = np.asarray(x).astype(np.float64)
  angles = reference_angles(positions, layer)[:, None, :]  # [P, 1, H/2]
  first, second = np.split(x, 2, axis=-1)
  cos, sin = np.cos(angles), np.sin(angles)
  return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def random_vectors(num_positions: int, vectors: int, head_dim: int, dtype, seed: int) -> np.ndarray:
  """[P, V, H] standard normal vectors rounded to dtype (a key's scale after the K-norm)."""
  x = np.random.default_rng(seed).standard_normal((num_positions, vectors, head_dim))
  return np.asarray(jnp.asarray(x, jnp.float32).astype(dtype))


# --------------------------------------------------------------------------------------------
# 1. Angle rounding
# --------------------------------------------------------------------------------------------


def angle_error(positions: np.ndarray, layer: LayerRope, execution: str = 'jit') -> dict[str, Any]:
  """|angle_f32 - angle_f64| per position and pair, in radians and in float32 ulps of the angle,
  with the float32 spacing at each position's largest angle and the accuracy of sin/cos."""
  positions = np.asarray(positions)
  a32 = float32_angles(positions, layer, execution)
  a64 = reference_angles(positions, layer)
  rotated = slice(0, layer.rotated_pairs)
  err = np.abs(a32.astype(np.float64) - a64)[:, rotated]  # [P, R]
  err_ulp = err / ulp_of(a64[:, rotated], np.float32)
  max_angle = a64[:, rotated].max(axis=1)
  spacing = ulp_of(max_angle, np.float32)
  # sin/cos evaluated in float32 on the rounded angle, against float64 sin/cos of the same angle:
  # isolates the evaluation error from the angle rounding.
  angle_in = a32[:, rotated]
  sin32 = np.asarray(jax.jit(jnp.sin)(angle_in)).astype(np.float64)
  cos32 = np.asarray(jax.jit(jnp.cos)(angle_in)).astype(np.float64)
  sin64, cos64 = np.sin(angle_in.astype(np.float64)), np.cos(angle_in.astype(np.float64))
  sincos_ulp = np.maximum(np.abs(sin32 - sin64) / ulp_of(sin64, np.float32),
                          np.abs(cos32 - cos64) / ulp_of(cos64, np.float32))
  ts32 = np.asarray(rope.timescales(layer.head_dim, layer.base)).astype(np.float64)
  ts64 = layer.base ** (2.0 * np.arange(layer.num_pairs) / layer.head_dim)
  per_position_max = err.max(axis=1)
  return {
      'positions': [int(p) for p in positions],
      'per_position': {
          'max_abs_error': _floats(per_position_max),
          'max_ulp_error': _floats(err_ulp.max(axis=1)),
          'max_angle': _floats(max_angle),
          'float32_spacing_at_max_angle': _floats(spacing),
          'max_abs_error_over_spacing': _floats(per_position_max / spacing),
      },
      'per_frequency': {
          'max_abs_error': _floats(err.max(axis=0)),
          'max_ulp_error': _floats(err_ulp.max(axis=0)),
      },
      'max_abs_error': float(err.max()),
      'max_ulp_error': float(err_ulp.max()),
      'correctly_rounded_fraction': float((err_ulp <= 0.5).mean()),
      'exact_fraction': float((err == 0).mean()),
      'loglog_slope_vs_position': _loglog_slope(positions, per_position_max),
      'timescale_max_ulp_error': float((np.abs(ts32 - ts64) / ulp_of(ts64, np.float32)).max()),
      'sincos_eval_max_ulp': float(sincos_ulp.max()),
  }


# --------------------------------------------------------------------------------------------
# 2. The rotation against a float64 reference
# --------------------------------------------------------------------------------------------


def rotation_error(positions: np.ndarray, layer: LayerRope, dtype, *, vectors: int = 4,
                   seed: int = 0, execution: str = 'jit') -> dict[str, Any]:
  """Rounded result of rotating random vectors in dtype (float32 arithmetic inside, rounded once
  to dtype) against the float64 rotation of the same dtype values by the exact angles."""
  positions = np.asarray(positions)
  x = random_vectors(len(positions), vectors, layer.head_dim, dtype, seed)
  got = apply(layer, x, positions, execution=execution).astype(np.float64)
  ref = reference_rotation(x, positions, layer)
  err = np.abs(got - ref)  # [P, V, H]
  # Within half an ulp of the exact component: what a correctly rounded RoPE would give.
  rounded = err <= 0.5 * ulp_of(ref, dtype)
  half = layer.num_pairs
  err_pair = _pair_max(err, half)  # [P, V, H/2]
  norm_ulp = err_pair / _pair_norm_ulp(ref, half, dtype)
  return {
      'per_position': {'max_abs_error': _floats(err.max(axis=(1, 2))),
                       'max_norm_ulp_error': _floats(norm_ulp.max(axis=(1, 2))),
                       'correctly_rounded_fraction': _floats(rounded.mean(axis=(1, 2)))},
      'per_frequency': {'max_abs_error': _floats(err_pair.max(axis=(0, 1))),
                        'max_norm_ulp_error': _floats(norm_ulp.max(axis=(0, 1)))},
      'max_abs_error': float(err.max()),
      'max_norm_ulp_error': float(norm_ulp.max()),
      'correctly_rounded_fraction': float(rounded.mean()),
      'loglog_slope_vs_position': _loglog_slope(positions, err.max(axis=(1, 2))),
  }


# --------------------------------------------------------------------------------------------
# 3. Composition: re-rotating a rotated key by δ against rotating it at p + δ
# --------------------------------------------------------------------------------------------


def compose(layer: LayerRope, x: np.ndarray, positions: np.ndarray, delta: int, *,
            mode: str = 'float', execution: str = 'jit') -> tuple[np.ndarray, np.ndarray]:
  """Returns (R(δ) R(p) x, R(p + δ) x) for x [P, V, H] at positions [P], both in x's dtype:
  the first is what a K-shift does to a cached key, the second a fresh key at p + δ."""
  positions = np.asarray(positions, np.int64)
  at_p = apply(layer, x, positions, mode=mode, execution=execution)
  shifted = apply(layer, at_p, np.full_like(positions, delta), mode=mode, execution=execution)
  direct = apply(layer, x, positions + delta, mode=mode, execution=execution)
  return shifted, direct


def composition_error(positions: np.ndarray, layer: LayerRope, delta: int, dtype, *,
                      mode: str = 'float', vectors: int = 4, seed: int = 0,
                      execution: str = 'jit', x: np.ndarray | None = None) -> dict[str, Any]:
  """|R(δ)R(p)x − R(p+δ)x| per position and pair (max over `vectors` random vectors), in
  absolute terms and in ulps of the result, and which (p, i) pairs are bit-exact."""
  positions = np.asarray(positions)
  if x is None:
    x = random_vectors(len(positions), vectors, layer.head_dim, dtype, seed)
  shifted, direct = compose(layer, x, positions, delta, mode=mode, execution=execution)
  half = layer.num_pairs
  exact_samples = _pairs_equal(shifted, direct, half)  # [P, V, H/2]
  exact = exact_samples.all(axis=1)  # [P, H/2]: every vector's pair bit-identical
  err_samples = _pair_max(np.abs(shifted.astype(np.float64) - direct.astype(np.float64)), half)
  err = err_samples.max(axis=1)  # [P, H/2]
  # Two units: the literal count of floats between the two results (huge where a component
  # crosses zero), and the error in ulps of the pair's norm (stable; see _pair_norm_ulp).
  ulps = _pair_max(ulp_distance(shifted, direct), half).max(axis=1).astype(np.float64)
  norm_ulps = (err_samples / _pair_norm_ulp(direct, half, direct.dtype)).max(axis=1)
  rotated = slice(0, layer.rotated_pairs)
  result = {
      'exact_fraction': float(exact.mean()),
      'exact_fraction_rotated_pairs': float(exact[:, rotated].mean()),
      'exact_fraction_samples': float(exact_samples.mean()),
      'unrotated_pairs_exact': bool(exact[:, layer.rotated_pairs:].all()),
      'max_abs': float(err.max()),
      'max_ulp': float(ulps.max()),
      'max_norm_ulp': float(norm_ulps.max()),
      'loglog_slope_vs_position': _loglog_slope(positions, err.max(axis=1)),
  }
  if exact.all():  # nothing to resolve by position or pair: leave the arrays out
    return {**result, 'per_position': {}, 'per_frequency': {}, 'curves': {}}
  return {
      **result,
      'per_position': {'max_abs': _floats(err.max(axis=1)),
                       'max_norm_ulp': _floats(norm_ulps.max(axis=1)),
                       'exact_fraction': _floats(exact.mean(axis=1))},
      'per_frequency': {'max_abs': _floats(err.max(axis=0)),
                        'max_norm_ulp': _floats(norm_ulps.max(axis=0)),
                        'exact_fraction': _floats(exact.mean(axis=0))},
      # Error against position for a few pairs, spread over the spectrum.
      'curves': {str(i): {'max_abs': _floats(err[:, i]), 'max_norm_ulp': _floats(norm_ulps[:, i])}
                 for i in frequency_indices(layer)},
  }


def find_composition_witness(layer: LayerRope, delta: int, positions: Iterable[int] | None = None,
                             *, dtype=jnp.float32, mode: str = 'float', seed: int = 0,
                             execution: str = 'jit') -> dict[str, Any] | None:
  """The first (position, pair, vector) for which R(δ)R(p)x and R(p+δ)x differ in bits, as
  plain values that reproduce it alone (pairs rotate independently); None if none is found."""
  positions = position_grid(131_072)[1:] if positions is None else np.asarray(list(positions))
  x = random_vectors(len(positions), 1, layer.head_dim, dtype, seed)
  shifted, direct = compose(layer, x, positions, delta, mode=mode, execution=execution)
  half = layer.num_pairs
  differ = ~_pairs_equal(shifted, direct, half)[:, 0, :]  # [P, H/2]
  if not differ.any():
    return None
  p, i = (int(v) for v in np.argwhere(differ)[0])
  pick = lambda a: [float(a[p, 0, i]), float(a[p, 0, i + half])]
  return {'layer': layer.name, 'dtype': jnp.dtype(dtype).name, 'mode': mode, 'delta': int(delta),
          'position': int(positions[p]), 'pair': i, 'x': pick(x), 'shifted': pick(shifted),
          'direct': pick(direct),
          'ulp_distance': int(ulp_distance(shifted[p, 0, [i, i + half]],
                                           direct[p, 0, [i, i + half]]).max())}


# --------------------------------------------------------------------------------------------
# 4. Error propagation through the layers (position-sweep results)
# --------------------------------------------------------------------------------------------


def summarize_layer_propagation(sweep: dict | str | os.PathLike) -> list[dict[str, Any]]:
  """From a position-sweep result (dict or path; rows with per-layer K/V divergence, see
  analysis/figures/ for the schema), per row: the first layer whose K or V bits differ, the
  per-layer divergence (max of K and V), and how it grows from layer to layer (ratios of
  consecutive nonzero divergences and their geometric mean)."""
  if not isinstance(sweep, dict):
    sweep = json.loads(pathlib.Path(sweep).read_text())
  summaries = []
  for row in sweep.get('rows', []):
    layers = sorted(row.get('layers') or [], key=lambda l: l['layer'])
    if not layers:
      continue
    abs_div = np.array([max(l['k_max_abs'], l['v_max_abs']) for l in layers], np.float64)
    ulp_div = np.array([max(l['k_max_ulp'], l['v_max_ulp']) for l in layers], np.float64)
    differing = [l['layer'] for l in layers if not (l['k_equal'] and l['v_equal'])]
    ratios = [float(b / a) for a, b in zip(abs_div[:-1], abs_div[1:]) if a > 0 and b > 0]
    summaries.append({
        **{key: row.get(key) for key in ('model', 'weights', 'dtype', 'rope', 'method', 'offset')},
        'equal': row.get('equal'),
        'first_differing_layer': differing[0] if differing else None,
        'layers_differing': len(differing),
        'num_layers': len(layers),
        'per_layer_max_abs': _floats(abs_div),
        'per_layer_max_ulp': _floats(ulp_div),
        'growth_factors': ratios,
        'mean_growth_factor': float(np.exp(np.mean(np.log(ratios)))) if ratios else None,
        'first_layer_max_abs': (float(abs_div[[l['layer'] for l in layers].index(differing[0])])
                                if differing else 0.0),
        'last_layer_max_abs': float(abs_div[-1]),
    })
  return summaries


# --------------------------------------------------------------------------------------------
# The whole analysis
# --------------------------------------------------------------------------------------------


def analyze(*, max_position: int = 131_072, dtypes: Sequence[str] = ('float32', 'bfloat16'),
            head_dims: Sequence[int] = (256,), offsets: Sequence[int] = DEFAULT_OFFSETS,
            grid_points: int = 40, vectors: int = 4, seed: int = 0, execution: str = 'jit',
            sweep_results: Sequence[str] = ()) -> dict[str, Any]:
  """Runs every measurement and returns the JSON-ready result with its full config."""
  positions = position_grid(max_position, grid_points)
  # R(0) is the identity, so R(δ)R(0)x and R(0 + δ)x are the same computation: position 0 is
  # trivially exact and left out of the composition grid.
  comp_positions = positions[positions > 0]
  types = layer_types(head_dims)
  config = {
      'max_position': int(max_position), 'grid_points': grid_points,
      'positions': [int(p) for p in positions],
      'composition_positions': [int(p) for p in comp_positions], 'dtypes': list(dtypes),
      'head_dims': [int(h) for h in head_dims], 'offsets': [int(d) for d in offsets],
      'vectors': vectors, 'seed': seed, 'execution': execution,
      'composition_modes': list(COMPOSITION_MODES),
      'reference': 'float64 angles p / base**(2i/H) / scale with numpy sin/cos',
      'jax_version': jax.__version__, 'numpy_version': np.__version__,
      'backend': jax.default_backend(), 'machine': platform.machine(),
      'sweep_results': list(sweep_results),
  }
  spacing_points = sorted({32_768, 131_072, int(max_position)})
  result: dict[str, Any] = {
      'config': config,
      'created': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
      'facts': {'float32_spacing_at_position': {str(p): float(ulp_of(p, np.float32))
                                                for p in spacing_points}},
      'layer_types': {},
      'summary': {},
  }
  fact_positions = np.array(spacing_points, np.int32)
  for layer in types:
    logging.info('layer type %s', layer.name)
    entry: dict[str, Any] = {'spec': layer.as_dict(),
                             'frequency_indices': frequency_indices(layer)}
    entry['angles'] = angle_error(positions, layer, execution)
    at = angle_error(fact_positions, layer, execution)
    entry['angles']['at_positions'] = {
        str(p): {field: at['per_position'][field][k]
                 for field in ('max_abs_error', 'max_ulp_error', 'float32_spacing_at_max_angle')}
        for k, p in enumerate(spacing_points)}
    # Eager and jitted apply_rope are different programs to XLA (see the module docstring).
    other = 'eager' if execution == 'jit' else 'jit'
    entry['angles']['differing_bits_fraction_vs_' + other] = float(
        (~bits_equal(float32_angles(positions, layer, execution),
                     float32_angles(positions, layer, other))).mean())
    entry['rotation'] = {name: rotation_error(positions, layer, DTYPES[name], vectors=vectors,
                                              seed=seed, execution=execution)
                         for name in dtypes}
    entry['composition'] = {}
    for name in dtypes:
      entry['composition'][name] = {}
      for mode in COMPOSITION_MODES:
        per_delta = {}
        for delta in offsets:
          stats = composition_error(comp_positions, layer, int(delta), DTYPES[name], mode=mode,
                                    vectors=vectors, seed=seed, execution=execution)
          stats['witness'] = (None if delta == 0 else find_composition_witness(
              layer, int(delta), comp_positions, dtype=DTYPES[name], mode=mode, seed=seed,
              execution=execution))
          per_delta[str(delta)] = stats
        entry['composition'][name][mode] = per_delta
    entry['rotary'] = {
        'rotated_pairs': layer.rotated_pairs, 'total_pairs': layer.num_pairs,
        'unrotated_fraction': 1.0 - layer.rotated_pairs / layer.num_pairs,
        'unrotated_pairs_exact_for_every_offset': all(
            d['unrotated_pairs_exact'] for by_mode in entry['composition'].values()
            for by_delta in by_mode.values() for d in by_delta.values()),
    }
    result['layer_types'][layer.name] = entry
    result['summary'][layer.name] = {
        'angle_max_abs_error_at': {p: v['max_abs_error']
                                   for p, v in entry['angles']['at_positions'].items()},
        'composition_exact_fraction': {
            name: {mode: {d: v['exact_fraction'] for d, v in by_delta.items()}
                   for mode, by_delta in by_mode.items()}
            for name, by_mode in entry['composition'].items()},
    }
  if sweep_results:
    result['propagation'] = [s for path in sweep_results for s in summarize_layer_propagation(path)]
  return result
