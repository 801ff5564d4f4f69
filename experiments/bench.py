"""One benchmark, side by side in one run on the same weights: this project's engines and peers.

  python -m experiments.bench --output=results/bench_gemma3_270m_float32.json
  python -m experiments.bench --systems=ours_spec,ours_pinned,ours_default --repeats=5
  python -m experiments.bench --systems=ours_spec,ours_spec_relative,ours_pinned,\
      ours_pinned_relative --start=false --output=results/bench_gemma3_270m_float32_relative.json

For every system: prefill tokens/s on a --prompt_tokens prompt (logits of the last position
only), decode tokens/s over --decode_tokens greedy steps after a 32-token prompt (one token per
call, KV cache on), and time to first token for a --library_tokens library plus a
--query_tokens query, recomputed from scratch and (where the system can) restored from a saved
KV state. Ours splits the graft's time into restore (read), verify (hash), graft (into the
engine's cache) and query compute. The systems' repeats are interleaved (experiments/
interleaved.py): after an untimed warm-up of everything, repeat r of every system's every
operation runs before repeat r + 1 of any (A B A B ...), so the machine's drift falls on all
alike; each figure is the median of --repeats with its spread (`spread`: (max - min) / median
of the seconds), and each ratio the median of the repeats' own ratios (repeat r against repeat
r; `ratio_spread` gives their min, max and spread). The machine's ceilings are measured in the
same run: a large float32 matmul's GFLOP/s and a streaming read's GB/s (experiments/
ceilings.py), so every figure is also a fraction of the limit. In a process of their own, and
so not interleaved with the rest: the start (fresh processes), deepmind_gemma (its own
Python); with --processes or --baseline each repeat is a fresh process per system or tree, the
processes interleaved the same way (A B A B).

Systems (`--systems`, default all but the relative ones): ours_spec (on its default dot
library: the native kernels on a CPU), ours_spec_eigen (the spec engine on XLA's Eigen dots),
ours_pinned, ours_default, hf_transformers (torch, the same dequantized GGUF in float32),
llama_cpp_q4_k_m, llama_cpp_f32 and deepmind_gemma (experiments/peers/); and, only when named,
ours_spec_relative, ours_pinned_relative and ours_default_relative: the same engines under the
relative RoPE mode (gemma_jax.rope), their ratios to float's in `ratios`. Each of ours records
its engine_config (dot_library included). A peer that is not installed is skipped with the
reason printed and recorded in its row (`skipped`), never silently. Output: schema `bench`
(analysis/results.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import jax
from absl import app, flags, logging

from experiments import bench_start, ceilings, common, interleaved, peers, samples
from gemma_jax import cost, resources
from gemma_jax.checkpoints import orbax_util
from graft.store import artifact
from graft import shift
from graft.engine import fingerprint

FLAGS = flags.FLAGS

# Our systems -> (engine mode, dot library; None: the engine's default).
OURS = {'ours_spec': ('spec', None), 'ours_spec_eigen': ('spec', 'eigen'),
        'ours_pinned': ('pinned', None), 'ours_default': ('default', None)}
# The same engines with the relative RoPE mode (gemma_jax.rope.RelativeScores): its cost next to
# float's, measured only when asked for (--systems).
RELATIVE = {f'{name}_relative': OURS[name] for name in ('ours_spec', 'ours_pinned',
                                                       'ours_default')}
SYSTEMS = tuple(OURS) + peers.NAMES + tuple(RELATIVE)


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  common.define_list('systems', list(OURS) + list(peers.NAMES),
                     f'Systems to measure: any of {", ".join(SYSTEMS)}.', integers=False,
                     words=SYSTEMS)
  flags.DEFINE_multi_integer('prompt_tokens', [2000], 'Prompt length in tokens, for prefill '
                             'throughput '
                             '(repeat the flag for several: --prompt_tokens=512 '
                             '--prompt_tokens=2048); prefill_tok_s is the first\'s, '
                             'prefill_tok_s_by_length every one\'s.', lower_bound=1)
  flags.DEFINE_integer('decode_tokens', 32, 'Greedy decode steps for decode throughput.',
                       lower_bound=1)
  flags.DEFINE_integer('library_tokens', 2048, 'Library length in tokens, for time to first '
                       'token.', lower_bound=1)
  flags.DEFINE_integer('query_tokens', 64, 'Query length in tokens, for time to first token.',
                       lower_bound=1)
  flags.DEFINE_multi_integer('batch_slots', [], 'Batch slots: also measure the spec engine\'s '
                             'decode with N contexts per call (Engine.generate_batch), for each '
                             'N (repeat the flag: --batch_slots=1 --batch_slots=8).',
                             lower_bound=1)
  common.define_list('batch_cache_len', [], 'KV slots: the cache lengths (slots per context) '
                     'the batch slots are measured at, an engine each (unset: --cache_len), e.g. '
                     '2560,256.', lower_bound=1)
  flags.DEFINE_bool('start', True, 'Also time a fresh process to its first logits, on an empty '
                    'compilation cache and on a warm one, by phase (import, load, engine, first '
                    'logits: start_phases_s), ours and llama.cpp\'s on the same GGUF.')
  flags.DEFINE_bool('start_only', False, 'Time only the fresh processes (--start), not '
                    'throughput: a quick run of the start phases.')
  flags.DEFINE_integer('repeats', 3, 'Timed repetitions (after one warm-up); medians reported.',
                       lower_bound=1)
  common.define_output_flag()
  flags.DEFINE_bool('processes', False, 'Measure each of our systems in a fresh process of its '
                    "own (this bench, run once per system): each row's peak_rss_bytes is then "
                    "that system's alone.")
  flags.DEFINE_string('baseline', None, 'Also measure our systems as the code at this git '
                      'revision does (a worktree of it, its own bench in a subprocess on this '
                      "run's workload, without start or graft timings): rows named "
                      'NAME@REVISION and their ratios, side by side in this run.')
  common.define_model_flags()
  common.define_engine_flags(cache_len=common.GRAFT_CACHE_LEN)


OWN_DEFAULTS = {
    'cache_len': "the graft samples' longest context, as experiments.graft_exactness",
    'repeats': 'medians of 3, as the committed benches',
}


@dataclasses.dataclass(frozen=True)
class Workload:
  prompts: list[list[int]]  # prefill, one prompt per --prompt_tokens length
  decode_prompt: list[int]  # the 32 tokens decode continues from
  library: list[int]  # time to first token: library + query
  query: list[int]
  decode_tokens: int
  repeats: int

  @property
  def prompt(self) -> list[int]:
    """The first prefill prompt (what the peers' prefill measures)."""
    return self.prompts[0]


def workload(tokenizer) -> Workload:
  """Token ids from real text (experiments/samples.py), the same for every system."""
  text = tokenizer.encode(samples.corpus_text())
  return Workload(prompts=[text[:n] for n in FLAGS.prompt_tokens], decode_prompt=text[:32],
                  library=text[:FLAGS.library_tokens],
                  query=text[FLAGS.library_tokens:FLAGS.library_tokens + FLAGS.query_tokens],
                  decode_tokens=FLAGS.decode_tokens, repeats=FLAGS.repeats)


def _time_graft(engine, path: str, query: list[int]) -> dict:
  """One graft from disk, split into its phases (seconds)."""
  phases = {}
  t0 = time.perf_counter()
  loaded = artifact.load(path, engine, timings=phases)
  t1 = time.perf_counter()
  ctx = artifact.graft(engine, loaded)
  t2 = time.perf_counter()
  engine.extend(ctx, query, logits='last', consume=True)
  t3 = time.perf_counter()
  return {'restore_s': phases['read_s'], 'verify_s': phases['verify_s'],
          'load_s': t1 - t0, 'graft_s': t2 - t1, 'query_s': t3 - t2, 'total_s': t3 - t0}


def _read_files(root: str, keep: bool = True) -> int:
  """Reads every file under root into memory with plain reads; returns the bytes read. With
  `keep`, every file's bytes are held until all are read, as a restore must hold what it read
  (fresh memory, faulted in as it is written); without it each file's buffer is freed before
  the next read, which then reuses the same warm pages."""
  kept, total = [], 0
  for directory, _, names in os.walk(root):
    for name in names:
      with open(os.path.join(directory, name), 'rb') as f:
        data = f.read()
      total += len(data)
      if keep:
        kept.append(data)
  return total


def ours_ops(engine, work: Workload, scratch: str) -> tuple[dict, Callable[[dict], dict]]:
  """One of our engines' timed operations and the function of their seconds giving its row:
  prefill_<L> (each prompt, last logits), decode (generate of decode_tokens + 1 from the
  32-token prompt: decode_tokens calls after the first token), ttft_recompute (library +
  query), ttft_graft (the library's artifact, saved under `scratch`, restored, verified and
  grafted, then the query: `_time_graft`'s phases), and the same files read raw (kept, and
  each buffer freed before the next) and by Orbax's restore: what restore + verify is set
  against."""
  ctx, _ = engine.prefill(work.decode_prompt, logits='last')
  path = os.path.join(scratch, f'library-{id(engine)}')
  library, _ = engine.prefill(work.library, logits='none')
  artifact.save(path, engine, library)
  artifact_bytes = sum(f['size'] for f in artifact.load(path, engine).manifest['files'].values())
  grafts = []
  closures = {**{f'prefill_{len(p)}': lambda p=p: engine.prefill(p, logits='last')
                 for p in work.prompts},
              'decode': lambda: engine.generate(ctx, work.decode_tokens + 1, stop_at_eos=False),
              'ttft_recompute': lambda: engine.prefill(work.library + work.query, logits='last'),
              'ttft_graft': lambda: grafts.append(_time_graft(engine, path, work.query)),
              'raw_read': lambda: _read_files(path),
              'raw_read_discarding': lambda: _read_files(path, keep=False),
              'orbax_restore': lambda: orbax_util.restore(os.path.join(path, artifact.STATE))}

  def row(times: dict) -> dict:
    median = {name: statistics.median(t) for name, t in times.items()}
    runs = grafts[-len(times['ttft_graft']):]  # the timed ones (after the warm-up)
    split = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    restore = split['restore_s'] + split['verify_s']
    prefill = {len(p): len(p) / median[f'prefill_{len(p)}'] for p in work.prompts}
    return {'prefill_tok_s': prefill[len(work.prompts[0])], 'prefill_tok_s_by_length': prefill,
            # generate(n + 1) makes n extend calls after the first token.
            'decode_tok_s': work.decode_tokens / median['decode'],
            'ttft_recompute_s': median['ttft_recompute'], 'ttft_graft_s': split['total_s'],
            'ttft_graft_split_s': split, 'artifact_bytes': artifact_bytes,
            'restore_gbps': artifact_bytes / restore / 1e9,
            # The same files read raw (no decoding, no hashing) and kept, in this run: what
            # restore + verify is measured against (issue goal: >= 0.7); and read with each
            # file's memory reused by the next, which pays no page faults (_read_files).
            'raw_read_gbps': artifact_bytes / median['raw_read'] / 1e9,
            'restore_fraction_of_raw_read': median['raw_read'] / restore,
            'raw_read_discarding_gbps': artifact_bytes / median['raw_read_discarding'] / 1e9,
            'restore_fraction_of_raw_read_discarding': median['raw_read_discarding'] / restore,
            # Orbax's own restore of the same checkpoint (no hashing): what reading the leaf
            # files directly saves.
            'orbax_restore_gbps': artifact_bytes / median['orbax_restore'] / 1e9,
            'engine_config': dataclasses.asdict(engine.engine_config)}

  return closures, row


def batch_ops(engine, work: Workload, slots: list[int]) -> tuple[dict, Callable[[dict], list]]:
  """Decode of the engine serving N contexts per call (one per batch slot), each continuing the
  same 32-token prompt (every slot gets the bits it gets alone), against one stream
  (`Engine.generate`, its logits fused into the step), as timed operations: one_stream, and
  slots_<N> the next decode_tokens + 1 tokens of every slot of a batch stacked once
  (`Engine.batch`: a caller that decodes slots together keeps them stacked between steps) --
  and, apart, stack_<N> (stacking the N states) and split_<N> (splitting them back), what a
  slot's joining and leaving cost. Rows: decode tok/s and the speedup over one stream, a
  median of the repeats' own ratios (each batch repeat against the one-stream repeat next to
  it) with their spread."""
  ctx, _ = engine.prefill(work.decode_prompt, logits='last')
  closures = {'one_stream': lambda: engine.generate(ctx, work.decode_tokens + 1,
                                                    stop_at_eos=False)}
  batches = {}
  for n in slots:
    if n == 1:
      closures['slots_1'] = closures['one_stream']
      continue
    batches[n] = engine.batch([ctx] * n)
    closures[f'slots_{n}'] = lambda n=n: batches[n].decode([work.decode_tokens + 1] * n,
                                                           digests=False)
    closures[f'stack_{n}'] = lambda n=n: jax.block_until_ready(engine._stack([ctx] * n))
    closures[f'split_{n}'] = lambda n=n: jax.block_until_ready(
        [c.kv for c in batches[n].contexts()])

  def rows(times: dict) -> list[dict]:
    out = []
    for n in slots:
      many = times[f'slots_{n}']
      speedup = interleaved.paired([n * t for t in times['one_stream']], many)
      out.append({'batch_slots': n, 'decode_tok_s': n * work.decode_tokens / statistics.median(
                      many),
                  'one_stream_decode_tok_s': work.decode_tokens / statistics.median(
                      times['one_stream']),
                  'speedup_vs_one_stream': speedup['median'], 'speedup_spread': speedup,
                  'decode_s': interleaved.summary(many),
                  **({'stack_s': statistics.median(times[f'stack_{n}']),
                      'split_s': statistics.median(times[f'split_{n}'])} if n > 1 else {}),
                  'cache_len': engine.engine_config.cache_len})
      logging.info('batch of %d: %.1f decode tok/s (%.2fx one stream)', n,
                   out[-1]['decode_tok_s'], out[-1]['speedup_vs_one_stream'])
    return out

  return closures, rows


def repeat_figures(times: dict, work: Workload) -> list[dict]:
  """Each timed repeat's throughputs from a system's operations' seconds (the names ours_ops
  and the peers give them): prefill_tok_s_<L> and decode_tok_s, for ratios taken repeat by
  repeat."""
  out = []
  for r in range(len(next(iter(times.values())))):
    figures = {}
    for name, seconds in times.items():
      if name.startswith('prefill_'):
        figures[f'prefill_tok_s_{name.removeprefix("prefill_")}'] = int(
            name.removeprefix('prefill_')) / seconds[r]
    if 'prefill' in times:  # llama.cpp's, on the first prompt
      figures[f'prefill_tok_s_{len(work.prompt)}'] = len(work.prompt) / times['prefill'][r]
    if 'decode' in times:
      figures['decode_tok_s'] = work.decode_tokens / times['decode'][r]
    if 'decode_loop' in times:  # the peers': the loop net of its prompt
      figures['decode_tok_s'] = work.decode_tokens / max(
          times['decode_loop'][r] - times['decode_prompt'][r], 1e-9)
    out.append(figures)
  return out


def _ratios(row: dict, other: dict, name: str) -> tuple[dict, dict]:
  """({name}_decode_tok_s, {name}_prefill_tok_s[_L]: row / other, each the median of the
  repeats' own ratios}, {the same: their interleaved.paired summary}) from the rows'
  `repeats` (repeat_figures)."""
  ratios, spread = {}, {}
  mine, theirs = row.get('repeats', []), other.get('repeats', [])
  first = len(row['prefill_tok_s_by_length']) and next(iter(row['prefill_tok_s_by_length']))
  for metric in mine[0] if mine and theirs else []:
    if metric not in theirs[0]:
      continue
    paired = interleaved.paired([f[metric] for f in mine], [f[metric] for f in theirs])
    key = f'{name}_{metric}'
    ratios[key], spread[key] = paired['median'], paired
    if metric == f'prefill_tok_s_{first}':
      ratios[f'{name}_prefill_tok_s'], spread[f'{name}_prefill_tok_s'] = paired['median'], paired
  if (row.get('interleaved') == other.get('interleaved') == 'processes'
      and row.get('peak_rss_bytes') and other.get('peak_rss_bytes')):  # each process's own
    ratios[f'{name}_peak_rss_bytes'] = row['peak_rss_bytes'] / other['peak_rss_bytes']
  return ratios, spread


def _workload_flags(work: Workload) -> list[str]:
  """This run's workload and model as flags of a bench of its own."""
  return ([f'--prompt_tokens={len(p)}' for p in work.prompts]
          + [f'--decode_tokens={work.decode_tokens}', f'--library_tokens={len(work.library)}',
             f'--query_tokens={len(work.query)}', f'--model={FLAGS.model}',
             f'--weights={FLAGS.weights}', f'--dtype={FLAGS.dtype}',
             f'--cache_len={FLAGS.cache_len}'])


def _bench_process(tree: str, names: list[str], flag_sets: list[list[str]]) -> list[dict]:
  """Our systems `names` measured once (--repeats=1, after its warm-up) by the bench of `tree`
  in fresh processes, one per flag set (an older bench took one prompt length a run): the
  rows, one per system, merged over the flag sets (prefill by length), each with its
  process's peak resident memory and its figures as one repeat."""
  measured = []
  for extra in flag_sets:
    with tempfile.TemporaryDirectory() as scratch:
      output = os.path.join(scratch, 'rows.json')
      subprocess.run([sys.executable, '-m', 'experiments.bench', f'--systems={",".join(names)}',
                      '--nostart', '--repeats=1', *extra, f'--output={output}'], cwd=tree,
                     env={**os.environ, 'PYTHONPATH': tree}, check=True, capture_output=True,
                     text=True)
      with open(output) as f:
        result = json.load(f)
    measured.append((result['systems'], result.get('resources', {}).get('peak_rss_bytes')))
  rows = []
  for i, row in enumerate(measured[0][0]):
    by_length = {}
    for systems, _ in measured:
      got = systems[i].get('prefill_tok_s_by_length') or {
          str(result['config']['prompt_tokens']): systems[i]['prefill_tok_s']}
      by_length.update({int(k): v for k, v in got.items()})
    figures = {f'prefill_tok_s_{k}': v for k, v in by_length.items()}
    figures['decode_tok_s'] = row['decode_tok_s']
    rows.append({**row, 'prefill_tok_s_by_length': by_length, 'repeats': [figures],
                 'peak_rss_bytes': max(p or 0 for _, p in measured) or None})
  return rows


def process_rows(trees: dict[str, tuple[str, list[list[str]]]], names: list[str],
                 repeats: int, separately: bool) -> dict[str, list[dict]]:
  """Our systems measured in fresh processes, interleaved by repeat: for r in range(repeats),
  each tree's bench in turn (label -> (tree, its flag sets)), each system in a process of its
  own when `separately` (A B A B ...). Returns label -> the rows, one per system: figures the
  medians over the repeats' processes, `repeats` each process's figures, peak_rss_bytes the
  largest."""
  runs = {label: {name: [] for name in names} for label in trees}
  for r in range(repeats):
    logging.info('processes: repeat %d of %d', r + 1, repeats)
    for label, (tree, flag_sets) in trees.items():
      for group in ([[n] for n in names] if separately else [names]):
        for row in _bench_process(tree, group, flag_sets):
          runs[label][row['name']].append(row)
  out = {}
  for label, by_name in runs.items():
    out[label] = []
    for name, rows in by_name.items():
      lengths = rows[0]['prefill_tok_s_by_length']
      by_length = {k: statistics.median(r['prefill_tok_s_by_length'][k] for r in rows)
                   for k in lengths}
      out[label].append({**rows[-1], 'name': name, 'prefill_tok_s_by_length': by_length,
                         'prefill_tok_s': by_length[next(iter(lengths))],
                         'decode_tok_s': statistics.median(r['decode_tok_s'] for r in rows),
                         'repeats': [r['repeats'][0] for r in rows], 'interleaved': 'processes',
                         'peak_rss_bytes': max((r['peak_rss_bytes'] or 0) for r in rows) or None})
  return out


def baseline_trees(revision: str, work: Workload, scratch: str) -> dict:
  """{'head': this tree, REVISION: a worktree of it under `scratch`} with their flag sets (the
  revision's bench runs one prompt length a process, as it may take one --prompt_tokens)."""
  tree = os.path.join(scratch, 'tree')
  subprocess.run(['git', 'worktree', 'add', '--detach', tree, revision], cwd=common.REPO,
                 check=True, capture_output=True)
  flags_ = [f for f in _workload_flags(work) if not f.startswith('--prompt_tokens')]
  return {'head': (common.REPO, [_workload_flags(work)]),
          revision: (tree, [[f'--prompt_tokens={len(p)}', *flags_] for p in work.prompts])}


def main(argv):
  del argv
  unknown = sorted(set(FLAGS.systems) - set(SYSTEMS))
  if unknown:
    raise app.UsageError(f'--systems: unknown {unknown}; expected some of {SYSTEMS}')
  if FLAGS.start_only:
    return start_only()
  loaded = common.load_model()
  work = workload(loaded.tokenizer)
  logging.info('measuring the ceilings')
  limits = ceilings.measure(repeats=FLAGS.repeats)
  ours = [n for n in FLAGS.systems if n in OURS or n in RELATIVE]
  slots = list(FLAGS.batch_slots)
  systems, finish, alone, batch_rows = {}, {}, {}, []
  with tempfile.TemporaryDirectory() as scratch:
    if FLAGS.processes and ours:
      alone.update({row['name']: {**row, 'interleaved': 'processes'} for row in process_rows(
          {'head': (common.REPO, [_workload_flags(work)])}, ours, FLAGS.repeats,
          separately=True)['head']})
    for name in FLAGS.systems:
      if name in alone:
        continue
      logging.info('preparing %s', name)
      if name in ours:
        mode, library = OURS.get(name) or RELATIVE[name]
        model = loaded if name in OURS else shift.with_config(loaded, rope_mode='relative')
        systems[name], finish[name] = ours_ops(
            common.make_engine(model, mode=mode, dot_library=library), work, scratch)
        continue
      made = peers.ops(name, loaded, work)
      if made is None:  # a peer measured in a process of its own
        alone[name] = {**peers.measure(name, loaded, work), 'interleaved': False}
      elif isinstance(made, dict):  # skipped
        alone[name] = made
      else:
        systems[name], finish[name] = made
    for cache_len in [int(n) for n in FLAGS.batch_cache_len] or [FLAGS.cache_len] if slots else []:
      label = f'batches@{cache_len}'
      systems[label], finish[label] = batch_ops(
          common.make_engine(loaded, mode='spec', cache_len=cache_len), work, slots)
    logging.info('measuring %s interleaved, %d repeats', ', '.join(systems), FLAGS.repeats)
    times = interleaved.run(systems, FLAGS.repeats, log=logging.info)
    rows = []
    for name in FLAGS.systems:
      if name in alone:
        row = alone[name]
      else:
        row = {**finish[name](times[name]), 'interleaved': True,
               'repeats': repeat_figures(times[name], work),
               'spread': {op: interleaved.summary(t) for op, t in times[name].items()}}
      if name in OURS and FLAGS.start:
        row.update(bench_start.measure_start(*OURS[name], work.repeats))
      elif FLAGS.start and not row.get('skipped') and name not in ours:
        row.update(bench_start.measure_peer_start(name, work.repeats))
      row = {'name': name, 'skipped': None, **row,
             'peak_rss_bytes': row.get('peak_rss_bytes') or resources.peak_rss_bytes()}
      if row['skipped']:
        print(f'{name}: skipped ({row["skipped"]})')
      rows.append(row)
    for label in systems:
      if label.startswith('batches@'):
        batch_rows.extend(finish[label](times[label]))
  by_name = {r['name']: r for r in rows if not r['skipped']}
  ratios, spread = {}, {}
  for row in batch_rows:
    suffix = '' if row['cache_len'] == FLAGS.cache_len else f'_cache{row["cache_len"]}'
    ratios[f'batch_decode_speedup_{row["batch_slots"]}{suffix}'] = row['speedup_vs_one_stream']
    spread[f'batch_decode_speedup_{row["batch_slots"]}{suffix}'] = row['speedup_spread']
  if 'ours_spec' in by_name and 'batch_decode_speedup_8' in ratios:
    by_name['ours_spec']['batch_decode_speedup_8'] = ratios['batch_decode_speedup_8']
  for mine, other in (('spec', 'spec_eigen'), ('spec', 'pinned'), ('spec', 'default'),
                      ('spec_eigen', 'pinned'), ('pinned', 'default'),
                      ('spec_relative', 'spec'), ('pinned_relative', 'pinned'),
                      ('default_relative', 'default')):
    if f'ours_{mine}' in by_name and f'ours_{other}' in by_name:
      more, more_spread = _ratios(by_name[f'ours_{mine}'], by_name[f'ours_{other}'],
                                  f'{mine}_vs_{other}')
      ratios.update(more)
      spread.update(more_spread)
  if FLAGS.baseline:
    with tempfile.TemporaryDirectory() as scratch:
      trees = baseline_trees(FLAGS.baseline, work, scratch)
      try:
        measured = process_rows(trees, [n for n in FLAGS.systems if n in OURS], FLAGS.repeats,
                                separately=False)
      finally:
        subprocess.run(['git', 'worktree', 'remove', '--force', trees[FLAGS.baseline][0]],
                       cwd=common.REPO, capture_output=True)
    for head, base in zip(measured['head'], measured[FLAGS.baseline]):
      name = head['name']
      for label, row in (('head', head), (FLAGS.baseline, base)):
        row = {**row, 'name': f'{name}@{label}', 'skipped': row.get('skipped'),
               'interleaved': 'processes'}
        rows.append(row)
        by_name[row['name']] = row
      more, more_spread = _ratios(head, base, f"{name.removeprefix('ours_')}_vs_baseline")
      ratios.update(more)
      spread.update(more_spread)
  # Prefill FLOPs per token of the --prompt_tokens prompt with last-position logits; decode
  # reads every weight once per token (gemma_jax/cost.py).
  flops_per_token = cost.prefill_flops(loaded.config, len(work.prompt)) / len(work.prompt)
  bytes_per_token = cost.weight_bytes(loaded.config, 4)
  for name, row in by_name.items():
    row['prefill_fraction_of_matmul_ceiling'] = (
        row['prefill_tok_s'] * flops_per_token / 1e9 / limits['matmul_gflops'])
    row['decode_fraction_of_read_ceiling'] = (
        row['decode_tok_s'] * bytes_per_token / 1e9 / limits['read_gbps'])
    if 'hf_transformers' in by_name and name != 'hf_transformers':
      ratios[f'{name}_vs_hf_prefill'] = row['prefill_tok_s'] / by_name['hf_transformers'][
          'prefill_tok_s']
  config = {**common.model_config_json(), 'systems': list(FLAGS.systems),
            'prompt_tokens': [len(p) for p in work.prompts], 'baseline': FLAGS.baseline,
            'decode_tokens': work.decode_tokens,
            'library_tokens': len(work.library), 'query_tokens': len(work.query),
            'repeats': work.repeats, 'batch_slots': slots, 'cache_len': FLAGS.cache_len,
            'batch_cache_len': [int(n) for n in FLAGS.batch_cache_len] or [FLAGS.cache_len],
            'interleaved': True, 'processes': FLAGS.processes,
            'prefill_flops_per_token': flops_per_token,
            'decode_bytes_per_token': bytes_per_token, 'environment': fingerprint.environment()}
  output = common.output_path('bench', FLAGS.model, FLAGS.dtype)
  common.write_result(output, 'bench', {'config': config, 'ceilings': limits, 'systems': rows,
                                        'ratios': ratios, 'ratio_spread': spread,
                                        'batches': batch_rows})
  print(f"ceilings: matmul {limits['matmul_gflops']:.0f} GFLOP/s, read {limits['read_gbps']:.1f} "
        'GB/s')
  for row in by_name.values():
    graft = 'n/a' if row.get('ttft_graft_s') is None else f"{row['ttft_graft_s']:.3f}s"
    print(f"{row['name']:18s} prefill {row['prefill_tok_s']:7.1f} tok/s  decode "
          f"{row['decode_tok_s']:6.2f} tok/s  ttft recompute {row.get('ttft_recompute_s', 0):.3f}s"
          f'  graft {graft}')
    if 'ttft_cold_start_s' in row:
      print(f"{'':18s} a fresh process to its first logits: {row['ttft_cold_start_s']:.1f}s cold, "
            f"{row['ttft_warm_start_s']:.1f}s warm")
  for row in batch_rows:
    s = row['speedup_spread']
    print(f"ours_spec, {row['batch_slots']} batch slots, {row['cache_len']} slots: decode "
          f"{row['decode_tok_s']:.1f} tok/s ({row['speedup_vs_one_stream']:.2f}x one stream, "
          f"{s['min']:.2f}-{s['max']:.2f})")
  print('ratios (median of the repeats\' own; min-max):', {
      k: f'{v:.3f}' + (f" ({spread[k]['min']:.3f}-{spread[k]['max']:.3f})" if k in spread else '')
      for k, v in ratios.items()})


def start_only() -> None:
  """--start_only: the start phases of every system in --systems that has them, and a process
  that only imports jax (bench_start)."""
  bench_start.start_only(FLAGS.systems, OURS, FLAGS.repeats, FLAGS.output)


if __name__ == '__main__':
  define_flags()
  common.run(main)
