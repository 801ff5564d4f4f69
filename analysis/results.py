"""The results schema: what each experiment's JSON holds, and how a reader recognises it.

Every result file carries `"schema": "<kind>/<version>"` at its top level, written by the
experiment (experiments/common.py `write_result`), and is recognised by that field alone, never
by its file name: a sweep written with `--output=float.json` is still a position sweep.

`KINDS` lists each kind with its version and the top-level fields its readers rely on (the
field lists below say what is inside). A new experiment adds its kind here; a new figure reads
`load(results_dir)[kind]` (analysis/figures/).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from absl import logging


@dataclasses.dataclass(frozen=True)
class Kind:
  version: int
  fields: tuple[str, ...]  # top-level fields besides "schema"
  description: str


KINDS: dict[str, Kind] = {
    # {"config": {"manifest", "limit", "dot_library", "manifest_made_on", ...},
    #  "summary": {"records", "reproduced"}, "failures": [line, ...]} (experiments/replay.py)
    'replay': Kind(1, ('config', 'summary', 'failures'),
                   'a committed manifest recomputed here, hash for hash'),
    # {"config": {"model", "weights", "dtype", "engine", "attention", "engine_config", ...},
    #  "samples": [{"library_tokens", "query_tokens", "fresh_sha256", "graft_sha256", "equal",
    #               "kl", "argmax_agreement", "continuation_equal", ...}],
    #  "summary": {"samples", "equal", "max_kl", "argmax_agreement", "continuations_equal"}}
    'graft_exactness': Kind(1, ('config', 'samples', 'summary'),
                            'own-position graft against fresh computation, per sample'),
    # {"config": {"model", "weights", "dtype", "rope", "methods", "offsets", ...},
    #  "rows": [{"model", "weights", "dtype", "rope", "method", "offset", "equal", "max_abs",
    #            "max_ulp", "kl", "argmax_agreement", "top5_overlap",
    #            "layers": [{"layer", "k_max_abs", "v_max_abs", "k_max_ulp", "v_max_ulp",
    #                        "k_equal", "v_equal"}]}]}
    'position_sweep': Kind(1, ('config', 'rows'), 'shifted grafts against fresh, per offset'),
    # {"config": {"model", "weights", "dtype", "modes", ...}, "texts": [{"text", "tokens",
    #  "max_abs", "max_kl", "mean_kl", "argmax_agreement", "continuation_equal", ...}],
    #  "summary": {"max_abs", "max_kl", "min_argmax_agreement", "continuations_equal",
    #  "perplexity": {mode: value}, ...}} (experiments/rope_fidelity.py)
    'rope_fidelity': Kind(1, ('config', 'texts', 'summary'),
                          'the relative RoPE mode against float on the same weights'),
    # {"config": {"rows", "slots", "head_dim", ...}, "summary": {"median_s": {"turned",
    #  "tables"}, "tables_vs_turned_speed", "max_abs_difference"}} (experiments/rope_formulation.py)
    'rope_formulation': Kind(1, ('config', 'summary'),
                             "the relative mode's two score formulations, timed side by side"),
    # {"config", "facts", "layer_types": {name: {"spec", "angles", "rotation", "composition",
    #  "rotary"}}, "summary"} (analysis/rope_float.py `analyze`)
    'rope_float': Kind(1, ('config', 'layer_types', 'summary'),
                       'floating-point account of RoPE angles and re-rotation'),
    # {"config": {..., "prefill_flops_per_token", "decode_bytes_per_token"},
    #  "ceilings": {"matmul_gflops", "read_gbps"},
    #  "systems": [{"name", "prefill_tok_s", "decode_tok_s", "ttft_graft_s",
    #               "ttft_recompute_s", "skipped", "prefill_fraction_of_matmul_ceiling",
    #               "decode_fraction_of_read_ceiling", "ttft_graft_split_s": {"restore_s",
    #               "verify_s", "load_s", "graft_s", "query_s", "total_s"}, "restore_gbps",
    #               "raw_read_gbps", "restore_fraction_of_raw_read", ...}], "ratios"}
    # {"config": {"model", "weights", "dtype", "tokens", "splits", "engine_fingerprint", ...},
    #  "summary": {"tokens", "kv_equal", "logits_equal", "first_difference": null or {"run",
    #  "layer", "op", "position"}}, "splits", "logit_rows", "reference_seconds", ...}
    'spec_check': Kind(1, ('config', 'summary'),
                       'the spec engine against the NumPy interpreter of the written arithmetic'),
    'bench': Kind(1, ('config', 'ceilings', 'systems'),
                  'speed of this project\'s engines and of peers, side by side'),
    # {"config", "ceilings": {"matmul_gflops", "read_gbps"}, "prefill" and "decode": {"wall_s",
    #  "thunk_s", "outside_thunks_s", "dot_s", "dot_share", "dot_gflops",
    #  "dot_fraction_of_matmul_ceiling", "by_kind": [{"kind", "s", "share"}],
    #  "by_component": [{"component", "s", "share"}], ...}} (analysis/profile.py `summarize`)
    'profile': Kind(1, ('config', 'ceilings', 'prefill', 'decode'),
                    'where prefill and decode spend their time, op by op'),
    # {"config", "summary": {"addressable_tokens", "device_kv_tokens", "ratio",
    #  "device_bytes_before", "device_bytes_after", "store_bytes", "bytes_per_token", "put_gbps",
    #  "get_gbps", "disk_write_gbps", "disk_read_gbps", "ttft_hit_host_s", "ttft_hit_backing_s",
    #  "ttft_miss_s", "sampled", "sampled_equal", ...}, "deposit", "queries": [...]}
    'widen_context': Kind(1, ('config', 'summary', 'queries'),
                          'usable context from the store against the device cache'),
    # {"config", "kinds": {kind: {"trials", "exact", "refused", "reasons": {reason: count},
    #  "silent_wrong", "lost"}}, "summary": {"trials", "exact", "refused", "silent_wrong", "lost"}}
    'faults': Kind(1, ('config', 'kinds', 'summary'),
                   'fault-injection campaign over artifacts and the store'),
    # {"config", "tasks": [{"id", "split" (recurring|heldout), "base_correct",
    #  "base_decode_tokens", "deposited", "source", "library_correct", "library_decode_tokens",
    #  "grafted_tokens", "graft_exact", ...}], "summary": {"base_accuracy", "recurring_accuracy",
    #  "heldout_base_accuracy", "heldout_library_accuracy", "never_solved",
    #  "never_solved_answered", "never_solved_base_tokens", "never_solved_library_decode_tokens",
    #  "token_factor", "flops_factor", "energy_factor", "graft_exact", ...}}
    'flywheel': Kind(1, ('config', 'tasks', 'summary'),
                     'verified solutions deposited as KV and grafted on recurrence'),
    # {"config": {"engine", "meshes", "layouts", "samples", ...}, "runs": [{"mesh", "layout",
    #  "devices", "graft_equal", "equal_to_one_device", "carried_from", "carried_equal",
    #  "carried_refused", "samples", "rows": [{"fresh_sha256", "graft_sha256",
    #  "carried_sha256" and "carried_equal", or "carried_refused" (the reason)}]}]}
    'mesh_exactness': Kind(1, ('config', 'runs'),
                           'grafts within device meshes, and bits across device counts'),
    # {"config": {"processes", "devices", "engine_config", ...}, "summary": {"samples", "equal",
    #  "equal_to_single_process"}, "samples": [{"fresh_sha256", "graft_sha256",
    #  "single_process_sha256", "processes_agree", ...}]}
    'distributed_check': Kind(1, ('config', 'summary', 'samples'),
                              'grafts on a mesh across two jax.distributed processes'),
    # {"config", "report": {"backend", "device_kind", "steps": {name: {"status", "seconds",
    #  "tail", ...}}, "ok"}}
    'device_check': Kind(1, ('config', 'report'), 'the accelerator host check'),
    # {"config": {"cpu", "qemu", "tokens", "replay_limit", "manifest", ...},
    #  "report": {"emulator", "cpu", "another_machine", "spec_rsqrt_equal", "ok",
    #             "digests_equal_here": {model_library: bool},
    #             "steps": {name: {"command", "status", "seconds", "tail", "probe"|"summary"}}}}
    'emulated_check': Kind(1, ('config', 'report'),
                           'the spec engine on an emulated CPU of another vendor'),
    # {"config", "prompts": [{"name", "tokens", "argmax_agreement", "max_abs_over_max_logit",
    #  "continuation_equal"}], "summary"}
    'hf_parity': Kind(1, ('config', 'prompts', 'summary'),
                      'this project\'s Gemma against HF transformers on the same weights'),
    # {"config": {"model", "weights", "dtype", "rope", "window", "drop", "shifts", ...},
    #  "summary": {"rope", "shifts", "exact", "references_equal_stream", "k_max_abs", "kl",
    #  "first_differing_token"}, "measurements": [{"shifts", "most_turns", "kv_equal",
    #  "k_max_abs", "k_max_ulp", "reference_k_max", "logits_equal", "reference_equals_stream",
    #  "kl", "logits_max_abs", "first_differing_token", "layers": [{"layer", "k_equal",
    #  "v_equal", "k_max_abs", "k_max_ulp"}], ...}]} (experiments/context_shift.py)
    'context_shift': Kind(1, ('config', 'summary', 'measurements'),
                          'a window shifted N times against its tokens placed directly'),
    # {"config": {"modes", "documents", "lengths", "positions", "strategies", "fractions",
    #  "contexts", "questions_per_context", "offsets", ...},
    #  "modes": {mode: {"reference": {"accuracy", "ci95", "questions", ...},
    #    "rows": [{"strategy", "fraction", "accuracy", "ci95", "kl_mean", "kl_max",
    #              "top1_agreement", "logits_equal", "questions", "layers": [{"layer",
    #              "attention_type", "k_rel_l2", "v_rel_l2", ...}], "layers_by_type": {"local",
    #              "global"}, "continuations", "compose_seconds_mean", ...}],
    #    "relocation": [{"document", "offset", "equal", "k_max_abs", "v_max_abs"}],
    #    "ttft": {"fresh_seconds", "rows": [{"strategy", "fraction", "seconds", "speedup"}]}}},
    #  "summary": {"full_recompute_equal", "relocation_exact", "failures"}}
    # (experiments/compose.py)
    'compose': Kind(1, ('config', 'modes', 'summary'),
                    'documents composed anywhere against full recompute, per strategy'),
}


def tag(kind: str) -> str:
  """The value of the "schema" field for a result of `kind`."""
  if kind not in KINDS:
    raise ValueError(f'unknown result kind {kind!r}; known: {sorted(KINDS)}')
  return f'{kind}/{KINDS[kind].version}'


def kind_of(data: Any) -> str | None:
  """The kind of a parsed result (None when it is not one this code reads)."""
  if not isinstance(data, dict) or not isinstance(data.get('schema'), str):
    return None
  kind, _, version = data['schema'].partition('/')
  if kind not in KINDS or version != str(KINDS[kind].version):
    return None
  if any(field not in data for field in KINDS[kind].fields):
    return None
  return kind


def load(results_dir: str | pathlib.Path) -> dict[str, list[tuple[pathlib.Path, dict]]]:
  """Every result in the directory (recursively), grouped by kind, in file-name order. Files
  that are not results (unreadable, no known schema) are logged once and left out."""
  found: dict[str, list[tuple[pathlib.Path, dict]]] = {kind: [] for kind in KINDS}
  root = pathlib.Path(results_dir)
  if not root.is_dir():
    logging.warning('results directory %s does not exist', root)
    return found
  for path in sorted(root.rglob('*.json')):
    try:
      data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
      logging.warning('skipping %s: %s', path, e)
      continue
    kind = kind_of(data)
    if kind is None:
      logging.warning('skipping %s: no known "schema" field (known: %s)', path,
                      ', '.join(tag(k) for k in KINDS))
      continue
    found[kind].append((path, data))
  return found
