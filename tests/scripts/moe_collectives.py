"""On a fake process group of 2: HF Mixtral (tests/zoo) under TP 2 without SP, the executor's
graphs (default options: Inductor compiles the graphs counted); print the TP collectives of the
step by graph, kind and bytes as JSON. Usage: moe_collectives.py"""
import collections
import json

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from tests import zoo

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
model = zoo.build("hf-mixtral")
ids = torch.randint(0, 200, (2, 16))
pm = autopar.compile(model, 2, example_inputs=(ids,), plan="tp=2,sp=0,pp=1,dp=1,mb=2,ac=none")  # default options
got = collections.Counter(f"{r['graph']}:{r['kind']}:{r['bytes']}" for r in pm.info.collectives["step"]
                          if r["pass"] == "tp")
print(json.dumps({"got": dict(got), "hidden": model.config.hidden_size, "top_k": model.config.num_experts_per_tok}))
