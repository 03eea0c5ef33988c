#!/usr/bin/env bash
# Make a virtual environment in .venv with the pinned torch and zinf installed.
# Sourced by run_example.sh and run_tests.sh; safe to run again (fast when done).
#   TORCH_VERSION   torch to pin (default 2.13.0, the CPU wheel); pyproject keeps a range
#   VENV_DIR       folder of the environment (default .venv in the repo)
#   PIP_EXTRAS     pip extras to install (default: none; run_tests.sh asks for dev, which
#                  also puts triton into .triton/ for the kernel tests)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV_DIR:-$repo/.venv}"
torch_version="${TORCH_VERSION:-2.13.0}"
python_bin="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "zinf setup: creating $venv" >&2
    "$python_bin" -m venv "$venv"
fi
pip_quiet=(--quiet --disable-pip-version-check)
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
    echo "zinf setup: installing torch==$torch_version (first run takes a minute or two)" >&2
    "$venv/bin/pip" install "${pip_quiet[@]}" "torch==$torch_version"
fi
spec="$repo"
if [ -n "${PIP_EXTRAS:-}" ]; then spec="$repo[${PIP_EXTRAS}]"; fi
"$venv/bin/pip" install "${pip_quiet[@]}" -e "$spec"
# Triton for the kernel tests (Triton's interpreter on the CPU), in a folder of its own: in
# the environment itself, Inductor would import it in every compiling process (~5 s each).
if [ "${PIP_EXTRAS:-}" = "dev" ] && [ ! -d "$repo/.triton/triton" ] \
        && ! "$venv/bin/python" -c "import triton" 2>/dev/null; then
    echo "zinf setup: installing triton into .triton/ (kernel tests)" >&2
    "$venv/bin/pip" install "${pip_quiet[@]}" --no-deps --target "$repo/.triton" "triton>=3.2"
fi
VENV_PYTHON="$venv/bin/python"
export VENV_PYTHON
