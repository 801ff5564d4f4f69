"""What this process runs on, as far as bits can follow it: the CPU's /proc/cpuinfo fields."""

from __future__ import annotations

import functools


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
