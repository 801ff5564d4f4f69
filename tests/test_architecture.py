"""The structure as docs/architecture.md draws it, checked from the source (`ast`, nothing
imported): imports run one way, between the layers its "Layers" table names.

The module graph of gemma_jax, graft, analysis and experiments counts every import, those inside
functions too (an import under `if TYPE_CHECKING:` never runs and names a type only: it is not
an arrow). It must be acyclic; no arrow may point from a layer to one above it, or between
layers of different sides; the modules of a layer marked `apart` import none of each other. An
import inside a function defers an optional or heavy dependency and says why in a comment (on
its line, or on a line of its run of imports); few of them import a module of this project. A
module has at most 600 lines. The checks are run on a planted cycle and a planted upward arrow
too, so they are seen to fail.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import graphlib
import os
import re

import pytest

from gemma_jax.kernels import native_build, native_dot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ('gemma_jax', 'graft', 'analysis', 'experiments')
ARCHITECTURE = os.path.join(ROOT, 'docs', 'architecture.md')
MAX_LINES = 600
MAX_PROJECT_IMPORTS_IN_FUNCTIONS = 10


@dataclasses.dataclass(frozen=True)
class Import:
  module: str  # the importing module
  line: int
  target: str | None  # the project module it names (None: a third-party one)
  in_function: bool
  reason: str | None  # the comment on its line or its run of import lines


@dataclasses.dataclass(frozen=True)
class Layer:
  name: str
  side: str  # '' | a side's name | 'apart'
  patterns: tuple[str, ...]


def sources() -> dict[str, str]:
  """Module name -> its source, for every module of the four packages."""
  out = {}
  for top in PACKAGES:
    for directory, _, names in os.walk(os.path.join(ROOT, top)):
      for name in names:
        if name.endswith('.py'):
          path = os.path.join(directory, name)
          module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, '.')
          with open(path) as f:
            out[module.removesuffix('.__init__')] = f.read()
  return out


def _resolve(name: str, modules) -> str | None:
  """The project module `name` names: itself, or the longest module prefix of it."""
  while name and name not in modules:
    name = name.rpartition('.')[0]
  return name or None


def _type_checking(node: ast.AST) -> bool:
  test = getattr(node, 'test', None)
  return isinstance(node, ast.If) and (
      (isinstance(test, ast.Name) and test.id == 'TYPE_CHECKING')
      or (isinstance(test, ast.Attribute) and test.attr == 'TYPE_CHECKING'))


def _reason(lines: list[str], node: ast.stmt) -> str | None:
  """The comment that says why an import is where it is: on one of the lines of its run of
  consecutive import statements, or on the line just above the run."""
  def comment(text):
    return text.split('#', 1)[1].strip() if '#' in text else None

  def is_import(text):
    return re.match(r'\s*(import|from)\s', text) is not None

  first = last = node.lineno - 1
  while first > 0 and is_import(lines[first - 1]):
    first -= 1
  while last + 1 < len(lines) and is_import(lines[last + 1]):
    last += 1
  for text in lines[first:last + 1]:
    if comment(text):
      return comment(text)
  above = lines[first - 1].strip() if first > 0 else ''
  return above[1:].strip() if above.startswith('#') else None


def imports(module: str, source: str, modules) -> list[Import]:
  """Every import statement of `module` (each imported name of a `from` import apart, as it
  can name a submodule), with the project module it names."""
  tree, lines = ast.parse(source), source.splitlines()
  package = module if _is_package(module, modules) else module.rpartition('.')[0]
  out = []

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      if _type_checking(child):
        continue
      inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                ast.Lambda))
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        for target in _targets(child, package, modules):
          out.append(Import(module, child.lineno, target, inner,
                            _reason(lines, child) if inner else None))
      visit(child, inner)

  visit(tree, False)
  return out


def _is_package(module: str, modules) -> bool:
  return any(other.startswith(module + '.') for other in modules)


def _targets(node, package: str, modules) -> list[str | None]:
  if isinstance(node, ast.Import):
    return [_resolve(alias.name, modules) for alias in node.names]
  base = node.module or ''
  if node.level:
    parts = package.split('.')
    base = '.'.join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
  return [f'{base}.{alias.name}' if f'{base}.{alias.name}' in modules
          else _resolve(base, modules) for alias in node.names]


def graph(source_of: dict[str, str]) -> dict[str, list[Import]]:
  """Module -> its imports."""
  return {m: imports(m, s, source_of) for m, s in source_of.items()}


def cycles(imports_of: dict[str, list[Import]]) -> list[list[str]]:
  """The strongly connected parts of the module graph that hold a cycle (empty: acyclic)."""
  edges = {m: sorted({i.target for i in found if i.target and i.target != m})
           for m, found in imports_of.items()}
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def connect(v):  # Tarjan's algorithm
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in edges.get(v, ()):
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      part = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        part.append(w)
        if w == v:
          break
      if len(part) > 1:
        out.append(sorted(part))

  for v in sorted(edges):
    if v not in index:
      connect(v)
  return out


def layers() -> list[Layer]:
  """The rows of docs/architecture.md's "Layers" table, top to bottom."""
  with open(ARCHITECTURE) as f:
    text = f.read()
  section = text.split('\n## Layers\n', 1)[1].split('\n## ', 1)[0]
  out = []
  for row in section.splitlines():
    cells = [c.strip() for c in row.strip().strip('|').split('|')]
    if len(cells) != 3 or not row.startswith('|') or cells[0] in ('layer', '') or \
        set(cells[0]) <= set('-: '):
      continue
    out.append(Layer(cells[0], cells[1], tuple(re.findall(r'`([^`]+)`', cells[2]))))
  return out


