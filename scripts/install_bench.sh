#!/usr/bin/env bash
# Install the peers that benchmarks/peers.py compares zinf against, outside the project's
# environment: DeepSpeed and its pure-Python dependencies go into .bench/site (gitignored),
# never into .venv (transformers and accelerate would detect DeepSpeed there and the test
# suite would change). peers.py puts .bench/site on PYTHONPATH for the DeepSpeed processes
# only. Safe to run again (fast when done). Never installs or upgrades torch (--no-deps).
#   DEEPSPEED_VERSION   default 0.19.8 (the version measured in benchmarks/RESULTS.md)
#   VENV_DIR            the project's environment (default .venv; created by scripts/install.sh)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV_DIR:-$repo/.venv}"
ds_version="${DEEPSPEED_VERSION:-0.19.8}"
target="$repo/.bench/site"

if [ ! -x "$venv/bin/python" ]; then
    echo "install_bench: no $venv; running scripts/install.sh first" >&2
    # shellcheck source=install.sh
    source "$repo/scripts/install.sh"
fi
py="$venv/bin/python"
mkdir -p "$target" "$repo/.bench/torch_extensions"

have() {  # have MODULE: importable from the venv with .bench/site on the path
    PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" "$py" -c "import $1" 2>/dev/null
}

# DeepSpeed's own dependencies, pure Python and torch-free; those the venv already has are kept.
# pydantic>=2, packaging, psutil and tqdm usually come with the dev extras.
wanted=()
have einops || wanted+=(einops)
have hjson || wanted+=(hjson)
have msgpack || wanted+=(msgpack)
have ninja || wanted+=(ninja)
have cpuinfo || wanted+=(py-cpuinfo)
have packaging || wanted+=(packaging)
have psutil || wanted+=(psutil)
have tqdm || wanted+=(tqdm)
if ! PYTHONPATH="$target" "$py" -c "import pydantic, sys; sys.exit(int(pydantic.VERSION.split('.')[0]) < 2)" 2>/dev/null; then
    wanted+=("pydantic>=2")
fi
if ! PYTHONPATH="$target" "$py" -c "import deepspeed, sys; sys.exit(deepspeed.__version__ != '$ds_version')" 2>/dev/null; then
    wanted+=("deepspeed==$ds_version")
fi
if [ "${#wanted[@]}" -gt 0 ]; then
    echo "install_bench: pip install --no-deps --target $target ${wanted[*]}" >&2
    "$py" -m pip install --quiet --disable-pip-version-check --no-deps --upgrade --target "$target" "${wanted[@]}"
fi
if [ -d "$target/torch" ]; then
    echo "install_bench: ERROR: a torch landed in $target; remove it (pip must run with --no-deps)" >&2
    exit 1
fi

# libaio headers: DeepSpeed JIT-builds its async_io op against them (NVMe offload).
if [ -e /usr/include/libaio.h ]; then
    :
elif [ "$(id -u)" = 0 ]; then
    echo "install_bench: apt-get install -y libaio-dev" >&2
    (apt-get install -y libaio-dev >/dev/null || { apt-get update >/dev/null && apt-get install -y libaio-dev >/dev/null; }) \
        || echo "install_bench: WARNING: apt-get install libaio-dev failed; DeepSpeed's NVMe offload will fail" >&2
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    echo "install_bench: sudo apt-get install -y libaio-dev" >&2
    (sudo apt-get install -y libaio-dev >/dev/null || { sudo apt-get update >/dev/null && sudo apt-get install -y libaio-dev >/dev/null; }) \
        || echo "install_bench: WARNING: sudo apt-get install libaio-dev failed; DeepSpeed's NVMe offload will fail" >&2
else
    echo "install_bench: WARNING: libaio-dev is not installed and neither root nor passwordless sudo is" \
         "available: DeepSpeed's NVMe offload (async_io) cannot be built; peers.py reports those" \
         "configurations as failed. Install it with: apt-get install libaio-dev" >&2
fi

PYTHONPATH="$target" "$py" - <<'PY'
import deepspeed, torch
print(f"install_bench: deepspeed {deepspeed.__version__} with torch {torch.__version__} "
      f"(accelerator {deepspeed.get_accelerator().device_name()})")
PY
echo "install_bench: done; DeepSpeed's JIT-built ops go to $repo/.bench/torch_extensions (set by peers.py)" >&2
