"""Beyond the prefix: documents computed once after a shared prefix, composed in front of a
question, against the full recompute.

  python -m experiments.compose --output=results/compose_gemma3_270m_float32.json \\
      --manifest_output=manifests/compose_gemma3_270m_float32_spec.json
  python -m experiments.compose --contexts=1 --questions=4 --strategies=none,window \\
      --fractions=0,1 --modes=relative --nottft          # a quick look (minutes)

A retrieval task (experiments/facts.py): each context holds --documents documents of --lengths
tokens (--task=needles: real text with --facts_per_document lines "<person> lives in <city>."
among its lines; records: such lines only), stored once after a prefix (BOS and an instruction)
with Store.put_document, and --questions questions, each answered in one of them.
Per RoPE mode in --modes ('relative': position-free rows; 'float': keys re-rotated by each
document's shift, CacheBlend's, asked for and recorded), per placement order in --orders,
the reference is the fresh prefill of prefix + documents + question in the same mode; then for
each recompute strategy in --strategies (none; cacheblend: the largest K/V deviation at layer
1; epic: each document's first tokens; window: ours, the last tokens before the question, which
Gemma's local layers read) at each fraction in --fractions (graft/store/compose.py):

  - the K and V of every layer against the reference's, local and global layers apart;
  - each question's next-token logits: SHA-256 equality, KL(reference || composed), top-1;
  - the answer: right when the city's logit is the largest among the candidates' (the
    context's cities for needles, every city for records: their log-probabilities compared, one
    logits row per question), with 95% Wilson intervals;
  - greedy continuations of --continuation_tokens tokens for --continued questions per context.

Built-in checks (exit status 1 when one fails): at fraction 1.0 every composed question's
logits are SHA-256 equal to the reference's, for every strategy and mode; under 'relative' each
checked document's rows placed at each offset in --offsets ('max': the last that fits the
model's context) are SHA-256 equal to the prefix and the document computed from that offset.

Time to first token (--ttft): one context of --documents x --ttft_length tokens, its documents
stored (host tier warm), the median of --repeats of: Store.compose of prefix, documents and a
question (reading, placing, recomputing, the question's logits) against the engine's prefill of
all of it.

Output: schema compose (analysis/results.py). --manifest_output also writes a replayable manifest
(python -m experiments.replay --manifest=...): per mode and strategy, one composition's prefix,
documents, question, strategy and the SHA-256 of its logits, KV and greedy continuation.
Then `python -m analysis.figures` draws compose_fidelity and compose_ttft.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import sys
import time

from absl import flags, logging
import numpy as np

from experiments import common, facts
from gemma_jax import compare, weights
from gemma_jax.config import get_config
from graft import composition
from graft.engine import Engine
from graft.store import Recompute, Store, compose as composing
from graft.store.kvstore import KvStore

FLAGS = flags.FLAGS
ORDERS = ('given', 'reversed', 'shuffled')
TASKS = ('needles', 'records')


def define_flags() -> None:
  flags.DEFINE_integer('documents', 8, 'Documents per context (4 to 16 in the task).',
                       lower_bound=1, upper_bound=64)
  common.define_list('lengths', [256], 'Each document\'s length in tokens (whole fact lines up '
                     'to it), cycled over the documents.', lower_bound=8)
  common.define_list('orders', ['shuffled'], f'Orders the documents are placed in, each a '
                     f'composition of its own: {", ".join(ORDERS)} (a seeded permutation per '
                     'context).', integers=False, words=ORDERS)
  common.define_list('strategies', list(composing.STRATEGIES), 'Recompute strategies: '
                     f'{", ".join(composing.STRATEGIES)} (graft/store/compose.py).',
                     integers=False, words=composing.STRATEGIES)
  flags.DEFINE_list('fractions', ['0', '0.05', '0.15', '0.3', '1'], 'Fractions of the '
                    'documents\' tokens recomputed, each in [0, 1] (none runs at 0 only).')
  flags.register_validator('fractions', _fractions_valid,
                           message='--fractions: expected numbers in [0, 1]')
  common.define_list('modes', list(composing.MODES), 'RoPE modes: relative (position-free '
                     'rows) and float (keys re-rotated by the shift, recorded).', integers=False,
                     words=composing.MODES)
  flags.DEFINE_enum('task', 'needles', list(TASKS), 'The documents: needles (real text with '
                    '--facts_per_document fact lines each, scored among the context\'s cities) or '
                    'records (fact lines only, scored among every city): experiments/facts.py.')
  flags.DEFINE_integer('facts_per_document', 3, 'needles: fact lines in each document.',
                       lower_bound=1, upper_bound=6)
  flags.DEFINE_integer('contexts', 8, 'Contexts (sets of documents).', lower_bound=1)
  flags.DEFINE_integer('questions', 25, 'Questions per context.', lower_bound=1)
  flags.DEFINE_integer('continuation_tokens', 16, 'Greedy tokens compared after a question.',
                       lower_bound=0)
  flags.DEFINE_integer('continued', 2, 'Questions per context whose greedy continuations are '
                       'compared.', lower_bound=0)
  common.define_list('offsets', ['0', '1', '511', '512', '513', '4096', 'max'], 'Offsets δ at '
                     'which the first context\'s first and last documents are placed in the '
                     'relocation check (max: the last that fits the model\'s context).',
                     lower_bound=0, words=('max',))
  flags.DEFINE_bool('ttft', True, 'Measure the time to first token (composed against fresh).')
  flags.DEFINE_integer('ttft_length', 512, 'Document length of the time-to-first-token context.',
                       lower_bound=8)
  flags.DEFINE_integer('repeats', 3, 'Timed repetitions (medians) of the time to first token.',
                       lower_bound=1)
  flags.DEFINE_integer('seed', 0, 'Seed of the task and of the shuffled orders.', lower_bound=0)
  common.define_output_flag()
  flags.DEFINE_string('manifest_output', None, 'Also write a replayable manifest of this run here '
                      '(experiments.replay --manifest reads it).')
  common.define_model_flags()
  common.define_engine_flags(cache_len=0)


OWN_DEFAULTS = {
    'cache_len': 'sized for the longest context, its question and continuation',
    'continuation_tokens': 'a short answer after each question',
    'offsets': 'the relocation check around the 512-token window and past it',
}


def _fractions_valid(items) -> bool:
  try:
    return all(0.0 <= float(item) <= 1.0 for item in items)
  except ValueError:
    return False


# ----------------------------------------------------------------------------------------------
# Flags


def _ints(name: str, values, low: int, high: int) -> list[int]:
  try:
    out = [int(v) for v in values]
  except ValueError:
    raise ValueError(f'--{name}: expected integers, got {list(values)}') from None
  if not out or not all(low <= v <= high for v in out):
    raise ValueError(f'--{name}: each value must lie in [{low}, {high}], got {out}')
  return out


def _configs() -> list[Recompute]:
  """Every (strategy, fraction) asked, none at fraction 0 only, fraction 0 run once (it is
  none for every strategy)."""
  try:
    fractions = sorted({float(f) for f in FLAGS.fractions})
  except ValueError:
    raise ValueError(f'--fractions: expected numbers, got {FLAGS.fractions}') from None
  if not fractions or not all(0.0 <= f <= 1.0 for f in fractions):
    raise ValueError(f'--fractions: each must lie in [0, 1], got {FLAGS.fractions}')
  unknown = sorted(set(FLAGS.strategies) - set(composing.STRATEGIES))
  if unknown or not FLAGS.strategies:
    raise ValueError(f'--strategies: unknown {unknown}; expected some of '
                     f'{composing.STRATEGIES}')
  out = [Recompute()] if 0.0 in fractions or 'none' in FLAGS.strategies else []
  for strategy in FLAGS.strategies:
    if strategy != 'none':
      out += [Recompute(strategy, f) for f in fractions if f > 0]
  return out


def _offsets(max_offset: int) -> list[int]:
  out = []
  for value in FLAGS.offsets:
    if value == 'max':
      out.append(max_offset)
      continue
    try:
      out.append(int(value))
    except ValueError:
      raise ValueError(f'--offsets: expected integers or max, got {FLAGS.offsets}') from None
  if not all(0 <= o <= max_offset for o in out):
    raise ValueError(f'--offsets: each must lie in [0, {max_offset}] (the model\'s context), got '
                     f'{FLAGS.offsets}')
  return out


def _ordered(context: facts.Context, position: str, rng) -> tuple[list, list[int]]:
  """The documents in a placement order, and where each question's document went."""
  n = len(context.documents)
  order = {'given': list(range(n)), 'reversed': list(range(n))[::-1],
           'shuffled': [int(i) for i in rng.permutation(n)]}[position]
  where = {d: i for i, d in enumerate(order)}
  return [context.documents[i] for i in order], [where[q.document] for q in context.questions]


