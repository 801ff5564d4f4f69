#!/usr/bin/env bash
# The one-command check for a GPU or TPU host, under 5 minutes on one GPU:
#
#   bash experiments/device_check.sh --output=results/device_<kind>.json
#
# Kernel tests compiled for the device, graft exactness on the embedded 270M (10 samples, XLA
# and Pallas attention), a replay of the CI manifest, the lowering summary; hashes and timings
# in the result (experiments/device_check.py). Runs from the source tree with the host's python3
# (jax for the device, flax, orbax-checkpoint, tensorstore, absl-py, pytest, hypothesis, and the
# embedded model's package: pip install -e '.[test]' without torch works).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 -m experiments.device_check "$@"
