"""Contracts a researcher can read: every exported name of gemma_jax, graft.engine, graft.store
and graft.knowledge is documented, and so is every public function, class and method of their
modules; a public function that takes or gives arrays states their shapes in the model's letters
(docs/architecture.md, "Shapes"), and an exported one does so in Args and Returns sections.

A method that overrides a documented one inherits its contract (`inspect.getdoc`); a class needs
its own docstring; a constant is documented by the comment on or above its assignment.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import inspect
import os
import pkgutil
import re
import typing

import pytest

PACKAGES = ('gemma_jax', 'graft.engine', 'graft.store', 'graft.knowledge')
# An array in a signature: jax.Array, np.ndarray, jax.ShapeDtypeStruct.
ARRAY = re.compile(r'\b(jax\.Array|np\.ndarray|ShapeDtypeStruct|KVState)\b')
# A shape, after a space or an opening: [B, T, D], [V], [O / P, I, P], [n - lo, K, H], [bq, 1]
# (not an index such as w[k], nor a list of strings).
SHAPE = re.compile(r'(?<![\w\]])\[[\w ,./*+\-×()]*[A-Za-z][\w ,./*+\-×()]*\]')


def modules(package: str) -> list:
  root = importlib.import_module(package)
  found = [root]
  for info in pkgutil.walk_packages(root.__path__, package + '.'):
    if not info.name.endswith('__main__'):
      found.append(importlib.import_module(info.name))
  return found


ALL_MODULES = sorted({m.__name__: m for p in PACKAGES for m in modules(p)}.items())


def _public(module) -> list[tuple[str, object]]:
  """The public functions and classes `module` defines, and the public methods and properties
  of those classes (their own, not inherited)."""
  out = []
  for name, obj in vars(module).items():
    if name.startswith('_') or getattr(obj, '__module__', None) != module.__name__:
      continue
    if inspect.isfunction(obj):
      out.append((name, obj))
    elif inspect.isclass(obj):
      out.append((name, obj))
      fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else ()
      for attr, member in vars(obj).items():
        if attr.startswith('_') or attr in fields or isinstance(obj, enum.EnumMeta):
          continue
        if isinstance(member, (staticmethod, classmethod)):
          member = member.__func__
        if isinstance(member, property):
          member = member.fget
        elif hasattr(member, 'func') and inspect.isfunction(getattr(member, 'func')):
          member = member.func  # functools.cached_property
        if inspect.isfunction(member):
          out.append((f'{name}.{attr}', _bound(obj, attr, member)))
  return out


def _bound(cls, attr, function):
  """What documents cls.attr: a method as the class gives it (`inspect.getdoc` finds an
  override's contract in the base classes); a property's getter, or the first documented one
  of a base class it overrides."""
  raw = inspect.getattr_static(cls, attr)
  if not isinstance(raw, property) and not hasattr(raw, 'attrname'):
    return getattr(cls, attr)
  for base in cls.__mro__:
    member = base.__dict__.get(attr)
    getter = member.fget if isinstance(member, property) else getattr(member, 'func', None)
    if getter is not None and getter.__doc__:
      return getter
  return function


def _doc(obj) -> str:
  """obj's documentation: a class's own (not a base class's, nor the signature a dataclass
  writes in its place), a method's or property's own or that of the one it overrides."""
  if isinstance(obj, property):
    obj = obj.fget
  if inspect.isclass(obj):
    own = obj.__dict__.get('__doc__') or ''
    return '' if own.startswith(obj.__name__ + '(') else inspect.cleandoc(own)
  return inspect.getdoc(obj) or ''


def _signature_text(function) -> str:
  try:
    hints = typing.get_type_hints(function)
  except Exception:  # noqa: BLE001 (annotations that only a type checker resolves)
    hints = getattr(function, '__annotations__', {})
  return ' '.join(str(h) if not isinstance(h, str) else h for h in hints.values()) + ' ' + \
      ' '.join(str(a) for a in getattr(function, '__annotations__', {}).values())


def _states_shapes(doc: str) -> bool:
  """Whether a docstring gives a shape, or says its arrays may have any shape (elementwise) or
  are scalars."""
  words = ' '.join(doc.split()).lower()
  return bool(SHAPE.search(doc)) or 'any shape' in words or 'scalar' in words


def _constant_documented(package, name: str) -> bool:
  """Whether the assignment of `name` in one of the package's modules has a comment on its
  line or the line above."""
  for _, module in ALL_MODULES:
    if not (module.__name__ == package or module.__name__.startswith(package + '.')):
      continue
    try:
      source = inspect.getsource(module)
    except (OSError, TypeError):
      continue
    lines = source.splitlines()
    for node in ast.parse(source).body:
      targets = (node.targets if isinstance(node, ast.Assign) else
                 [node.target] if isinstance(node, ast.AnnAssign) else [])
      names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
      if name in names:
        here, above = lines[node.lineno - 1], lines[node.lineno - 2] if node.lineno > 1 else ''
        if '#' in here or above.strip().startswith('#'):
          return True
  return False


@pytest.mark.parametrize('package', PACKAGES)
def test_every_exported_name_is_documented(package):
  module = importlib.import_module(package)
  assert module.__doc__, package
  names = getattr(module, '__all__', None)
  assert names, f'{package} has no curated __all__'
  silent, no_shapes = [], []
  for name in names:
    obj = getattr(module, name)
    if inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj):
      if not _doc(obj):
        silent.append(name)
      # An exported function, or a public method of an exported class, of arrays.
      functions = [(name, obj)] if inspect.isfunction(obj) else [
          (f'{name}.{attr}', member) for attr, member in vars(obj).items()
          if inspect.isclass(obj) and not attr.startswith('_') and inspect.isfunction(member)]
      for label, function in functions:
        if ARRAY.search(_signature_text(function)):
          doc = _doc(function)
          takes = [p for p in inspect.signature(function).parameters if p not in ('self', 'cls')]
          if not (('Args:' in doc or not takes) and 'Returns:' in doc and _states_shapes(doc)):
            no_shapes.append(label)
    elif not _constant_documented(package, name):
      silent.append(name)
  assert not silent, f'{package}: exported names without documentation: {silent}'
  assert not no_shapes, f'{package}: exported functions of arrays without Args/Returns shapes: ' \
                        f'{no_shapes}'


@pytest.mark.parametrize('name,module', ALL_MODULES, ids=[n for n, _ in ALL_MODULES])
def test_every_public_function_class_and_method_is_documented(name, module):
  assert module.__doc__, f'{name} has no module docstring'
  silent = [n for n, obj in _public(module) if not _doc(obj)]
  assert not silent, f'{name}: public names without a docstring: {silent}'


@pytest.mark.parametrize('name,module', ALL_MODULES, ids=[n for n, _ in ALL_MODULES])
def test_public_functions_of_arrays_state_shapes(name, module):
  missing = []
  for n, obj in _public(module):
    function = obj.fget if isinstance(obj, property) else obj
    if inspect.isfunction(function) and ARRAY.search(_signature_text(function)):
      if not _states_shapes(_doc(obj)):
        missing.append(n)
  assert not missing, f'{name}: functions of arrays whose docstring gives no shape: {missing}'


def test_the_checks_fail_on_an_undocumented_name():
  def undocumented(x):
    return x

  def shapeless(x: 'jax.Array') -> 'jax.Array':
    """Returns x."""
    return x

  assert not _doc(undocumented)
  assert ARRAY.search(_signature_text(shapeless)) and not _states_shapes(_doc(shapeless))
  assert SHAPE.search('q [B, T, N, H] float32') and SHAPE.search('-> [V]')
  assert not SHAPE.search("rows [0, n) of ['a', 'b'], w[k]")


# ---------------------------------------------------------------------------------------------
# Annotations: every public function and method of gemma_jax and graft, and every __call__, says
# the types it takes and gives; the type checker (mypy, configured in pyproject.toml and run by
# .ci/run) checks them against every body. Its suppressions are few, and each says why.

TYPED_PACKAGES = ('gemma_jax', 'graft')
MAX_SUPPRESSIONS = 20


def _library_sources() -> dict[str, str]:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = {}
  for top in TYPED_PACKAGES:
    for directory, _, names in os.walk(os.path.join(root, top)):
      for name in names:
        if name.endswith('.py'):
          path = os.path.join(directory, name)
          with open(path) as f:
            out[os.path.relpath(path, root)] = f.read()
  return out


def unannotated(source: str) -> list[str]:
  """'line name: what' of every public function or method (of a public class), and every
  __call__, whose parameters (but self and cls) or return lack an annotation."""
  found = []

  def visit(node: ast.AST, prefix: str, public: bool) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if (public and not child.name.startswith('_')) or child.name == '__call__' or (
            public and child.name == '__init__'):
          args = child.args
          params = (args.posonlyargs + args.args + args.kwonlyargs
                    + [a for a in (args.vararg, args.kwarg) if a])
          missing = [a.arg for a in params if a.annotation is None
                     and a.arg not in ('self', 'cls')]
          if child.returns is None and child.name != '__init__':
            missing.append('return')
          if missing:
            found.append(f'{child.lineno} {prefix}{child.name}: {missing}')
      elif isinstance(child, ast.ClassDef):
        visit(child, f'{prefix}{child.name}.', public and not child.name.startswith('_'))

  visit(ast.parse(source), '', True)
  return found


def test_every_public_function_and_call_is_annotated():
  missing = {path: found for path, source in _library_sources().items()
             if (found := unannotated(source))}
  assert not missing, missing


def test_a_missing_annotation_is_found():
  source = ('def public(x: int):\n  return x\n\nclass Thing:\n'
            '  def __call__(self, y) -> int:\n    return y\n\n'
            'def _private(z):\n  return z\n')
  assert unannotated(source) == ["1 public: ['return']", "5 Thing.__call__: ['y']"]


SUPPRESSION = re.compile(r'#\s*type:\s*ignore(\[[^\]]*\])?(.*)$')


def suppressions(source: str) -> list[tuple[int, str | None, str]]:
  """(line, error codes or None, the reason after them) of every `# type: ignore`."""
  return [(i, m.group(1), m.group(2).lstrip('# ').strip())
          for i, line in enumerate(source.splitlines(), 1)
          if (m := SUPPRESSION.search(line))]


def test_the_type_checker_is_suppressed_rarely_and_each_time_says_why():
  found = {path: s for path, source in _library_sources().items() if (s := suppressions(source))}
  count = sum(len(s) for s in found.values())
  assert count <= MAX_SUPPRESSIONS, found
  silent = [(path, line) for path, s in found.items() for line, codes, reason in s
            if not codes or not reason]
  assert not silent, f'suppressions without an error code and a reason: {silent}'
  assert suppressions('x = f()  # type: ignore[arg-type]  # numpy stub') == [
      (1, '[arg-type]', 'numpy stub')]
  assert suppressions('x = f()  # type: ignore') == [(1, None, '')]
