"""On a fake process group of 2: a tests/zoo model (HF Mixtral unless argv[2] names another)
under TP 2, with SP when argv[1] is 1, the executor's graphs (default options: Inductor compiles
the graphs counted); print as JSON the step's TP collectives by graph, kind and bytes, and the
plan's priced TP collectives per step by kind and bytes. Usage: tp_collectives.py SP [MODEL]"""
import collections
import json
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from tests import zoo

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
model = zoo.build(sys.argv[2] if len(sys.argv) > 2 else "hf-mixtral")
ids = torch.randint(0, 200, (2, 16))
pm = autopar.compile(model, 2, example_inputs=(ids,), plan=f"tp=2,sp={sys.argv[1]},pp=1,dp=1,mb=2,ac=none")
got = collections.Counter(f"{r['graph']}:{r['kind']}:{r['bytes']}" for r in pm.info.collectives["step"]
                          if r["pass"] == "tp")
plan = collections.Counter()
for c in pm.plan.collectives:
    if c["group"] == "tp":
        plan[f"{c['kind']}:{int(c['bytes'])}"] += c["count"] // pm.plan.n_microbatches
print(json.dumps({"got": dict(got), "plan": dict(plan), "hidden": model.config.hidden_size,
                  "top_k": getattr(model.config, "num_experts_per_tok", None),
                  "latent": getattr(model.config, "kv_lora_rank", None)}))
