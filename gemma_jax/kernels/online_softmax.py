"""One step of the online softmax: fold a KV tile into a block of query rows.

This is the arithmetic every backend's kernel runs, written once on plain arrays so that the GPU
loop driver and the TPU grid driver in `pallas_attention` share it line for line.

State per query row (float32): `m` the running max of the visible logits (MASKED while nothing
was visible), `l` the running sum of exp(logit - m), `acc` the running sum of exp(logit - m) * v.
All shapes are 2-D so that they lower on Triton and Mosaic alike: m, l [bq, 1], acc [bq, H].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# The initial running max is gemma_jax.numerics.MASKED: being finite keeps exp(m_old - m_new)
# finite for rows that have seen nothing.
from gemma_jax import kv_state as kvs
from gemma_jax.numerics import MASKED

# q [bq, H] . k [tile, H] contracting H; p [bq, tile] . v [tile, H] contracting the slots.
_QK_DIMS = (((1,), (1,)), ((), ()))
_PV_DIMS = (((1,), (0,)), ((), ()))
# HIGHEST keeps float32 dots in float32: Triton's default for float32 is TF32 and Mosaic's is a
# bfloat16 pass. For bfloat16 inputs it is the native bf16 x bf16 -> f32 product on every backend.
_PRECISION = lax.Precision.HIGHEST


def visible_slots(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
  """[bq, tile] bool from q_pos [bq, 1] (or [bq, tile]) and k_pos [1, tile] (or [tile... 2-D]):
  the visibility rule (gemma_jax.kv_state.visible)."""
  return kvs.visible(q_pos, k_pos, window)


State = tuple[jax.Array, jax.Array, jax.Array]  # (m [bq, 1], l [bq, 1], acc [bq, H])


def initial_state(block_q: int, head_dim: int) -> State:
  """The state before any tile: running max m [bq, 1] (MASKED), row sum l [bq, 1] and
  accumulator acc [bq, H], float32 (bq = block_q, H = head_dim)."""
  return (jnp.full((block_q, 1), MASKED, jnp.float32),
          jnp.zeros((block_q, 1), jnp.float32),
          jnp.zeros((block_q, head_dim), jnp.float32))


def rows_seeing(visible: jax.Array) -> jax.Array:
  """[bq, 1] bool: the rows that see at least one slot of the tile. (A max of 0/1 floats rather
  than `any`: Triton has no boolean reduction.)"""
  return jnp.max(jnp.where(visible, 1.0, 0.0), axis=1, keepdims=True) > 0.0


def any_visible(visible: jax.Array) -> jax.Array:
  """Scalar bool: some row sees some slot of the tile. Two one-axis reductions (Triton reduces
  one axis at a time)."""
  return jnp.max(jnp.max(jnp.where(visible, 1.0, 0.0), axis=1), axis=0) > 0.0


def fold_tile(state: State, q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, *,
              softcap: float | None) -> State:
  """Folds one tile into the running state. q [bq, H], k, v [tile, H], visible [bq, tile].

  Masked entries contribute exactly 0 (`where(visible, exp(s - m), 0)`, not exp(MASKED - m)),
  and a row that sees nothing in this tile keeps its (m, l, acc) bit for bit: the final `where`
  selects the old state, so computing a fully masked tile and skipping it give the same bits."""
  m, l, acc = state
  s = lax.dot_general(q, k, _QK_DIMS, precision=_PRECISION,
                      preferred_element_type=jnp.float32)  # [bq, tile]
  if softcap is not None:
    s = jnp.tanh(s / softcap) * softcap  # Gemma 2 logit softcap, same formula as the reference
  m_next = jnp.maximum(m, jnp.max(jnp.where(visible, s, MASKED), axis=1, keepdims=True))
  p = jnp.where(visible, jnp.exp(s - m_next), 0.0)  # [bq, tile]
  alpha = jnp.exp(m - m_next)  # rescales what was accumulated under the old max
  l_next = alpha * l + jnp.sum(p, axis=1, keepdims=True)
  # p is cast to v's dtype like the reference's probabilities; the product accumulates in f32.
  pv = lax.dot_general(p.astype(v.dtype), v, _PV_DIMS, precision=_PRECISION,
                       preferred_element_type=jnp.float32)  # [bq, H]
  acc_next = alpha * acc + pv
  seen = rows_seeing(visible)
  return (jnp.where(seen, m_next, m), jnp.where(seen, l_next, l), jnp.where(seen, acc_next, acc))


def finish(state: State) -> jax.Array:
  """acc / l, float32 [bq, H]. A row that saw nothing (a padding row) has l = 0 and acc = 0 and
  yields 0, finite. A row that saw something has l >= 1 (its max contributes exp(0))."""
  _, l, acc = state
  return acc / jnp.where(l > 0.0, l, 1.0)
