"""Batch invariance: a context served in a batch slot gets exactly the bits it gets alone.

The pinned engine's `extend_batch` runs N contexts per call, one per slot. Each slot's logits
(SHA-256 of float32) must equal those of `extend` on that context alone, whatever the other
slots hold (other texts, other lengths, grafted contexts) or whether they are idle, at any split.
The relative RoPE mode too, with a context-shifted context among the slots.
"""

import functools

import numpy as np
import pytest

from gemma_jax import kv_state as kvs
from gemma_jax import weights
from gemma_jax.compare import sha256_bytes
from gemma_jax.config import get_config
from graft import context_shift
from graft.store import artifact
from graft.engine import Engine, EngineConfig, _engine


@functools.lru_cache(maxsize=None)
def engine(name='tiny_gemma3', rope='float'):
  return Engine(weights.load(get_config(name).replace(rope_mode=rope), 'random:0', 'float32'),
                EngineConfig(rows_per_call=16, cache_len=512, attention_tile=16))


def tokens(n, seed):
  return [int(t) for t in np.random.default_rng(seed).integers(3, 512, n)]


@pytest.mark.parametrize('name', ['tiny_gemma2', 'tiny_gemma3', 'tiny_gemma4'])
def test_slot_equals_alone_whatever_the_other_slots_hold(name):
  eng = engine(name)
  texts = [tokens(n, seed) for seed, n in enumerate([37, 5, 70, 1])]
  alone = [sha256_bytes(eng.extend(eng.empty(), t, logits='all')[1]) for t in texts]
  # Four texts together, then each next to idle slots and next to other texts.
  _, together = eng.extend_batch([eng.empty()] * 4, texts, logits=[len(t) for t in texts])
  assert [sha256_bytes(r) for r in together] == alone
  _, with_idle = eng.extend_batch([eng.empty()] * 4, [[], texts[2], [], []], logits=[0, 70, 0, 0])
  assert with_idle[0] is None and sha256_bytes(with_idle[1]) == alone[2]
  _, swapped = eng.extend_batch([eng.empty()] * 4, [texts[3], texts[0], [], texts[1]],
                                logits=[1, 37, 0, 5])
  assert [sha256_bytes(swapped[i]) for i in (0, 1, 3)] == [alone[3], alone[0], alone[1]]


def test_relative_slots_equal_one_stream_a_shifted_context_among_them():
  """Relative RoPE in batch slots: logits, greedy tokens, logits digests and KV state of every
  slot equal the stream alone, one slot holding a context whose window has shifted."""
  eng = engine('tiny_gemma3', 'relative')
  texts = [tokens(n, 50 + n) for n in (37, 5, 70)]
  alone = [eng.extend(eng.empty(), t, logits='all') for t in texts]
  ctxs, together = eng.extend_batch([eng.empty()] * 3, texts, logits=[len(t) for t in texts])
  assert [sha256_bytes(r) for r in together] == [sha256_bytes(l) for _, l in alone]
  ctxs[2] = context_shift.drop_oldest(alone[2][0], 9)
  more = [tokens(n, 60 + n) for n in (4, 6, 3)]
  ctxs, rows = eng.extend_batch(ctxs, more, logits=[len(m) for m in more])
  decoded = eng.decode_batch(ctxs, [6, 2, 6])
  for i, (ctx, m, row, d) in enumerate(zip([c for c, _ in alone[:2]] + [
      context_shift.drop_oldest(alone[2][0], 9)], more, rows, decoded)):
    one, logits = eng.extend(ctx, m, logits=len(m))
    assert sha256_bytes(row) == sha256_bytes(logits), i
    by_itself = eng.decode(one, len(d.tokens))
    assert (d.tokens, d.logits_sha256) == (by_itself.tokens, by_itself.logits_sha256), i
    leaves = lambda c: kvs.to_leaves(c.kv, eng.model_config.cache_layers)
    assert ({k: sha256_bytes(v) for k, v in leaves(d.context).items()}
            == {k: sha256_bytes(v) for k, v in leaves(by_itself.context).items()}), i


def test_batched_grafts_and_decoding_equal_alone():
  eng = engine()
  libraries = [tokens(n, 10 + n) for n in (40, 3, 25)]
  queries = [tokens(n, 20 + n) for n in (6, 30, 1)]
  grafted = [artifact.graft(eng, artifact.capture(eng, eng.prefill(lib, logits='none')[0]))
             for lib in libraries]
  ctxs, rows = eng.extend_batch(grafted, queries, logits=[len(q) for q in queries])
  continuations = eng.generate_batch(ctxs, 12)
  for lib, query, row, continuation in zip(libraries, queries, rows, continuations):
    fresh, logits = eng.extend(eng.empty(), lib + query, logits=len(query))
    assert sha256_bytes(row) == sha256_bytes(logits)
    assert continuation == eng.generate(fresh, 12, stop_at_eos=False)[1]


