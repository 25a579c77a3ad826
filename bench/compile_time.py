"""Compile time: how long ``autopar.compile`` takes before training starts, by stage, on CPU
processes over gloo. ``setup_s`` is ``autopar.compile`` itself (fake-tensor trace, analysis,
search, passes); ``first_step_s`` is the first step, which includes Dynamo and Inductor compiling
the model (a fresh Inductor cache per run, so nothing is reused); ``step_s`` is a later step.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

from bench.common import write

MODEL, BATCH, SEQ = "llama-small", 8, 256
CASES = [(1, "auto"), (2, "dp=2,fsdp=1,pp=1,ac=none"), (2, "tp=2,sp=1,pp=1,ac=none"), (2, "pp=2,schedule=1f1b,mb=2,ac=none")]


def _rank(world: int, pin: str) -> dict:
    import torch.distributed as dist

    import autopar
    from autopar import models

    ids = torch.randint(0, 1024, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    tgt = torch.roll(ids, -1, dims=1)
    t0 = time.perf_counter()
    pm = autopar.compile(models.build_preset(MODEL), world, example_inputs=(ids,), hardware="cpu-gloo",
                         plan="auto" if pin == "auto" else pin, global_batch=BATCH)
    t1 = time.perf_counter()
    pm.step(ids, target=tgt)
    t2 = time.perf_counter()
    pm.step(ids, target=tgt)
    t3 = time.perf_counter()
    times = torch.tensor([t1 - t0, t2 - t1, t3 - t2])
    if dist.is_initialized():
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {"plan": pm.plan.as_config_string(), "setup_s": float(times[0]), "first_step_s": float(times[1]),
            "step_s": float(times[2])}


def main(argv=None) -> int:
    from autopar import launch

    rows = []
    for world, pin in CASES:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-inductor-")
        if world == 1:
            torch.set_num_threads(1)
            r = _rank(world, pin)
        else:
            r = launch.run(world, "gloo", _rank, world, pin)[0]
        r.update(world=world, pin=pin)
        rows.append(r)
        print(f"world {world} {pin:34s} setup {r['setup_s']:.2f}s  first step (Inductor) {r['first_step_s']:.2f}s  "
              f"step {r['step_s']:.2f}s  plan {r['plan']}")
    write("compile_time", rows, {"model": f"{MODEL}, batch {BATCH} x {SEQ}, fp32, Inductor"},
          ["world", "pin", "plan", "setup_s", "first_step_s", "step_s"], "Compile time by stage (CPU, gloo)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
