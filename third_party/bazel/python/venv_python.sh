#!/usr/bin/env bash
# The interpreter of //third_party/bazel/python:venv_toolchain.
#
# Bazel runs this from a test's runfiles tree, where it is a symlink back to the source file;
# resolving that link gives the repository root, so the repo's .venv is found wherever the
# repo is cloned without writing an absolute path into any checked-in file.
#
# Order: $KV_GRAFT_PYTHON (an explicit interpreter, e.g. in CI), else <repo>/.venv/bin/python,
# else python3 on PATH (with a warning).
set -euo pipefail
if [[ -n "${KV_GRAFT_PYTHON:-}" ]]; then
  exec "$KV_GRAFT_PYTHON" "$@"
fi
self="$(readlink -f -- "${BASH_SOURCE[0]}")"
root="$(cd -- "$(dirname -- "$self")/../../.." && pwd)"
if [[ -x "$root/.venv/bin/python" ]]; then
  exec "$root/.venv/bin/python" "$@"
fi
echo "venv_python.sh: no $root/.venv/bin/python; using python3 from PATH" >&2
exec python3 "$@"
