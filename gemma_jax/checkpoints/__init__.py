"""Checkpoint formats and the parameter cache: each reader returns the params tree
(gemma_jax.model.Params) checked against the config; gemma_jax.weights chooses among them.

Modules:
  tree           the params tree's flat names, its digest, assembly checked against the config
  hf             Hugging Face names and layouts, both ways (GGUF uses them too)
  gguf_io        GGUF files (llama.cpp): read dequantized, written as llama.cpp's converter does
  safetensors_io safetensors files and sharded directories
  orbax_io       Orbax checkpoints in the official Gemma layout
  orbax_util     Orbax raw (uncompressed) saves and quiet restores
  param_cache    the verified cache of converted parameters, memory-mapped at start
"""