def layer_of(module: str, table: list[Layer]) -> int | None:
  """The index of the layer whose pattern names `module` most closely (a module's own name
  before a wildcard, a longer wildcard before a shorter one); None where none does."""
  best, found = None, None
  for i, layer in enumerate(table):
    for pattern in layer.patterns:
      if fnmatch.fnmatchcase(module, pattern):
        score = ('*' not in pattern, len(pattern))
        if best is None or score > best:
          best, found = score, i
  return found


def wrong_arrows(imports_of: dict[str, list[Import]], table: list[Layer]) -> list[str]:
  """Every import that points up the layers, across sides, or within a layer kept apart."""
  out = []
  for module, found in imports_of.items():
    here = layer_of(module, table)
    for i in found:
      if i.target is None or i.target == module:
        continue
      there = layer_of(i.target, table)
      a, b = table[here], table[there]
      where = f'{module}:{i.line} imports {i.target}'
      if there < here:
        out.append(f'{where}: up from "{a.name}" to "{b.name}"')
      elif a.side and b.side and 'apart' not in (a.side, b.side) and a.side != b.side:
        out.append(f'{where}: from side {a.side} to side {b.side}')
      elif here == there and a.side == 'apart':
        out.append(f'{where}: within "{a.name}", whose modules import none of each other')
  return out


@pytest.fixture(scope='module')
def source_of():
  return sources()


@pytest.fixture(scope='module')
def imports_of(source_of):
  return graph(source_of)


def test_the_layers_table_names_every_module_once(source_of):
  table = layers()
  assert [t.name for t in table][:2] == ['entry points', 'experiment helpers'], table
  assert len(table) >= 10 and all(t.patterns for t in table), table
  unplaced = [m for m in source_of if layer_of(m, table) is None]
  assert not unplaced, f'modules in no layer of docs/architecture.md: {unplaced}'
  patterns = [p for t in table for p in t.patterns]
  assert len(patterns) == len(set(patterns)), 'a pattern named twice'
  unused = [p for p in patterns if not any(fnmatch.fnmatchcase(m, p) for m in source_of)]
  assert not unused, f'patterns that name no module: {unused}'


def test_the_module_graph_is_acyclic(imports_of):
  found = cycles(imports_of)
  assert not found, f'import cycles (imports inside functions counted): {found}'
  # graphlib agrees, and orders every module after what it imports.
  graphlib.TopologicalSorter({m: {i.target for i in f if i.target and i.target != m}
                              for m, f in imports_of.items()}).prepare()


def test_imports_point_down_the_layers(imports_of):
  wrong = wrong_arrows(imports_of, layers())
  assert not wrong, '\n'.join(wrong)


def test_imports_inside_functions_defer_a_dependency_and_say_why(imports_of):
  inside = [i for found in imports_of.values() for i in found if i.in_function]
  silent = [f'{i.module}:{i.line}' for i in inside if not i.reason]
  assert not silent, f'imports inside functions without a reason comment: {silent}'
  project = sorted({(i.module, i.line, i.target) for i in inside if i.target})
  assert len(project) <= MAX_PROJECT_IMPORTS_IN_FUNCTIONS, project


def test_no_module_is_over_600_lines(source_of):
  long = {m: s.count('\n') for m, s in source_of.items() if s.count('\n') > MAX_LINES}
  assert not long, long


def _planted(source_of, module, code):
  return {**source_of, module: source_of[module] + '\n\n' + code}


