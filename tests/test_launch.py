"""autopar.runtime.init_distributed reads torchrun's and SLURM's environment."""

import os
import subprocess
import sys

import pytest

from tests.dist_harness import free_port

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
