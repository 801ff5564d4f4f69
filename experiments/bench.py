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
engine's cache) and query compute. Each number is the median of --repeats timed runs after an
untimed warm-up. The machine's ceilings are measured in the same run: a large float32 matmul's
GFLOP/s and a streaming read's GB/s (experiments/ceilings.py), so every figure is also a
fraction of the limit.

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

from absl import app, flags, logging

from experiments import ceilings, common, peers, samples
from experiments.peers import llama_cpp
from gemma_jax import compilation_cache as compilation_cache_module
from gemma_jax import cost, executables, resources, verdicts
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


# A fresh process's phases, in order, and the stamp (experiments.generate --phases) that ends each.
START_PHASES = (('import_s', 'imported'), ('load_s', 'loaded'), ('engine_s', 'engine'),
                ('first_logits_s', 'first_logits'))


def process_phases(command: list[str], env: dict | None = None) -> dict:
  """Runs `command` (which takes --phases=PATH and writes there the wall-clock stamps of
  START_PHASES) as a fresh process; returns each phase's seconds and `total_s`, from the
  process's start to its first logits."""
  with tempfile.TemporaryDirectory() as scratch:
    path = os.path.join(scratch, 'phases.json')
    start = time.time()
    subprocess.run(command + [f'--phases={path}'], env=env, check=True, capture_output=True,
                   cwd=common.REPO)
    with open(path) as f:
      stamps = json.load(f)
  phases, last = {}, start
  for name, stamp in START_PHASES:
    phases[name] = stamps[stamp] - last
    last = stamps[stamp]
  phases['total_s'] = stamps['first_logits'] - start
  return phases


def _medians(runs: list[dict]) -> dict:
  return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def measure_start(mode: str, dot_library: str | None, repeats: int) -> dict:
  """A fresh process (`experiments.generate`, one new token) to its first logits: cold (each run
  on an empty compilation cache and no saved executables, every check run again:
  GEMMA_JAX_RECHECK) and warm (on what the first cold run left, with its kept verdicts); medians
  of `repeats`, per phase
  (START_PHASES). Weights come from the parameter cache in both."""
  command = [sys.executable, '-m', 'experiments.generate', '--max_new_tokens=1',
             f'--model={FLAGS.model}', f'--weights={FLAGS.weights}', f'--dtype={FLAGS.dtype}',
             f'--engine={mode}'] + ([f'--dot_library={dot_library}'] if dot_library else [])
  with tempfile.TemporaryDirectory() as scratch:
    env = lambda i, **more: {**os.environ,
                             compilation_cache_module.ENV: os.path.join(scratch, str(i), 'xla'),
                             executables.ENV: os.path.join(scratch, str(i), 'executables'),
                             **more}
    cold = [process_phases(command, env(i, **{verdicts.RECHECK_ENV: '1'}))
            for i in range(repeats)]
    warm = [process_phases(command, env(0)) for _ in range(repeats)]
  cold, warm = _medians(cold), _medians(warm)
  return {'ttft_cold_start_s': cold['total_s'], 'ttft_warm_start_s': warm['total_s'],
          'start_phases_s': {'cold': cold, 'warm': warm}}


def measure_peer_start(name: str, repeats: int) -> dict:
  """llama.cpp's fresh process to its first logits on the same GGUF (after one untimed run,
  so the file is in the page cache as ours is warm); {} for a peer without a start measure."""
  if not name.startswith('llama_cpp'):
    return {}
  path = llama_cpp.gguf_for(name.removeprefix('llama_cpp_'))
  if path is None:
    return {}
  command = [sys.executable, '-P', os.path.join(common.REPO, 'experiments', 'peers',
                                                'llama_start.py'),
             path, json.dumps(llama_cpp.settings())]
  process_phases(command)
  warm = _medians([process_phases(command) for _ in range(repeats)])
  return {'ttft_warm_start_s': warm['total_s'], 'start_phases_s': {'warm': warm}}


