#!/usr/bin/env bash
# Pack, for the lent GPU machine (Python 3.12, x86-64, no network, torch 2.11 with Triton 3.6), the Triton that
# torch 2.13 pins (what `pip install '.[gpu]'` brings today, and what [test] pins) and Snakemake with its
# dependencies, into .devpkgs/ (git-ignored), small enough to travel with a call (64 MiB with the tree):
#   triton.tar.xz  the wheel less its AMD code generator and headers (its entry point stays, Triton imports it),
#                  Blackwell ptxas, CUPTI, the instrumentation and plugin libraries, and libtriton.so's debug
#                  information (~49 MB);
#   site.tar.xz    Snakemake 9.27.1, jsonschema and their dependencies installed for Python 3.12, pulp's CBC
#                  solver for x86-64 Linux only (~11 MB).
#   here:   tools/device_packages.sh               (repository root; needs pip, unzip, strip and xz; minutes)
#   there:  carry [".devpkgs"]; tools/device_env.sh unpacks both to /tmp/devpkgs and puts them first on PYTHONPATH
set -euo pipefail
TRITON=${TRITON:-$(python3 -c 'import tomllib
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]
print(next(d.split("==")[1] for d in extra if d.startswith("triton==")))')}    # [test]'s pin
dest=$PWD/.devpkgs
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$dest"
grep -qx '/.devpkgs/' .git/info/exclude 2>/dev/null || echo '/.devpkgs/' >> .git/info/exclude
platform=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform manylinux_2_24_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)

python3 -m pip download -q --no-deps "${platform[@]}" -d "$work/wheel" "triton==$TRITON"
mkdir "$work/triton" && (cd "$work/triton" && unzip -q "$work"/wheel/triton-*.whl)
t=$work/triton/triton
rm -rf "$t/backends/amd/include" "$t/backends/amd/lib" "$t/backends/nvidia/lib/cupti"* \
       "$t/backends/nvidia/bin/ptxas-blackwell" "$t/instrumentation" "$t/_C/libproton.so" "$t/plugins" "$t/FileCheck"
strip --strip-unneeded "$t/_C/libtriton.so"
(cd "$work/triton" && tar -cf - .) | xz -9e -T0 > "$dest/triton.tar.xz.part" && mv "$dest/triton.tar.xz.part" \
    "$dest/triton.tar.xz"

python3 -m pip wheel -q --no-deps "connection_pool>=0.0.3" -w "$work/wheels"
python3 -m pip download -q "${platform[@]}" --platform any --find-links "$work/wheels" -d "$work/wheels" \
    "snakemake==9.27.1" jsonschema
python3 -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "${platform[@]}" --platform any \
    "$work"/wheels/*.whl
rm -rf "$work"/site/pulp/solverdir/cbc/{win,osx,linux/arm64,linux/i32}
(cd "$work/site" && tar -cf - .) | xz -9 -T0 > "$dest/site.tar.xz.part" && mv "$dest/site.tar.xz.part" "$dest/site.tar.xz"
du -b "$dest"/*.tar.xz
