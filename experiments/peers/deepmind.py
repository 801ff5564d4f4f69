"""google-deepmind's `gemma` library as a peer, driven in its own environment.

gemma 4.x needs Python 3.12 and its own jax/flax, so it runs in a separate virtual environment
($GEMMA_PEER_PYTHON, default ~/.cache/gemma_jax/peers/gemma/bin/python; experiments/peers/
setup_peer_envs.sh builds it) as a subprocess: `deepmind_gemma_peer.py` (which imports nothing
from this project) gets a JSON job and prints one JSON result. The weights are this project's,
written in the official Orbax layout (gemma_jax/checkpoints/orbax_io.py), and read by
`gm.ckpts.load_params`, so the peer also checks that layout against an independent reader: its
logits on the parity prompts (experiments/hf_parity.py) are compared with ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

import numpy as np

from experiments.peers import parity as hf_parity
from experiments.peers.row import skipped
from gemma_jax.checkpoints import orbax_io
from graft.engine import Engine, EngineConfig

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'deepmind_gemma_peer.py')
DEFAULT_PYTHON = os.path.expanduser('~/.cache/gemma_jax/peers/gemma/bin/python')


def python_path() -> str | None:
  """The peer environment's interpreter, or None when it is not there."""
  path = os.environ.get('GEMMA_PEER_PYTHON', DEFAULT_PYTHON)
  return path if os.access(path, os.X_OK) else None


def prepare(loaded, directory: str) -> dict:
  """Writes `loaded`'s params in the official Orbax layout and its SentencePiece model."""
  checkpoint = os.path.join(directory, 'orbax')
  orbax_io.save_orbax_official(loaded.params, loaded.config, checkpoint)
  tokenizer = os.path.join(directory, 'tokenizer.model')
  with open(tokenizer, 'wb') as f:
    f.write(loaded.tokenizer.model_proto)
  return {'checkpoint': checkpoint, 'tokenizer': tokenizer}


def run(python: str, job: dict, timeout: float = 3600) -> dict:
  proc = subprocess.run([python, DRIVER, '-'], input=json.dumps(job), capture_output=True,
                        text=True, timeout=timeout)
  if proc.returncode != 0:
    raise RuntimeError(f'the gemma peer failed ({proc.returncode}): {proc.stderr[-3000:]}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def logits_parity(loaded, python: str, prompts: list[list[int]], files: dict,
                  directory: str) -> list[dict]:
  """Per prompt: the peer's last-position logits against ours (max |diff| / max |logit|) and
  the fraction of positions whose argmax agrees. `files` from `prepare`."""
  output = os.path.join(directory, 'logits.npz')
  result = run(python, {**files, 'logits_prompts': prompts, 'logits_output': output})
  theirs = np.load(output)
  engine = Engine(loaded, EngineConfig(mode='default', cache_len=1024))
  rows = []
  for i, ids in enumerate(prompts):
    _, ours = engine.prefill(ids, logits='all')
    last = theirs[f'last_{i}']
    rows.append({'tokens': len(ids),
                 'max_abs_over_max_logit': float(np.max(np.abs(ours[-1] - last))
                                                 / np.max(np.abs(last))),
                 'argmax_agreement': float(np.mean(np.argmax(ours, -1)
                                                   == np.asarray(result['logits']['argmax'][i])))})
  return rows


def measure(loaded, work) -> dict:
  python = python_path()
  if python is None:
    return skipped('google-deepmind gemma needs its own Python 3.12 environment (gemma 4.0.1, '
                   'jax 0.12): bash experiments/peers/setup_peer_envs.sh, or set '
                   '$GEMMA_PEER_PYTHON')
  with tempfile.TemporaryDirectory() as directory:
    files = prepare(loaded, directory)
    speed = run(python, {**files, 'prompt_ids': work.prompt, 'decode_tokens': work.decode_tokens,
                         'library_ids': work.library, 'query_ids': work.query,
                         'repeats': work.repeats})['speed']
    prompts = [loaded.tokenizer.encode(t) for t in hf_parity.PROMPTS.values()]
    parity = logits_parity(loaded, python, prompts, files, directory)
  return {'prefill_tok_s': speed['sampler_prefill_tokens_per_s'],
          'decode_tok_s': speed['decode_tokens_per_s'],
          'ttft_recompute_s': speed['ttft_recompute_s'],
          'ttft_graft_s': speed['ttft_cached_library_s'],
          'ttft_graft_note': speed['ttft_note'],
          'jit_forward_prefill_tok_s': speed['jit_forward_prefill_tokens_per_s'],
          'official_layout_parity': parity, 'jax': speed['jax']}
