"""Model configurations for Gemma 2, 3 and 4 and the registry that names them.

One frozen `TransformerConfig` describes a model; `layer_spec(i)` resolves everything a single
layer needs (attention type, head shapes, RoPE, window, KV source), so the model code never
branches on the family name. Sizes follow the public reference implementations (docs/gemma.md
names them); tiny configs of each family exist for tests.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any


class Family(enum.Enum):
  """A model family: what decides which mechanisms a model has (see TransformerConfig)."""

  GEMMA2 = 'gemma2'
  GEMMA3 = 'gemma3'
  GEMMA4 = 'gemma4'


class AttentionType(enum.Enum):
  """Which keys a layer's queries see."""

  LOCAL = 'local'  # sliding window of `sliding_window` tokens
  GLOBAL = 'global'  # attends to every earlier token


L, G = AttentionType.LOCAL, AttentionType.GLOBAL

# Special token ids, the same in every Gemma version.
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """What one layer needs, resolved from the config."""

  attention_type: AttentionType
  num_kv_heads: int  # K
  head_dim: int  # H
  rope_base: float
  rope_scale: float  # linear position scaling (angle = pos / timescale / scale)
  rotary_fraction: float  # fraction of the H/2 rotation pairs that rotate
  window: int | None  # None: global attention
  k_eq_v: bool  # one projection feeds both K and V (Gemma 4 global layers)
  kv_source: int  # layer whose cache this layer reads (itself unless KV-shared)
  mlp_hidden: int  # F


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """A Gemma model. Letters: L layers, D width, F MLP hidden, N heads, K KV heads, H head dim."""

  name: str
  family: Family
  num_layers: int  # L
  embed_dim: int  # D
  hidden_dim: int  # F
  num_heads: int  # N
  num_kv_heads: int  # K (local layers; global layers too unless overridden)
  head_dim: int  # H (local layers; global layers too unless overridden)
  attention_pattern: tuple[AttentionType, ...]  # tiled over the layers from layer 0
  sliding_window: int  # W: a query at p sees p-W+1 .. p on local layers
  max_context: int
  vocab_size: int = 262_144
  # None: no query pre-scaling (Gemma 4 relies on QK-norm instead).
  query_pre_attn_scalar: float | None = None
  attn_logits_softcap: float | None = None
  final_logit_softcap: float | None = None
  use_qk_norm: bool = True
  use_v_norm: bool = False
  local_rope_base: float = 10_000.0
  global_rope_base: float = 1_000_000.0
  global_rope_scale: float = 1.0
  global_rotary_fraction: float = 1.0
  global_head_dim: int | None = None
  global_num_kv_heads: int | None = None
  global_k_eq_v: bool = False
  per_layer_embed_dim: int = 0  # Gemma 4 E-models: per-layer embeddings (PLE) width
  num_kv_shared_layers: int = 0  # the last layers reuse KV of earlier layers
  double_wide_mlp_in_shared: bool = False  # E2B: KV-shared layers have 2F hidden units
  use_skip_scale: bool = False  # Gemma 4: learned scalar on each block's output
  rms_norm_eps: float = 1e-6
  rope_mode: str = 'float'  # 'float' (the model as trained), or the controls 'none', 'quarter_turn'
  # Cache keys before RoPE and rotate them by their slot positions at every read (the
  # position-shift experiments' 'pre_rope' method); False caches rotated keys, as Gemma does.
  kv_cache_pre_rope: bool = False

  @property
  def norm_scale_offset(self) -> float:
    """Gemma 2/3 store RMSNorm scales zero-centred (multiply by 1 + scale); Gemma 4 does not."""
    return 0.0 if self.family is Family.GEMMA4 else 1.0

  @functools.cached_property
  def attention_types(self) -> tuple[AttentionType, ...]:
    """Every layer's attention type: attention_pattern repeated over the layers."""
    pattern = self.attention_pattern
    return tuple(pattern[i % len(pattern)] for i in range(self.num_layers))

  @functools.cached_property
  def kv_sources(self) -> tuple[int, ...]:
    """Layer i reads the KV cache of layer kv_sources[i]; the last `num_kv_shared_layers` layers
    reuse the last unshared layer of their own attention type."""
    first_shared = self.num_layers - self.num_kv_shared_layers
    sources = list(range(first_shared))
    for i in range(first_shared, self.num_layers):
      kind = self.attention_types[i]
      candidates = [j for j in range(first_shared) if self.attention_types[j] is kind]
      if not candidates:
        raise ValueError(f'{self.name}: layer {i} shares KV but no earlier {kind.value} layer '
                         'exists')
      sources.append(candidates[-1])
    return tuple(sources)

  @functools.cached_property
  def cache_layers(self) -> tuple[int, ...]:
    """Layers that own a KV cache (every layer that is not KV-shared)."""
    return tuple(i for i in range(self.num_layers) if self.kv_sources[i] == i)

  def layer_spec(self, i: int) -> LayerSpec:
    """What layer i is (attention type, KV heads, head dim, window, RoPE, whether it owns its KV
    cache): the one place per-layer facts are resolved, so model code does not branch on
    names."""
    kind = self.attention_types[i]
    is_global = kind is AttentionType.GLOBAL
    shared = self.kv_sources[i] != i
    return LayerSpec(
        attention_type=kind,
        num_kv_heads=((self.global_num_kv_heads or self.num_kv_heads) if is_global
                      else self.num_kv_heads),
        head_dim=(self.global_head_dim or self.head_dim) if is_global else self.head_dim,
        rope_base=self.global_rope_base if is_global else self.local_rope_base,
        rope_scale=self.global_rope_scale if is_global else 1.0,
        rotary_fraction=self.global_rotary_fraction if is_global else 1.0,
        window=None if is_global else self.sliding_window,
        k_eq_v=self.global_k_eq_v and is_global,
        kv_source=self.kv_sources[i],
        mlp_hidden=self.hidden_dim * (2 if shared and self.double_wide_mlp_in_shared else 1),
    )

  def replace(self, **changes: Any) -> 'TransformerConfig':
    """This config with `changes` (fields by name)."""
    return dataclasses.replace(self, **changes)