# ----------------------------------------------------------------------------------------------
# Measuring


@dataclasses.dataclass
class Tally:
  """What one (mode, strategy, fraction) accumulates over contexts and questions."""

  correct: int = 0
  top1: int = 0
  questions: int = 0
  equal: int = 0
  kl: list = dataclasses.field(default_factory=list)
  agree: int = 0
  by_position: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  asked_at: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  layers: list = dataclasses.field(default_factory=list)
  continuations: list = dataclasses.field(default_factory=list)
  seconds: list = dataclasses.field(default_factory=list)
  recomputed: list = dataclasses.field(default_factory=list)
  runs: list = dataclasses.field(default_factory=list)

  def answers(self) -> dict:
    """Accuracy (with its 95% interval), top-1 over the vocabulary, by answer position."""
    low, high = facts.wilson(self.correct, self.questions)
    return {'questions': self.questions, 'correct': self.correct,
            'accuracy': self.correct / self.questions, 'ci95': [low, high],
            'top1_accuracy': self.top1 / self.questions,
            'accuracy_by_answer_position': {str(k): self.by_position[k] / self.asked_at[k]
                                            for k in sorted(self.asked_at)}}

  def row(self) -> dict:
    layers = collections.defaultdict(list)
    for per_context in self.layers:
      for row in per_context:
        layers[(row['layer'], row['attention_type'])].append(row)
    by_layer = [{'layer': layer, 'attention_type': kind,
                 **{f'{part}_{m}': float(np.mean([r[f'{part}_{m}'] for r in rows]))
                    for part in ('k', 'v') for m in ('rel_l2', 'max_abs')},
                 'equal': all(r['k_equal'] and r['v_equal'] for r in rows)}
                for (layer, kind), rows in sorted(layers.items())]
    return {
        **self.answers(), 'logits_equal': self.equal, 'kl_mean': float(np.mean(self.kl)),
        'kl_max': float(np.max(self.kl)), 'kl_median': float(np.median(self.kl)),
        'top1_agreement': self.agree / self.questions,
        'layers': by_layer,
        'layers_by_type': composition.by_attention_type(by_layer),
        'continuations': {'compared': len(self.continuations),
                          'equal': sum(c is None for c in self.continuations),
                          'first_difference': self.continuations},
        'compose_seconds_mean': float(np.mean(self.seconds)),
        'recomputed_tokens_mean': float(np.mean(self.recomputed)),
        'runs_mean': float(np.mean(self.runs)),
    }


