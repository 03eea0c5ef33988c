#!/usr/bin/env bash
# On a CUDA machine that already has torch (and triton): run zinf from this source tree without
# installing it (no network needed), then the CUDA checks. Arguments: which parts to run
# (default: kernels check example bench); CHECK_ARGS / BENCH_ARGS go to gpu_check.py check / bench (e.g. "--jobs 8"). Logs go to $OUT when set (the device tool), else ./gpu_out.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$repo/gpu_out}"
mkdir -p "$out"
# The package's layout as pyproject maps it (passes/ and runtime/ are subpackages).
pkg="$(mktemp -d)"
mkdir -p "$pkg/zinf_compiler"
cp -r "$repo"/zinf_compiler/* "$pkg/zinf_compiler/"
cp -r "$repo/passes" "$pkg/zinf_compiler/passes"
cp -r "$repo/runtime" "$pkg/zinf_compiler/runtime"
export PYTHONPATH="$pkg:$repo/tests/support:$repo/tests/workers:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/zinf_inductor_cache}"
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], torch.cuda.get_device_name())"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(kernels check example bench)
status=0
for part in "${parts[@]}"; do
    echo "=== $part ==="
    case "$part" in
        kernels) python3 "$repo/tests/workers/kernels_worker.py" cuda > "$out/kernels.json" 2> "$out/kernels.err" \
                     && python3 -c "import json,sys; r=json.load(open('$out/kernels.json')); r.pop('refusals'); bad=[k for k,v in r.items() if not (v.get('exact', True) and v.get('out_exact', True) and v.get('master', 0) <= 1e-6)]; print('kernels bad:', bad); sys.exit(bool(bad))" \
                     || { status=1; tail -20 "$out/kernels.err"; } ;;
        check) python3 "$repo/benchmarks/gpu_check.py" check --json "$out/check.json" ${CHECK_ARGS:-} 2>&1 | tee "$out/check.log" || status=1 ;;
        example) (cd "$(mktemp -d)" && python3 "$repo/examples/train_gpt.py" --steps 60 --log-every 20 2>&1) \
                     | tee "$out/example.log" || status=1 ;;
        bench) python3 "$repo/benchmarks/gpu_check.py" bench --json "$out/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" || status=1 ;;
        pytest:*) python3 -m pytest -q -x -p no:cacheprovider "$repo/${part#pytest:}" 2>&1 | tail -30 || status=1 ;;
        *) echo "unknown part $part"; status=2 ;;
    esac
done
exit $status
