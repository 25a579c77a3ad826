"""For one model and several plans: each graph Inductor compiles decomposed node by node
(``backend.decomposed``) checked against a retrace of the whole graph through the same
decompositions (``AUTOPAR_DECOMPOSE=check`` raises where they differ), on a fake process group of
``world`` ranks (no process group for 1), default options. A plan's ``"mp"`` names the mixed
precision (passed as FSDP2's policy). Prints, per plan, JSON: ok or the error.
Usage: decompose_check.py KIND WORLD PLAN_JSON..."""
import json
import os
import sys

os.environ["AUTOPAR_DECOMPOSE"] = "check"
os.environ["AUTOPAR_QUIET"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import autopar  # noqa: E402
from tests import zoo  # noqa: E402
from tests.dist_harness import policy  # noqa: E402

kind, world = sys.argv[1], int(sys.argv[2])
if world > 1:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
base = kind.rsplit("-", 1)[0] if kind.endswith("layers") else kind
for plan in sys.argv[3:]:
    torch.manual_seed(0)
    model = zoo.build(kind)
    inputs, target = zoo.example(base, 0, B=8, S=16)
    p = json.loads(plan)
    mp = policy(p.pop("mp")) if "mp" in p else None
    try:
        autopar.compile(model, world, example_inputs=inputs, example_target=target, plan=p,
                        loss_fn=zoo.loss_of(kind), mp_policy=mp)
        print(json.dumps({"plan": plan, "ok": True}), flush=True)
    except Exception as e:  # noqa: BLE001 - reported to the test
        print(json.dumps({"plan": plan, "error": f"{type(e).__name__}: {e}"[:3000]}), flush=True)
