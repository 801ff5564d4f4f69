"""Where an engine's time goes, op by op: XLA:CPU's trace events joined to the optimized HLO.

XLA:CPU records a trace event for every thunk it executes (one instruction of the optimized
module: a dot, a fusion, a copy), carrying the module's program id and the instruction's name
(stats `program_id`, `hlo_op`). The optimized modules, dumped as text (`--xla_dump_to` with
`--xla_dump_hlo_as_text`: files `module_<program id>.<name>.cpu_after_optimizations.txt`), give
each instruction's opcode, shapes and the Python stack that made it (`stack_frame_id` into the
module's StackFrames table). Joining the two gives every thunk's seconds, its kind, the FLOPs of
the dots it runs, and the model code it belongs to (`component`).

jax 0.10's HLO printer writes a frame's parent as its id plus one (0 and 1: no parent); the
tests check the stacks read here against known model code.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re

from jax.profiler import ProfileData

DUMP_SUFFIX = '.cpu_after_optimizations.txt'
# The model's code (gemma_jax/): a thunk is labelled by the frames it was made in there.
MODEL_FILES = ('model.py', 'modules.py', 'layers.py', 'attention.py', 'tiled_attention.py', 'rope.py',
               'kv_state.py')
# Frames that only hold others: a label starts below them.
CONTAINERS = ('forward', 'Transformer.__call__', 'Block.__call__')


@dataclasses.dataclass(frozen=True)
class Op:
  """One instruction of an optimized module, as a thunk runs it."""
  kind: str  # 'dot' for a dot or a fusion that runs one; else the opcode or the fusion's kind
  flops: int  # 2 * output elements * contracted terms, summed over the dots it runs
  stack: tuple[str, ...]  # 'file.py:function', innermost first

  @property
  def component(self) -> str:
    """The model code that made the op: up to two frames below the model's containers, e.g.
    'Attention.__call__ > Dense.__call__' (a projection) or 'FeedForward.__call__ >
    Dense.__call__'; for an op XLA made without a stack, the weight it reads
    ('weight:layers.*.mlp.down_proj.w'); 'outside the model' for the engine's own ops (cache
    writes, logits selection)."""
    if len(self.stack) == 1 and self.stack[0].startswith('weight:'):
      return self.stack[0]
    model = [frame.split(':', 1)[1] for frame in reversed(self.stack)
             if frame.split(':', 1)[0] in MODEL_FILES]
    while model and model[0] in CONTAINERS:
      model.pop(0)
    return ' > '.join(model[:2]) if model else 'outside the model'


_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*)$')
_COMPUTATION = re.compile(r'^(?:ENTRY )?%?([\w.\-]+) .*\{$')
_SHAPE = re.compile(r'^\w+\[([\d,]*)\]')


def _table(text: str, name: str) -> dict[int, str]:
  """A numbered table of the module's stack section ('FileNames', 'StackFrames', ...)."""
  rows = {}
  section = text.split('\n' + name + '\n', 1)
  if len(section) < 2:
    return rows
  for line in section[1].split('\n'):
    m = re.match(r'(\d+) (.*)', line)
    if not m:
      break
    rows[int(m.group(1))] = m.group(2)
  return rows


def _fields(entry: str) -> dict[str, int]:
  return {k: int(v) for k, v in re.findall(r'(\w+)=(\d+)', entry)}


def _stacks(text: str) -> dict[int, tuple[str, ...]]:
  """stack_frame_id -> ('file.py:function', ...) innermost first."""
  files = {i: os.path.basename(v.strip('"')) for i, v in _table(text, 'FileNames').items()}
  functions = {i: v.strip('"') for i, v in _table(text, 'FunctionNames').items()}
  locations = {i: _fields(v) for i, v in _table(text, 'FileLocations').items()}
  frames = {i: _fields(v) for i, v in _table(text, 'StackFrames').items()}

  def chain(frame: int) -> tuple[str, ...]:
    out = []
    while frame in frames and len(out) < len(frames):
      where = locations[frames[frame]['file_location_id']]
      out.append(f"{files[where['file_name_id']]}:{functions[where['function_name_id']]}")
      frame = frames[frame]['parent_frame_id'] - 1
    return tuple(out)

  return {i: chain(i) for i in frames}


def _dims(shape: str) -> list[int]:
  m = _SHAPE.match(shape)
  return [int(d) for d in m.group(1).split(',') if d] if m else []


# The spec engine's native contraction kernels (gemma_jax/kernels/csrc/ffi.cc): custom calls
# whose first operand's last dimension is the contracted one.
_NATIVE_DOT = re.compile(r'custom_call_target="gemma_spec_\w+"')


def _dot_flops(shape: str, rest: str, shapes: dict[str, str]) -> int:
  """2 * output elements * contracted terms of one dot instruction or native contraction
  kernel (`rest`: its operands and attributes; `shapes`: the module's instruction shapes read so
  far)."""
  lhs = _dims(shapes.get(re.match(r'%?([\w.\-]+)', rest).group(1), ''))
  if _NATIVE_DOT.search(rest):
    terms = lhs[-1] if lhs else 0
  else:
    contracting = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', rest)
    terms = 1
    for d in (contracting.group(1).split(',') if contracting else []):
      if d and int(d) < len(lhs):
        terms *= lhs[int(d)]
  out = 1
  for d in _dims(shape):
    out *= d
  return 2 * out * terms


_VIEWS = ('bitcast', 'reshape', 'copy', 'transpose', 'slice')


