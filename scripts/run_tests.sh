#!/usr/bin/env bash
# Install what the tests need, then run the default suite (tests marked slow excluded; see pyproject).
#   --all    the whole suite, slow tests included (what .ci/run runs)
# Other arguments go to pytest: a tier (tests/unit, tests/integration, tests/multirank), a file, -k ...
#   (-n 0 runs in this one process: the tests run on TEST_WORKERS parallel workers, default one per
#   core up to 4; tests/conftest.py keeps each file on one worker and the multirank tier on one)
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
cores="$(nproc 2>/dev/null || echo 1)"
workers="${TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
if [ "$workers" -le 1 ]; then parallel=(-n 0); fi
# --durations: the slowest tests (under parallel workers a test's time includes its wait for a core).
"$VENV_PYTHON" -m pytest -q --durations=15 "${parallel[@]}" "${select[@]}" "$@"
