#!/usr/bin/env bash
# On a GPU node: are the GPU engines' batch results (one process per bundle, config.yaml) the same as one process
# per run? The default run, then gpu_fp32 and gpu_bf16 once more as single-run engines (overlay engines
# <name>_single, greedy, ddtree-b4 and score on every bundle), compared but for the command and the clock.
# Usage, from the repository root: OUT=dir [WHEELS=.whl] [CORES=16] bash tools/gpu_batch_equal.sh
set -u -o pipefail
: "${OUT:?set OUT to a folder for the outputs}"
CORES=${CORES:-16}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
source tools/device_env.sh   # Snakemake from $WHEELS where the device has none
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src
t=$(date +%s); python3 -m snakemake --cores "$CORES" > "$OUT/full.log" 2>&1; echo "default run: rc $?, $(( $(date +%s) - t )) s"
python3 - "$OUT/single.yaml" <<'PY'
import sys, yaml
config = yaml.safe_load(open("config.yaml"))
engines = {}
for name in ("gpu_fp32", "gpu_bf16"):
    e = dict(config["engines"][name])
    e["command"] = e["command"].replace("--batch {batch}", "--mode {mode} --budget {budget} --output {output}")
    engines[name + "_single"] = {**e, "ddtree_budgets": [4]}
yaml.safe_dump({"engines": engines}, open(sys.argv[1], "w"))
PY
targets=$(for e in gpu_fp32 gpu_bf16; do for m in tiny small; do for p in fp32 int4; do for mode in greedy ddtree-b4 score; do
    echo "results/runs/${e}_single/$m-$p-$mode.json"; done; done; done; done)
t=$(date +%s); python3 -m snakemake --cores "$CORES" $targets --configfile "$OUT/single.yaml" > "$OUT/single.log" 2>&1
echo "single runs: rc $?, $(( $(date +%s) - t )) s"
python3 - <<'PY' | tee "$OUT/compare.txt"
import glob, json, os
clock = {"engine", "command", "started_at", "ended_at", "wall_s", "timing", "scratch_kept"}
same = differ = 0
for single in sorted(glob.glob("results/runs/gpu_*_single/*.json")):
    engine = single.split("/")[2].removesuffix("_single")
    batch = f"results/runs/{engine}/{os.path.basename(single)}"
    a, b = (json.load(open(p)) for p in (batch, single))
    keys = {k for k in a.keys() | b.keys() if k not in clock and a.get(k) != b.get(k)}
    if keys:
        differ += 1
        print("DIFFER", batch, sorted(keys))
    else:
        same += 1
print(f"{same} equal, {differ} differ (of {same + differ})")
PY
