#!/usr/bin/env bash
# Install what the tests need, then run the suite (slow tests excluded; see pyproject).
# Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PIP_EXTRAS=dev source "$repo/scripts/install.sh"
cd "$repo"
# Crashed spawned workers leave pytorch-errorfile-* in $TMPDIR: keep them out of /tmp.
export TMPDIR="$(mktemp -d)"
trap 'rm -rf "$TMPDIR"' EXIT
# --durations: the slowest tests, to keep the suite within its 15 minutes.
"$VENV_PYTHON" -m pytest -q --durations=15 "$@"
