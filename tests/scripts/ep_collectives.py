"""On a fake process group of 4: a tests/zoo model (HF Mixtral unless argv[2] names another) under expert parallelism, the executor's
graphs (default options: Inductor compiles the graphs counted); print as JSON the step's
collectives by graph, kind, pass, bytes (None: sized by the routed rows) and dtype, and the plan's
priced collectives per step by group, kind and bytes, and layer 0's parameter bytes (fp32; in 3-D parameters). Usage: ep_collectives.py PINS [MODEL]"""
import collections
import json
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from tests import zoo

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
model = zoo.build(sys.argv[2] if len(sys.argv) > 2 else "hf-mixtral")
ids = torch.randint(0, 200, (8, 16))
pm = autopar.compile(model, 4, example_inputs=(ids,), plan=sys.argv[1])
got = collections.Counter(f"{r['graph']}:{r['kind']}:{r['pass']}:{r['bytes']}:{r['dtype']}" for r in pm.info.collectives["step"])
plan = collections.Counter()
for c in pm.plan.collectives:
    plan[f"{c['group']}:{c['kind']}:{int(c['bytes'])}"] += c["count"] // pm.plan.n_microbatches
layer0 = [p for n, p in zoo.build(sys.argv[2] if len(sys.argv) > 2 else "hf-mixtral").named_parameters() if ".layers.0." in n]
print(json.dumps({"got": dict(got), "plan": dict(plan), "layers": model.config.num_hidden_layers,
                  "layer_bytes": sum(p.numel() * 4 for p in layer0), "bytes_3d": sum(p.numel() * 4 for p in layer0 if p.dim() == 3),
                  "experts": model.config.num_local_experts, "hidden": model.config.hidden_size,
                  "top_k": model.config.num_experts_per_tok}))
