"""On a fake process group: plan an 8B-shaped Llama (2 layers) with TP 8 x FSDP, apply the plan
with the graph executor (default options: Inductor compiles the graphs counted), and print the
collectives counted from the forward and backward graphs beside the TP collectives the plan lists.
Usage: fake_pg_collectives.py SP WORLD [CP]"""
import collections
import dataclasses
import json
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar import models

cfg = dataclasses.replace(models.PRESETS["llama3-8b"], n_layers=2, max_seq_len=256)
sp, world = int(sys.argv[1]), int(sys.argv[2])
cp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
dp = world // 8 // cp
pins = f"tp=8,dp={dp},dp_shard={min(dp, 8)},pp=1,sp={sp},fsdp=1,mb=1,ac=none" + (f",cp={cp}" if cp > 1 else "")
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
with torch.device("meta"):
    model = models.Llama(cfg).to(torch.bfloat16)
model = model.to_empty(device="cpu")  # storage without initialisation: only shapes matter here
ids = torch.randint(0, cfg.vocab_size, (dp, 256))
pm = autopar.compile(model, world, example_inputs=(ids,), plan=pins, hardware="h100")  # default options
got, nbytes = collections.Counter(), collections.Counter()
for r in pm.info.collectives["step"]:
    got[f"{r['graph']}:{r['kind']}:{r['group_size']}:{r['pass']}"] += 1
    nbytes[f"{r['graph']}:{r['kind']}:{r['group_size']}:{r['pass']}"] += r["bytes"]
want = collections.Counter()
for c in pm.plan.collectives:
    want[f"{c['group']}:{c['kind']}:{int(c['bytes'])}"] += c["count"] // pm.plan.n_microbatches
print(json.dumps({"got": dict(got), "bytes": dict(nbytes), "plan": dict(want), "placements": pm.plan.placements[:12]}))
