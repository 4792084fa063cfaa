# Sourced by the device scripts (tools/gpu_node.sh, tools/gpu_batch_equal.sh, bench/gpu_loop.sh,
# bench/gpu_noise_verdicts.sh), run from the repository root. Where .devpkgs/ travelled (tools/device_packages.sh:
# the Triton torch 2.13 pins, and Snakemake), unpack it to /tmp/devpkgs and put it first on PYTHONPATH, ahead of the
# device's own Triton 3.6. Else, where the device's Python has no Snakemake, install it from the wheels in $WHEELS
# (default .whl; ../shared/tools/device-wheels.sh downloads them) into /tmp/site, on PYTHONPATH.
WHEELS=${WHEELS:-.whl}
if [ -f .devpkgs/triton.tar.xz ]; then
    if [ ! -d /tmp/devpkgs/site ]; then
        mkdir -p /tmp/devpkgs.part/triton /tmp/devpkgs.part/site
        tar -xJf .devpkgs/triton.tar.xz -C /tmp/devpkgs.part/triton \
            && tar -xJf .devpkgs/site.tar.xz -C /tmp/devpkgs.part/site && mv /tmp/devpkgs.part /tmp/devpkgs || exit 1
    fi
    export PYTHONPATH=/tmp/devpkgs/triton:/tmp/devpkgs/site${PYTHONPATH:+:$PYTHONPATH}
elif ! python3 -c 'import snakemake' 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
