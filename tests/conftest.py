"""Suite-wide fixtures.

XLA:CPU maps memory for every executable it compiles, and the pinned engine compiles one per
(row bucket, attention tiles) it meets, so a whole-suite process accumulates tens of thousands of
mappings; past the kernel's vm.max_map_count (65,530 by default) the next mapping fails and XLA
crashes inside compilation (seen as a segfault in tests/test_graft_exact.py after the modules
before it). Each module's compiled executables are released when it ends.
"""

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope='module')
def release_compiled_executables():
  yield
  jax.clear_caches()
  gc.collect()
