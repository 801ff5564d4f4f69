#!/usr/bin/env bash
# Builds the benchmark peers' environments (README.md, "Speed"). Idempotent.
#   bash experiments/peers/setup_peer_envs.sh [PEERS_DIR]     (default ~/.cache/gemma_jax/peers)
# llama-cpp-python: PyPI has only the sdist; it compiles llama.cpp with cmake (~23 min on 2
# busy cores). The built wheel is kept in $PEERS_DIR/wheels and installed into the project venv.
# gemma: its own Python 3.12 venv (gemma 4.x needs >= 3.12; pyenv has 3.12.1 here).
set -euo pipefail
PEERS_DIR=${1:-$HOME/.cache/gemma_jax/peers}
HERE=$(cd "$(dirname "$0")" && pwd)
PROJECT_PY=${PROJECT_PY:-python}
mkdir -p "$PEERS_DIR/wheels"

# --- llama-cpp-python (CPU, -march=native) ---
LLAMA_VERSION=0.3.36
if ! ls "$PEERS_DIR"/wheels/llama_cpp_python-$LLAMA_VERSION-*.whl >/dev/null 2>&1; then
  # Tools, examples, server and tests are not needed by the bindings: skipping them shortens
  # the build (the timed build above built them).
  CMAKE_BUILD_PARALLEL_LEVEL=2 \
  CMAKE_ARGS="-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF" \
    "$PROJECT_PY" -m pip wheel --no-deps -w "$PEERS_DIR/wheels" "llama-cpp-python==$LLAMA_VERSION"
fi
"$PROJECT_PY" -m pip install "$PEERS_DIR"/wheels/llama_cpp_python-$LLAMA_VERSION-*.whl

# --- google-deepmind gemma 4.0.1 in a Python 3.12 venv ---
PY312=${PY312:-$(command -v python3.12 || echo /root/.pyenv/versions/3.12.1/bin/python)}
if [ ! -x "$PEERS_DIR/gemma/bin/python" ]; then
  "$PY312" -m venv "$PEERS_DIR/gemma"
fi
G="$PEERS_DIR/gemma/bin/pip"
"$G" install -q -U pip
# gemma and kauldron without their declared deps (kauldron's pull xmanager, opencv, sklearn, ...
# and made a plain resolve of gemma 3.3.0 run past 15 minutes); then what their imports need.
"$G" install --no-deps gemma==4.0.1 kauldron==1.4.4
"$G" install -c "$HERE/gemma_env_constraints.txt" jax flax orbax-checkpoint \
  "etils[edc,enp,epath,epy,etree]" einops jaxtyping sentencepiece treescope absl-py numpy chex \
  optax immutabledict typeguard ml_collections tqdm typing_extensions "dialog>=1.1" \
  clu wrapt packaging tensorflow-cpu tensorboard pandas mediapy grain tensorflow_datasets
"$PEERS_DIR/gemma/bin/python" -c "from gemma import gm; gm.nn.Gemma3_270M(); print('gemma peer ok')"
