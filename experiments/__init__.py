"""Entry points, one per experiment: `python -m experiments.<name> --flag=...` (absl flags).

Each defines its flags only when run, so each imports as a library, and none imports another.
What several share lives in helpers: common.py (shared flags, the result writer), samples.py
and texts.py (inputs), ceilings.py (matmul ceilings), peers/ (the benchmark's other systems)
and fault_campaign/ (the fault campaign behind experiments.faults).

An entry point's process returns the memory it frees (glibc: two malloc arenas, the heap trimmed
on every free), set here, before jax starts its threads: XLA runs a call's work on a pool of
threads, each of which would otherwise keep an arena of its own, and a replay's peak resident
memory grew by the freed temporaries that stayed in them (about 0.25 GB of 2.4 on 12 samples,
measured). It moves no bit, and leaves processes that import the library alone.
"""

import ctypes
import ctypes.util


def _return_freed_memory() -> None:
  try:
    libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
    libc.mallopt(-8, 2)  # M_ARENA_MAX
    libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD
  except (OSError, AttributeError):  # not glibc: its own allocator's policy stands
    pass


_return_freed_memory()
