"""Exactness across device meshes: within a mesh, and across device counts and layouts.

  python -m experiments.mesh_exactness --model=gemma3_1b --weights=random:0 --engine=pinned \\
      --mesh= --mesh=model:2 --mesh=model:4 --mesh=model:8 --samples=4
  python -m experiments.mesh_exactness --mesh= --mesh=model:2 --samples=4
  python -m experiments.mesh_exactness --mesh= --mesh=model:4 --mesh=model:2,data:2

On a CPU host the process asks XLA for as many host devices as the largest mesh needs. For each
(mesh, layout) the engine (--engine: spec in the gather layout, or pinned; the other modes are
not byte-exact, so there is nothing to compare, and are refused) computes the same
samples fresh and through an own-position graft (the library's KV captured on that mesh, saved
as an artifact and restored); a sample's logits SHA-256 on every mesh is then compared with the
first mesh's (one device). The first mesh's artifacts are also restored on every other mesh and
grafted: exact there, or refused with the reason (the pinned engine's fingerprint binds its
mesh; the spec engine's binds only the arithmetic). Splitting a contraction over devices changes
its summation order (layout 'split'); layout 'gather' never splits one. The result (schema
mesh_exactness) says, per (mesh, layout): grafts equal to fresh, fresh equal to one device, and
carried artifacts equal or refused.
"""

from __future__ import annotations

import gc
import math
import os
import tempfile

from absl import app, flags, logging

from experiments import common, samples
from gemma_jax import compare, sharding
from graft.store import artifact
from graft import exactness
from graft.engine import Engine, EngineConfig, plans, resolve_engine_config

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_multi_string('mesh', ['', 'model:2', 'model:4'], "Devices: the meshes to run, "
                             "the first the reference (repeat the flag; '' is one device; a "
                             'mesh is axis:size pairs such as model:4 or model:2,data:2).')
  flags.DEFINE_multi_enum('mesh_layout', list(sharding.LAYOUTS), list(sharding.LAYOUTS),
                          'Mesh layout: the layouts to run on every mesh (repeat the flag; the '
                          'spec engine runs gather only, as it never splits a contraction).')
  flags.DEFINE_integer('samples', 4, 'Samples drawn from real text.', lower_bound=1)
  flags.DEFINE_integer('seed', 0, 'Seed of the samples.', lower_bound=0)
  common.define_output_flag()
  common.define_model_flags()
  flags.DEFINE_integer('cache_len', 2304, 'KV slots: the most tokens a context holds.',
                       lower_bound=1)
  flags.DEFINE_enum('engine', 'spec', list(plans.PLANS), 'The engine mode: spec or pinned (the '
                    'byte-exact ones; blocked and `default` are refused: they have no exact '
                    'grafts to compare across meshes).')


OWN_DEFAULTS = {
    'mesh': 'a sweep: one device, then the model meshes of 2 and 4',
    'mesh_layout': 'a sweep: both layouts',
    'cache_len': "the samples' longest context at 4 samples, in 256-slot tiles",
}


def run(loaded, pairs, mesh: str, layout: str, scratch: str, carried: list[str] | None
        ) -> list[dict]:
  """graft_exactness's check per sample on this mesh: the library's KV captured on this mesh,
  saved as an artifact under `scratch` and grafted back from disk; no continuation. With
  `carried` (the artifacts the first mesh saved), each sample's artifact from there is also
  restored here and grafted: its logits against this mesh's fresh ones (`carried_equal`), or
  the reason this engine refuses it (`carried_refused`)."""
  engine = Engine(loaded, EngineConfig(mode=FLAGS.engine, cache_len=FLAGS.cache_len, mesh=mesh,
                                       mesh_layout=layout))
  rows = []
  for i, s in enumerate(pairs):
    path = os.path.join(scratch, f'{mesh or "one"}_{layout}_{i}')
    row = exactness.check_sample(engine, exactness.artifact_graft(engine, engine, path),
                                 s.library, s.query, continuation_tokens=0)
    rows.append({'fresh_sha256': row['fresh_sha256'], 'graft_sha256': row['graft_sha256'],
                 'artifact': path})
    carried_text = ''
    if carried is not None:
      try:
        grafted = artifact.graft(engine, artifact.load(carried[i], engine))
      except artifact.ArtifactError as e:
        rows[-1]['carried_refused'] = str(e)
        carried_text = ', carried artifact refused'
      else:
        logits, _ = exactness.graft_logits(engine, grafted, s.library, s.query)
        rows[-1]['carried_sha256'] = compare.sha256_bytes(logits)
        rows[-1]['carried_equal'] = rows[-1]['carried_sha256'] == row['fresh_sha256']
        carried_text = f", carried {'==' if rows[-1]['carried_equal'] else '!='} fresh"
    logging.info('sample %d/%d: graft %s fresh%s', i + 1, len(pairs),
                 '==' if row['equal'] else '!=', carried_text)
  return rows


