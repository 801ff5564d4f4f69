"""The systems a user would otherwise pick, measured on the same weights and token ids as ours.

Each peer returns the benchmark's row fields (experiments/bench.py): prefill_tok_s,
decode_tok_s, ttft_recompute_s, ttft_graft_s (the library's saved KV state restored, then the
query) and `skipped` (None, or why it was not measured: a peer that is not installed is skipped
with the reason, never silently).

  hf_transformers     HF transformers' Gemma3ForCausalLM on the embedded GGUF, float32 (hf.py)
  llama_cpp_q4_k_m    llama.cpp through llama-cpp-python on the Q4_K_M file as shipped
  llama_cpp_f32       llama.cpp on a float32 GGUF written from the same file (llama_cpp.py)
  deepmind_gemma      google-deepmind's `gemma` (JAX) Gemma3_270M with its sampler, reading the
                      weights this project writes in the official Orbax layout, in its own
                      Python 3.12 environment (deepmind.py; setup_peer_envs.sh builds it)

The `bench` extra installs llama-cpp-python (PyPI ships only its source: the build compiles
llama.cpp, about 20 minutes on two cores).
"""

from __future__ import annotations

from experiments.peers import deepmind, hf, llama_cpp
from experiments.peers.row import skipped

NAMES = ('hf_transformers', 'llama_cpp_q4_k_m', 'llama_cpp_f32', 'deepmind_gemma')


def embedded_float32(loaded) -> str | None:
  """Why a peer that reads the embedded weights cannot run this configuration (None: it can)."""
  if loaded.weights != 'embedded' or loaded.dtype != 'float32':
    return 'peers run the embedded 270M in float32 (--weights=embedded --dtype=float32)'
  return None


def ops(name: str, loaded, work) -> tuple[dict, object] | dict | None:
  """A peer's timed operations (closures) and a function of their seconds (operation -> the
  timed runs) giving its row, for experiments/bench.py to interleave with the other systems';
  a skipped row where it cannot run; None for a peer measured only in a process of its own
  (deepmind_gemma: `measure`)."""
  reason = embedded_float32(loaded)
  if reason:
    return skipped(reason)
  if name == 'hf_transformers':
    return hf.ops(work)
  if name.startswith('llama_cpp_'):
    return llama_cpp.peer_ops(name.removeprefix('llama_cpp_'), work)
  if name == 'deepmind_gemma':
    return None
  raise ValueError(f'unknown peer {name!r}; expected one of {NAMES}')


def measure(name: str, loaded, work) -> dict:
  reason = embedded_float32(loaded)
  if reason:
    return skipped(reason)
  if name == 'hf_transformers':
    return hf.measure(loaded, work)
  if name.startswith('llama_cpp_'):
    return llama_cpp.measure_peer(name.removeprefix('llama_cpp_'), work)
  if name == 'deepmind_gemma':
    return deepmind.measure(loaded, work)
  raise ValueError(f'unknown peer {name!r}; expected one of {NAMES}')
