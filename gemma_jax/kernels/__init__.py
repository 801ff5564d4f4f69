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
"""
