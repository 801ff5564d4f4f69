"""Pallas kernels. `make_pallas_attention()` returns an attention function with the signature of
`gemma_jax.attention.attend`, to pass as the model's `attention_fn`."""

from gemma_jax.kernels.pallas_attention import BlockConfig
from gemma_jax.kernels.pallas_attention import default_block_config
from gemma_jax.kernels.pallas_attention import make_pallas_attention
from gemma_jax.kernels.pallas_attention import pallas_attend
from gemma_jax.kernels.pallas_attention import PallasAttention

__all__ = ['BlockConfig', 'PallasAttention', 'default_block_config', 'make_pallas_attention',
           'pallas_attend']
