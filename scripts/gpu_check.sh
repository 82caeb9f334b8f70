#!/usr/bin/env bash
# The GPU checks in one command, on a CUDA machine, from the repository root (docs/testing.md, "One command on a GPU"):
#
#   1. install the Python 3.12 wheels carried in .whl/ into /tmp/site (no index, no dependency resolution);
#   2. the LM-head benchmark, one process per model shape (a run stopped by its time limit loses one shape, not all):
#                                       nemo-is bench --device cuda --model M --out $OUT/head/M
#      then one table of all of them:   nemo-is bench --from-json $OUT/head/*/results.json --out $OUT/head
#      and the GPU section of docs/performance.md from it (the project's tooling, not the package):
#                                       python -m tools.bench_docs head $OUT/head/results.json
#   3. its results checked: no measurement failed, and the Triton backend did not fall back to torch
#      (results.json: every row's `failed`, and `triton_fallback`);
#   4. the MoE model step:              nemo-is bench --model-step --device cuda --out $OUT/step
#      run with NEMO_IS_STRICT_BACKEND=1, so a fallback to torch there is an error, and checked for failed variants;
#   5. the hosts' fused LM heads against the plugin's drop-ins for them (docs/nemo_rl.md, docs/verl.md):
#                                       nemo-is bench --host-heads --device cuda --out $OUT/host_heads
#      and its GPU section of docs/performance.md:
#                                       python -m tools.bench_docs host-heads $OUT/host_heads/host_heads.json
#      NeMo-RL from NEMO_RL_PATH (a checkout: the
#      directory holding nemo_rl/) where it is not installed, verl installed or from VERL_PATH; then checked: every
#      plugin head measured on the Triton backend, both hosts measured (a host's own head that fails is reported);
#   6. the `gpu` test tier:             python -m pytest -q -m gpu tests $PYTEST_ARGS
#   7. the kernel and chunk-size sweep: python -m nemo_is_plugin.apps.bench.kernel_sweep --out $OUT/sweep.json
#
# Each step's output goes to $OUT/<step>.log (OUT defaults to ./runs/gpu_check). A failing step does not stop the
# others; the script exits 1 if any step failed, and lists them. PYTHON overrides the interpreter (default: python);
# PYTEST_ARGS adds pytest arguments (e.g. "-n 8" with pytest-xdist); TIMEOUT_BENCH (per model), TIMEOUT_STEP,
# TIMEOUT_HOST_HEADS, TIMEOUT_TESTS and TIMEOUT_SWEEP bound a step's seconds (unset or 0: no limit; a step stopped by one fails);
# SKIP_SWEEP=1 leaves the sweep out.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/runs/gpu_check}"
PYTHON="${PYTHON:-python}"
SITE=/tmp/site
mkdir -p "$OUT"
export PYTHONPATH="$SITE:$PWD"
unset TRITON_INTERPRET # the real compiler and GPU, not Triton's CPU interpreter

failed=()

step() { # step NAME [SECONDS] COMMAND...: run COMMAND (for at most SECONDS when a number > 0 is given), its output
    # into $OUT/NAME.log (and the terminal); record a failure
    local name="$1" limit=()
    shift
    if [[ "${1:-}" =~ ^[0-9]+$ ]]; then
        [ "$1" -gt 0 ] && limit=(timeout --kill-after=10 "$1")
        shift
    fi
    echo "=== $name: $*" | tee "$OUT/$name.log"
    "${limit[@]}" "$@" 2>&1 | tee -a "$OUT/$name.log"
    local rc="${PIPESTATUS[0]}"
    if [ "$rc" -ne 0 ]; then
        echo "=== $name FAILED (exit $rc; log: $OUT/$name.log)" | tee -a "$OUT/$name.log"
        failed+=("$name")
    fi
}

