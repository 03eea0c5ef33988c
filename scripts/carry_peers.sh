#!/usr/bin/env bash
# On the CPU machine, before a GPU run: put into .whl/ (gitignored) what benchmarks/scale.py's DeepSpeed peers need
# on the GPU machine, whose image has no DeepSpeed and no network: DeepSpeed's wheel (built here without its ops,
# which build there at first use with that machine's nvcc), the pure-Python and cp312 wheels it needs that the
# image lacks, and libaio's .deb for its NVMe offload. scripts/gpu_check.sh installs them from .whl/ when present;
# the device tool carries the folder when asked to (carry [".whl"]). About 7 MB.
#   DEEPSPEED_VERSION   default 0.19.8 (the version measured in benchmarks/RESULTS.md)
#   GPU_PYTHON          the GPU machine's Python, default 3.12
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ds_version="${DEEPSPEED_VERSION:-0.19.8}"
py_version="${GPU_PYTHON:-3.12}"
out="$repo/.whl"
mkdir -p "$out"
# shellcheck source=install.sh
source "$repo/scripts/install.sh"  # (the venv's torch: DeepSpeed's setup imports it)
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$VENV_PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$py_version" --implementation cp \
    "${platforms[@]}" -d "$out" pydantic pydantic-core annotated-types typing-inspection hjson py-cpuinfo einops msgpack ninja
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
"$VENV_PYTHON" -m pip download -q --no-deps --no-binary=:all: -d "$scratch" "deepspeed==$ds_version"
DS_BUILD_OPS=0 "$VENV_PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$out" "$scratch"/deepspeed-*.tar.gz
(cd "$out" && apt-get download libaio1 libaio-dev >/dev/null 2>&1) \
    || echo "carry_peers: apt-get download libaio failed: DeepSpeed's NVMe offload will be skipped there" >&2
ls -la "$out"
du -sh "$out"