def test_a_planted_cycle_through_a_function_import_is_found(source_of):
  # gemma_jax.files is imported by nearly everything; an import of the model inside one of its
  # functions closes a cycle through the whole stack below the model.
  planted = graph(_planted(source_of, 'gemma_jax.files', (
      'def _planted():\n  from gemma_jax import model  # a planted cycle\n  return model\n')))
  found = cycles(planted)
  assert any({'gemma_jax.files', 'gemma_jax.model'} <= set(part) for part in found), found
  wrong = wrong_arrows(planted, layers())
  assert any(w.startswith('gemma_jax.files:') and 'up from "gemma_jax: foundation"' in w
             for w in wrong), wrong


def test_planted_wrong_arrows_are_found(source_of):
  table = layers()
  across = graph(_planted(source_of, 'graft.exactness', 'from analysis import results\n'))
  assert any(w.startswith('graft.exactness:') and 'from side graft to side analysis' in w
             for w in wrong_arrows(across, table))
  apart = graph(_planted(source_of, 'experiments.logits', 'from experiments import generate\n'))
  assert any(w.startswith('experiments.logits:') and 'within "entry points"' in w
             for w in wrong_arrows(apart, table))
  silent = graph(_planted(source_of, 'gemma_jax.files', 'def f():\n  import json\n'))
  assert [i for i in silent['gemma_jax.files'] if i.in_function and not i.reason]


# ---------------------------------------------------------------------------------------------
# Facts the exactness rests on live in one function each, used everywhere, copied nowhere.

# fact -> (its home 'module:function', patterns of an inline copy of it in code)
FACTS = {
    'KV leaf names': ('gemma_jax.kv_state:leaf_names',
                      (r"""['"]layer_\{[^}]*\}/""", r"""['"]layer_['"] *\+""")),
    'canonical JSON': ('gemma_jax.digest:canonical_json',
                       (r"separators=\(',', *':'\)", r'separators=\(",", *":"\)')),
    'first position of a row set': ('gemma_jax.kv_state:first_position',
                                    (r'positions\[0\]\[0\]',)),
    'visibility rule': ('gemma_jax.kv_state:visible',
                        (r'>= *0\) *& *\([^)]*<=', r'k_pos *<= *q|kp *<= *qp|index *<= *t\b')),
}


def _code_lines(source: str) -> list[tuple[int, str]]:
  """(line, text) of the code in `source`: comments and docstrings (string statements) left
  out."""
  tree = ast.parse(source)
  prose = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(
        node.value.value, str):
      prose.update(range(node.lineno, node.end_lineno + 1))
  return [(i, line.split('#', 1)[0]) for i, line in enumerate(source.splitlines(), 1)
          if i not in prose]


def fact_copies(source_of: dict[str, str]) -> list[str]:
  """'module:line (fact): text' of every inline copy of a fact outside its home, and of a home
  that is missing."""
  found = []
  for fact, (home, patterns) in FACTS.items():
    module, function = home.split(':')
    tree = ast.parse(source_of[module])
    defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function]
    if len(defs) != 1:
      found.append(f'{home} ({fact}): defined {len(defs)} times')
      continue
    inside = range(defs[0].lineno, defs[0].end_lineno + 1)
    for name, source in source_of.items():
      for line, code in _code_lines(source):
        if (name, line in inside) == (module, True):
          continue
        if any(re.search(p, code) for p in patterns):
          found.append(f'{name}:{line} ({fact}): {code.strip()}')
  return found


def test_each_fact_has_one_home_and_no_copy(source_of):
  copies = fact_copies(source_of)
  assert not copies, '\n'.join(copies)


def test_a_planted_copy_of_a_fact_is_found(source_of):
  planted = _planted(source_of, 'graft.store.lookup',
                     "def _planted(i):\n  return f'layer_{i}/k'\n")
  assert [c for c in fact_copies(planted) if c.startswith('graft.store.lookup:')
          and 'KV leaf names' in c]


# ---------------------------------------------------------------------------------------------
# The engine never branches on its mode: everything that differs by mode is its plan's answer.

ENGINE_MODULE = 'graft.engine._engine'
# Names that, read in a branch's test, make it a branch on the mode or the plan: the mode, the
# plan itself and its module, the plan classes, and what a plan answers.
MODE_NAMES = frozenset({
    'mode', 'plan', 'plans', 'plan_class', 'PLANS', 'Plan', 'Spec', 'Pinned', 'Blocked',
    'by_length', 'byte_exact', 'batch_slots', 'head_rows', 'preloads', 'runs_by_length',
    'reads_tiles', 'fuses_decode', 'default_attention', 'default_dot_library'})


