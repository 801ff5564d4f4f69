"""Kernels: our own loops where no library may choose an order, and the Pallas kernels.

Modules (imported by name; this package imports none of them, so a module that needs one
kernel loads only that one):
  native_build    compiles the native C++ kernels (csrc/: chains.h, attention.h, isa.cc, ffi.cc)
                  on first use; `PATHS` is the one list of instruction-set paths
  native_dot      the written arithmetic's contractions and attention as those kernels behind
                  XLA's FFI: one FMA chain per output, the same bits on every path
  spec_dot        the same contractions as a Pallas kernel, for accelerators
  pallas_attention  attention as a Pallas kernel (blocks of queries and KV tiles, online
                  softmax): `make_pallas_attention()` returns an `AttendFn`
  online_softmax  the online softmax the Pallas attention kernel accumulates with

`DotKernel` is the interface the contraction kernels (native_dot, spec_dot) implement.
"""

from __future__ import annotations

from typing import Protocol

import jax
from jax.sharding import Mesh


class DotKernel(Protocol):
  """What computes the written arithmetic's contractions (and, where it can, its attention
  whole): each output one sequential FMA chain per chunk, the chunks added in order. Decides
  no bit; `native_dot.NativeDot` (CPU) and `spec_dot.SpecDot` (accelerators) implement it."""

  @property
  def attends(self) -> bool:
    """Whether `attend` computes the tiled attention whole here (over the tiles some row sees:
    its work follows the context, so one call shape serves every length)."""
    ...

  def packs(self, k: int, n: int) -> bool:
    """Whether a [k, n] weight is kept in this kernel's column panels (`matmul_packed`)."""
    ...

  def on_mesh(self, mesh: Mesh | None) -> DotKernel:
    """This kernel as it runs on `mesh` (None: one device)."""
    ...

  def matmul(self, x: jax.Array, w: jax.Array, chunk: int,
             rows: jax.Array | None = None) -> jax.Array:
    """x [M, I] @ w [I, O] over chunks of `chunk` terms; rows: the first rows wanted (int32
    [], the rest may be skipped; None: all M)."""
    ...

  def matmul_packed(self, x: jax.Array, panels: jax.Array, chunk: int,
                    rows: jax.Array | None = None) -> jax.Array:
    """x [M, I] @ a weight kept as column panels [O / P, I, P] -> [M, O], bit for bit
    `matmul`'s."""
    ...

  def tile_scores(self, q: jax.Array, k: jax.Array, chunk: int) -> jax.Array:
    """q [B, K, R, H] . k [B, K, n, S, H] -> [B, K, n, R, S] over H in chunks of `chunk`."""
    ...

  def tile_values(self, p: jax.Array, v: jax.Array) -> jax.Array:
    """p [B, K, n, R, S] @ v [B, K, n, S, H] -> [B, K, n, R, H]."""
    ...

  def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
             k_pos: jax.Array, *, window: int | None, softcap: float | None, tile: int,
             chunk: int, relative: tuple | None = None) -> jax.Array:
    """The tiled attention whole: q [B, T, N, H] (scaled), k, v [B, S, K, H], q_pos [B, T],
    k_pos [B, S] -> [B, T, N, H] float32 (where `attends`)."""
    ...
