"""What ``coords.recording`` notes on a fake process group of 4 ranks (this process is rank 0 of a
(dp 2, tp 2) mesh): prints one JSON line per probe, {"probe": ..., "ranks": [...]} (the ranks the
graphs would be valid on), for tests/test_capture.py."""

import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.passes import coords

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
tp = mesh["tp"]


def run_time_rank_traced():
    """The tp coordinate as the graph reads it at run time, traced on fake tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(lambda x: coords.run_time_rank(x, mesh, 1) + x, tracing_mode="fake")(torch.zeros(1))


def nested_shard_redistributed(rows: int):
    """A (rows, 4) value split on dim 0 over dp, then over tp, made whole on dp, traced on fake
    tensors: DTensor's planner works out the shape left on each dim from the rank's coordinates."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(local):
        x = DTensor.from_local(local, mesh, [Shard(0), Shard(0)], run_check=False, shape=torch.Size((rows, 4)),
                               stride=(4, 1))
        return x.redistribute(mesh, [Replicate(), Shard(0)]).to_local()

    with coords.rank_free():
        make_fx(step, tracing_mode="fake")(torch.zeros(-(-rows // 4), 4))


probes = {
    "membership test": lambda: mesh.get_coordinate() is None,
    "tp coordinate by index": lambda: mesh.get_coordinate()[1],
    "every coordinate": lambda: list(mesh.get_coordinate()),
    "dp local rank": lambda: mesh.get_local_rank("dp"),
    "tp submesh members": lambda: tp.mesh.tolist(),
    "whole mesh members": lambda: mesh.mesh.tolist(),
    "global rank": lambda: dist.get_rank(),
    "even shard shape": lambda: compute_local_shape_and_global_offset((8, 4), tp, [Shard(0)], skip_offset=True),
    "uneven shard shape": lambda: compute_local_shape_and_global_offset((7, 4), tp, [Shard(0)], skip_offset=True),
    "shard offset": lambda: compute_local_shape_and_global_offset((8, 4), tp, [Shard(0)]),
    "run-time rank": lambda: run_time_rank_traced(),
    "even nested shard redistributed": lambda: nested_shard_redistributed(8),
    "uneven nested shard redistributed": lambda: nested_shard_redistributed(7),
}
for name, probe in probes.items():
    with coords.recording() as reads:
        probe()
    print(json.dumps({"probe": name, "ranks": sorted(reads.ranks())}))
# DTensor's inline read for the chunk that the run-time rank then chooses is not written into the graph
with coords.recording() as reads:
    c = mesh._sym_get_coordinate(1)
    reads.discharge(mesh, 1, c)
print(json.dumps({"probe": "discharged", "ranks": sorted(reads.ranks())}))