def mode_branches(source: str) -> list[str]:
  """'line: test' of every branch in `source` (if, a conditional expression, while, assert, a
  comprehension's condition, match, and/or) whose test reads a name of MODE_NAMES or a string
  naming a mode."""
  modes = {'spec', 'pinned', 'blocked', 'default'}

  def reads_mode(node: ast.AST) -> bool:
    for n in ast.walk(node):
      if isinstance(n, ast.Name) and n.id in MODE_NAMES:
        return True
      if isinstance(n, ast.Attribute) and n.attr in MODE_NAMES:
        return True
      if isinstance(n, ast.Constant) and n.value in modes:
        return True
    return False

  found = []
  for node in ast.walk(ast.parse(source)):
    tests = []
    if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
      tests = [node.test]
    elif isinstance(node, ast.comprehension):
      tests = node.ifs
    elif isinstance(node, ast.Match):
      tests = [node.subject]
    elif isinstance(node, ast.BoolOp):
      tests = node.values
    found += [f'{t.lineno}: {ast.unparse(t)}' for t in tests if reads_mode(t)]
  return sorted(set(found), key=lambda f: int(f.split(':')[0]))


def test_the_engine_never_branches_on_its_mode_or_plan(source_of):
  found = mode_branches(source_of[ENGINE_MODULE])
  assert not found, f'{ENGINE_MODULE} branches on its mode or plan: {found}'
  with open(ARCHITECTURE) as f:  # and the document says so
    assert '`Engine` has no branch on a mode' in f.read()


def test_a_planted_mode_branch_is_found(source_of):
  planted = _planted(source_of, ENGINE_MODULE, (
      'def _planted(self):\n  if self.engine_config.mode == "spec":\n    return 1\n'
      '  return 2 if isinstance(self.plan, plans.Pinned) else 3\n'))[ENGINE_MODULE]
  found = mode_branches(planted)
  assert len(found) == 2 and 'mode' in found[0] and 'plans.Pinned' in found[1], found


# ---------------------------------------------------------------------------------------------
# The native kernels' paths: listed once (native_build.ISAS, PATHS), the C++ checked against it.


def _csrc(name: str) -> str:
  with open(os.path.join(native_build.SOURCE_DIR, name)) as f:
    return f.read()


def test_the_kernel_paths_are_listed_once_and_the_cpp_follows_them():
  isas = native_build.ISAS
  assert native_dot.ISAS is isas and isas[0] == 'auto'
  assert sorted({p for paths in native_build.PATHS.values() for p in paths}) == sorted(isas[1:])
  ffi = _csrc('ffi.cc')
  # enum Isa { kAuto = 0, kPortable = 1, ... }: the codes are the indices in ISAS.
  enum = re.search(r'enum Isa\b[^{]*\{([^}]*)\}', ffi).group(1)
  codes = {name.lower(): int(code) for name, code in re.findall(r'k(\w+)\s*=\s*(\d+)', enum)}
  assert codes == {name: i for i, name in enumerate(isas)}, codes
  names = re.search(r'kIsaNames\[\]\s*=\s*\{([^}]*)\}', ffi).group(1)
  assert tuple(re.findall(r'"(\w+)"', names)) == isas
  # Each path declared for the architectures PATHS gives it, and dispatched on.
  declared, condition = {}, None
  for line in ffi.split('extern "C" {', 1)[1].split('}', 1)[0].splitlines():
    arch = re.match(r'#if defined\(__(\w+)__\)', line.strip())
    if arch:
      condition = arch.group(1)
    elif line.strip() == '#endif':
      condition = None
    name = re.match(r'GEMMA_SPEC_DECLARE\((\w+)\)', line.strip())
    if name:
      declared[name.group(1)] = condition
  for arch, paths in native_build.PATHS.items():
    assert sorted(p for p, c in declared.items() if c in (None, arch)) == sorted(paths), arch
  for path in isas[1:]:
    assert f'gemma_spec_panel_{path}' in ffi and f'gemma_spec_calls_{path}' in ffi, path
  isa = _csrc('isa.cc')
  built = set(re.findall(r'#(?:el)?if GEMMA_SPEC_ISA_(\w+)', isa))
  assert sorted(built) == sorted(isas[1:]), built
  assert re.search(r'constexpr int64_t kPanel = (\d+);', ffi).group(1) == str(native_dot.PANEL)
  for target, symbol in native_dot._TARGETS.items():
    assert f'XLA_FFI_DEFINE_HANDLER_SYMBOL({symbol},' in ffi, (target, symbol)
