"""On a fake process group of 4 ranks: PP 2 x CP 2 on a Llama (64-token sequences) compiled as
rank 3 (stage 1, cp rank 1); print what the stage receives from stage 0 (the schedule's buffers:
activations and token ids) and the bytes the plan prices per pipeline message. Default options:
the shapes are those of the graphs Inductor compiled."""
import json

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar import models
from autopar.runtime import _StageModule

dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
torch.manual_seed(0)
model = models.Llama(models.PRESETS["llama-tiny"])
ids = torch.randint(0, model.config.vocab_size, (4, 64))
pm = autopar.compile(model, 4, example_inputs=(ids,), example_target=ids,
                     plan={"pp": 2, "cp": 2, "dp": 1, "tp": 1, "mb": 1, "schedule": "1f1b"})
(sg, runner), = pm._stages.values()
stage = _StageModule(pm, sg, runner)
print(json.dumps({"received": [[list(shape), str(dtype).removeprefix("torch."), grad]
                               for shape, dtype, grad in stage.input_meta],
                  "priced": [c["bytes"] for c in pm.plan.collectives if c["group"] == "pp"],
                  "hidden": model.config.dim}))
