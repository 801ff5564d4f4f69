#!/bin/sh
# Offline stand-in for Bazel's coverage tools (see third_party/README.md).
echo "remote_coverage_tools stand-in: 'bazel coverage' is not supported offline;" \
  "use pytest's own coverage instead." >&2
exit 1
