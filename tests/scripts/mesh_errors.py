"""Bad meshes given to autopar.compile, on a fake process group of 8 ranks (one process).
Prints one JSON object: case -> "ErrorType: message" (or "no error")."""

import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from tests.dist_harness import batch, build

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
ids, _ = batch(1)
out = {}


def attempt(name, fn):
    model = build("llama-tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        fn(model)
        out[name] = "no error"
    except Exception as e:  # noqa: BLE001 - the test asserts the type
        out[name] = f"{type(e).__name__}: {e}"
    out[name + "/untouched"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())


attempt("mesh_of_4_in_world_of_8", lambda m: autopar.compile(m, init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)),
                                                              example_inputs=(ids,)))
attempt("unknown_dim_names", lambda m: autopar.compile(m, init_device_mesh("cpu", (2, 4), mesh_dim_names=("data", "model")),
                                                       example_inputs=(ids,)))
attempt("dp_beside_dp_shard", lambda m: autopar.compile(
    m, init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "dp_shard", "tp")), example_inputs=(ids,)))
attempt("pin_contradicts_mesh", lambda m: autopar.compile(
    m, init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")), example_inputs=(ids,), plan="tp=2"))
print(json.dumps(out))
