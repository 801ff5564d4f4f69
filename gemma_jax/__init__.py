"""Gemma 2, 3 and 4 as Flax NNX modules with an explicit KV state.

    import gemma_jax as gj

    loaded = gj.load('gemma3_270m', 'embedded', 'float32')   # config, params, tokenizer
    kv = gj.init_kv_state(loaded.config, batch_size=1, cache_len=4096, dtype=jnp.float32)
    hidden, kv = gj.forward(loaded.params, loaded.config, tokens, positions, kv)
    logits = gj.compute_logits(loaded.params, loaded.config, hidden)

Model calls are pure functions of (params, config, tokens, positions, KV state). The registries
a researcher extends: `gj.get_config` / gemma_jax/config.py (model families and sizes),
`gj.rope.MODES` (RoPE modes), `gj.attention.IMPLEMENTATIONS` (attention kernels).
`gj.compare` holds the one SHA-256 of arrays and the distances (ULP, KL, argmax) every
comparison uses; `gj.files` the one atomic writer; `gj.cost` FLOP and byte counts. Importing the
package changes no JAX setting (tests/test_imports.py): JAX's persistent compilation cache is
turned on by the entry points and engines that compile (gemma_jax/compilation_cache.py). It
starts the counting of what the process compiles (gemma_jax/resources.py, a listener of JAX's
monitoring events).
"""

from gemma_jax import resources  # noqa: F401  (counts executables from the first compile)

from gemma_jax import attention, compare, cost, files, rope
from gemma_jax.config import BOS_ID, EOS_ID, PAD_ID, TransformerConfig, get_config
from gemma_jax.config import names as model_names
from gemma_jax.kv_state import KVRows, KVState, LayerKV, init_kv_state
from gemma_jax.model import abstract_params, compute_logits, forward, init_params
from gemma_jax.tokenizer import Tokenizer
from gemma_jax.weights import LoadedModel, load

__all__ = [
    'BOS_ID', 'EOS_ID', 'PAD_ID', 'KVRows', 'KVState', 'LayerKV', 'LoadedModel', 'Tokenizer',
    'Transformer', 'TransformerConfig', 'abstract_params', 'attention', 'compare',
    'compute_logits', 'cost', 'files', 'forward', 'get_config', 'init_kv_state', 'init_params',
    'load', 'model_names', 'rope',
]


def __getattr__(name: str):
  """`gj.Transformer`, the NNX module (gemma_jax.modules), imported when first asked for: the
  package's import imports no Flax (docs/performance.md, "The start")."""
  if name == 'Transformer':
    from gemma_jax.modules import Transformer  # deferred: the NNX modules import Flax (0.4 s)
    return Transformer
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
