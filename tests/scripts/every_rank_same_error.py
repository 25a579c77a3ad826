"""Every rank asks autopar.compile for a plan with an unknown pin: each must raise its own
AutoparError (caught here), none be stopped as if waiting for another rank. Prints CAUGHT or exits."""
import sys

import torch
import torch.distributed as dist

import autopar
from autopar.errors import AutoparError
from tests import zoo

dist.init_process_group("gloo")
torch.manual_seed(0)
try:
    autopar.compile(zoo.build("llama-tiny"), dist.get_world_size(), example_inputs=(torch.zeros(8, 32, dtype=torch.long),),
                    plan={"tensor": 2})
    print("NO ERROR", flush=True)
except AutoparError as e:
    print(f"CAUGHT rank {dist.get_rank()}: {e}", flush=True)
autopar.shutdown()
sys.exit(0)
