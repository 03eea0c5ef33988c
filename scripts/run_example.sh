#!/usr/bin/env bash
# The main job: install what is needed, then train the example GPT on CPU.
# Extra arguments go to examples/train_gpt.py (see --help there).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/install.sh"
cd "$repo"
exec "$VENV_PYTHON" examples/train_gpt.py "$@"
