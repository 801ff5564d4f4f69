"""What this process runs on, as far as bits can follow it: the CPU's /proc/cpuinfo fields and
the threads XLA:CPU gives Eigen."""

from __future__ import annotations

import functools
import os

import jax


@functools.lru_cache(maxsize=1)
def cpuinfo() -> dict[str, str]:
  """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
  fields = {}
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if not line.strip():
          break
        name, _, value = line.partition(':')
        fields[name.strip()] = value.strip()
  except OSError:
    pass
  return fields


def intra_op_threads() -> int:
  """The threads XLA:CPU gives Eigen in this process: max(CPUs this process may run on, local
  host devices) (xla/pjrt/cpu/cpu_client.cc, `std::max(DefaultThreadPoolSize(),
  cpu_device_count)`). Eigen blocks a contraction by it, so it decides dot bits."""
  return max(len(os.sched_getaffinity(0)), jax.local_device_count())
