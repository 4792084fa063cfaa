# Sourced by the device scripts (tools/gpu_node.sh, tools/gpu_batch_equal.sh, bench/gpu_loop.sh,
# bench/gpu_noise_verdicts.sh), run from the repository root: where the device's Python has no Snakemake, install
# it from the wheels in $WHEELS (default .whl; ../shared/tools/device-wheels.sh downloads them) into /tmp/site,
# on PYTHONPATH.
WHEELS=${WHEELS:-.whl}
if ! python3 -c 'import snakemake' 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
