"""On a fake process group of 4 ranks, GPT (vocabulary-split embedding and loss, learned
positions, TP 2 x FSDP 2 + SP) compiled as the rank given, or with ``ep`` as the second argument
Mixtral under ep 2 x HSDP 2x2 (two ep groups), with ``cp`` Llama under CP 4 (each rank its own
query rows, swapped with the mirror rank): print the key of the graphs the rank hands Inductor
(``backend._graph_key``, what decides who compiles) and how many ops read the rank at run time.
Default options; the graphs are recorded where Inductor would get them.
Usage: fake_pg_same_graphs.py RANK [ep|cp]"""
import json
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar import backend, models

keys, reads = [], []
compile_step = backend.compile_step


def record(graphs, inductor):
    keys.append(backend._graph_key(graphs))
    reads.append(sum(g.code.count("autopar.group_rank") for g in (graphs.fw, graphs.bw)))
    return compile_step(graphs, False)  # the eager step: this test is about the graphs, not Inductor


backend.compile_step = record
dist.init_process_group("fake", store=FakeStore(), rank=int(sys.argv[1]), world_size=4)
torch.manual_seed(0)
if sys.argv[2:] == ["ep"]:
    from tests import zoo

    model, plan = zoo.build("hf-mixtral"), {"ep": 2, "dp": 4, "dp_shard": 2, "fsdp": 1, "mb": 2}
    ids = torch.randint(0, 200, (8, 16))
elif sys.argv[2:] == ["cp"]:
    from tests import zoo

    model, plan = zoo.build("hf-llama"), {"cp": 4}
    ids = torch.randint(0, 200, (2, 64))
else:
    model, plan = models.GPT(models.PRESETS["gpt-tiny"]), {"tp": 2, "sp": 1, "dp": 2, "fsdp": 1, "pp": 1}
    ids = torch.randint(0, model.config.vocab_size, (8, 32))
autopar.compile(model, 4, example_inputs=(ids,), example_target=ids, plan=plan)
print(json.dumps({"key": keys[0], "reads": reads[0]}))
