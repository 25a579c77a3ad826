"""autopar's additions to DTensor (``passes/dtensor_rules.py``), on 2 gloo processes."""

import pytest
import torch

from autopar import launch

# (shape, dim, split factor): heads folded into the hidden dim (T5, DeepSeek-V2) and windows
# folded into the batch (Swin) give split factors of 8 to 128; a split factor of 1 is a plain Shard.
CASES = [((4, 48, 3), 1, 4), ((64, 5), 0, 8), ((2, 3, 32), 2, 2), ((2, 16), 1, 1)]


def _gather(rank, world, port, cases):
    import os

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.fx.experimental.proxy_tensor import make_fx

    import autopar.passes.dtensor_rules  # noqa: F401  (installs the gather)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    out = []
    for shape, dim, sf in cases:
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
        p = _StridedShard(dim, split_factor=sf)
        shards, _ = p._split_tensor(full, world, with_padding=False, contiguous=True)
        dt = DTensor.from_local(shards[rank], mesh, [p], run_check=False, shape=full.shape, stride=full.stride())
        whole = dt.redistribute(mesh, [Replicate()]).to_local()
        g = make_fx(lambda t: DTensor.from_local(t, mesh, [p], run_check=False, shape=full.shape,
                                                 stride=full.stride()).redistribute(mesh, [Replicate()]).to_local())(
            shards[rank])
        out.append((torch.equal(whole, full), len(g.graph.nodes)))
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_strided_shard_gathers_whole_in_a_few_nodes():
    """A ``_StridedShard`` gathered to whole on 2 processes is the original tensor, and its trace
    is an all-gather and a reorder of views, 14 nodes (DTensor's own traced an index computation:
    45 nodes for a split factor of 4, more as it grows)."""
    res = launch.spawn(2, _gather, CASES, timeout=300)
    assert not res.failures, res.failures
    for rank, (per_rank,) in res.results.items():
        for (shape, dim, sf), (same, nodes) in zip(CASES, per_rank):
            assert same, (rank, shape, dim, sf)
            assert nodes <= 16, (rank, shape, dim, sf, nodes)
