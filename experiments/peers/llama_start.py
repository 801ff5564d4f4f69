"""llama.cpp's fresh process to its first logits, as experiments.bench times ours.

  python -P experiments/peers/llama_start.py GGUF SETTINGS_JSON --phases=PATH

Run as a file, not a module of this package, and with -P (its folder is not put on sys.path,
where llama_cpp.py would shadow the peer): it imports llama-cpp-python and nothing of ours
(importing experiments.peers would import jax and gemma_jax, about 1.4 s that are not llama.cpp's
start). Writes the wall-clock stamps after the import, after loading the model (`loaded` and
`engine`: llama.cpp has no separate engine step) and at the prompt's first logits as JSON to
PATH; SETTINGS_JSON: llama_cpp.Llama's arguments (experiments.peers.llama_cpp.settings).
"""

import json
import sys
import time


def main(gguf_path: str, settings: str, phases_path: str) -> None:
  stamps = {}
  import llama_cpp  # timed: the peer's import is part of its start
  stamps['imported'] = time.time()
  llm = llama_cpp.Llama(model_path=gguf_path, **json.loads(settings))
  stamps['loaded'] = stamps['engine'] = time.time()
  llm.eval(llm.tokenize(b'The capital of France is', add_bos=True))
  logits = llm._ctx.get_logits_ith(-1)  # the last position's (see llama_cpp.last_logits)
  assert logits[0] == logits[0], 'no logits'
  stamps['first_logits'] = time.time()
  with open(phases_path, 'w') as f:
    json.dump(stamps, f)


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2], sys.argv[3].removeprefix('--phases='))
