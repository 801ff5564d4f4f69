#!/usr/bin/env bash
# Runs the pytest suite under Bazel, offline.
#
#   bash .ci/bazel_test.sh                      # the fast smoke target
#   bash .ci/bazel_test.sh //tests/...          # every tests/test_*.py
#   bash .ci/bazel_test.sh //tests:test_foo --test_filter=some_case
#
# Installs Debian's bazel-bootstrap (Bazel 4.2.3) with apt-get when `bazel` is not on PATH.
# All flags that matter live in .bazelrc, so plain `bazel test //tests/...` behaves the same;
# this script adds only CI-friendly output settings. Arguments are passed to `bazel test`
# unchanged (targets and flags); with none, //tests:test_bazel_smoke runs.
# Environment: BAZEL (the bazel binary, default `bazel`), BAZEL_STARTUP_OPTS (extra startup
# options, e.g. "--output_user_root=/some/dir"), KV_GRAFT_PYTHON (the interpreter the tests
# use; default <repo>/.venv/bin/python).
set -euo pipefail

repo="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

BAZEL="${BAZEL:-bazel}"
if ! command -v "$BAZEL" >/dev/null 2>&1; then
  echo "bazel_test.sh: $BAZEL not found; installing bazel-bootstrap with apt-get" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends bazel-bootstrap >/dev/null
  BAZEL=bazel
fi

if [[ ! -x "$repo/.venv/bin/python" && -z "${KV_GRAFT_PYTHON:-}" ]]; then
  echo "bazel_test.sh: warning: no $repo/.venv/bin/python; tests will use python3 from PATH" >&2
fi

if [[ $# -eq 0 ]]; then
  set -- //tests:test_bazel_smoke
fi

# shellcheck disable=SC2086  # BAZEL_STARTUP_OPTS is a word list on purpose
exec "$BAZEL" ${BAZEL_STARTUP_OPTS:-} test \
  --color=no --curses=no --show_progress_rate_limit=10 \
  --test_output=errors \
  "$@"