def measure_ours(engine, work: Workload) -> dict:
  prefill = {len(prompt): len(prompt) / common.median_seconds(
      lambda prompt=prompt: engine.prefill(prompt, logits='last'), work.repeats)
             for prompt in work.prompts}
  ctx, _ = engine.prefill(work.decode_prompt, logits='last')
  decode = common.median_seconds(
      lambda: engine.generate(ctx, work.decode_tokens + 1, stop_at_eos=False), work.repeats)
  recompute = common.median_seconds(
      lambda: engine.prefill(work.library + work.query, logits='last'), work.repeats)
  with tempfile.TemporaryDirectory() as scratch:
    path = os.path.join(scratch, 'library')
    library, _ = engine.prefill(work.library, logits='none')
    artifact.save(path, engine, library)
    artifact_bytes = sum(f['size'] for f in artifact.load(path, engine).manifest['files'].values())
    _time_graft(engine, path, work.query)  # warm-up (the files are in the page cache after it)
    runs = [_time_graft(engine, path, work.query) for _ in range(work.repeats)]
    raw_read = common.median_seconds(lambda: _read_files(path), work.repeats)
    raw_read_discarding = common.median_seconds(lambda: _read_files(path, keep=False),
                                                work.repeats)
    orbax_restore = common.median_seconds(
        lambda: orbax_util.restore(os.path.join(path, artifact.STATE)), work.repeats)
  median = lambda key: sorted(r[key] for r in runs)[len(runs) // 2]
  split = {key: median(key) for key in runs[0]}
  return {'prefill_tok_s': prefill[len(work.prompts[0])], 'prefill_tok_s_by_length': prefill,
          # generate(n + 1) makes n extend calls after the first token.
          'decode_tok_s': work.decode_tokens / decode,
          'ttft_recompute_s': recompute, 'ttft_graft_s': split['total_s'],
          'ttft_graft_split_s': split, 'artifact_bytes': artifact_bytes,
          'restore_gbps': artifact_bytes / (split['restore_s'] + split['verify_s']) / 1e9,
          # The same files read raw (no decoding, no hashing) and kept, in this run: what
          # restore + verify is measured against (issue goal: >= 0.7); and read with each
          # file's memory reused by the next, which pays no page faults (_read_files).
          'raw_read_gbps': artifact_bytes / raw_read / 1e9,
          'restore_fraction_of_raw_read': raw_read / (split['restore_s'] + split['verify_s']),
          'raw_read_discarding_gbps': artifact_bytes / raw_read_discarding / 1e9,
          'restore_fraction_of_raw_read_discarding':
              raw_read_discarding / (split['restore_s'] + split['verify_s']),
          # Orbax's own restore of the same checkpoint (no hashing): what reading the leaf
          # files directly saves.
          'orbax_restore_gbps': artifact_bytes / orbax_restore / 1e9,
          'engine_config': dataclasses.asdict(engine.engine_config)}


def measure_batches(engine, work: Workload, slots: list[int]) -> list[dict]:
  """Decode tokens/s of the engine serving N contexts per call (one per batch slot), each
  continuing the same 32-token prompt (every slot gets the bits it gets alone), and its ratio
  to one stream (`Engine.generate`, its logits fused into the step) measured here, in turn with
  the batches (`speedup_vs_one_stream`)."""
  ctx, _ = engine.prefill(work.decode_prompt, logits='last')
  one_stream = lambda: engine.generate(ctx, work.decode_tokens + 1, stop_at_eos=False)
  rows = []
  for n in slots:
    batch = lambda n=n: engine.generate_batch([ctx] * n, work.decode_tokens + 1)
    one, many = common.median_seconds(one_stream, work.repeats), common.median_seconds(
        batch, work.repeats)
    rows.append({'batch_slots': n, 'decode_tok_s': n * work.decode_tokens / many,
                 'one_stream_decode_tok_s': work.decode_tokens / one,
                 'speedup_vs_one_stream': n * one / many})
    logging.info('batch of %d: %.1f decode tok/s (%.2fx one stream)', n,
                 rows[-1]['decode_tok_s'], rows[-1]['speedup_vs_one_stream'])
  return rows


def _ratios(row: dict, other: dict, name: str) -> dict:
  """{name}_prefill_tok_s (and at each prompt length), {name}_decode_tok_s: row / other."""
  out = {f'{name}_decode_tok_s': row['decode_tok_s'] / other['decode_tok_s'],
         f'{name}_prefill_tok_s': row['prefill_tok_s'] / other['prefill_tok_s']}
  for length, speed in row.get('prefill_tok_s_by_length', {}).items():
    theirs = other.get('prefill_tok_s_by_length', {}).get(length)
    if theirs:
      out[f'{name}_prefill_tok_s_{length}'] = speed / theirs
  if row.get('peak_rss_bytes') and other.get('peak_rss_bytes'):
    out[f'{name}_peak_rss_bytes'] = row['peak_rss_bytes'] / other['peak_rss_bytes']
  return out


def _workload_flags(work: Workload) -> list[str]:
  """This run's workload and model as flags of a bench of its own."""
  return ([f'--prompt_tokens={len(p)}' for p in work.prompts]
          + [f'--decode_tokens={work.decode_tokens}', f'--library_tokens={len(work.library)}',
             f'--query_tokens={len(work.query)}', f'--repeats={work.repeats}',
             f'--model={FLAGS.model}', f'--weights={FLAGS.weights}', f'--dtype={FLAGS.dtype}',
             f'--cache_len={FLAGS.cache_len}'])


def measure_in_process(name: str, tree: str, work: Workload) -> dict:
  """`name` measured by this bench in a fresh process of its own (from `tree`): its row, with
  that process's peak resident memory as `peak_rss_bytes`."""
  with tempfile.TemporaryDirectory() as scratch:
    output = os.path.join(scratch, 'row.json')
    subprocess.run([sys.executable, '-m', 'experiments.bench', f'--systems={name}', '--nostart',
                    *_workload_flags(work), f'--output={output}'], cwd=tree,
                   env={**os.environ, 'PYTHONPATH': tree}, check=True, capture_output=True,
                   text=True)
    with open(output) as f:
      result = json.load(f)
  row = result['systems'][0]
  return {**row, 'prefill_tok_s_by_length': {  # (JSON made the lengths strings)
      int(k): v for k, v in row.get('prefill_tok_s_by_length', {}).items()},
          'peak_rss_bytes': result['resources']['peak_rss_bytes']}


def baseline_rows(revision: str, systems: list[str], work: Workload) -> list[dict]:
  """`systems` (ours) as the code at git `revision` measures them, on this run's workload: its
  own bench, run in a subprocess from a temporary worktree of the revision (throughput only:
  no start or graft timings beyond what it always measures). Rows named NAME@REVISION."""
  with tempfile.TemporaryDirectory() as scratch:
    tree, output = os.path.join(scratch, 'tree'), os.path.join(scratch, 'baseline.json')
    subprocess.run(['git', 'worktree', 'add', '--detach', tree, revision], cwd=common.REPO,
                   check=True, capture_output=True)
    try:
      # The revision's own flags: one prompt length (--prompt_tokens took one value then).
      measured = []
      for prompt in work.prompts:
        command = [sys.executable, '-m', 'experiments.bench', f'--systems={",".join(systems)}',
                   '--nostart', f'--prompt_tokens={len(prompt)}',
                   f'--decode_tokens={work.decode_tokens}',
                   f'--library_tokens={len(work.library)}', f'--query_tokens={len(work.query)}',
                   f'--repeats={work.repeats}', f'--model={FLAGS.model}',
                   f'--weights={FLAGS.weights}', f'--dtype={FLAGS.dtype}',
                   f'--cache_len={FLAGS.cache_len}', f'--output={output}']
        logging.info('measuring %s at %s (prompt of %d tokens)', systems, revision, len(prompt))
        subprocess.run(command, cwd=tree, env={**os.environ, 'PYTHONPATH': tree}, check=True,
                       capture_output=True, text=True)
        with open(output) as f:
          measured.append(json.load(f)['systems'])
    finally:
      subprocess.run(['git', 'worktree', 'remove', '--force', tree], cwd=common.REPO,
                     capture_output=True)
  rows = []
  for i, row in enumerate(measured[0]):
    by_length = {len(p): run[i]['prefill_tok_s'] for p, run in zip(work.prompts, measured)}
    rows.append({**row, 'name': f"{row['name']}@{revision}", 'prefill_tok_s_by_length': by_length,
                 'skipped': row.get('skipped')})
  return rows


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
  rows = []
  for name in FLAGS.systems:
    logging.info('measuring %s', name)
    if FLAGS.processes and (name in OURS or name in RELATIVE):
      rows.append(measure_in_process(name, common.REPO, work))
      continue
    if name in OURS:
      mode, library = OURS[name]
      row = {**measure_ours(common.make_engine(loaded, mode=mode, dot_library=library), work),
             **(measure_start(mode, library, work.repeats) if FLAGS.start else {})}
    elif name in RELATIVE:
      mode, library = RELATIVE[name]
      relative = shift.with_config(loaded, rope_mode='relative')
      row = measure_ours(common.make_engine(relative, mode=mode, dot_library=library), work)
    else:
      row = peers.measure(name, loaded, work)
      if FLAGS.start and not row.get('skipped'):
        row.update(measure_peer_start(name, work.repeats))
    row = {'name': name, 'skipped': None, **row, 'peak_rss_bytes': resources.peak_rss_bytes()}
    if row['skipped']:
      print(f'{name}: skipped ({row["skipped"]})')
    rows.append(row)
  by_name = {r['name']: r for r in rows if not r['skipped']}
  batches = measure_batches(common.make_engine(loaded, mode='spec'), work,
                            list(FLAGS.batch_slots)) if FLAGS.batch_slots else []
  ratios = {f'batch_decode_speedup_{row["batch_slots"]}': row['speedup_vs_one_stream']
            for row in batches}
  if 'ours_spec' in by_name and 'batch_decode_speedup_8' in ratios:
    by_name['ours_spec']['batch_decode_speedup_8'] = ratios['batch_decode_speedup_8']
  for ours, other in (('spec', 'spec_eigen'), ('spec', 'pinned'), ('spec', 'default'),
                      ('spec_eigen', 'pinned'), ('pinned', 'default'),
                      ('spec_relative', 'spec'), ('pinned_relative', 'pinned'),
                      ('default_relative', 'default')):
    if f'ours_{ours}' in by_name and f'ours_{other}' in by_name:
      ratios.update(_ratios(by_name[f'ours_{ours}'], by_name[f'ours_{other}'],
                            f'{ours}_vs_{other}'))
  if FLAGS.baseline:
    for row in baseline_rows(FLAGS.baseline, [n for n in FLAGS.systems if n in OURS], work):
      rows.append(row)
      by_name[row['name']] = row
      ratios.update(_ratios(by_name[row['name'].split('@')[0]], row,
                            f"{row['name'].split('@')[0].removeprefix('ours_')}_vs_baseline"))
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
            'repeats': work.repeats, 'batch_slots': list(FLAGS.batch_slots),
            'prefill_flops_per_token': flops_per_token,
            'decode_bytes_per_token': bytes_per_token, 'environment': fingerprint.environment()}
  output = common.output_path('bench', FLAGS.model, FLAGS.dtype)
  common.write_result(output, 'bench', {'config': config, 'ceilings': limits, 'systems': rows,
                                        'ratios': ratios, 'batches': batches})
  print(f"ceilings: matmul {limits['matmul_gflops']:.0f} GFLOP/s, read {limits['read_gbps']:.1f} "
        'GB/s')
  for row in by_name.values():
    graft = 'n/a' if row['ttft_graft_s'] is None else f"{row['ttft_graft_s']:.3f}s"
    print(f"{row['name']:18s} prefill {row['prefill_tok_s']:7.1f} tok/s  decode "
          f"{row['decode_tok_s']:6.2f} tok/s  ttft recompute {row['ttft_recompute_s']:.3f}s  "
          f'graft {graft}')
    if 'ttft_cold_start_s' in row:
      print(f"{'':18s} a fresh process to its first logits: {row['ttft_cold_start_s']:.1f}s cold, "
            f"{row['ttft_warm_start_s']:.1f}s warm")
  for row in batches:
    print(f"ours_spec, {row['batch_slots']} batch slots: decode {row['decode_tok_s']:.1f} tok/s "
          f"({row['speedup_vs_one_stream']:.2f}x one stream)")
  print('ratios:', {k: round(v, 3) for k, v in ratios.items()})


def start_only() -> None:
  """--start_only: the start phases of every system in --systems that has them."""
  rows = []
  for name in FLAGS.systems:
    logging.info('timing the start of %s', name)
    if name in OURS:
      row = measure_start(*OURS[name], FLAGS.repeats)
    else:
      row = measure_peer_start(name, FLAGS.repeats) or {
          'skipped': 'no start measure for this peer, or it is not installed'}
    rows.append({'name': name, 'skipped': None, **row})
  config = {**common.model_config_json(), 'systems': list(FLAGS.systems), 'start_only': True,
            'repeats': FLAGS.repeats, 'environment': fingerprint.environment()}
  output = common.output_path('bench', FLAGS.model, FLAGS.dtype, 'start')
  common.write_result(output, 'bench', {'config': config, 'ceilings': {}, 'systems': rows})
  for row in rows:
    if row['skipped']:
      print(f"{row['name']:18s} skipped ({row['skipped']})")
      continue
    for when, phases in row['start_phases_s'].items():
      print(f"{row['name']:18s} {when}: " + ', '.join(
          f"{k.removesuffix('_s')} {v:.2f}s" for k, v in phases.items()))


if __name__ == '__main__':
  define_flags()
  common.run(main)