def _measure_context(engine: Engine, store: Store, prefix, documents, questions, answers_at,
                     configs, candidates, rerotate: bool, tallies: dict, reference: Tally,
                     manifest: list | None) -> list[str]:
  """One composed context against its fresh prefill, for every config; returns failures of the
  built-in check (fraction 1.0 not equal to fresh)."""
  p, total = len(prefix), len(prefix) + sum(len(d) for d in documents)
  fresh = composition.fresh(engine, prefix, documents)
  ref_logits, ref_continuations = [], []
  for i, (q, at) in enumerate(zip(questions, answers_at)):
    ctx, logits = engine.extend(fresh, q.tokens, logits='last')
    ref_logits.append(logits[-1])
    scored = facts.score(logits[-1], q.answer, candidates)
    reference.correct += scored['correct']
    reference.top1 += scored['top1']
    reference.questions += 1
    reference.asked_at[at] += 1
    reference.by_position[at] += scored['correct']
    if i < FLAGS.continued:
      ref_continuations.append(engine.decode(ctx, FLAGS.continuation_tokens).tokens)
  failures = []
  for recompute in configs:
    start = time.perf_counter()
    composed = store.compose(prefix, documents, recompute=recompute, rerotate=rerotate)
    tally = tallies[(recompute.strategy, recompute.fraction)]
    tally.seconds.append(time.perf_counter() - start)
    tally.recomputed.append(composed.record['recompute']['tokens'])
    tally.runs.append(composed.record['recompute']['runs'])
    tally.layers.append(composition.kv_deviation(engine, composed.context, fresh, p, total))
    for i, (q, at) in enumerate(zip(questions, answers_at)):
      ctx, logits = engine.extend(composed.context, q.tokens, logits='last')
      scored = facts.score(logits[-1], q.answer, candidates)
      compared = composition.next_token(ref_logits[i], logits[-1])
      tally.correct += scored['correct']
      tally.top1 += scored['top1']
      tally.questions += 1
      tally.asked_at[at] += 1
      tally.by_position[at] += scored['correct']
      tally.equal += compared['equal']
      tally.kl.append(compared['kl'])
      tally.agree += compared['top1_agrees']
      if i < FLAGS.continued:
        tokens = engine.decode(ctx, FLAGS.continuation_tokens).tokens
        tally.continuations.append(composition.first_difference(tokens, ref_continuations[i]))
      if recompute.fraction == 1.0 and not compared['equal']:
        failures.append(f'{engine.model_config.rope_mode} {recompute.strategy} at 1.0: question {i} '
                        'logits differ from fresh')
    if manifest is not None:
      q = questions[0]
      ctx, logits = engine.extend(composed.context, q.tokens, logits='all')
      decoded = engine.decode(ctx, FLAGS.continuation_tokens)
      manifest.append({
          'rope': engine.model_config.rope_mode, 'rerotate': rerotate, 'prefix': list(prefix),
          'documents': [list(d) for d in documents], 'query': list(q.tokens),
          'recompute': recompute.as_dict(),
          'kv_sha256': composition.kv_digest(engine, composed.context),
          'logits_sha256': compare.sha256_bytes(logits),
          'continuation': decoded.tokens, 'continuation_sha256': decoded.logits_sha256})
  return failures