def _gemma2(name, *, layers, d, f, n, k, h, scalar, **kw) -> TransformerConfig:
  return TransformerConfig(
      name=name, family=Family.GEMMA2, num_layers=layers, embed_dim=d, hidden_dim=f,
      num_heads=n, num_kv_heads=k, head_dim=h, attention_pattern=(L, G),
      sliding_window=kw.pop('window', 4096), max_context=kw.pop('max_context', 8192),
      vocab_size=kw.pop('vocab_size', 256_128), query_pre_attn_scalar=scalar,
      attn_logits_softcap=50.0, final_logit_softcap=30.0, use_qk_norm=False,
      local_rope_base=10_000.0, global_rope_base=10_000.0, **kw)


def _gemma3(name, *, layers, d, f, n, k, h, window, scalar, rope_scale, context, **kw):
  return TransformerConfig(
      name=name, family=Family.GEMMA3, num_layers=layers, embed_dim=d, hidden_dim=f,
      num_heads=n, num_kv_heads=k, head_dim=h, attention_pattern=(L,) * 5 + (G,),
      sliding_window=window, max_context=context, query_pre_attn_scalar=scalar,
      global_rope_scale=rope_scale, **kw)


def _gemma4(name, *, layers, d, f, n, k, kg, window, pattern, context=131_072, **kw):
  return TransformerConfig(
      name=name, family=Family.GEMMA4, num_layers=layers, embed_dim=d, hidden_dim=f,
      num_heads=n, num_kv_heads=k, head_dim=kw.pop('h', 256), global_head_dim=kw.pop('hg', 512),
      global_num_kv_heads=kg, attention_pattern=pattern, sliding_window=window,
      max_context=context, final_logit_softcap=30.0, use_v_norm=True,
      global_rotary_fraction=0.25, use_skip_scale=True, **kw)


