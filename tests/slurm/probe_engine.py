"""The numpy engine, declared as a GPU engine for the SLURM integration test, that also records in its
result where it ran: the devices it was given and its SLURM job, with start and end times.

    probe_engine.py --bundle B --mode M --budget N --output O

Its result is the numpy engine's plus a top-level "probe" object (the contract allows extra keys):
{cuda_visible_devices, slurm_job_id, slurm_step_gpus, slurm_job_gpus, host, start, end}.
"""
import json
import os
import socket
import sys
import time

from k2vec.engines import numpy_engine

PROBE_ENV = {"cuda_visible_devices": "CUDA_VISIBLE_DEVICES", "slurm_job_id": "SLURM_JOB_ID",
             "slurm_step_gpus": "SLURM_STEP_GPUS", "slurm_job_gpus": "SLURM_JOB_GPUS"}

HOLD_S = 2.0   # long enough for runs started together to overlap, which the test needs to see

start = time.time()
rc = numpy_engine.main(sys.argv[1:])
time.sleep(HOLD_S)
output = sys.argv[sys.argv.index("--output") + 1]
with open(output) as fh:
    result = json.load(fh)
result["probe"] = {**{key: os.environ.get(var) for key, var in PROBE_ENV.items()},
                   "host": socket.gethostname(), "start": start, "end": time.time()}
with open(output, "w") as fh:
    json.dump(result, fh)
sys.exit(rc)
