"""The written arithmetic: every float32 value of the spec engine as a stated sequence of
IEEE-754 binary32 operations (docs/determinism.md), and what checks a machine against it.

Modules:
  functions    the elementwise functions (exp, tanh, GELU, sin/cos, 1/sqrt, soft-capping) and
               the RoPE timescale table, written once over a backend of binary32 operations
  binary32     those operations in NumPy, independent of XLA (exact FMA emulation, flush to zero)
  interpreter  the NumPy reference interpreter: KV state and logits of a token sequence
  selfcheck    the probe an engine runs at construction: this machine's XLA against binary32
"""

SPEC_VERSION = 1
