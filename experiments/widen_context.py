"""Usable context far beyond the device cache: a store holding 100x what the engine's cache can.

  python -m experiments.widen_context --store=file:///data/widen/      # embedded 270M
  python -m experiments.widen_context --model=tiny_gemma3 --weights=random:0 \
      --target_tokens=3000000 --store=file:///data/widen_tiny/

1. Deposit distinct libraries of real text (--library_tokens each; experiments/samples.py
   `distinct_libraries`) into the store until the tokens it can graft reach --ratio times the
   engine's device KV capacity (its cache length), or --target_tokens. The device cache never
   changes: every graft fills the engine's one fixed buffer.
2. Serve a seeded stream of --queries queries: each picks a deposited library (half the time
   one served recently, so the host tier sees repeats), grafts it from the store by longest
   prefix and computes a --query_tokens query that continues its text (the next library's first
   tokens), up to the query's last logits. Time to first token is split by where the library's
   blocks came from: the host LRU or the backing store (whose pages are evicted from the OS cache
   first on file:// stores, so backing reads are cold). A few held-out libraries measure a miss
   (no stored prefix: the engine computes everything). For --sampled of the served queries the
   logits are compared by SHA-256 with a fresh computation of library + query.
3. Report addressable tokens, device KV tokens and their ratio, device bytes held before and
   after (jax's live arrays: flat is the claim), store bytes and bytes per token, put and get
   throughput next to this machine's raw disk throughput measured in the same run, the time to
   first token of each tier, and what the paper's 2,854,766 tokens would cost here.

Output: schema widen_context (analysis/results.py); --keep_store keeps the store afterwards.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import statistics
import tempfile
import time

from absl import app, flags, logging
import jax
import numpy as np

from experiments import ceilings, common, samples
from gemma_jax import compare, files
from graft import exactness
from graft.store import Store
from graft.store.kvstore import local_directory

FLAGS = flags.FLAGS
PAPER_TOKENS = 2_854_766  # the paper's usable context (arXiv 2607.14431)


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_string('store', None, 'Store URL (unset: a file:// store in a temporary '
                      'directory).')
  flags.DEFINE_integer('ratio', 100, 'Deposit until addressable tokens >= ratio x cache_len.',
                       lower_bound=1)
  flags.DEFINE_integer('target_tokens', 0, 'Deposit at least this many tokens (0: by --ratio).',
                       lower_bound=0)
  flags.DEFINE_integer('library_tokens', 2048, 'Library length in tokens: each deposited '
                       'library (BOS and text; more than --query_tokens).', lower_bound=2)
  flags.DEFINE_integer('queries', 48, 'Queries served from the store.', lower_bound=1)
  flags.DEFINE_integer('query_tokens', 16, 'Query length in tokens.', lower_bound=1)
  flags.DEFINE_integer('sampled', 8, 'Served queries checked against a fresh computation.',
                       lower_bound=0)
  flags.DEFINE_integer('misses', 3, 'Queries on libraries that were never deposited.',
                       lower_bound=0)
  flags.DEFINE_integer('seed', 0, 'Seed of the query stream.', lower_bound=0)
  flags.DEFINE_integer('host_cache_bytes', 1 << 30, 'Bound of the store\'s host LRU.',
                       lower_bound=0)
  flags.DEFINE_bool('keep_store', False, 'Keep the store afterwards (false: delete it).')
  common.define_output_flag()
  common.define_model_flags()
  common.define_store_flags()
  common.define_engine_flags()


OWN_DEFAULTS = {
    'library_tokens': "libraries of 2,048 tokens: the bench's time-to-first-token library",
    'query_tokens': 'a short query after each served library',
}


def device_bytes() -> int:
  """Bytes of every live jax array (on this process's devices)."""
  gc.collect()
  return sum(a.nbytes for a in jax.live_arrays())


def evict_page_cache(directory: str) -> None:
  """Asks the OS to drop its cached pages of every file under `directory` (posix_fadvise)."""
  files.fsync_tree(directory, then=lambda fd: os.posix_fadvise(fd, 0, 0,
                                                               os.POSIX_FADV_DONTNEED))


def deposit(store: Store, libraries, target: int) -> dict:
  """Puts libraries until the store holds `target` tokens; returns the totals."""
  totals = {'libraries': 0, 'tokens': 0, 'bytes_written': 0, 'compute_seconds': 0.0,
            'storage_seconds': 0.0, 'seconds': 0.0}
  deposited = []
  for library in libraries:
    report = store.put(library)
    deposited.append(library)
    totals['libraries'] += 1
    totals['tokens'] += report['tokens'] - report['reused_tokens']
    for key in ('bytes_written', 'compute_seconds', 'storage_seconds', 'seconds'):
      totals[key] += report[key]
    if totals['libraries'] % 10 == 0 or totals['tokens'] >= target:
      logging.info('deposited %d libraries, %d tokens (%.0f%% of %d), %.2f GB, %.0f s',
                   totals['libraries'], totals['tokens'], 100 * totals['tokens'] / target,
                   target, totals['bytes_written'] / 1e9, totals['seconds'])
    if totals['tokens'] >= target:
      break
  if totals['tokens'] < target:
    raise ValueError(f'the corpus holds only {totals["tokens"]} tokens of distinct '
                     f'libraries; {target} were asked for')
  return {**totals, 'deposited': deposited}


def serve(store: Store, engine, deposited, queries: int, query_tokens: int, sampled: int,
          seed: int) -> list[dict]:
  """The seeded query stream (see the module docstring); one row per query."""
  rng = np.random.default_rng(seed)
  rows, recent = [], []
  for q in range(queries):
    if recent and rng.random() < 0.5:
      index = int(rng.choice(recent))
    else:
      index = int(rng.integers(0, len(deposited) - 1))  # the next library holds its query
    recent = (recent + [index])[-8:]
    library, query = list(deposited[index]), list(deposited[index + 1][1:1 + query_tokens])
    reads, read_bytes = store.counters['backing_reads'], store.counters['backing_bytes']
    start = time.perf_counter()
    ctx, match = store.graft(library)
    grafted = time.perf_counter()
    logits, _ = exactness.graft_logits(engine, ctx, library, query, rows=1, consume=True)
    done = time.perf_counter()
    row = {'query': q, 'library': index, 'grafted_tokens': match.tokens,
           'tier': 'backing' if store.counters['backing_reads'] > reads else 'host',
           'ttft_s': done - start, 'graft_s': grafted - start, 'query_s': done - grafted,
           'backing_bytes': store.counters['backing_bytes'] - read_bytes,
           'sha256': compare.sha256_bytes(logits)}
    if q < sampled:
      row['fresh_sha256'] = exactness.fresh_sha256(engine, library, query, rows=1)
      row['equal'] = row['fresh_sha256'] == row['sha256']
    rows.append(row)
    logging.info('query %d/%d: library %d from %s, ttft %.3f s%s', q + 1, queries, index,
                 row['tier'], row['ttft_s'],
                 f', equal to fresh: {row["equal"]}' if 'equal' in row else '')
  return rows


def misses(store: Store, engine, libraries, count: int, query_tokens: int) -> list[float]:
  """Time to first token of queries whose library was never deposited (no stored prefix)."""
  out = []
  for library in libraries[:count]:
    library, query = list(library[:-query_tokens]), list(library[-query_tokens:])
    start = time.perf_counter()
    ctx, match = store.graft(library)
    if match.tokens >= store.block_tokens:  # a few common first tokens at most
      raise ValueError(f'a held-out library has {match.tokens} stored tokens')
    engine.extend(ctx, library[match.tokens:] + query, logits='last', consume=True)
    out.append(time.perf_counter() - start)
  return out


def median(values) -> float | None:
  return statistics.median(values) if values else None


def main(argv):
  del argv
  if FLAGS.library_tokens <= FLAGS.query_tokens:
    raise app.UsageError(f'--library_tokens={FLAGS.library_tokens}: a query is the last '
                         f'--query_tokens={FLAGS.query_tokens} tokens of a library, so a library '
                         'needs more')
  loaded = common.load_model()
  engine = common.make_engine(loaded)
  cache_len = engine.engine_config.cache_len
  target = FLAGS.target_tokens or FLAGS.ratio * cache_len
  scratch = None
  url = FLAGS.store
  if not url:
    scratch = tempfile.mkdtemp(prefix='widen_context.')
    url = f'file://{scratch}/store/'
  store = Store(url, engine, host_cache_bytes=FLAGS.host_cache_bytes, **common.store_args())
  directory = local_directory(store.url)
  disk = ceilings.disk_gbps(directory) if directory else {}
  engine.prefill([2, 3], logits='last')  # compile before measuring what the device holds
  before = device_bytes()

  libraries = samples.distinct_libraries(loaded.tokenizer, FLAGS.library_tokens)
  totals = deposit(store, libraries, target)
  deposited = totals.pop('deposited')
  held_out = [next(libraries) for _ in range(FLAGS.misses)]
  if directory:
    evict_page_cache(directory)
  backing_start = (store.counters['backing_bytes'], store.counters['backing_seconds'])
  rows = serve(store, engine, deposited, FLAGS.queries, FLAGS.query_tokens, FLAGS.sampled,
               FLAGS.seed)
  miss_times = misses(store, engine, held_out, FLAGS.misses, FLAGS.query_tokens)
  after = device_bytes()
  stats = store.stats()
  read_bytes = store.counters['backing_bytes'] - backing_start[0]
  read_seconds = store.counters['backing_seconds'] - backing_start[1]
  checked = [r for r in rows if 'equal' in r]
  deposit_tok_s = totals['tokens'] / totals['seconds']
  summary = {
      'addressable_tokens': stats['tokens_addressable'],
      'device_kv_tokens': cache_len,
      'ratio': stats['tokens_addressable'] / cache_len,
      'device_bytes_before': before,
      'device_bytes_after': after,
      'store_bytes': stats['bytes'],
      'bytes_per_token': stats['bytes_per_token'],
      'put_gbps': totals['bytes_written'] / totals['storage_seconds'] / 1e9,
      'get_gbps': read_bytes / read_seconds / 1e9 if read_seconds else None,
      'disk_write_gbps': disk.get('disk_write_gbps'),
      'disk_read_gbps': disk.get('disk_read_gbps'),
      'ttft_hit_host_s': median([r['ttft_s'] for r in rows if r['tier'] == 'host']),
      'ttft_hit_backing_s': median([r['ttft_s'] for r in rows if r['tier'] == 'backing']),
      'ttft_miss_s': median(miss_times),
      'sampled': len(checked),
      'sampled_equal': sum(r['equal'] for r in checked),
      'queries_host': sum(r['tier'] == 'host' for r in rows),
      'queries_backing': sum(r['tier'] == 'backing' for r in rows),
      'deposit_tokens_per_s': deposit_tok_s,
      'paper_tokens': PAPER_TOKENS,
      'paper_store_bytes': PAPER_TOKENS * stats['bytes_per_token'],
      'paper_deposit_hours': PAPER_TOKENS / deposit_tok_s / 3600,
  }
  if summary['disk_write_gbps']:
    summary['put_fraction_of_disk'] = summary['put_gbps'] / summary['disk_write_gbps']
  if summary['disk_read_gbps'] and summary['get_gbps']:
    summary['get_fraction_of_disk'] = summary['get_gbps'] / summary['disk_read_gbps']
  config = {**common.model_config_json(),
            'engine_config': dataclasses.asdict(engine.engine_config),
            'store': store.url, 'namespace': store.namespace, 'ratio': FLAGS.ratio,
            'target_tokens': target, 'library_tokens': FLAGS.library_tokens,
            'queries': FLAGS.queries, 'query_tokens': FLAGS.query_tokens,
            'sampled': FLAGS.sampled, 'misses': FLAGS.misses, 'seed': FLAGS.seed,
            'host_cache_bytes': FLAGS.host_cache_bytes, 'disk': disk,
            'page_cache_evicted': bool(directory),
            'engine_fingerprint': engine.fingerprint}
  output = common.output_path('widen_context', FLAGS.model, FLAGS.dtype)
  common.write_result(output, 'widen_context', {'config': config, 'summary': summary,
                                                'deposit': totals, 'queries': rows})
  if not FLAGS.keep_store:
    store.destroy()
    if scratch:
      shutil.rmtree(scratch, ignore_errors=True)
  for key, value in summary.items():
    print(f'{key}: {value}')


if __name__ == '__main__':
  define_flags()
  common.run(main)
