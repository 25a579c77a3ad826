"""A mixture-of-experts training step: autopar's routed form (each expert on its own tokens, one
grouped matmul per expert linear) against the dense form it replaced (every expert on every
token, weighted 0 where not routed), the routed form under expert parallelism (``ep`` = the FSDP
degree: each rank runs half the experts on the rows both ranks route to them, and receives only
its own experts' weights), and FSDP2 on the model's own routed loop (what a user would otherwise
run), on the same model, in the same processes, in one run.

The model: HF Mixtral, hidden 256, 8 experts of FFN 512, top 2, 8 heads, vocabulary 512, fp32,
``--layers`` layers; 2 gloo processes under FSDP 2 (reshard after forward, one microbatch a rank,
as FSDP2 runs it; its ``fully_shard`` per decoder block and on the root, eager). Per side and rank:
the step time (median of alternating steps), the step's allocator peak above what the process
held before it (``memory.allocator_peaks``, gloo's staging copies left out), and the first loss
(the same model on every side). For autopar's forms also: the executed graphs' liveness peak
(``memory.step_peak``; under EP the routed sizes at their even share), the cost model's prediction
of the same (activations and gathered parameters, ``plan.predicted``), and the expert matmul FLOPs
per token of the traced step.

``python -m bench.moe [--layers 4] [--steps 3]`` writes bench/results/moe.{json,md}.
Targets (issue 24): the routed form spends the experts' active FLOPs (top_k / E of the dense
form's), and its step is faster and leaner than the dense form's; under EP the step is no slower
than without it.
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from unittest import mock

import torch
import torch.distributed as dist

from autopar import traceable
from bench.common import add_ratios, run_depths, write
from bench.memory import fsdp2_model, measure_sides

HIDDEN, FFN, EXPERTS, TOP_K, HEADS, VOCAB = 256, 512, 8, 2, 8, 512
BATCH, SEQ, WORLD = 4, 256, 2
PLAN = {"dp": WORLD, "fsdp": 1, "reshard": 1, "tp": 1, "pp": 1, "ac": "none", "mb": BATCH // WORLD}


def build(layers: int) -> torch.nn.Module:
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
                           num_attention_heads=HEADS, num_key_value_heads=HEADS, num_local_experts=EXPERTS,
                           num_experts_per_tok=TOP_K, max_position_embeddings=SEQ, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.MixtralForCausalLM(cfg)


def dense_form():
    """The dense form autopar traced before the routed one: every expert on every token."""
    return mock.patch.object(traceable.RoutedExperts, "linears", property(lambda self: None))


def expert_flops_per_token(layers: int) -> float:
    """Forward matmul FLOPs per token of the traced step's ops that read an expert's weight."""
    from autopar import capture
    from autopar.fxops import node_flops

    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    sg = capture.trace_step(build(layers), (ids,), target=ids)
    phs = sg.placeholders()
    experts = {phs[i] for i, name in enumerate(sg.param_names) if ".experts." in name}

    def weight(a: torch.fx.Node) -> bool:  # an expert's weight, through its transpose
        while a.op == "call_function" and a.target in (torch.ops.aten.t.default, torch.ops.aten.transpose.int):
            a = a.args[0]
        return a in experts

    total = sum(node_flops(n) for n in sg.gm.graph.nodes
                if n.op == "call_function" and any(weight(a) for a in n.all_input_nodes))
    return total / (BATCH * SEQ)


def _run(layers: int, steps: int) -> dict:
    import autopar
    from autopar import memory
    from autopar.capture import default_loss

    world, rank = dist.get_world_size(), dist.get_rank()
    base = build(layers)
    g = torch.Generator().manual_seed(0)
    ids, tgt = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
    out: dict = {"layers": layers}
    sides: dict = {}
    for form, ctx, plan in (("routed", nullcontext, PLAN), ("dense", dense_form, PLAN),
                            ("ep", nullcontext, {**PLAN, "ep": world})):
        t0 = time.perf_counter()
        with ctx():
            pm = autopar.compile(copy.deepcopy(base), world, example_inputs=(ids,), plan=plan, global_batch=BATCH)
        out[f"{form}_setup_s"] = time.perf_counter() - t0
        out[f"{form}_liveness_mib"] = memory.step_peak(pm).peak_bytes / 2**20
        pred = pm.plan.predicted
        # What the step holds above the parameters, gradients and optimizer state: activations and
        # the gathered parameters (the allocator's step peak measures the same).
        parts = pred["memory_breakdown_gb"]
        out[f"{form}_pred_step_mib"] = (parts.get("activations", 0.0) + parts.get("unsharded_params", 0.0)) * 1024
        sides[form] = (lambda pm=pm: pm.step(ids, target=tgt), pm)
    ref = fsdp2_model(copy.deepcopy(base), world, 1)
    sl = slice(rank * (BATCH // world), (rank + 1) * (BATCH // world))

    def fsdp2_step():
        loss = default_loss(ref(ids[sl]), tgt[sl])
        loss.backward()
        return loss

    sides["fsdp2"] = (fsdp2_step, ref)
    losses = measure_sides(sides, steps, out)
    ref_loss = torch.tensor(losses["fsdp2"])
    dist.all_reduce(ref_loss)
    out["loss_routed_vs_fsdp2"] = abs(losses["routed"] - float(ref_loss) / world)
    out["loss_dense_vs_fsdp2"] = abs(losses["dense"] - float(ref_loss) / world)
    out["loss_ep_vs_fsdp2"] = abs(losses["ep"] - float(ref_loss) / world)
    return out


def _ratios(row: dict, layers: int) -> None:
    row["routed_expert_gflop_per_token"] = expert_flops_per_token(layers) / 1e9
    with dense_form():
        row["dense_expert_gflop_per_token"] = expert_flops_per_token(layers) / 1e9
    add_ratios(row, {
        "time_routed_over_dense": ("routed_s", "dense_s"), "time_ep_over_routed": ("ep_s", "routed_s"),
        "time_ep_over_dense": ("ep_s", "dense_s"), "alloc_ep_over_routed": ("ep_alloc_mib", "routed_alloc_mib"),
        "time_routed_over_fsdp2": ("routed_s", "fsdp2_s"), "alloc_routed_over_dense": ("routed_alloc_mib", "dense_alloc_mib"),
        "alloc_routed_over_fsdp2": ("routed_alloc_mib", "fsdp2_alloc_mib"),
        "flops_routed_over_dense": ("routed_expert_gflop_per_token", "dense_expert_gflop_per_token")})


def main(argv=None) -> int:
    rows = run_depths(argv, WORLD, _run, _ratios)
    summary = {"model": f"HF Mixtral hidden {HIDDEN}, {EXPERTS} experts of FFN {FFN}, top {TOP_K}, {HEADS} heads, "
                        f"vocab {VOCAB}, fp32",
               "batch": f"{BATCH} x {SEQ} tokens global, one microbatch per rank",
               "plan": f"FSDP {WORLD} (reshard after forward), no AC, compiled (Inductor)",
               "sides": "autopar routed form; autopar dense form (every expert on every token); autopar routed form "
                        f"under EP {WORLD} (experts split over the FSDP ranks); FSDP2 fully_shard per block + root, eager, "
                        "the model's own routed loop",
               "expected expert FLOPs ratio": f"top_k / E = {TOP_K / EXPERTS}"}
    write("moe", rows, summary,
          ["layers", "routed_expert_gflop_per_token", "dense_expert_gflop_per_token", "flops_routed_over_dense",
           "routed_s", "dense_s", "ep_s", "fsdp2_s", "time_routed_over_dense", "time_ep_over_routed",
           "time_ep_over_dense", "time_routed_over_fsdp2", "routed_alloc_mib", "dense_alloc_mib", "ep_alloc_mib",
           "fsdp2_alloc_mib", "alloc_routed_over_dense", "alloc_ep_over_routed", "alloc_routed_over_fsdp2",
           "routed_liveness_mib", "dense_liveness_mib", "ep_liveness_mib", "routed_pred_step_mib",
           "dense_pred_step_mib", "ep_pred_step_mib", "routed_setup_s", "dense_setup_s", "ep_setup_s",
           "loss_routed_vs_fsdp2", "loss_dense_vs_fsdp2", "loss_ep_vs_fsdp2"],
          "Mixture of experts: the routed form against the dense form, expert parallelism and FSDP2")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
