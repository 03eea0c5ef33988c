#!/usr/bin/env bash
# Install what the tests need, then run the default suite (tests marked slow excluded; see pyproject).
#   --all    the whole suite, slow tests included (what .ci/run runs)
# Other arguments go to pytest: a tier (tests/unit, tests/integration, tests/multirank), a file, -k ...
# tests/README.md says what each tier holds and which tests run by default.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PIP_EXTRAS=dev source "$repo/scripts/install.sh"
cd "$repo"
# Crashed spawned workers leave pytorch-errorfile-* in $TMPDIR: keep them out of /tmp.
export TMPDIR="$(mktemp -d)"
trap 'rm -rf "$TMPDIR"' EXIT
select=()
if [ "${1:-}" = "--all" ]; then
    shift
    select=(-m "")  # every marker: the default run leaves out -m slow
    export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"  # 8 drawn cases per property, not 3
fi
# --durations: the slowest tests. The default run from a fresh clone, cold Inductor cache, 2 cores: 9 min 38 s
# wall with the install (pytest 8 min 6 s), 14 min 32 s on a slower machine of the same kind (README, "Setup").
"$VENV_PYTHON" -m pytest -q --durations=15 "${select[@]}" "$@"
