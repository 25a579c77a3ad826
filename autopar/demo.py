"""``make demo``: plan real model shapes on paper, then plan and train a real model on 4 processes.

1. Plans Llama 3 8B on 64 H100s and Llama 3.1 405B on 16,384 H100s (fake tensors: no weights are
   allocated) and prints the explanation of the first.
2. Launches 4 CPU processes over gloo, lets ``autopar.compile`` plan and apply a layout for a small
   Llama, trains it for a few AdamW steps, and checks the first step's loss against one process.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import autopar
from autopar import api, explain, launch, models
from autopar.capture import default_loss

WORLD, STEPS, BATCH, SEQ = 4, 5, 8, 64


def _data(step: int):
    g = torch.Generator().manual_seed(step)
    vocab = models.PRESETS["llama-small"].vocab_size
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g), torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def _build():
    torch.manual_seed(0)
    return models.build_preset("llama-small")


def _train() -> None:
    """One rank's training run (``launch.run`` made the process group)."""
    rank = dist.get_rank()
    model = _build()
    ids, tgt = _data(0)
    t0 = time.perf_counter()
    pm = autopar.compile(model, WORLD, example_inputs=(ids,))  # default options: Inductor on
    if rank == 0:
        print(f"[rank 0] autopar chose: {pm.plan.as_config_string()} ({time.perf_counter() - t0:.1f}s to plan, "
              "trace, rewrite and compile the step)")
        print(pm.explain(graph=True).split("pass times")[0][-1500:])
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    for step in range(STEPS):  # one fixed batch: the loss must fall as the model fits it
        opt.zero_grad()
        loss = pm.step(ids, target=tgt)
        norm = pm.clip_grad_norm_(1.0)
        opt.step()
        value = loss.item()  # every rank reads its loss: the all-reduce behind it completes
        if rank == 0:
            print(f"[rank 0] step {step}: loss {value:.5f}  grad norm {norm.item():.4f}")


def main() -> int:
    print("== planning on paper (fake tensors, no weights allocated)")
    for name, gpus in (("llama3-8b", 64), ("llama3-405b", 16384)):
        t0 = time.perf_counter()
        p = api.plan(name, gpus)
        print(f"{name} on {gpus} H100: {p.as_config_string()}  "
              f"({p.predicted['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU {p.predicted['mfu'] * 100:.1f}%, "
              f"planned in {time.perf_counter() - t0:.2f}s)")
        if name == "llama3-8b":
            print(explain.render(p, top=2))
    print(f"== training llama-small on {WORLD} CPU processes (gloo) with autopar.compile")
    ref = _build()
    ids, tgt = _data(0)
    ref_loss = default_loss(ref(ids), tgt).item()
    print(f"one-process reference, step 0 loss: {ref_loss:.5f}")
    launch.run(WORLD, "gloo", _train)
    return 0


if __name__ == "__main__":
    sys.exit(main())
