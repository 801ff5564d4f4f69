"""This machine's limits, measured in the same run as what is compared with them.

  matmul_gflops   a jitted float32 [4096, 4096] @ [4096, 4096] matmul: the most float32 FLOP/s
                  XLA reaches here (prefill is compute-bound, so its ceiling)
  read_gbps       a jitted sum over a 1 GiB float32 array: streaming-read bandwidth (decode is
                  bandwidth-bound: each token reads every weight once, so its ceiling)
  disk_*_gbps     writing a file with fsync and reading it back uncached (O_DIRECT where the
                  filesystem allows it): what a store on local disk can reach

Medians of `repeats` runs after a warm-up.
"""

from __future__ import annotations

import mmap
import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import median_seconds

MATMUL_N = 4096
READ_BYTES = 1 << 30
DISK_BYTES = 1 << 30
_CHUNK = 1 << 24  # 16 MiB per write/read call, aligned for O_DIRECT


def matmul_gflops(repeats: int = 3) -> float:
  a = jax.random.normal(jax.random.key(0), (MATMUL_N, MATMUL_N), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (MATMUL_N, MATMUL_N), jnp.float32)
  matmul = jax.jit(lambda x, y: x @ y)
  seconds = median_seconds(lambda: matmul(a, b).block_until_ready(), repeats)
  return 2 * MATMUL_N ** 3 / seconds / 1e9


def read_gbps(repeats: int = 3) -> float:
  x = jnp.ones((READ_BYTES // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  seconds = median_seconds(lambda: total(x).block_until_ready(), repeats)
  return READ_BYTES / seconds / 1e9


def measure(repeats: int = 3) -> dict:
  return {'matmul_gflops': matmul_gflops(repeats), 'read_gbps': read_gbps(repeats),
          'matmul_n': MATMUL_N, 'read_bytes': READ_BYTES, 'repeats': repeats}


def disk_gbps(directory: str, repeats: int = 3, size: int = DISK_BYTES) -> dict:
  """{'disk_write_gbps', 'disk_read_gbps', 'disk_read_direct'} for a file in `directory`:
  written in 16 MiB chunks and fsynced, then read back with O_DIRECT (bypassing the page cache)
  where the filesystem allows it, else with posix_fadvise(DONTNEED) first."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f'.disk_probe.{os.getpid()}')
  block = mmap.mmap(-1, _CHUNK)  # page-aligned, as O_DIRECT needs
  block.write(np.random.default_rng(0).bytes(_CHUNK))
  direct = hasattr(os, 'O_DIRECT')

  def write():
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
      for _ in range(size // _CHUNK):
        os.write(fd, block)
      os.fsync(fd)
    finally:
      os.close(fd)

  def read():
    nonlocal direct
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    try:
      fd = os.open(path, flags)
    except OSError:  # the filesystem refuses O_DIRECT
      direct = False
      fd = os.open(path, os.O_RDONLY)
    try:
      if not direct:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      buffer = mmap.mmap(-1, _CHUNK)
      while os.readv(fd, [buffer]) > 0:
        pass
    finally:
      os.close(fd)

  try:
    write_s = median_seconds(write, repeats)
    read_s = median_seconds(read, repeats)
  finally:
    if os.path.exists(path):
      os.unlink(path)
  return {'disk_write_gbps': size / write_s / 1e9, 'disk_read_gbps': size / read_s / 1e9,
          'disk_read_direct': direct, 'disk_probe_bytes': size}
