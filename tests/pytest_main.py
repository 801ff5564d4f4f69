"""Main of every //tests:test_* py_test target: runs pytest on one test file.

Usage (by Bazel): pytest_main.py test_foo.py [extra pytest args...]

Bazel starts this from the test's runfiles tree, whose files are symlinks back to the source
tree. The runner resolves its own real path to find the repository root, then runs
`pytest tests/test_foo.py` there, exactly as a developer would from the repo root: the repo
root is first on sys.path and PYTHONPATH (so `from gemma_jax import ...` works, also in
subprocesses), pyproject.toml's pytest settings and tests/conftest.py apply, and files the
tests look up relative to the repo are found. Bazel's declared inputs (see tests/BUILD) only
decide when a test is rerun.

Bazel's test protocol is honoured where it maps onto pytest:
  XML_OUTPUT_FILE        -> --junitxml (Bazel's test.xml)
  TEST_TMPDIR            -> --basetemp (pytest's tmp_path lives in Bazel's per-test temp dir)
  TESTBRIDGE_TEST_ONLY   -> -k (bazel test --test_filter=EXPR)
  TEST_SHARD_STATUS_FILE -> touched (sharding is not split further; one shard runs all)
"""

from __future__ import annotations

import os
import sys


def _repo_root() -> str:
  return os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _pytest_args(test_file: str, extra: list[str]) -> list[str]:
  args = [test_file, '-p', 'no:cacheprovider', '-ra', '-n', '0']  # Bazel runs targets in parallel
  xml = os.environ.get('XML_OUTPUT_FILE')
  if xml:
    args += ['--junitxml', xml]
  tmp = os.environ.get('TEST_TMPDIR')
  if tmp:
    args += ['--basetemp', os.path.join(tmp, 'pytest')]
  only = os.environ.get('TESTBRIDGE_TEST_ONLY')
  if only:
    args += ['-k', only]
  return args + extra


def main(argv: list[str]) -> int:
  if len(argv) < 2:
    print(f'usage: {argv[0]} test_file.py [pytest args...]', file=sys.stderr)
    return 2
  root = _repo_root()
  test_file = os.path.join('tests', os.path.basename(argv[1]))
  if not os.path.isfile(os.path.join(root, test_file)):
    print(f'pytest_main: {test_file} not found under {root}', file=sys.stderr)
    return 2

  # Run from the repo root, with it first on the import path, like `pytest` from a checkout.
  os.chdir(root)
  # Drop the runfiles entries that Bazel's stub put on the path: imports come from the tree.
  runfiles = os.environ.get('TEST_SRCDIR') or os.environ.get('RUNFILES_DIR')

  def keep(p: str) -> bool:
    if runfiles:
      path, tree = os.path.abspath(p or '.'), os.path.abspath(runfiles)
      if path == tree or path.startswith(tree + os.sep):
        return False
    return os.path.realpath(p or '.') != root

  sys.path[:] = [root] + [p for p in sys.path if keep(p)]
  pythonpath = [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p and keep(p)]
  os.environ['PYTHONPATH'] = os.pathsep.join([root] + pythonpath)

  shard_status = os.environ.get('TEST_SHARD_STATUS_FILE')
  if shard_status:
    open(shard_status, 'a').close()

  import pytest  # pylint: disable=g-import-not-at-top

  code = pytest.main(_pytest_args(test_file, argv[2:]))
  # pytest exits 5 when nothing was collected (e.g. a --test_filter that matches no test):
  # a failure, as for any other test runner.
  return int(code)


if __name__ == '__main__':
  sys.exit(main(sys.argv))