install_wheels() {
    local wheels=(.whl/*.whl)
    if [ ! -e "${wheels[0]}" ]; then
        echo "no wheels in .whl/ (expected the Python 3.12 wheels this check installs)"
        return 1
    fi
    "$PYTHON" --version
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
}

bench_head_report() { # one table, plots and the docs' GPU section from the per-model results that exist
    local parts=() model
    for model in "${MODELS[@]}"; do
        [ -e "$OUT/head/$model/results.json" ] && parts+=(--from-json "$OUT/head/$model/results.json")
    done
    if [ "${#parts[@]}" -eq 0 ]; then
        echo "no model's head benchmark wrote results"
        return 1
    fi
    "$PYTHON" -m nemo_is_plugin.apps.cli.main bench "${parts[@]}" --out "$OUT/head" &&
        "$PYTHON" -m tools.bench_docs head "$OUT/head/results.json"
}

check_head_results() { # the head benchmark's results.json: no failed measurement, no Triton fallback
    "$PYTHON" - "$OUT/head/results.json" <<'EOF'
import json
import sys

results = json.load(open(sys.argv[1]))
problems = [
    f"{r['model']} {r['path']} {what}: {error}" for r in results["rows"] for what, error in (r.get("failed") or {}).items()
]
if results.get("triton_fallback") is not None:
    problems.append(f"THE TRITON BACKEND FELL BACK TO TORCH: {results['triton_fallback']}")
fused = [r for r in results["rows"] if r["path"].startswith("fused")]
problems += [f"{r['model']} {r['path']} ran on backend {r['backend']!r}, not triton" for r in fused if r.get("backend") != "triton"]
for line in problems:
    print(line)
sys.exit(1 if problems else 0)
EOF
}

check_step_results() { # the model step's model_step.json: every variant ran (a strict-mode fallback would be listed)
    "$PYTHON" - "$OUT/step/model_step.json" <<'EOF'
import json
import sys

skipped = json.load(open(sys.argv[1]))["skipped"]
for name, why in skipped.items():
    print(f"{name}: {why}")
sys.exit(1 if skipped else 0)
EOF
}

check_host_heads_results() { # host_heads.json: the plugin's heads ran on Triton; both hosts' heads were measured
    "$PYTHON" - "$OUT/host_heads/host_heads.json" <<'EOF'
import json
import sys

results = json.load(open(sys.argv[1]))
problems = [f"{name} not measured: {why}" for name, why in results["skipped"].items()]
for r in results["rows"]:
    for what, error in (r.get("failed") or {}).items():
        line = f"{r['model']} {r['head']} {what}: {error}"
        if r["head"].startswith("plugin"):
            problems.append(line)
        else:  # a host's own head that fails is a finding, reported in the docs section, not a failed check
            print(f"(host) {line}")
    if r["head"].startswith("plugin") and not r.get("failed") and r.get("backend") != "triton":
        problems.append(f"{r['model']} {r['head']} ran on backend {r.get('backend')!r}, not triton")
if results.get("triton_fallback") is not None:
    problems.append(f"THE TRITON BACKEND FELL BACK TO TORCH: {results['triton_fallback']}")
for line in problems:
    print(line)
sys.exit(1 if problems else 0)
EOF
}

step install install_wheels
step cuda "$PYTHON" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
# the model shapes of `nemo-is bench`, from the one list of them (bench/shapes.py)
mapfile -t MODELS < <("$PYTHON" -c "from nemo_is_plugin.apps.bench.shapes import MODEL_SHAPES
for s in MODEL_SHAPES: print(s.name)")
for model in "${MODELS[@]}"; do
    step "bench_head_$model" "${TIMEOUT_BENCH:-0}" "$PYTHON" -m nemo_is_plugin.apps.cli.main bench --device cuda \
        --model "$model" --out "$OUT/head/$model"
done
step bench_head bench_head_report
step bench_head_results check_head_results
step bench_step "${TIMEOUT_STEP:-0}" env NEMO_IS_STRICT_BACKEND=1 "$PYTHON" -m nemo_is_plugin.apps.cli.main bench \
    --model-step --device cuda --out "$OUT/step"
step bench_step_results check_step_results
host_head_args=()
[ -n "${NEMO_RL_PATH:-}" ] && host_head_args+=(--nemo-rl-path "$NEMO_RL_PATH")
[ -n "${VERL_PATH:-}" ] && host_head_args+=(--verl-path "$VERL_PATH")
step bench_host_heads "${TIMEOUT_HOST_HEADS:-0}" "$PYTHON" -m nemo_is_plugin.apps.cli.main bench --host-heads --device cuda \
    ${host_head_args[@]+"${host_head_args[@]}"} --out "$OUT/host_heads"
step bench_host_heads_docs "$PYTHON" -m tools.bench_docs host-heads "$OUT/host_heads/host_heads.json"
step bench_host_heads_results check_host_heads_results
# shellcheck disable=SC2086 # PYTEST_ARGS is a list of words
step pytest_gpu "${TIMEOUT_TESTS:-0}" "$PYTHON" -m pytest -q -m gpu tests ${PYTEST_ARGS:-}
if [ "${SKIP_SWEEP:-0}" != 1 ]; then
    step sweep "${TIMEOUT_SWEEP:-0}" "$PYTHON" -m nemo_is_plugin.apps.bench.kernel_sweep --out "$OUT/sweep.json"
fi

if [ "${#failed[@]}" -ne 0 ]; then
    echo "gpu_check FAILED: ${failed[*]} (logs in $OUT)"
    exit 1
fi
echo "gpu_check passed (logs in $OUT)"
