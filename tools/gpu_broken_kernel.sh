#!/usr/bin/env bash
# A deliberately broken MoE kernel, run through the pipeline on a GPU node: the report must show real
# divergences of gpu_fp32 (exact with the intact kernel), and the pipeline must not crash.
# The edit is made on this copy of the tree only: the MoE launches pass twice the group size, so each
# weight column is scaled by another group's scale. gpu_fp32 alone, int4 bundles, greedy (2 runs).
# Usage, from the repository root: OUT=dir [WHEELS=.whl] bash tools/gpu_broken_kernel.sh
set -u -o pipefail
: "${OUT:?set OUT to a folder for the outputs}"
WHEELS=${WHEELS:-.whl}
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/k2vec-triton-cache}
mkdir -p "$OUT"
if ! python3 -c 'import snakemake' 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src
MOE=src/k2vec/engines/gpu_triton/kernels/fused_moe.py
sed -i 's/G=group_size,$/G=2 * group_size,/' "$MOE"
echo "broken edit: $(grep -c 'G=2 \* group_size,' "$MOE") line(s) of $MOE" | tee "$OUT/broken.log"
python3 - <<'EOF'
import yaml
cfg = yaml.safe_load(open("config.yaml"))
cfg["engines"] = {"gpu_fp32": {**cfg["engines"]["gpu_fp32"], "precisions": ["int4"], "modes": ["greedy"]}}
yaml.safe_dump(cfg, open("/tmp/broken.yaml", "w"), sort_keys=False)
EOF
start=$(date +%s)
python3 -m snakemake --cores 16 --configfile /tmp/broken.yaml --replace-workflow-config \
    results/report/divergence.html > /tmp/broken-snakemake.log 2>&1
echo "snakemake rc $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/broken.log"
cat results/report/summary.txt >> "$OUT/broken.log"
python3 -c "import json; [print(p, json.load(open(p))['status']) for p in ('results/runs/gpu_fp32/tiny-int4-greedy.json', 'results/runs/gpu_fp32/small-int4-greedy.json')]" >> "$OUT/broken.log"
cp results/report/divergence.csv "$OUT/broken-divergence.csv"
cp /tmp/broken-snakemake.log "$OUT/"
cat "$OUT/broken.log"