_CONFIGS: dict[str, TransformerConfig] = {c.name: c for c in [
    _gemma2('gemma2_2b', layers=26, d=2304, f=9216, n=8, k=4, h=256, scalar=256),
    _gemma2('gemma2_9b', layers=42, d=3584, f=14336, n=16, k=8, h=256, scalar=256),
    _gemma2('gemma2_27b', layers=46, d=4608, f=36864, n=32, k=16, h=128, scalar=144),
    _gemma3('gemma3_270m', layers=18, d=640, f=2048, n=4, k=1, h=256, window=512, scalar=256,
            rope_scale=1.0, context=32_768),
    _gemma3('gemma3_1b', layers=26, d=1152, f=6912, n=4, k=1, h=256, window=512, scalar=256,
            rope_scale=1.0, context=32_768),
    _gemma3('gemma3_4b', layers=34, d=2560, f=10240, n=8, k=4, h=256, window=1024, scalar=256,
            rope_scale=8.0, context=131_072),
    _gemma3('gemma3_12b', layers=48, d=3840, f=15360, n=16, k=8, h=256, window=1024, scalar=256,
            rope_scale=8.0, context=131_072),
    _gemma3('gemma3_27b', layers=62, d=5376, f=21504, n=32, k=16, h=128, window=1024, scalar=168,
            rope_scale=8.0, context=131_072),
    _gemma4('gemma4_e2b', layers=35, d=1536, f=6144, n=8, k=1, kg=1, window=512,
            pattern=(L,) * 4 + (G,), per_layer_embed_dim=256, num_kv_shared_layers=20,
            double_wide_mlp_in_shared=True),
    _gemma4('gemma4_e4b', layers=42, d=2560, f=10240, n=8, k=2, kg=2, window=512,
            pattern=(L,) * 5 + (G,), per_layer_embed_dim=256, num_kv_shared_layers=18),
    _gemma4('gemma4_12b', layers=48, d=3840, f=15360, n=16, k=8, kg=1, window=1024,
            pattern=(L,) * 5 + (G,), global_k_eq_v=True),
    _gemma4('gemma4_31b', layers=60, d=5376, f=21504, n=32, k=16, kg=4, window=1024,
            pattern=(L,) * 5 + (G,), global_k_eq_v=True),
    # Tiny configs: every mechanism of the family at a size that runs in milliseconds.
    _gemma2('tiny_gemma2', layers=4, d=64, f=128, n=4, k=2, h=16, scalar=16, window=8,
            max_context=512, vocab_size=512),
    _gemma3('tiny_gemma3', layers=7, d=64, f=128, n=4, k=2, h=16, window=8, scalar=16,
            rope_scale=1.0, context=4096, vocab_size=512),
    # Above the spec's pairwise-tree threshold (every projection and the output table has more
    # than 65,536 weights; the MLP's and the table's contractions are chunked, 320 = 2 x 160 and
    # 640 = 4 x 160 terms; a vocabulary that is not whole 64-column panels): the chained dots
    # of the written arithmetic at a size the fast suite compares with its interpreter.
    _gemma3('tiny_gemma3_wide', layers=3, d=320, f=640, n=4, k=2, h=64, window=8, scalar=64,
            rope_scale=1.0, context=4096, vocab_size=520),
    _gemma4('tiny_gemma4', layers=6, d=64, f=128, n=4, k=2, kg=1, h=16, hg=32, window=8,
            pattern=(L,) * 2 + (G,), context=4096, vocab_size=512, per_layer_embed_dim=8,
            num_kv_shared_layers=3, double_wide_mlp_in_shared=True, global_k_eq_v=True),
]}

# Named in the registry so that asking for them says why they cannot be built yet.
UNSUPPORTED: dict[str, str] = {
    'gemma4_26b_a4b': 'Gemma 4 26B-A4B needs mixture-of-experts blocks (128 experts, top-8), '
                      'which gemma_jax does not implement yet',
}


def names() -> list[str]:
  """The names `get_config` knows, sorted."""
  return sorted(_CONFIGS)


def get_config(name: str) -> TransformerConfig:
  """Returns the named config; unknown or unsupported names raise ValueError saying why."""
  if name in UNSUPPORTED:
    raise ValueError(f'model {name!r} is not supported: {UNSUPPORTED[name]}')
  if name not in _CONFIGS:
    raise ValueError(f'unknown model config {name!r}; known: {", ".join(names())}')
  return _CONFIGS[name]
