"""README's run command on a GPU node, simulated by a fake `nvidia-smi` on PATH: it asks for the GPU
engines' packages there and only there."""
import os
import subprocess

import pytest

from conftest import REPO, fake_nvidia_smi


@pytest.mark.parametrize("n_gpus, spec", [(2, "'.[gpu]'"), (0, "'.'")], ids=["gpu-node", "no-gpu"])
def test_make_run_installs_the_gpu_extra_on_a_gpu_node(tmp_path, n_gpus, spec):
    path = f"{fake_nvidia_smi(tmp_path / 'bin', n_gpus)}:{os.environ['PATH']}"
    # -n: print the recipe without running it (the install itself is pip's; the extra is pyproject's)
    out = subprocess.run(["make", "-n", "-C", str(REPO), "run"], capture_output=True, text=True,
                         env={**os.environ, "PATH": path}, check=True).stdout
    installs = [line for line in out.splitlines() if "pip install" in line and " -e " in line]
    assert installs == [f".venv/bin/pip install -q -e {spec}"], out
    assert ".venv/bin/snakemake" in out


def test_the_gpu_extra_holds_what_the_gpu_engines_require():
    import tomllib

    import yaml

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    packages = {req.split(">")[0].split("=")[0].strip() for req in extra}
    engines = yaml.safe_load((REPO / "config.yaml").read_text())["engines"]
    gpu_engines = {name: e for name, e in engines.items() if e.get("gpus")}
    assert gpu_engines and all(set(e["requires"]) == packages for e in gpu_engines.values()), gpu_engines
