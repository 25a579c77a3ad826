"""One rank of four passes a bad batch to step(); run by tests/test_faults.py as 4 processes.

Every rank compiles and runs one good step, then rank FAIL_RANK passes float ids. That rank must
raise autopar's error; the others, waiting for it in the step's collectives, must stop within
seconds with a message naming it (not hang until the gloo timeout)."""

import os
import sys
import time

import torch
import torch.distributed as dist

import autopar
from tests.dist_harness import batch, build

rank, fail = int(os.environ["RANK"]), int(os.environ["FAIL_RANK"])
torch.set_num_threads(1)
dist.init_process_group("gloo")
ids, tgt = batch(1)
pm = autopar.compile(build("llama-tiny"), dist.get_world_size(), example_inputs=(ids,),
                     plan={"dp": 4, "fsdp": 0, "pp": 1}, global_batch=ids.shape[0])
float(pm.step(ids, target=tgt))
print(f"GOOD_STEP {time.time()}", flush=True)
if os.environ.get("HOLD_RANK") == str(rank):
    time.sleep(3)  # outside every guarded call when the failure arrives: it raises and ends at once
try:
    for _ in range(2):
        float(pm.step(ids.float() if rank == fail else ids, target=tgt))
except autopar.AutoparError as e:
    print(f"RAISED {time.time()} {e}", file=sys.stderr, flush=True)
    sys.exit(3)
print("NOT STOPPED", flush=True)
