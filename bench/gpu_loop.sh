#!/usr/bin/env bash
# Issue 30 on a GPU node: from a gpu_triton kernel edit to a verdict (bench/RESULTS.md "Edit to verdict").
#   PARTS=full   the default config from an empty results/ (plain `snakemake --cores $CORES`), timed;
#   PARTS=share  config.yaml's own gpus.jobs_per_device and then each of $SHARES (an overlay config): a kernel
#                edit (bench/loop.py --edits gpu) each, the wall time beside the GPU runs' own decode time, and
#                the per-run GPU time (runs.txt);
#   both need the full run first (results/ of a finished default run in this checkout).
# Usage, from the repository root: OUT=dir [WHEELS=.whl] [PARTS="full share"] [SHARES="1 8"] bash bench/gpu_loop.sh
set -u -o pipefail
: "${OUT:?set OUT to a folder for the outputs}"
PARTS=${PARTS:-full share}
SHARES=${SHARES-1 8}
CORES=${CORES:-16}
T0=$(date +%s)
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
source tools/device_env.sh   # Snakemake from $WHEELS where the device has none
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src
LOG=$OUT/loop.log
say() { echo "== [$(( $(date +%s) - T0 )) s] $*" | tee -a "$LOG"; }
nvidia-smi --query-gpu=index,name,uuid --format=csv,noheader 2>&1 | tee -a "$LOG"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' 2>&1 | tee -a "$LOG"

gpu_runs() {  # what the GPU engines' last runs spent: per run wall (runner) and decode (engine), per job wall
    python3 - "$1" <<'PY' | tee -a "$LOG"
import csv, glob, json, sys
label = sys.argv[1]
runs = [json.load(open(p)) for p in sorted(glob.glob("results/runs/gpu_*/*.json"))]
ok = [r for r in runs if r["status"] == "ok"]
decode = sum(r["timing"]["decode_s"] for r in ok); load = sum(r["timing"]["load_s"] for r in ok)
wall = sum(r["wall_s"] for r in ok)
jobs = [float(next(csv.DictReader(open(p), delimiter="\t"))["s"]) for p in glob.glob("results/benchmarks/runs/gpu_*/*.tsv")]
print(f"{label}: {len(ok)}/{len(runs)} GPU runs ok; runner wall {wall:.1f} s ({wall / max(len(ok), 1):.2f} s/run), "
      f"engine decode {decode:.1f} s, load {load:.1f} s; outside decoding {100 * (1 - decode / wall) if wall else 0:.0f}%; "
      f"{len(jobs)} jobs, {sum(jobs):.1f} s of job wall (Snakemake benchmark)")
PY
}

if [[ " $PARTS " == *" full "* ]]; then
    t=$(date +%s)
    python3 -m snakemake --cores "$CORES" > "$OUT/full.log" 2>&1
    say "full default run: rc $?, $(( $(date +%s) - t )) s wall"
    cp results/report/summary.txt "$OUT/full-summary.txt" 2>/dev/null
    gpu_runs "full run"
fi

if [[ " $PARTS " == *" share "* ]]; then
    for share in default $SHARES; do
        overlay=()
        if [ "$share" != default ]; then
            printf 'gpus:\n  jobs_per_device: %s\n' "$share" > "$OUT/share$share.yaml"
            overlay=(--configfile "$OUT/share$share.yaml")
        fi
        python3 bench/loop.py . --cores "$CORES" "${overlay[@]}" --edits gpu --no-restore \
            > "$OUT/loop-share$share.md" 2>> "$LOG"
        say "kernel edit, jobs_per_device $share: $(tail -1 "$OUT/loop-share$share.md")"
        gpu_runs "jobs_per_device $share"
        cp results/report/summary.txt "$OUT/share$share-summary.txt" 2>/dev/null
    done
    python3 -m snakemake --cores "$CORES" > "$OUT/restore.log" 2>&1   # back to the shipped kernels' results
    say "restored: rc $?"
fi
