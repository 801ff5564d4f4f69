#!/usr/bin/env bash
# Device check for the Pallas kernels on a GPU or TPU host, one command, under 5 minutes:
#
#   bash experiments/device_check.sh [OUTPUT_DIR]      (default: $OUT, else results/device_check)
#
# 1. the kernel tests (compiled for the backend instead of interpret mode);
# 2. graft exactness with --attention=pallas (random weights: no model package is needed there),
#    printing the fresh and grafted logits hashes;
# 3. kernel timings against XLA's attention at 4k and 32k contexts, and the output hashes twice
#    (a nondeterministic kernel shows up as differing hashes).
# Runs from the source tree with the host's python3 (jax, flax, orbax, absl, pytest, hypothesis).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-results/device_check}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c 'import jax; print("backend", jax.default_backend(), jax.devices())' | tee "$out/device.txt"
python3 -m pytest -q -p no:cacheprovider -k 'pallas or kernel' tests/test_pallas_kernel.py \
  2>&1 | tee "$out/kernel_tests.log" | tail -n 5
for model in tiny_gemma3 gemma3_270m; do
  python3 -m experiments.graft_exactness --model="$model" --weights=random:0 --attention=pallas \
    --samples=6 --continuation_tokens=8 --output="$out/graft_exactness_${model}_pallas.json" \
    2>&1 | grep -E 'sample|SHA-256' | tail -n 7
done
python3 -m experiments.kernel_bench --contexts=4096,32768 --output="$out/kernel_bench.json" \
  2>&1 | tail -n 12
python3 -m experiments.kernel_bench --contexts=4096,32768 --sha256_only 2>&1 | tail -n 4
