#!/usr/bin/env bash
# The bfloat16 verdicts of issue 29 on a GPU node (bench/RESULTS.md "Noise-model verdicts on the H200"):
#   default: the default config with plain `snakemake --cores 16`; gpu_bf16 must have no real and no
#            over-budget row (the noise model judges it);
#   bugs:    gpu_bf16 with one porting bug at a time, each a one-line edit of gpu_triton/model.py made in a
#            copy of the tree (never in the shipped engine): routed-expert weights scaled 0.9x, and the
#            correction bias added into the mixing weights (greedy and score), and the DDTree tree attention
#            causal over node index instead of ancestor-only (gpu_triton/ddtree.py; greedy and DDTree: the
#            lossless check needs the greedy run). On the 4 default bundles, report.strict on: each must be
#            judged real / over-budget and fail the gate.
# Usage, from the repository root: OUT=dir [WHEELS=.whl] [PARTS="default bugs"] [BUGS="scale_0.9 ..."] bash bench/gpu_noise_verdicts.sh
# Works without GPUs too (gpu_bf16 is then left out and the bug runs have nothing to judge).
set -u -o pipefail
: "${OUT:?set OUT to a folder for the outputs}"
PARTS=${PARTS:-default bugs}
T0=$(date +%s)
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/k2vec-triton-cache}
mkdir -p "$OUT" "$TRITON_CACHE_DIR"
source tools/device_env.sh   # Snakemake from $WHEELS where the device has none
ROOT=$PWD
LOG=$OUT/run.log
say() { echo "== [$(( $(date +%s) - T0 )) s] $*" | tee -a "$LOG"; }
nvidia-smi --query-gpu=index,name,uuid --format=csv,noheader 2>&1 | tee -a "$LOG"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' 2>&1 | tee -a "$LOG"

run_smk() {  # run_smk NAME DIR ARGS...: snakemake in DIR (its own src/ first on the path), output in $OUT/NAME.log
    local name=$1 dir=$2; shift 2
    local t=$(date +%s)
    (cd "$dir" && PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$dir/src python3 -m snakemake "$@") > "$OUT/$name.log" 2>&1
    local rc=$?
    say "$name: rc $rc, $(( $(date +%s) - t )) s wall: snakemake $*"
    return $rc
}

keep_report() {  # keep_report NAME DIR: the report's summary and CSV, and the noise-model lines
    cp "$2/results/report/summary.txt" "$OUT/$1-summary.txt" 2>/dev/null
    cp "$2/results/report/divergence.csv" "$OUT/$1-divergence.csv" 2>/dev/null
    head -3 "$2/results/report/summary.txt" 2>/dev/null | tee -a "$LOG"
    grep "noise model gpu_bf16\|score gpu_bf16" "$2/results/report/summary.txt" 2>/dev/null | tee -a "$LOG"
}

for part in $PARTS; do
    case $part in
    default)
        run_smk default "$ROOT" --cores 16
        keep_report default "$ROOT"
        tar czf "$OUT/gpu_bf16-runs.tar.gz" -C "$ROOT" results/runs/gpu_bf16 2>/dev/null
        ;;
    bugs)
        for bug in ${BUGS:-scale_0.9 bias_in_weights tree_mask_causal}; do
            dir=/tmp/k2vec-bug-$bug
            rm -rf "$dir" && mkdir -p "$dir"
            # the tree and whatever results it has (upstream stages are then not redone)
            tar -C "$ROOT" --exclude=./.whl -cf - . | tar -C "$dir" -xf -
            model=$dir/src/k2vec/engines/gpu_triton/model.py
            modes="greedy score"
            case $bug in
            scale_0.9) sed -i 's/    return ids, weights \* d.routed_scaling_factor$/    return ids, weights * d.routed_scaling_factor * 0.9/' "$model"
                       edited=$(grep -c 'weights \* d.routed_scaling_factor \* 0.9$' "$model") ;;
            bias_in_weights) sed -i 's/    weights = scores.gather(1, ids)$/    weights = (scores + layer.router_bias).gather(1, ids)/' "$model"
                       edited=$(grep -c 'weights = (scores + layer.router_bias).gather(1, ids)$' "$model") ;;
            tree_mask_causal) model=$dir/src/k2vec/engines/gpu_triton/ddtree.py; modes="greedy ddtree"
                       sed -i 's/^    visible\[nodes, nodes\] = True$/    visible = torch.ones(n1, n1, dtype=torch.bool, device=parents.device).tril()/' "$model"
                       edited=$(grep -c 'visible = torch.ones(n1, n1, dtype=torch.bool, device=parents.device).tril()$' "$model") ;;
            esac
            [ "$edited" = 1 ] || { say "$bug: the edit did not apply to $model ($edited lines)"; exit 1; }
            say "$bug: $(cd "$dir" && git diff --stat -- src/k2vec/engines/gpu_triton/ | tail -1)"
            python3 - "$dir" $modes <<'EOF'
import sys, yaml
cfg = yaml.safe_load(open(f"{sys.argv[1]}/config.yaml"))
cfg["engines"] = {"gpu_bf16": {**cfg["engines"]["gpu_bf16"], "modes": sys.argv[2:]}}
cfg["report"]["strict"] = True
yaml.safe_dump(cfg, open(f"{sys.argv[1]}/bug.yaml", "w"), sort_keys=False)
EOF
            run_smk "bug-$bug" "$dir" --cores 16 --configfile bug.yaml --replace-workflow-config
            say "$bug: strict gate $( [ -e "$dir/results/report/strict.ok" ] && echo passed || echo failed)"
            keep_report "bug-$bug" "$dir"
        done
        ;;
    esac
done
say "done"