def measure(loaded, pairs, layouts: list[str], scratch: str) -> list[dict]:
  """`run` on every mesh and layout, the first one's artifacts carried to the others."""
  reference = None
  runs = []
  for mesh in FLAGS.mesh:
    for layout in (layouts if mesh else ['gather']):  # one device: no layout
      logging.info('mesh %r layout %s', mesh, layout)
      rows = run(loaded, pairs, mesh, layout, scratch,
                 None if reference is None else [r['artifact'] for r in reference])
      # The mesh's engine holds its placed weights (about 10 GB for the 1B at model:8) and
      # refers to itself through its functions: collected now, before the next one places its.
      gc.collect()
      if reference is None:
        reference = rows
      carried = [r for r in rows if 'carried_refused' in r or 'carried_sha256' in r]
      runs.append({
          'mesh': mesh, 'layout': layout if mesh else None,
          'devices': math.prod(sharding.parse_mesh(mesh).values()) if mesh else 1,
          'graft_equal': sum(r['fresh_sha256'] == r['graft_sha256'] for r in rows),
          'equal_to_one_device': sum(r['fresh_sha256'] == ref['fresh_sha256']
                                     for r, ref in zip(rows, reference)),
          # The first mesh's artifacts restored on this one: exact, or refused (and why).
          'carried_from': runs[0]['mesh'] if runs else None,
          'carried_equal': sum(r.get('carried_equal', False) for r in carried),
          'carried_refused': sum('carried_refused' in r for r in carried),
          'samples': len(rows), 'rows': [{k: v for k, v in r.items() if k != 'artifact'}
                                         for r in rows]})
      carried_text = (f", carried from {runs[0]['mesh'] or 'one device'}: "
                      f"{runs[-1]['carried_equal']} equal, {runs[-1]['carried_refused']} refused"
                      if carried else '')
      print(f"mesh {mesh or 'one device'!s:16s} {runs[-1]['layout'] or '':6s} grafts equal "
            f"{runs[-1]['graft_equal']}/{len(rows)}, equal to one device "
            f"{runs[-1]['equal_to_one_device']}/{len(rows)}{carried_text}", flush=True)
  return runs


def main(argv):
  del argv
  # The spec engine never splits a contraction (graft.engine.plans.Spec): gather only.
  if FLAGS.engine not in ('spec', 'pinned'):
    raise app.UsageError(f'--engine={FLAGS.engine} is not byte-exact: mesh_exactness compares '
                         'exact grafts, so it runs spec or pinned')
  layouts = ['gather'] if FLAGS.engine == 'spec' else list(dict.fromkeys(FLAGS.mesh_layout))
  sizes = [math.prod(sharding.parse_mesh(m).values()) for m in FLAGS.mesh if m]
  if sizes:
    sharding.set_host_devices({'data': 1, 'model': max(sizes)})
  loaded = common.load_model()
  pairs = samples.draw(loaded.tokenizer, FLAGS.samples, seed=FLAGS.seed,
                       window=loaded.config.sliding_window)
  pairs = [p for p in pairs if len(p.library) + len(p.query) <= FLAGS.cache_len]
  with tempfile.TemporaryDirectory(prefix='mesh_exactness_') as scratch:
    runs = measure(loaded, pairs, layouts, scratch)
  config = {**common.model_config_json(), 'engine': FLAGS.engine,
            'dot_library': resolve_engine_config(
                loaded.config, EngineConfig(mode=FLAGS.engine)).dot_library,
            'meshes': FLAGS.mesh,
            'layouts': layouts,
            'samples': len(pairs), 'seed': FLAGS.seed, 'cache_len': FLAGS.cache_len}
  output = common.output_path('mesh_exactness', FLAGS.model, FLAGS.dtype)
  common.write_result(output, 'mesh_exactness', {'config': config, 'runs': runs})


if __name__ == '__main__':
  define_flags()
  common.run(main)
