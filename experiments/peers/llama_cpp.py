"""llama.cpp (through llama-cpp-python) as a benchmark peer, and full-precision GGUFs for it.

  write_gguf(src, dst, 'float32' | 'float16')   dequantize every tensor of a GGUF and write it
                                                 back unquantized, all metadata kept
  measure_peer('q4_k_m' | 'f32' | 'f16', work)   the benchmark's row for the embedded model

Prefill is llm.eval of the prompt from an empty cache; decode is greedy, one llm.eval per
token, net of its 32-token prompt; time to first token is library + query from an empty cache,
or the library's state (KV cache and logits, llm.save_state) restored with llm.load_state and
then the query. llama.cpp's state file carries no model hash or checksum: it is restored as is.
With logits_all=False, llama-cpp-python 0.3.x leaves llm.scores empty, so the last logits are
read from the context.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from experiments.peers.row import skipped
from gemma_jax.files import cache_root
from gemma_jax.weights import embedded_gguf_path, sha256_file

# GGUF general.file_type values (llama.cpp's llama_ftype).
FILE_TYPES = {'float32': 0, 'float16': 1}


def write_gguf(src_path: str, dst_path: str, dtype: str) -> dict:
  """Writes `src_path`'s tensors dequantized to `dtype` ('float32' or 'float16') at `dst_path`.

  Every metadata key/value is copied with its GGUF type (tokenizer arrays included) except
  general.file_type, set to the new one. In a float16 file the 1-D tensors (norms) stay float32,
  as llama.cpp's converter writes them. Returns {tensor type name: count}.
  """
  import gguf  # heavy: only where a GGUF is written
  if dtype not in FILE_TYPES:
    raise ValueError(f'dtype must be one of {sorted(FILE_TYPES)}, got {dtype!r}')
  reader = gguf.GGUFReader(src_path)
  arch = reader.fields['general.architecture'].contents()
  staging = f'{dst_path}.{os.getpid()}.partial'
  writer = gguf.GGUFWriter(staging, arch)
  for key, field in reader.fields.items():
    if key.startswith('GGUF.') or key == 'general.architecture':
      continue  # the header, and the key the writer itself adds
    if key == 'general.file_type':
      writer.add_file_type(FILE_TYPES[dtype])
      continue
    if key == 'general.alignment':
      writer.data_alignment = int(field.contents())
    main_type = field.types[0]
    if main_type == gguf.GGUFValueType.ARRAY:
      writer.add_key_value(key, field.contents(), main_type, sub_type=field.types[-1])
    else:
      writer.add_key_value(key, field.contents(), main_type)
  counts: dict[str, int] = {}
  for tensor in reader.tensors:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists ne innermost-first
    values = np.ascontiguousarray(values.reshape(shape), np.float32)
    if dtype == 'float16' and values.ndim > 1:
      values = values.astype(np.float16)
    writer.add_tensor(tensor.name, values)
    kind = 'F16' if values.dtype == np.float16 else 'F32'
    counts[kind] = counts.get(kind, 0) + 1
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  os.replace(staging, dst_path)
  return counts


def settings(n_ctx: int = 4096, n_threads: int = 2, n_batch: int = 512) -> dict:
  """llama_cpp.Llama's arguments as every measurement here makes one (the start's process,
  experiments/peers/llama_start.py, is given them as JSON)."""
  return dict(n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads, n_batch=n_batch,
              n_ubatch=n_batch, logits_all=False, verbose=False)


def _llama(gguf_path: str, **kw):
  import llama_cpp  # the peer: optional (the bench extra)
  return llama_cpp.Llama(model_path=gguf_path, **settings(**kw))


def last_logits(llm) -> np.ndarray:
  """The last evaluated position's logits, read from the context (with logits_all=False,
  llama-cpp-python 0.3.x no longer copies them into llm.scores)."""
  return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))


def _last_argmax(llm) -> int:
  return int(np.argmax(last_logits(llm)))


def _greedy(llm, ids: list[int], n: int) -> list[int]:
  llm.reset()
  llm.eval(ids)
  out = [_last_argmax(llm)]
  for _ in range(n - 1):
    llm.eval([out[-1]])
    out.append(_last_argmax(llm))
  return out


def greedy(gguf_path: str, ids: list[int], n: int, **kw) -> list[int]:
  return _greedy(_llama(gguf_path, **kw), ids, n)


WARMUP = 2  # untimed runs of each operation before the timed ones (the first large
# runs are much slower here: first touch of buffers, page-in of the mmapped weights)


def ops(gguf_path: str, prompt_ids: list[int], decode_tokens: int, library_ids: list[int],
        query_ids: list[int], *, n_threads: int = 2, n_ctx: int = 4096,
        n_batch: int = 512) -> tuple[dict, dict]:
  """The timed operations on one GGUF, as closures, and facts about the setup.

  prefill: llm.eval of `prompt_ids` from an empty cache. decode_prompt / decode_loop: greedy
  from a 32-token prompt for 1 / decode_tokens + 1 tokens, one llm.eval per token (decode is
  their difference). ttft_recompute: library + query from an empty cache. ttft_restored: the
  library's state (KV cache and logits, llm.save_state) restored with llm.load_state, then the
  query. Each ends at the first token's argmax and returns it.
  """
  import llama_cpp  # the peer: optional (the bench extra)
  llm = _llama(gguf_path, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch)

  def prefill():
    llm.reset()
    llm.eval(prompt_ids)
    return _last_argmax(llm)

  def recompute():
    llm.reset()
    llm.eval(library_ids + query_ids)
    return _last_argmax(llm)

  llm.reset()
  llm.eval(library_ids)
  start = time.perf_counter()
  state = llm.save_state()
  save_s = time.perf_counter() - start

  def restored():
    llm.load_state(state)
    llm.eval(query_ids)
    return _last_argmax(llm)

  short = prompt_ids[:32]
  closures = {'prefill': prefill,
              'decode_prompt': lambda: _greedy(llm, short, 1),
              'decode_loop': lambda: _greedy(llm, short, decode_tokens + 1),
              'ttft_recompute': recompute, 'ttft_restored': restored,
              'state_load': lambda: llm.load_state(state)}
  info = {'gguf': os.path.basename(gguf_path), 'gguf_bytes': os.path.getsize(gguf_path),
          'llama_cpp_python': llama_cpp.__version__, 'n_threads': n_threads, 'n_ctx': n_ctx,
          'n_batch': n_batch, 'state_save_s': save_s, 'state_bytes': int(state.llama_state_size),
          'first_token_same': recompute() == restored()}
  return closures, info


def summarize(runs: dict, info: dict, prompt_tokens: int, decode_tokens: int) -> dict:
  """Medians of the timed runs (seconds) as the benchmark's figures."""
  med = {name: statistics.median(times) for name, times in runs.items()}
  out = dict(info)
  out.update({
      'prefill_tokens': prompt_tokens, 'prefill_s': med['prefill'],
      'prefill_tokens_per_s': prompt_tokens / med['prefill'],
      'decode_tokens': decode_tokens,
      'decode_tokens_per_s': decode_tokens / max(med['decode_loop'] - med['decode_prompt'], 1e-9),
  })
  for name in runs:
    if name.startswith(('ttft_', 'state_', 'cache_')):
      out[f'{name}_s'] = med[name]
  out['runs_s'] = {name: [round(t, 4) for t in times] for name, times in runs.items()}
  out['loadavg_1m_end'] = os.getloadavg()[0]
  return out


