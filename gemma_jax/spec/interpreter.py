"""The NumPy reference interpreter of the written arithmetic: KV state and logits of a token
sequence, for every family the engine runs (Gemma 2, 3, 4: local and global layers, soft-capping,
QK- and V-norms, per-layer inputs, shared KV, partial rotary), computed without XLA.

    ref = Interpreter(config, params)                  # float32 params (numpy or jax arrays)
    out = ref.run(tokens, logit_rows=[len(tokens) - 1])
    out.k[layer], out.v[layer]                          # [T, K, H] per cache-owning layer
    out.logits[row]                                     # float32 [V]

Every value is the sequence of binary32 operations docs/determinism.md states, in the order the
spec engine (gemma_jax.numerics.Spec with tiled attention) computes it: contractions as
gemma_jax.spec.binary32.dot chains over chunks, row sums as pairwise trees, elementwise functions
from gemma_jax.spec.functions. All rows of a layer are computed at once: a token's values do not
depend on the rows after it, which is what the engine's byte-exactness rests on.

Attention follows the tiled algorithm's slot layout, which decides the order of its sums: the
token with sequence index i sits in slot i on global layers and in slot i mod S on a local
layer's ring of S = round_up(W + rows_per_call - 1, tile) slots; a query adds the tiles it sees
in slot order (tile sums as pairwise trees over the tile's slots, products p v as one FMA chain
per tile in slot order, then tile after tile).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from gemma_jax import kv_state as kvs
from gemma_jax.config import LayerSpec, TransformerConfig
from gemma_jax.numerics import MASKED
from gemma_jax.sizes import round_up
from gemma_jax.spec import binary32 as b32
from gemma_jax.spec import functions as fn

O = b32.OPS
F32 = np.float32


@dataclasses.dataclass
class Output:
  """k, v: per cache-owning layer (config.cache_layers order), [T, K, H] float32; logits:
  {row: float32 [V]}."""

  k: list[np.ndarray]
  v: list[np.ndarray]
  logits: dict[int, np.ndarray]


# The RoPE modes the written arithmetic defines: 'float' (keys rotated by their positions) and
# 'relative' (unrotated keys, scores from offsets; gemma_jax.rope.RelativeScores).
ROPE_MODES = ('float', 'relative')


class Interpreter:
  """The reference for one model and the engine geometry that decides the order of sums:
  k_chunk and small (contractions), tile and rows_per_call (attention's slot layout)."""

  def __init__(self, config: TransformerConfig, params: dict, *, k_chunk: int = 256,
               small: int = 65536, tile: int = 256, rows_per_call: int = 256,
               progress: Callable[[str], None] | None = None):
    if config.rope_mode not in ROPE_MODES:
      raise ValueError("the interpreter computes RoPE 'float' (rotated keys cached, or raw keys "
                       "rotated at every read: kv_cache_pre_rope) and 'relative' (unrotated "
                       f"keys, scores from offsets), not {config.rope_mode!r}")
    self.relative = config.rope_mode == 'relative'
    # Raw keys cached: under 'float' they are rotated when read, by the same operations a
    # rotated cache applies when it writes (so attention sees the same bits).
    self.raw_keys = self.relative or config.kv_cache_pre_rope
    self.config = config
    self.p = _to_numpy(params)
    self.k_chunk, self.small, self.tile = k_chunk, small, tile
    self.rows_per_call = rows_per_call
    self.progress = progress or (lambda message: None)
    self._table_t: np.ndarray | None = None

  # Contractions and norms -----------------------------------------------------------------------

  def matmul(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [M, I] @ w [I, O] as the written arithmetic contracts it."""
    return b32.matmul(x, w, k_chunk=self.k_chunk, small=self.small)

  def dense(self, x: np.ndarray, w: np.ndarray, in_dims: int = 1) -> np.ndarray:
    """x [..., *in] against w [*in, *out] (gemma_jax.layers.Dense)."""
    in_shape, out_shape = w.shape[:in_dims], w.shape[in_dims:]
    batch = x.shape[:x.ndim - in_dims]
    y = self.matmul(x.reshape(-1, math.prod(in_shape)),
                    w.reshape(math.prod(in_shape), math.prod(out_shape)))
    return y.reshape(batch + out_shape)

  def norm(self, x: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """RMSNorm over the last axis (gemma_jax.layers.RMSNorm under the spec): x [..., X] float32,
    scale [X] or None -> [..., X]."""
    mean_square = O.mul(b32.tree_sum(O.mul(x, x)), fn.reciprocal(O, F32(x.shape[-1])))
    normed = O.mul(x, fn.rsqrt(O, O.add(mean_square, F32(self.config.rms_norm_eps))))
    if scale is None:
      return normed
    offset = self.config.norm_scale_offset
    return O.mul(normed, O.add(F32(offset), scale) if offset else scale)

  # RoPE ------------------------------------------------------------------------------------------

  @staticmethod
  def angles(positions: np.ndarray, head_dim: int, base: float, scale: float,
             fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """sin, cos [T, H/2] of the RoPE angles at integer positions [T] (the relative mode's table
    of offsets is this at offsets 0, 1, ...)."""
    angles = O.mul(positions.astype(F32)[:, None], fn.inverse_frequencies(head_dim, base)[None])
    if scale != 1.0:
      angles = O.mul(angles, fn.reciprocal(O, F32(scale)))
    rotated = int(fraction * (head_dim // 2))
    angles = np.where(np.arange(head_dim // 2) < rotated, angles, F32(0.0)).astype(F32)
    return fn.sin_cos(O, angles)

  @staticmethod
  def rotate(x: np.ndarray, sin: np.ndarray, cos: np.ndarray) -> np.ndarray:
    """x [T, heads, H] turned by sin, cos [T, H/2]."""
    sin, cos = sin[:, None], cos[:, None]
    first, second = np.split(x, 2, axis=-1)
    return np.concatenate([O.sub(O.mul(first, cos), O.mul(second, sin)),
                           O.add(O.mul(second, cos), O.mul(first, sin))], axis=-1)

  # Attention --------------------------------------------------------------------------------------

  def slots(self, spec: LayerSpec, num_tokens: int) -> int:
    """The slots a layer of LayerSpec `spec` has for `num_tokens` tokens, in whole tiles: the
    ring a call of rows_per_call rows needs on a local layer, every token on a global one."""
    if spec.window is not None:  # a local layer (global ones have none)
      return round_up(spec.window + self.rows_per_call - 1, self.tile)
    return round_up(num_tokens, self.tile)

  def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, spec: LayerSpec,
             offset_table: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """q [T, N, H] (scaled), k, v [T, K, H] -> [T, N, H] (gemma_jax.tiled_attention under the
    spec). q and k are rotated by their positions, or, with `offset_table` (sin, cos [T, H/2]
    of offsets 0 .. T - 1), unrotated and scored from offsets (the relative mode)."""
    t_len, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    groups = num_heads // num_kv
    slots = self.slots(spec, t_len)
    # index[t, s]: the sequence index visible to query t in slot s, or -1.
    t = np.arange(t_len)[:, None]
    s = np.arange(slots)[None, :]
    index = s + slots * ((t - s) // slots)  # the latest index <= t held in slot s
    visible: np.ndarray = kvs.visible(t, index, spec.window)  # the rule over sequence indices
    index = np.where(visible, index, 0)
    cap = self.config.attn_logits_softcap
    tiles = slots // self.tile
    saw = np.asarray(visible.reshape(t_len, tiles, self.tile).any(axis=2))  # [T, tiles]
    out = np.zeros((t_len, num_kv, groups, head_dim), F32)
    for kh in range(num_kv):
      rows = q[:, kh * groups:(kh + 1) * groups]
      scores = (self._scores(rows, k[:, kh]) if offset_table is None
                else self._relative_scores(rows, k[:, kh], *offset_table))
      scores = np.take_along_axis(scores, index[:, None, :], axis=2)  # [T, G, slots]
      if cap is not None:
        scores = fn.softcap(O, scores, cap)
      seen = visible[:, None, :]
      m = np.max(np.where(seen, scores, F32(MASKED)), axis=2, keepdims=True)
      p = np.where(seen, fn.exp(O, O.sub(scores, m)), F32(0.0)).astype(F32)
      sums = b32.tree_sum(p.reshape(t_len, groups, tiles, self.tile))[..., 0]  # [T, G, tiles]
      values = v[:, kh]  # [T, H]
      l = np.zeros((t_len, groups, 1), F32)
      acc = np.zeros((t_len, groups, head_dim), F32)
      for j in range(tiles):
        pv = np.zeros((t_len, groups, head_dim), F32)
        if saw[:, j].any():
          for slot in range(j * self.tile, (j + 1) * self.tile):
            rows = values[index[:, slot]] * visible[:, slot:slot + 1]  # [T, H]; unseen: 0
            pv = b32.fma(p[:, :, slot:slot + 1], rows[:, None, :], pv)
        sees = saw[:, None, j:j + 1]
        l = np.where(sees, O.add(l, sums[:, :, j:j + 1]), l).astype(F32)
        acc = np.where(sees, O.add(acc, pv), acc).astype(F32)
      out[:, kh] = O.mul(acc, fn.reciprocal(O, np.where(l > 0, l, F32(1.0)).astype(F32)))
    return out.reshape(t_len, num_heads, head_dim)

  def _scores(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """q [T, G, H] . k [S, H] -> [T, G, S], contracted over H in chunks of at most k_chunk."""
    t_len, groups, head_dim = q.shape
    return b32.chunked_dot(q.reshape(t_len * groups, head_dim), k.T,
                           self.k_chunk).reshape(t_len, groups, -1)

  def _relative_scores(self, q: np.ndarray, k: np.ndarray, sin: np.ndarray,
                       cos: np.ndarray) -> np.ndarray:
    """q [T, G, H] . R(-a(t - i)) k[i] -> [T, G, T] (0 where i > t): each row against the keys
    before it, turned back by the angle of their offset (gemma_jax.rope.RelativeScores)."""
    t_len, groups, head_dim = q.shape
    out = np.zeros((t_len, groups, t_len), F32)
    for t in range(t_len):
      offsets = t - np.arange(t + 1)
      first, second = np.split(k[:t + 1], 2, axis=-1)
      s, c = -sin[offsets], cos[offsets]
      keys = np.concatenate([O.sub(O.mul(first, c), O.mul(second, s)),
                             O.add(O.mul(second, c), O.mul(first, s))], axis=-1)
      out[t, :, :t + 1] = b32.chunked_dot(q[t], keys.T, self.k_chunk)
    return out

  # The model --------------------------------------------------------------------------------------

  def run(self, tokens: Sequence[int], logit_rows: Sequence[int] = ()) -> Output:
    """The KV state and logits of `tokens` (T ids from position 0), computed whole: an Output
    with every cache layer's k, v [T, K, H] float32 and the float32 logits [V] of each row in
    `logit_rows`."""
    cfg, p = self.config, self.p
    ids = np.asarray(tokens, np.int64)
    positions = np.arange(len(ids))
    table = p['embedder']['input_embedding']
    x = O.mul(table[ids], F32(math.sqrt(cfg.embed_dim)))
    per_layer = None
    if cfg.per_layer_embed_dim:
      e = p['embedder']
      by_token = O.mul(e['per_layer_embeddings'][ids], F32(math.sqrt(cfg.per_layer_embed_dim)))
      by_context = O.mul(self.dense(x, e['per_layer_model_projection']['w']),
                         F32(cfg.embed_dim ** -0.5))
      by_context = self.norm(by_context, e['per_layer_projection_norm']['scale'])
      per_layer = O.mul(O.add(by_context, by_token), F32(2.0 ** -0.5))  # [T, L, P]
    angles = {}
    caches = {}  # cache-owning layer -> (k, v)
    for i in range(cfg.num_layers):
      spec = cfg.layer_spec(i)
      lp = p['layers'][i]
      key = (spec.head_dim, spec.rope_base, spec.rope_scale, spec.rotary_fraction)
      if key not in angles:
        angles[key] = self.angles(positions, *key)
      sin, cos = angles[key]
      h = self.norm(x, lp['pre_attention_norm']['scale'])
      a = lp['attn']
      q = self.dense(h, a['q_proj']['w'])
      if 'query_norm' in a:
        q = self.norm(q, a['query_norm']['scale'])
      if not self.relative:
        q = self.rotate(q, sin, cos)
      if cfg.query_pre_attn_scalar is not None:
        q = O.mul(q, F32(cfg.query_pre_attn_scalar ** -0.5))
      if spec.kv_source == i:
        if 'k_proj' in a:
          k = v = self.dense(h, a['k_proj']['w'])
        else:
          kv = self.dense(h, a['kv_proj']['w'])
          k, v = kv[:, 0], kv[:, 1]
        if 'key_norm' in a:
          k = self.norm(k, a['key_norm']['scale'])
        if cfg.use_v_norm:
          v = self.norm(v, None)
        caches[i] = (k if self.raw_keys else self.rotate(k, sin, cos), v)
      k, v = caches[spec.kv_source]
      if self.raw_keys and not self.relative:
        k = self.rotate(k, sin, cos)
      # Positions are 0 .. T - 1, so their table is the offsets' table too.
      encoded = self.attend(q, k, v, spec, (sin, cos) if self.relative else None)
      x = O.add(x, self.norm(self.dense(encoded, a['o_proj']['w'], 2),
                             lp['post_attention_norm']['scale']))
      mlp = lp['mlp']
      gate_up = self.dense(self.norm(x, lp['pre_ffw_norm']['scale']), mlp['gate_up_proj']['w'])
      hidden = O.mul(fn.gelu(O, gate_up[:, 0]), gate_up[:, 1])
      x = O.add(x, self.norm(self.dense(hidden, mlp['down_proj']['w']),
                             lp['post_ffw_norm']['scale']))
      if per_layer is not None:
        gated = O.mul(fn.gelu(O, self.dense(x, lp['per_layer_input_gate']['w'])),
                      per_layer[:, i])
        x = O.add(x, self.norm(self.dense(gated, lp['per_layer_projection']['w']),
                               lp['post_per_layer_input_norm']['scale']))
      if cfg.use_skip_scale:
        x = O.mul(x, lp['skip_scale'])
      self.progress(f'layer {i + 1}/{cfg.num_layers}')
    x = self.norm(x, p['final_norm']['scale'])
    logits = {}
    for row in logit_rows:
      logits[int(row)] = self.logits(x[row:row + 1])[0]
      self.progress(f'logits of row {row}')
    return Output(k=[caches[i][0] for i in cfg.cache_layers],
                  v=[caches[i][1] for i in cfg.cache_layers], logits=logits)

  def logits(self, rows: np.ndarray) -> np.ndarray:
    """rows [R, D] -> [R, V] against the transposed embedding table, soft-capped where the
    family does."""
    if self._table_t is None:
      self._table_t = np.ascontiguousarray(self.p['embedder']['input_embedding'].T)
    table = self._table_t
    logits = self.matmul(rows, table)
    cap = self.config.final_logit_softcap
    return fn.softcap(O, logits, cap) if cap is not None else logits


def tiled_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray,
                    k_pos: np.ndarray, *, window: int | None, softcap: float | None, tile: int,
                    k_chunk: int = 256,
                    relative: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
  """The spec's tiled attention for slots at any positions (gemma_jax.tiled_attention, and the
  native kernel that computes it whole): q [T, N, H] (scaled), k, v [S, K, H], q_pos [T], k_pos
  [S] (int; -1: a padding row, an empty slot) -> [T, N, H] float32. Slot s is visible to a row
  at p when 0 <= k_pos[s] <= p (and p - k_pos[s] < window); scores over H in chunks, the
  soft-cap, each row's max over what it sees, p = exp(s - max) where visible, then tile after
  tile in slot order the row sum (a pairwise tree) and p . v (one FMA chain over the tile's
  slots) added where the row saw the tile, and acc * (1 / l). relative: (sin, cos) [S', H/2]
  of offsets 0 .. S' - 1 (the relative RoPE mode, gemma_jax.rope.RelativeScores): q and k are
  unrotated and each row scores every slot's key turned back by the angle of its offset (offset
  0 where it does not see the slot; an offset past S' reads NaN)."""
  t_len, num_heads, head_dim = q.shape
  num_slots, num_kv = k.shape[:2]
  groups, n = num_heads // num_kv, num_slots // tile
  row_pos = np.repeat(np.asarray(q_pos), groups)[:, None]  # row r = token r // G, head r % G
  k_pos = np.asarray(k_pos)[None]
  visible = kvs.visible(row_pos, k_pos, window)
  out = np.zeros((t_len, num_kv, groups, head_dim), F32)
  for kh in range(num_kv):
    rows = q[:, kh * groups:(kh + 1) * groups].reshape(t_len * groups, head_dim)
    if relative is None:
      scores = b32.chunked_dot(rows, k[:, kh].T, k_chunk)  # [R, S]
    else:
      scores = np.stack([_turned_scores(rows[r], k[:, kh], np.where(visible[r], row_pos[r, 0]
                                                                    - k_pos[0], 0), *relative,
                                        k_chunk) for r in range(len(rows))])
    if softcap is not None:
      scores = fn.softcap(O, scores, softcap)
    tile_max = np.where(visible, scores, F32(MASKED)).reshape(-1, n, tile).max(axis=2)
    saw = tile_max > F32(MASKED)  # [R, n]
    m = tile_max.max(axis=1, keepdims=True)
    p = np.where(visible, fn.exp(O, O.sub(scores, m)), F32(0.0)).astype(F32)
    sums = b32.tree_sum(p.reshape(-1, n, tile))[..., 0]  # [R, n]
    l = np.zeros((len(rows), 1), F32)
    acc = np.zeros((len(rows), head_dim), F32)
    for j in range(n):
      part = slice(j * tile, (j + 1) * tile)
      pv = b32.dot(p[:, part], v[part, kh])
      l = np.where(saw[:, j:j + 1], O.add(l, sums[:, j:j + 1]), l).astype(F32)
      acc = np.where(saw[:, j:j + 1], O.add(acc, pv), acc).astype(F32)
    out[:, kh] = O.mul(acc, fn.reciprocal(O, np.where(l > 0, l, F32(1.0)).astype(F32))).reshape(
        t_len, groups, head_dim)
  return out.reshape(t_len, num_heads, head_dim)


def _turned_scores(row: np.ndarray, keys: np.ndarray, offsets: np.ndarray, sin: np.ndarray,
                   cos: np.ndarray, k_chunk: int) -> np.ndarray:
  """row [H] against keys [S, H], each turned back by the angle of its offset [S]."""
  known = offsets < len(sin)
  index = np.where(known, offsets, 0)
  s = np.where(known[:, None], -sin[index], np.nan).astype(F32)
  c = np.where(known[:, None], cos[index], np.nan).astype(F32)
  first, second = np.split(keys, 2, axis=-1)
  turned = np.concatenate([O.sub(O.mul(first, c), O.mul(second, s)),
                           O.add(O.mul(second, c), O.mul(first, s))], axis=-1)
  return b32.chunked_dot(row[None], turned.T, k_chunk)[0]


def _to_numpy(tree):
  """Parameters as float32 NumPy arrays, subnormals flushed (XLA:CPU reads them as zeros)."""
  if isinstance(tree, dict):
    return {k: _to_numpy(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [_to_numpy(v) for v in tree]
  array = np.asarray(tree)
  if array.dtype != np.float32:
    raise ValueError(f'the written arithmetic is float32; a parameter is {array.dtype}')
  return b32.flush(array)