def test_nine_slots_decode_one_row_each_as_alone(monkeypatch):
  """With min_rows slots or more a decode call has one row per slot (the single stream's
  attention shape), and the slots' logits rows share logits calls."""
  eng = engine()
  ctxs = [eng.extend(eng.empty(), tokens(n, 30 + n), logits=1)[0] for n in range(3, 12)]
  shapes = []
  real = _engine.call_inputs
  monkeypatch.setattr(_engine, 'call_inputs', lambda *a: shapes.append(a[2]) or real(*a))
  together = eng.generate_batch(ctxs, 6)
  assert shapes == [1] * 5
  assert together == [eng.generate(c, 6, stop_at_eos=False)[1] for c in ctxs]


def test_sampled_decoding_with_a_stop_rule_equals_alone():
  """decode_batch: each slot's sampled tokens, logits digest and context equal decode alone,
  slots stopping at different steps (a stop rule, token limits, one of 0) and idling after."""
  eng = engine()
  ctxs = [eng.extend(eng.empty(), tokens(n, 40 + n), logits=1)[0] for n in (4, 19, 7, 30, 2)]
  limits, temps, seeds = [9, 5, 0, 12, 9], [1.0, 0.0, 1.0, 2.0, 0.7], [1, 2, 3, 4, 5]
  stop = lambda toks: toks[-1] % 7 == 0
  together = eng.decode_batch(ctxs, limits, temperatures=temps, seeds=seeds, stop=stop)
  assert len({len(d.tokens) for d in together}) > 2  # the slots finished apart
  for ctx, limit, t, seed, d in zip(ctxs, limits, temps, seeds, together):
    alone = eng.decode(ctx, limit, temperature=t, seed=seed, stop=stop)
    assert (d.tokens, d.logits_sha256) == (alone.tokens, alone.logits_sha256)
    assert d.context.tokens == alone.context.tokens
    if d.tokens:
      more = [5, 6]
      assert (sha256_bytes(eng.extend(d.context, more, logits='all')[1])
              == sha256_bytes(eng.extend(alone.context, more, logits='all')[1]))


def test_a_batch_stays_stacked_between_decodes_and_splits_only_when_a_slot_leaves(monkeypatch):
  """Engine.batch: the slots' states are stacked once and stay stacked through two decodes
  (no split, no stacking again); the decodes go on as one decode of each slot alone does, with
  each piece's logits digest equal to the stream's; a slot leaving (context) gets its state,
  equal to the stream's, and the others go on."""
  eng = engine()
  ctxs = [eng.extend(eng.empty(), tokens(n, 70 + n), logits=1)[0] for n in (5, 23, 11)]
  calls = []
  for name in ('_stack', '_unstack'):
    real = getattr(Engine, name)
    monkeypatch.setattr(Engine, name, staticmethod(
        lambda *a, name=name, real=real: calls.append(name) or real(*a)))
  limits = [[4, 2, 4], [3, 3, 0], [2, 0, 2]]  # slot 1 leaves after the second decode
  batch = eng.batch(ctxs)
  pieces = [batch.decode(limits[0]), batch.decode(limits[1])]
  leaving = batch.context(1)
  pieces.append(batch.decode(limits[2]))
  assert calls == ['_stack']
  leaves = lambda c: {k: sha256_bytes(v) for k, v in kvs.to_leaves(c.kv, eng.model_config.cache_layers)
                      .items()}
  for i, ctx in enumerate(ctxs):
    alone = eng.decode(ctx, limits[0][i])
    assert pieces[0][i] == (alone.tokens, alone.logits_sha256), i
    for piece, limit in zip(pieces[1:], (limits[1][i], limits[2][i])):
      if limit == 0:
        assert piece[i][0] == [], i
        continue
      going_on, _ = eng.extend(alone.context, alone.tokens[-1:], logits='last')
      alone = eng.decode(going_on, limit)
      assert piece[i] == (alone.tokens, alone.logits_sha256), i
      if i == 1:
        assert leaving.tokens == alone.context.tokens
        assert leaves(leaving) == leaves(alone.context)


def test_one_slot_leaves_the_callers_context_valid():
  """The batched state is donated to the call: with one slot it must still be a copy (the
  benchmark's one-slot row reused its context and found its buffers deleted)."""
  eng = engine()
  ctx, _ = eng.extend(eng.empty(), tokens(9, 5), logits=1)
  first = eng.generate_batch([ctx], 3)
  assert eng.generate_batch([ctx], 3) == first == [eng.generate(ctx, 3, stop_at_eos=False)[1]]


def test_batch_slots_refuse_bad_input():
  eng = engine()
  with pytest.raises(ValueError, match='2 contexts and 1 token lists'):
    eng.extend_batch([eng.empty()] * 2, [[5]])
  with pytest.raises(ValueError, match='slot 0: 3 logit rows asked of 2 tokens'):
    eng.extend_batch([eng.empty()], [[5, 6]], logits=[3])
  blocked = Engine(eng.loaded, EngineConfig(mode='blocked', rows_per_call=8, cache_len=512))
  with pytest.raises(ValueError, match='batch slots need a plan'):
    blocked.extend_batch([blocked.empty()], [[5]])