def _ttft(engine: Engine, store: Store, context: facts.Context, configs, rerotate: bool) -> dict:
  """Medians of --repeats: the fresh prefill of prefix + documents + a question against
  Store.compose of them (documents stored, host tier warm)."""
  prefix, documents = list(context.prefix), [list(d) for d in context.documents]
  query = list(context.questions[0].tokens)
  for document in documents:
    store.put_document(prefix, document)
  tokens = prefix + [t for d in documents for t in d] + query

  def timed(fn) -> float:
    return common.median_seconds(fn, FLAGS.repeats)

  fresh = timed(lambda: engine.prefill(tokens, logits='last'))
  rows = []
  for recompute in configs:
    seconds = timed(lambda: store.compose(prefix, documents, query, recompute=recompute,
                                          rerotate=rerotate))
    rows.append({**recompute.as_dict(), 'seconds': seconds, 'speedup': fresh / seconds})
    logging.info('ttft %s %s at %.2f: %.3f s (fresh %.3f s, %.2fx)',
                 engine.model_config.rope_mode, recompute.strategy, recompute.fraction, seconds,
                 fresh, fresh / seconds)
  return {'tokens': len(tokens), 'document_lengths': [len(d) for d in documents],
          'fresh_seconds': fresh, 'rows': rows}


# ----------------------------------------------------------------------------------------------


