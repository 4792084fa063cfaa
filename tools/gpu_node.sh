#!/usr/bin/env bash
# The GPU engine on a multi-GPU node, in one go (bench/RESULTS.md "GPU engine on the H200s"):
#   (a) the default config with plain `snakemake --cores 16` (default profile): every run, the report;
#   (b) dispatch: gpu_fp32's 20 runs again on one GPU (gpus.devices: [0]), then on every GPU, timed;
#   (c) the kernel-edit loop: an edit to the MoE kernel file (dry run: which jobs rerun), then a broken
#       edit (scales read for the wrong group) run for real (tools/gpu_broken_kernel.sh): the report shows
#       divergences, not a crash.
# Usage, from the repository root: OUT=dir [WHEELS=.whl] [BUDGET_S=560] bash tools/gpu_node.sh
# Works without GPUs too (GPU engines are then left out), which is how it is tested before a GPU call.
set -u -o pipefail
: "${OUT:?set OUT to a folder for the outputs}"
BUDGET_S=${BUDGET_S:-560}
T0=$(date +%s)
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/k2vec-triton-cache}
mkdir -p "$OUT" "$TRITON_CACHE_DIR"
source tools/device_env.sh   # Snakemake from $WHEELS where the device has none
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src
LOG=$OUT/run.log
say() { echo "== [$(( $(date +%s) - T0 )) s] $*" | tee -a "$LOG"; }
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
smk() {  # smk NAME ARGS...: one timed snakemake call, its output in $OUT/logs/NAME.log
    local name=$1; shift
    local t=$(date +%s.%N)
    python3 -m snakemake "$@" > "/tmp/k2vec-logs/$name.log" 2>&1
    local rc=$?
    say "$name: rc $rc, $(python3 -c "import time; print(f'{time.time() - $t:.1f}')") s wall: snakemake $*"
    return $rc
}
mkdir -p /tmp/k2vec-logs
nvidia-smi --query-gpu=index,name,uuid --format=csv,noheader 2>&1 | tee -a "$LOG"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$LOG"

# Smoke test: one int4 bundle, both precisions, straight through the engine; stop here if it fails.
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    smk smoke-bundle --cores 16 results/bundles/tiny-int4.kdtr
    for dtype in float32 bfloat16; do
        python3 -m k2vec.engines.gpu_triton --bundle results/bundles/tiny-int4.kdtr --mode ddtree --budget 16 \
            --dtype $dtype --output /tmp/smoke-$dtype.json 2>&1 | tail -20 | tee -a "$LOG"
        [ -s /tmp/smoke-$dtype.json ] || { say "smoke test failed ($dtype)"; exit 1; }
        python3 -c "import json; r = json.load(open('/tmp/smoke-$dtype.json')); print('$dtype', r['device'], r['gpu'], r['timing'])" | tee -a "$LOG"
    done
    say "smoke test ok"
fi

# (a) the default run
smk a-default --cores 16
grep -m1 "Provided resources" /tmp/k2vec-logs/a-default.log | tee -a "$LOG"
grep -m1 "k2vec: no run of GPU" /tmp/k2vec-logs/a-default.log | tee -a "$LOG"
cat results/report/summary.txt >> "$LOG" 2>/dev/null
python3 bench/dispatch.py results/runs --label "(a) default run, every GPU" 2>&1 | tee -a "$LOG"
tar czf "$OUT/default-run.tar.gz" results/report/divergence.csv results/report/summary.txt results/runs 2>/dev/null

# (b) the same 20 gpu_fp32 runs (Triton cache warm) on one GPU, then on every GPU: deleted, then asked for
# by name (a finished report does not bring back a deleted input by itself).
RUNS_B=$(echo results/runs/gpu_fp32/{tiny,small}-{fp32,int4}-{greedy,ddtree-b1,ddtree-b4,ddtree-b16,ddtree-b64}.json)
printf 'gpus:\n  devices: [0]\n' > /tmp/one-gpu.yaml
if [ "$(left)" -gt 200 ]; then
    rm -rf results/runs/gpu_fp32
    smk b-one-gpu --cores 16 --configfile /tmp/one-gpu.yaml -- $RUNS_B
    rm -rf /tmp/runs-1gpu && mkdir -p /tmp/runs-1gpu && cp -r results/runs/gpu_fp32 /tmp/runs-1gpu/
fi
if [ "$(left)" -gt 120 ]; then
    rm -rf results/runs/gpu_fp32
    smk b-all-gpus --cores 16 $RUNS_B
    rm -rf /tmp/runs-2gpu && mkdir -p /tmp/runs-2gpu && cp -r results/runs/gpu_fp32 /tmp/runs-2gpu/
    python3 bench/dispatch.py /tmp/runs-2gpu --engines gpu_fp32 --label "(b) gpu_fp32 on every GPU" \
        --compare /tmp/runs-1gpu --compare-label "(b) gpu_fp32 on GPU 0 alone" 2>&1 | tee -a "$LOG"
fi
tar czf "$OUT/dispatch-runs.tar.gz" -C /tmp runs-1gpu runs-2gpu 2>/dev/null

# (c) the kernel-edit loop on the finished run
MOE=src/k2vec/engines/gpu_triton/kernels/fused_moe.py
cp -p "$MOE" /tmp/fused_moe.py.orig
echo "# an edit" >> "$MOE"
smk c-edit-dry-run -n
awk '/^Job stats/ {f = 1} f {print} f && /^total/ {exit}' /tmp/k2vec-logs/c-edit-dry-run.log | tee -a "$LOG"
grep -o "output: results/runs/[a-z0-9_]*/" /tmp/k2vec-logs/c-edit-dry-run.log | sort | uniq -c | tee -a "$LOG"
cp -p /tmp/fused_moe.py.orig "$MOE"
# Broken: the MoE launches pass twice the group size (tools/gpu_broken_kernel.sh: gpu_fp32, int4, greedy).
if [ "$(left)" -gt 45 ]; then
    OUT=$OUT bash tools/gpu_broken_kernel.sh 2>&1 | tee -a "$LOG"
fi
cp -p /tmp/fused_moe.py.orig "$MOE"
tar czf "$OUT/snakemake-logs.tar.gz" -C /tmp k2vec-logs
say "done"