def time_ops(closures: dict, repeats: int) -> dict:
  """Each closure WARMUP times untimed, then `repeats` timed runs (one closure after another)."""
  runs = {}
  for name, fn in closures.items():
    for _ in range(WARMUP):
      fn()
    runs[name] = []
    for _ in range(repeats):
      start = time.perf_counter()
      fn()
      runs[name].append(time.perf_counter() - start)
  return runs


def gguf_for(variant: str) -> str | None:
  """The embedded GGUF as shipped ('q4_k_m') or written unquantized ('f32', 'f16') into the
  parameter cache directory (once); None where llama-cpp-python is not installed."""
  try:
    import llama_cpp  # noqa: F401  (the peer: optional, the bench extra)
  except ImportError:
    return None
  path = embedded_gguf_path()
  if variant != 'q4_k_m':
    dtype = {'f32': 'float32', 'f16': 'float16'}[variant]
    target = os.path.join(cache_root(), 'peers', f'{sha256_file(path)[:16]}-{dtype}.gguf')
    if not os.path.exists(target):
      os.makedirs(os.path.dirname(target), exist_ok=True)
      write_gguf(path, target, dtype)
    path = target
  return path


def peer_ops(variant: str, work) -> tuple[dict, object] | dict:
  """The benchmark's timed operations for the embedded GGUF as shipped ('q4_k_m') or written
  unquantized ('f32', 'f16'), and a function of their seconds (operation -> the timed runs)
  giving its row; or the row of a skip where llama-cpp-python is missing."""
  path = gguf_for(variant)
  if path is None:
    return skipped('llama-cpp-python is not installed: pip install -e ".[bench]" (it compiles '
                   'llama.cpp, about 20 minutes on two cores)')
  closures, info = ops(path, work.prompt, work.decode_tokens, work.library, work.query)
  info['repeats'] = work.repeats
  for fn in closures.values():  # WARMUP untimed runs in all: one here, one by the caller's
    for _ in range(WARMUP - 1):  # warm-up (experiments/interleaved.py)
      fn()

  def row(times: dict) -> dict:
    measured = summarize(times, info, len(work.prompt), work.decode_tokens)
    return {'prefill_tok_s': measured['prefill_tokens_per_s'],
            'decode_tok_s': measured['decode_tokens_per_s'],
            'ttft_recompute_s': measured['ttft_recompute_s'],
            'ttft_graft_s': measured['ttft_restored_s'],
            'ttft_graft_note': 'llm.load_state of the library\'s saved state, then the query',
            'details': {k: v for k, v in measured.items() if k != 'runs_s'}}

  return closures, row


def measure_peer(variant: str, work) -> dict:
  """The benchmark's row for one GGUF variant alone (peer_ops timed one operation after
  another: time_ops)."""
  made = peer_ops(variant, work)
  if isinstance(made, dict):
    return made
  closures, row = made
  return row(time_ops(closures, work.repeats))


def measure(gguf_path: str, prompt_ids: list[int], decode_tokens: int, library_ids: list[int],
            query_ids: list[int], repeats: int = 3, **kw) -> dict:
  """Prefill, decode and library+query time to first token of one GGUF (medians of `repeats`
  after WARMUP untimed runs of each; see `ops`)."""
  closures, info = ops(gguf_path, prompt_ids, decode_tokens, library_ids, query_ids, **kw)
  info['repeats'] = repeats
  return summarize(time_ops(closures, repeats), info, len(prompt_ids), decode_tokens)