def main(argv):
  del argv
  t_start = time.perf_counter()
  configs = _configs()
  unknown = sorted(set(FLAGS.modes) - set(composing.MODES))
  if unknown or not FLAGS.modes:
    raise ValueError(f'--modes: unknown {unknown}; expected some of {composing.MODES}')
  positions = list(FLAGS.orders)
  if not positions or set(positions) - set(ORDERS):
    raise ValueError(f'--orders: expected some of {ORDERS}, got {positions}')
  model_config = get_config(FLAGS.model)
  lengths = _ints('lengths', FLAGS.lengths, 8, model_config.max_context)
  doc_lengths = [lengths[i % len(lengths)] for i in range(FLAGS.documents)]
  tokenizer = weights.load(model_config, FLAGS.weights, FLAGS.dtype).tokenizer
  rng = np.random.default_rng(FLAGS.seed)
  make = lambda lengths, questions: facts.make_context(tokenizer, lengths, questions, rng)
  if FLAGS.task == 'needles' and facts.splits_a_city(tokenizer) is None:
    filler = facts.filler_lines(tokenizer)
    make = lambda lengths, questions: facts.make_needle_context(
        tokenizer, lengths, FLAGS.facts_per_document, questions, rng, filler)
  contexts = [make(doc_lengths, FLAGS.questions) for _ in range(FLAGS.contexts)]
  ttft_context = make([FLAGS.ttft_length] * FLAGS.documents, 1)
  every_city = facts.candidates(tokenizer)
  longest = max([len(c.prefix) + sum(len(d) for d in c.documents) for c in contexts]
                + [len(ttft_context.prefix) + sum(len(d) for d in ttft_context.documents)])
  question_len = max(len(q.tokens) for c in contexts for q in c.questions)
  needed = longest + question_len + FLAGS.continuation_tokens + 1
  cache_len = FLAGS.cache_len or -(-needed // 256) * 256
  first = contexts[0]
  max_offset = model_config.max_context - len(first.prefix) - max(len(d) for d in first.documents)
  offsets = _offsets(max_offset)
  output = common.output_path('compose', FLAGS.model, FLAGS.dtype)
  logging.info('%d contexts of %d documents (%s tokens), %d questions each; %d configs; modes '
               '%s; cache %d', len(contexts), FLAGS.documents, doc_lengths, FLAGS.questions,
               len(configs), FLAGS.modes, cache_len)
  results, failures, manifest_records = {}, [], [] if FLAGS.manifest_output else None
  engines = {}
  for mode in FLAGS.modes:
    loaded = weights.load(model_config.replace(rope_mode=mode), FLAGS.weights, FLAGS.dtype)
    engine = engines[mode] = common.make_engine(loaded, cache_len=cache_len)
    store = Store(KvStore('memory://'), engine)
    rerotate = mode == 'float'
    tallies = collections.defaultdict(Tally)
    reference = Tally()
    deposit_seconds = []
    order_rng = np.random.default_rng([FLAGS.seed, 1])
    status = {'context': 0}
    with common.heartbeat(lambda: f'{mode}: context {status["context"]} of {len(contexts)}',
                          every=120):
      for c, context in enumerate(contexts):
        status['context'] = c + 1
        for position in positions:
          documents, answers_at = _ordered(context, position, order_rng)
          start = time.perf_counter()
          for document in documents:
            store.put_document(context.prefix, document)
          deposit_seconds.append(time.perf_counter() - start)
          candidates = (np.array(context.candidates) if context.candidates is not None
                        else every_city)
          failures += _measure_context(
              engine, store, context.prefix, documents, context.questions, answers_at, configs,
              candidates, rerotate, tallies, reference,
              manifest_records if c == 0 and position == positions[0] else None)
        logging.info('%s: context %d/%d done (%.0f s)', mode, c + 1, len(contexts),
                     time.perf_counter() - t_start)
    relocation = []
    for which in sorted({0, len(first.documents) - 1}):
      for row in composition.relocation(engine, store, first.prefix, first.documents[which],
                                        offsets):
        relocation.append({'document': which, 'tokens': len(first.documents[which]), **row})
    if mode == 'relative' and not all(r['equal'] for r in relocation):
      failures.append('relative: a relocated document is not SHA-256 equal to it computed '
                      'from its offset')
    ttft = _ttft(engine, store, ttft_context, configs, rerotate) if FLAGS.ttft else None
    results[mode] = {
        'reference': reference.answers(),
        'rows': [{**Recompute(s, f).as_dict(), **tallies[(s, f)].row()}
                 for s, f in sorted(tallies, key=lambda k: (k[0] != 'none', k[0], k[1]))],
        'relocation': relocation, 'ttft': ttft,
        'deposit_seconds_mean': float(np.mean(deposit_seconds)),
        'engine_fingerprint': engine.fingerprint,
    }
    log_rows(mode, results[mode])
  engine = next(iter(engines.values()))
  config = {
      **common.model_config_json(), 'modes': list(FLAGS.modes), 'documents': FLAGS.documents,
      'lengths': doc_lengths, 'orders': positions, 'strategies': list(FLAGS.strategies),
      'fractions': sorted({float(f) for f in FLAGS.fractions}), 'contexts': FLAGS.contexts,
      'questions_per_context': FLAGS.questions, 'continuation_tokens': FLAGS.continuation_tokens,
      'continued': FLAGS.continued, 'offsets': offsets, 'ttft_length': FLAGS.ttft_length,
      'repeats': FLAGS.repeats, 'seed': FLAGS.seed, 'cache_len': cache_len,
      'engine': FLAGS.engine, 'engine_config': dataclasses.asdict(engine.engine_config),
      'model_fingerprint': engine.model_fingerprint['sha256'],
      'task': FLAGS.task, 'facts_per_document': FLAGS.facts_per_document,
      'scored_among': ('the context\'s cities' if contexts[0].candidates is not None
                       else 'every city (experiments/facts.py CITIES)'),
      'prefix_tokens': len(first.prefix),
      'document_tokens': [[len(d) for d in c.documents] for c in contexts],
      'wall_seconds': round(time.perf_counter() - t_start, 1),
  }
  summary = {
      'full_recompute_equal': not any('at 1.0' in f for f in failures),
      'relocation_exact': all(r['equal'] for r in results.get('relative', {}).get(
          'relocation', [])) if 'relative' in results else None,
      'failures': failures,
  }
  common.write_result(output, 'compose', {'config': config, 'modes': results,
                                          'summary': summary})
  if FLAGS.manifest_output:
    write_manifest(FLAGS.manifest_output, config, engines, manifest_records)
  if failures:
    for failure in failures:
      print(f'error: {failure}', file=sys.stderr)
    sys.exit(1)


def write_manifest(path: str, config: dict, engines: dict, records: list) -> None:
  """A replayable manifest (graft/replay.py `replay_compositions`)."""
  engine = next(iter(engines.values()))
  common.write_json(path, {
      'kind': 'compose', 'config': {**config, **common.provenance(),
                                    'command': common.recorded_command()},
      'model_fingerprint': engine.model_fingerprint,
      'engine_fingerprint': engine.fingerprint,
      'engine_fingerprints': {mode: e.fingerprint for mode, e in engines.items()},
      'model_fingerprints': {mode: e.model_fingerprint for mode, e in engines.items()},
      'compositions': records})
  print(f'wrote {path} ({len(records)} compositions)')


def log_rows(mode: str, result: dict) -> None:
  ref = result['reference']
  print(f'{mode}: full recompute accuracy {ref["accuracy"]:.3f} '
        f'[{ref["ci95"][0]:.3f}, {ref["ci95"][1]:.3f}] over {ref["questions"]} questions')
  for row in result['rows']:
    types = row['layers_by_type']
    print(f'{mode:8s} {row["strategy"]:10s} {row["fraction"]:.2f}  accuracy {row["accuracy"]:.3f} '
          f'KL {row["kl_mean"]:.3g}  top-1 {row["top1_agreement"]:.3f}  equal '
          f'{row["logits_equal"]}/{row["questions"]}  K rel. (local '
          f'{types.get("local", {}).get("k_rel_l2", 0):.3g}, global '
          f'{types.get("global", {}).get("k_rel_l2", 0):.3g})')
  relocated = result['relocation']
  print(f'{mode}: relocation {sum(r["equal"] for r in relocated)}/{len(relocated)} SHA-256 equal')
  if result['ttft']:
    t = result['ttft']
    print(f'{mode}: time to first token, fresh {t["fresh_seconds"]:.2f} s; ' + ', '.join(
        f'{r["strategy"]}@{r["fraction"]:g} {r["seconds"]:.2f} s' for r in t['rows']))


if __name__ == '__main__':
  define_flags()
  common.run(main)
