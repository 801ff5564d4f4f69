"""Exactness across device meshes: within a mesh, and across device counts and layouts.

  python -m experiments.mesh_exactness --model=gemma3_1b --weights=random:0 \\
      --meshes=,model:2,model:4,model:8 --layouts=gather,split --samples=4

On a CPU host the process asks XLA for as many host devices as the largest mesh needs. For each
(mesh, layout) the pinned engine computes the same samples fresh and through an own-position
graft (the library's KV captured on that mesh, grafted back); a sample's logits SHA-256 on every
mesh is then compared with the one-device engine's. Splitting a contraction over devices
changes its summation order (layout 'split'); layout 'gather' never splits one. The result
(schema mesh_exactness) says, per (mesh, layout): grafts equal to fresh, and fresh equal to
one device.
"""

from __future__ import annotations

import math

from absl import flags, logging

from experiments import common, samples
from gemma_jax import sharding
from graft.store import artifact
from graft import exactness
from graft.engine import Engine, EngineConfig

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_list('meshes', ['', 'model:2', 'model:4'], "Meshes ('' is one device).")
  flags.DEFINE_list('layouts', list(sharding.LAYOUTS), 'Layouts to run on every mesh.')
  flags.DEFINE_integer('samples', 4, 'Samples drawn from real text.')
  flags.DEFINE_integer('seed', 0, 'Seed of the samples.')
  flags.DEFINE_string('output', None, 'Results JSON (default: named after the model).')
  common.define_model_flags()
  flags.DEFINE_integer('cache_len', 2304, 'KV slots.')


def run(loaded, pairs, mesh: str, layout: str) -> list[dict]:
  """graft_exactness's check per sample on this mesh: the graft source is the library's KV
  captured on the same mesh and grafted back (no disk), no continuation."""
  engine = Engine(loaded, EngineConfig(mode='pinned', cache_len=FLAGS.cache_len, mesh=mesh,
                                       mesh_layout=layout))

  def graft(library):
    ctx, _ = engine.prefill(list(library), logits='none')
    return artifact.graft(engine, artifact.capture(engine, ctx))

  rows = [exactness.check_sample(engine, graft, s.library, s.query, continuation_tokens=0)
          for s in pairs]
  return [{'fresh_sha256': r['fresh_sha256'], 'graft_sha256': r['graft_sha256']} for r in rows]


def main(argv):
  del argv
  sizes = [math.prod(sharding.parse_mesh(m).values()) for m in FLAGS.meshes if m]
  if sizes:
    sharding.set_host_devices({'data': 1, 'model': max(sizes)})
  loaded = common.load_model()
  pairs = samples.draw(loaded.tokenizer, FLAGS.samples, seed=FLAGS.seed,
                       window=loaded.config.sliding_window)
  pairs = [p for p in pairs if len(p.library) + len(p.query) <= FLAGS.cache_len]
  reference = None
  runs = []
  for mesh in FLAGS.meshes:
    for layout in (FLAGS.layouts if mesh else ['gather']):  # one device: no layout
      logging.info('mesh %r layout %s', mesh, layout)
      rows = run(loaded, pairs, mesh, layout)
      if reference is None:
        reference = rows
      runs.append({
          'mesh': mesh, 'layout': layout if mesh else None,
          'devices': math.prod(sharding.parse_mesh(mesh).values()) if mesh else 1,
          'graft_equal': sum(r['fresh_sha256'] == r['graft_sha256'] for r in rows),
          'equal_to_one_device': sum(r['fresh_sha256'] == ref['fresh_sha256']
                                     for r, ref in zip(rows, reference)),
          'samples': len(rows), 'rows': rows})
      print(f"mesh {mesh or 'one device'!s:16s} {runs[-1]['layout'] or '':6s} grafts equal "
            f"{runs[-1]['graft_equal']}/{len(rows)}, equal to one device "
            f"{runs[-1]['equal_to_one_device']}/{len(rows)}")
  config = {**common.model_config_json(), 'meshes': FLAGS.meshes, 'layouts': FLAGS.layouts,
            'samples': len(pairs), 'seed': FLAGS.seed, 'cache_len': FLAGS.cache_len}
  output = FLAGS.output or common.default_output('mesh_exactness', FLAGS.model, FLAGS.dtype)
  common.write_result(output, 'mesh_exactness', {'config': config, 'runs': runs})


if __name__ == '__main__':
  define_flags()
  common.run(main)
