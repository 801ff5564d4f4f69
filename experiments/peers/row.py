"""A peer's row of the benchmark (experiments/bench.py): the fields every peer returns."""

from __future__ import annotations


def skipped(reason: str) -> dict:
  """The row of a peer that was not measured, with the reason (never a silent gap)."""
  return {'skipped': reason, 'prefill_tok_s': None, 'decode_tok_s': None,
          'ttft_recompute_s': None, 'ttft_graft_s': None}