def _weight(name: str, rows: dict) -> str | None:
  """The parameter an operand views (through bitcasts, reshapes, copies, transposes, slices),
  as its pytree path with layer numbers starred ('layers.*.mlp.down_proj.w'), or None."""
  for _ in range(8):
    if name not in rows:
      return None
    opcode, operands = rows[name][0], rows[name][5]
    if opcode == 'parameter':
      parts = [p for p in re.split(r'_{2,}', re.sub(r'\.\d+$', '', name)) if p]
      return '.'.join('*' if p.isdigit() else p for p in parts[1:] or parts)
    if opcode not in _VIEWS or not operands:
      return None
    name = operands[0]
  return None


def _fallback_stack(operands: list[str], rows: dict) -> tuple[str, ...]:
  """A stack for an instruction a compiler pass made without metadata (XLA rewrites dots and
  drops it): the weight it reads ('weight:layers.*.attn.q_proj.w'), else the stack of its first
  operand that has one."""
  for operand in operands:
    weight = _weight(operand, rows)
    if weight:
      return (f'weight:{weight}',)
  for operand in operands:
    if rows[operand][4]:
      return rows[operand][4]
  return ()


def read_module(text: str) -> dict[str, Op]:
  """Instruction name -> Op for every instruction of one optimized module's text."""
  stacks = _stacks(text)
  shapes, rows, computation = {}, {}, None
  in_computation = collections.Counter()  # FLOPs of the dots inside each computation
  for line in text.split('\n'):
    m = _INSTRUCTION.match(line)
    if not m:
      c = _COMPUTATION.match(line)
      computation = c.group(1) if c else computation
      continue
    name, shape, opcode, rest = m.groups()
    shapes[name] = shape
    flops = (_dot_flops(shape, rest, shapes)
             if opcode == 'dot' or (opcode == 'custom-call' and _NATIVE_DOT.search(rest)) else 0)
    in_computation[computation] += flops
    fusion_kind = re.search(r'kind=(\w+)', rest)
    called = re.search(r'calls=%?([\w.\-]+)', rest)
    frame = re.search(r'stack_frame_id=(\d+)', rest)
    operands = [o for o in re.findall(r'%([\w.\-]+)', rest.split(')', 1)[0]) if o in rows]
    stack = stacks.get(int(frame.group(1)), ()) if frame else ()
    if not stack:
      stack = _fallback_stack(operands, rows)
    rows[name] = (opcode, fusion_kind.group(1) if fusion_kind else None,
                  called.group(1) if called else None, flops, stack, operands)
  ops = {}
  for name, (opcode, fusion_kind, called, flops, stack, _) in rows.items():
    flops = flops or in_computation[called]
    kind = 'dot' if flops else (fusion_kind or opcode)
    ops[name] = Op(kind=kind, flops=flops, stack=stack)
  return ops


def read_dump(directory: str) -> dict[int, dict[str, Op]]:
  """program id -> that module's ops, for every optimized module dumped in `directory`."""
  modules = {}
  for path in glob.glob(os.path.join(directory, 'module_*' + DUMP_SUFFIX)):
    program = int(os.path.basename(path).split('.', 1)[0].removeprefix('module_'))
    with open(path) as f:
      modules[program] = read_module(f.read())
  return modules


@dataclasses.dataclass(frozen=True)
class Thunk:
  """One executed thunk: its module's program id and name, its instruction, its seconds."""
  program: int
  module: str
  op: str
  seconds: float


def read_trace(directory: str) -> list[Thunk]:
  """Every thunk event of the newest trace under `directory` (jax.profiler.trace's output)."""
  paths = sorted(glob.glob(os.path.join(directory, '**', '*.xplane.pb'), recursive=True),
                 key=os.path.getmtime)
  if not paths:
    raise FileNotFoundError(f'no trace (*.xplane.pb) under {directory}')
  thunks = []
  for plane in ProfileData.from_file(paths[-1]).planes:
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        if 'hlo_op' in stats and 'program_id' in stats:
          thunks.append(Thunk(int(stats['program_id']), str(stats.get('hlo_module', '')),
                              str(stats['hlo_op']), event.duration_ns / 1e9))
  return thunks


def summarize(thunks: list[Thunk], modules: dict[int, dict[str, Op]], wall_seconds: float,
              matmul_gflops: float | None = None, top: int = 12) -> dict:
  """Seconds by op kind and by model component, the dots' FLOP rate (and its fraction of
  `matmul_gflops`, the machine's ceiling measured in the same run), and the wall time spent
  outside thunks (dispatch, host work between calls)."""
  by_kind, by_component = collections.Counter(), collections.Counter()
  dot_flops, unknown = 0, 0.0
  for t in thunks:
    op = modules.get(t.program, {}).get(t.op)
    if op is None:
      unknown += t.seconds
      continue
    by_kind[op.kind] += t.seconds
    label = op.component if op.kind == 'dot' else f'{op.component} [{op.kind}]'
    by_component[label] += t.seconds
    dot_flops += op.flops
  thunk_seconds = sum(t.seconds for t in thunks)
  dot_seconds = by_kind.get('dot', 0.0)
  dot_gflops = dot_flops / dot_seconds / 1e9 if dot_seconds else None
  share = lambda s: s / thunk_seconds if thunk_seconds else None
  return {
      'wall_s': wall_seconds, 'thunk_s': thunk_seconds, 'thunks': len(thunks),
      'outside_thunks_s': max(wall_seconds - thunk_seconds, 0.0),
      'unattributed_s': unknown,
      'dot_s': dot_seconds, 'dot_share': share(dot_seconds), 'dot_flops': dot_flops,
      'dot_gflops': dot_gflops,
      'dot_fraction_of_matmul_ceiling': (dot_gflops / matmul_gflops
                                         if dot_gflops and matmul_gflops else None),
      'by_kind': [{'kind': k, 's': s, 'share': share(s)} for k, s in by_kind.most_common()],
      'by_component': [{'component': k, 's': s, 'share': share(s)}
                       for k, s in by_component.most_common(top)],
  }
