"""FSDP gathered once per step (ZeRO-1, ``once=gather``) against FSDP per microbatch, autopar's
and FSDP2's, on the same model, in the same processes, in one run.

The model: HF Llama, hidden 512, FFN 2048, 8 heads, vocabulary 512, fp32, ``--layers`` layers;
2 gloo processes, a global batch of 8 x 128 tokens: 4 microbatches of one sequence per rank.
Sides:

- ``once``: autopar, ``dp=2,fsdp=1,mb=1,once=gather``: every layer's parameters gathered once
  before the 4 microbatches, their gradients accumulated whole and reduce-scattered once after.
- ``fsdp``: autopar, the same with ``once=microbatch`` (FSDP: gathered and reduced per
  microbatch, resharded after forward).
- ``fsdp2_once``: FSDP2 gathering once and reducing once, as its documentation has gradient
  accumulation do it: ``fully_shard(reshard_after_forward=False)`` per decoder block and on the
  root, ``set_requires_gradient_sync`` and ``set_reshard_after_backward`` off but on the last
  microbatch (eager).
- ``fsdp2``: FSDP2 per microbatch (``reshard_after_forward=True``, gradients reduced every
  microbatch), eager.

Per side and rank: the step time (median of alternating steps), the step's allocator peak above
what the process held before it (``memory.allocator_peaks``, gloo's staging copies left out) and
the first loss (the same model everywhere); for autopar's sides also the executed liveness peak
(``memory.step_peak``: with the whole parameters and gradients the step holds outside its graphs),
the cost model's prediction of the same (gathered parameters and activations) and the time from
``autopar.compile`` to the end of the first step.

``python -m bench.zero [--layers 4] [--steps 3]`` writes bench/results/zero.{json,md}.
Expected: ``once`` moves 1 / M of ``fsdp``'s parameter bytes and holds every layer's whole
parameters and gradients (more memory, as FSDP2's ``fsdp2_once`` does); no slower than
``fsdp2_once``, and no more memory.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist

from bench.common import add_ratios, run_depths, write
from bench.memory import measure_sides

HIDDEN, FFN, HEADS, VOCAB = 512, 2048, 8, 512
BATCH, SEQ, WORLD = 8, 128, 2
M = BATCH // WORLD  # microbatches of one sequence per rank
PLAN = {"dp": WORLD, "fsdp": 1, "tp": 1, "pp": 1, "mb": 1, "ac": "none", "reshard": 1}


def build(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
                      num_key_value_heads=HEADS, num_hidden_layers=layers, vocab_size=VOCAB,
                      max_position_embeddings=SEQ, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def fsdp2_sides(base: torch.nn.Module, ids, tgt) -> dict:
    """FSDP2 per microbatch and gathered once, each a step over this rank's M microbatches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from autopar.capture import default_loss, find_layers

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    rank = dist.get_rank()
    sides = {}
    for name, once in (("fsdp2_once", True), ("fsdp2", False)):
        model = copy.deepcopy(base)
        for n in find_layers(model):
            fully_shard(model.get_submodule(n), mesh=mesh, reshard_after_forward=not once)
        fully_shard(model, mesh=mesh, reshard_after_forward=not once)

        def step(model=model, once=once):
            total = 0.0
            for i in range(M):
                last = i == M - 1
                if once:
                    model.set_requires_gradient_sync(last)
                    model.set_reshard_after_backward(last)
                r = rank * M + i
                loss = default_loss(model(ids[r:r + 1]), tgt[r:r + 1]) / M
                loss.backward()
                total += float(loss.detach())
            return torch.tensor(total)

        sides[name] = (step, model)
    return sides


def _run(layers: int, steps: int) -> dict:
    import autopar
    from autopar import memory

    world = dist.get_world_size()
    base = build(layers)
    g = torch.Generator().manual_seed(0)
    ids, tgt = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
    out: dict = {"layers": layers}
    sides: dict = {}
    for form, once in (("once", "gather"), ("fsdp", "microbatch")):
        t0 = time.perf_counter()
        pm = autopar.compile(copy.deepcopy(base), world, example_inputs=(ids,), plan={**PLAN, "once": once},
                             global_batch=BATCH)
        pm.step(ids, target=tgt)
        out[f"{form}_first_step_s"] = time.perf_counter() - t0
        out[f"{form}_liveness_mib"] = memory.step_peak(pm, gradients=False).peak_bytes / 2**20
        parts = pm.plan.predicted["memory_breakdown_gb"]
        out[f"{form}_pred_step_mib"] = (parts.get("activations", 0.0) + parts.get("unsharded_params", 0.0)) * 1024
        out[f"{form}_plan"] = pm.plan.as_config_string()
        sides[form] = (lambda pm=pm: pm.step(ids, target=tgt), pm)
    sides.update(fsdp2_sides(base, ids, tgt))
    losses = measure_sides(sides, steps, out)
    ref = torch.tensor(losses["fsdp2"])
    dist.all_reduce(ref)
    for side in ("once", "fsdp", "fsdp2_once"):
        mine = torch.tensor(losses[side])
        if side.startswith("fsdp2"):
            dist.all_reduce(mine)
            mine /= world
        out[f"loss_{side}_vs_fsdp2"] = abs(float(mine) - float(ref) / world)
    return out


RATIOS = {"time_once_over_fsdp2_once": ("once_s", "fsdp2_once_s"),
          "alloc_once_over_fsdp2_once": ("once_alloc_mib", "fsdp2_once_alloc_mib"),
          "time_once_over_fsdp": ("once_s", "fsdp_s"), "alloc_once_over_fsdp": ("once_alloc_mib", "fsdp_alloc_mib"),
          "liveness_once_over_pred": ("once_liveness_mib", "once_pred_step_mib")}


def main(argv=None) -> int:
    rows = run_depths(argv, WORLD, _run, lambda row, _: add_ratios(row, RATIOS))
    summary = {"model": f"HF Llama hidden {HIDDEN}, FFN {FFN}, {HEADS} heads, vocab {VOCAB}, fp32",
               "batch": f"{BATCH} x {SEQ} tokens global: {M} microbatches of one sequence per rank, {WORLD} gloo processes",
               "sides": "autopar once=gather (ZeRO-1); autopar FSDP per microbatch; FSDP2 gathered once and reduced once "
                        "(reshard_after_forward=False, gradient sync and reshard after backward on the last microbatch "
                        "only); FSDP2 per microbatch; FSDP2 eager, fully_shard per block + root"}
    write("zero", rows, summary,
          ["layers", "once_s", "fsdp_s", "fsdp2_once_s", "fsdp2_s", "time_once_over_fsdp2_once", "time_once_over_fsdp",
           "once_alloc_mib", "fsdp_alloc_mib", "fsdp2_once_alloc_mib", "fsdp2_alloc_mib", "alloc_once_over_fsdp2_once",
           "alloc_once_over_fsdp", "once_liveness_mib", "once_pred_step_mib", "liveness_once_over_pred",
           "fsdp_liveness_mib", "fsdp_pred_step_mib", "once_first_step_s", "fsdp_first_step_s",
           "loss_once_vs_fsdp2", "loss_fsdp_vs_fsdp2", "loss_fsdp2_once_vs_fsdp2", "once_plan", "fsdp_plan"],
          "FSDP gathered once per step (ZeRO-1) against per microbatch, autopar and FSDP2")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
