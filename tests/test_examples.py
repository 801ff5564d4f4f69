"""examples/: the way in without absl, run as a researcher runs it (plain Python, the public API)."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_graft_library_example_grafts_byte_exact_and_generates():
  """examples/graft_library.py: load the embedded model, save a library's KV as an artifact,
  graft it into a fresh context, check the logits' SHA-256 against a fresh run, generate."""
  script = REPO / 'examples' / 'graft_library.py'
  assert len(script.read_text().splitlines()) <= 40
  source = script.read_text()
  assert 'absl' not in source and 'experiments' not in source  # the public API only
  out = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, 'PYTHONPATH': str(REPO)}, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.splitlines()
  assert lines[0].startswith('grafted logits SHA-256 ') and lines[0].endswith(
      "== a fresh computation's"), out.stdout
  assert lines[1].startswith('continued: ') and len(lines[1]) > len('continued: ')
