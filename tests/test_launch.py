"""autopar.runtime.init_distributed reads torchrun's and SLURM's environment."""

import os
import subprocess
import sys

import pytest

from autopar.launch import free_port

CHILD = """
import torch.distributed as dist
from autopar.runtime import init_distributed
init_distributed()
print(dist.get_rank(), dist.get_world_size(), dist.get_backend())
dist.destroy_process_group()
"""


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_init_from_environment(launcher):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "SLURM_", "MASTER_"))}
    port = str(free_port())
    if launcher == "torchrun":
        env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    else:
        env.update(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", SLURM_LAUNCH_NODE_IPADDR="127.0.0.1",
                   MASTER_PORT=port)
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["0", "1", "gloo"]


def _rank_one_raises():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("bad input on rank 1")
    dist.barrier()  # the others wait in a collective for the rank that failed
    return dist.get_rank()


def _each_rank():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def test_launch_returns_every_ranks_result_and_stops_on_a_failure():
    """``autopar.launch.run``, the launcher of the CLI, demo, benches and tests: every rank's result
    in rank order; a rank that raises stops the launch (its peers, blocked in a barrier, are
    stopped rather than left hanging) and its error, not a peer's lost connection, is raised."""
    import time

    from autopar import launch
    from autopar.errors import AutoparError

    assert launch.run(3, "gloo", _each_rank) == [(0, 3), (1, 3), (2, 3)]
    t0 = time.monotonic()
    with pytest.raises(AutoparError, match="rank 1: ValueError: bad input on rank 1"):
        launch.run(3, "gloo", _rank_one_raises)
    assert time.monotonic() - t0 < 90
