"""Runs kernel checks in a child interpreter with TRITON_INTERPRET=1 (the flag must be set before Triton
compiles anything and must not leak into other tests), returning their results as dicts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import triton  # noqa: F401  (the test extra requires it: a broken install fails, not skips)

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys
from dataclasses import asdict
from k2vec.engines.gpu_triton.kernels import verify
out = []
for fn, args, kwargs in json.loads(sys.stdin.read()):
    result = getattr(verify, fn)(*args, device="cpu", **kwargs)
    out.append({**asdict(result), "ok": result.ok})
print(json.dumps(out))
"""


def run_interpreted(calls: list[tuple[str, list, dict]]) -> list[dict]:
    """[(verify function, args, kwargs)] -> their CheckResults as dicts, computed on CPU by Triton's interpreter, in
    one child per CPU core (calls dealt out in turn; each check seeds itself from its name, so the split does not
    change a result)."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    workers = max(1, min(len(calls), len(os.sched_getaffinity(0))))
    shares = [calls[i::workers] for i in range(workers)]

    def child(share):
        proc = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(share), capture_output=True, text=True,
                              env=env, timeout=600)
        assert proc.returncode == 0, f"interpreted kernel checks failed:\n{proc.stderr[-4000:]}"
        return json.loads(proc.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(workers) as pool:
        outs = list(pool.map(child, shares))
    return [outs[i % workers][i // workers] for i in range(len(calls))]


def cuda_device():
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs a CUDA device (and TRITON_INTERPRET unset)")
    return torch.device("cuda")
