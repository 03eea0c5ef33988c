#!/usr/bin/env bash
# On a CUDA machine that already has torch (and triton): install zinf from this source tree into a
# temporary folder (no network needed), then run the CUDA checks. Arguments: which parts to run
# (default: kernels check example bench; plan: zinf.plan of the bench's GPT on this GPU; scale: the ladder of
# model sizes beside the peers, benchmarks/scale.py, SCALE_ARGS added; overhead: the runtime's cost per unit,
# benchmarks/overhead.py, OVERHEAD_ARGS added; pytest:PATH: tests under PATH, PYTEST_ARGS added, e.g. "-n 8");
# CHECK_ARGS / BENCH_ARGS go to gpu_check.py check / bench (e.g. "--jobs 8"). Logs go to $OUT when set (the
# device tool), else ./gpu_out.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$repo/gpu_out}"
mkdir -p "$out"
# zinf installed from this tree into a folder of its own (its entry point registers the "zinf" backend, as
# for a user), without network or build isolation; where pip cannot, the package's layout as pyproject
# maps it (passes/ and runtime/ are subpackages; no entry point: the scripts call zinf.register()).
pkg="$(mktemp -d)"
if ! python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$pkg" "$repo" >/dev/null 2>&1; then
    echo "pip could not install zinf from $repo: copying the package instead"
    mkdir -p "$pkg/zinf_compiler"
    cp -r "$repo"/zinf_compiler/* "$pkg/zinf_compiler/"
    cp -r "$repo/passes" "$pkg/zinf_compiler/passes"
    cp -r "$repo/runtime" "$pkg/zinf_compiler/runtime"
fi
export PYTHONPATH="$pkg:$repo/tests/support:$repo/tests/workers:${PYTHONPATH:-}"
# DeepSpeed for benchmarks/scale.py's peers, where a session carried it (.whl/: its wheel and what the image lacks,
# built on the CPU machine, and libaio's .deb for its NVMe offload): installed into a folder of its own, on the
# path of the DeepSpeed children only (SCALE_DS_SITE); libaio unpacked beside it, found through gcc's variables.
if ls "$repo"/.whl/*.whl >/dev/null 2>&1; then
    ds_site="$(mktemp -d)"
    if python3 -m pip install -q --no-index --no-deps --no-compile --target "$ds_site" "$repo"/.whl/*.whl; then
        export SCALE_DS_SITE="$ds_site"
    fi
    for deb in "$repo"/.whl/*.deb; do
        [ -e "$deb" ] && dpkg -x "$deb" "$ds_site/aio"
    done
    if [ -d "$ds_site/aio/usr/include" ]; then
        aio_lib="$(dirname "$(find "$ds_site/aio" -name 'libaio.so*' | head -1)")"
        export CPATH="$ds_site/aio/usr/include${CPATH:+:$CPATH}" LIBRARY_PATH="$aio_lib${LIBRARY_PATH:+:$LIBRARY_PATH}" \
               LD_LIBRARY_PATH="$aio_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
fi
export PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/zinf_inductor_cache}"
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
# Every part runs from an empty folder: `python3 -m` puts the working directory first on sys.path, and in
# the repository that is the source tree's zinf_compiler/ (its passes/ and runtime/ are not inside it).
cd "$(mktemp -d)"
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
        plan) { python3 -m zinf_compiler.plan_cli --probe --n-layer 4 --n-embd 1024 --n-head 16 --vocab 256 \
                    --block-size 512 --seq 512 --batch 8 \
                && python3 -m zinf_compiler.plan_cli --probe --n-layer 4 --n-embd 1024 --n-head 16 --vocab 256 \
                    --block-size 512 --seq 512 --batch 8 --device-memory 1.2GiB --host-memory 0.5; } 2>&1 \
                  | tee "$out/plan.log" || status=1 ;;
        bench) python3 "$repo/benchmarks/gpu_check.py" bench --json "$out/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" || status=1 ;;
        scale) python3 "$repo/benchmarks/scale.py" --out "$out" ${SCALE_ARGS:-} 2>&1 | tee "$out/scale.log" || status=1 ;;
        overhead) python3 "$repo/benchmarks/overhead.py" --device "${GPU_CHECK_DEVICE:-cuda}" --json "$out/overhead.json" \
                      ${OVERHEAD_ARGS:-} 2>&1 | tee "$out/overhead.log" || status=1 ;;
        pytest:*) python3 -m pytest -q -p no:cacheprovider --rootdir "$repo" -c "$repo/pyproject.toml" ${PYTEST_ARGS:-} \
                      "$repo/${part#pytest:}" 2>&1 | tee "$out/pytest.log" | tail -40 || status=1 ;;
        *) echo "unknown part $part"; status=2 ;;
    esac
done
exit $status
