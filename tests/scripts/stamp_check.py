"""For one model and several plans: the joint graph built with each run of identical layers
replayed once and the rest copied (``passes/stamp.py``) checked node for node against the replay
of every layer (``AUTOPAR_STAMP=check`` raises where they differ), on a fake process group of
``world`` ranks (no process group for 1), with default options (Inductor compiles the graphs;
nothing runs on the fake group). Prints, per plan, JSON: what the distribute pass noted (which
layers were copied) or the error.
Usage: stamp_check.py KIND WORLD PLAN_JSON..."""
import json
import os
import sys

os.environ["AUTOPAR_STAMP"] = "check"
os.environ["AUTOPAR_QUIET"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import autopar  # noqa: E402
from tests import zoo  # noqa: E402

kind, world = sys.argv[1], int(sys.argv[2])
if world > 1:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
base = kind.rsplit("-", 1)[0] if kind.endswith("layers") else kind
for plan in sys.argv[3:]:
    torch.manual_seed(0)
    model = zoo.build(kind)
    inputs, target = zoo.example(base, 0, B=8, S=16)
    try:
        pm = autopar.compile(model, world, example_inputs=inputs, example_target=target, plan=json.loads(plan),
                             loss_fn=zoo.loss_of(kind))
        print(json.dumps({"plan": plan, "copied": pm.info.notes.get("distribute", [])}), flush=True)
    except Exception as e:  # noqa: BLE001 - reported to the test
        print(json.dumps({"plan": plan, "error": f"{type(e).__name__}: {e}"[:3000]}), flush=True)
