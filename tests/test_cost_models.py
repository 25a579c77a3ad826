"""Cost formulas against numbers computed by hand."""

import dataclasses
import math

import numpy as np
import pytest

from autopar.analysis import KIND_ATTN, KIND_MATMUL, KIND_OTHER, NodeCosts
from autopar.cost_models import Config, CostContext, estimate, load_hardware
from autopar.cost_models.comm import Group, collective_time, collective_transfer, group_on_mesh
from autopar.cost_models.compute import node_times
from autopar.cost_models.step import GiB, StageModel, uniform_assignment
from autopar.errors import AutoparError
from tests.conftest import profile

HW = load_hardware("h100").with_efficiency(collective=1.0, matmul=0.5, attention=0.5, memory=1.0, fusion=1.0)


def test_ring_all_gather_inside_a_node():
    n = 1 << 30
    t = collective_time(HW, "all_gather", n, Group(8, 8))
    assert t == pytest.approx(7 * 4e-6 + 7 / 8 * n / 450e9)


def test_two_level_reduce_scatter_across_nodes():
    # 16 ranks, 8 per node on 2 nodes: intra (7/8) n / 450 GB/s + inter (1/2) n / (8 * 50 GB/s).
    n = 1e9
    t = collective_time(HW, "reduce_scatter", n, Group(16, 8))
    assert t == pytest.approx(15 * 12e-6 + 7 / 8 * n / 450e9 + 0.5 * n / (8 * 50e9))


def test_all_reduce_takes_cheaper_of_ring_and_tree():
    small, big = 1e3, 1e9
    g = Group(64, 1)  # one rank per node: 64 nodes
    ring = lambda n: 2 * (63 * 12e-6 + 63 / 64 * n / 50e9)  # noqa: E731
    tree = lambda n: 2 * math.log2(64) * 12e-6 + 2 * n / 50e9  # noqa: E731
    assert collective_time(HW, "all_reduce", small, g) == pytest.approx(min(ring(small), tree(small)))
    assert collective_time(HW, "all_reduce", big, g) == pytest.approx(min(ring(big), tree(big)))
    assert collective_time(HW, "all_reduce", small, g) == pytest.approx(tree(small))


def test_groups_on_the_mesh():
    # mesh (pp=4, dp=8, tp=8) on 8-GPU nodes: tp inside a node, dp one rank per node.
    assert group_on_mesh([4, 8, 8], 2, 8) == Group(8, 8)
    assert group_on_mesh([4, 8, 8], 1, 8) == Group(8, 1)
    assert group_on_mesh([4, 4, 2], 1, 8) == Group(4, 4)
    assert Group(8, 1).nodes == 8


def test_fitted_collective_overrides_analytic():
    hw = load_hardware({**HW.to_dict(), "collectives": {"all_reduce": {"4": [10.0, 2.0]}}})
    assert collective_time(hw, "all_reduce", 4e9, Group(4, 4)) == pytest.approx(10e-6 + 2.0)


def test_roofline_compute_and_memory_bound():
    costs = NodeCosts(
        names=["mm", "attn", "add"], flops=np.array([2e12, 1e12, 0.0]),
        act_bytes=np.array([1e6, 1e6, 3e9]), weight_bytes=np.array([2e8, 0, 0]),
        kind=np.array([KIND_MATMUL, KIND_ATTN, KIND_OTHER], dtype=np.int8),
        tp=np.array([True, True, False]), causal=np.array([False, True, False]),
        recompute_selective=np.array([False, False, True]),
    )
    ct = node_times(costs, HW, mb=2, tp=2, sp=False, compiled=False)
    peak = 989e12 * 0.5
    t_mm = 2e12 * 2 / 2 / peak
    t_attn = 1e12 * 2 / 2 * 0.5 / peak  # causal: half the blocks
    t_add = 3e9 * 2 / 3350e9  # sequence region, no SP: not divided by tp
    assert ct.fwd == pytest.approx(t_mm + t_attn + t_add)
    assert ct.bwd == pytest.approx(2 * t_mm + 2.5 * t_attn + 2 * t_add)
    assert ct.recompute_selective == pytest.approx(t_add)
    sp = node_times(costs, HW, mb=2, tp=2, sp=True, compiled=False)
    assert sp.fwd == pytest.approx(t_mm + t_attn + t_add / 2)


def test_memory_states_fsdp_vs_ddp(llama8b):
    ctx = CostContext(llama8b, load_hardware("h100"), 16)
    ddp = StageModel(ctx, Config(dp=8, mb=1))
    fsdp = StageModel(ctx, Config(dp=8, dp_shard=8, fsdp=True, mb=1))
    p = llama8b.n_params
    states = lambda sm: sm.rank_memory(0, (32, 0, 0))["parameters+grads+optimizer"]  # noqa: E731
    assert states(ddp) == pytest.approx(p * 16, rel=1e-6)  # fp32 param+grad+2 Adam states
    assert states(fsdp) == pytest.approx(p * 16 / 8, rel=1e-6)
    # Without FSDP the step casts every weight to bf16 once and holds the copy through the step
    # (the executed graphs' liveness holds it there, not between steps); FSDP gathers per layer.
    assert ddp.rank_memory(0, (32, 0, 0))["unsharded_params"] == pytest.approx(p * 2, rel=1e-6)
    assert fsdp.rank_memory(0, (32, 0, 0))["unsharded_params"] < p * 2 / 8


def test_activation_memory_scales_with_tp_sp_and_inflight(llama8b):
    ctx = CostContext(llama8b, load_hardware("h100"), 64)
    b = llama8b.blocks[0]
    sm = StageModel(ctx, Config(tp=4, sp=True, pp=4, dp=2, mb=2, schedule="1f1b"))
    saved = b.saved_partitioned["none"]  # what autopar's executor saves (min-cut partitioner)
    # ... and under SP each column group's gathered input, whole (3/4 of it beyond the shard).
    gathered = b.gathers * 2 * llama8b.seq_len * llama8b.hidden * 2 * (1 - 1 / 4)
    assert saved[2] == 0  # without AC the row linears' reduced outputs are saved, split
    assert sm.coeffs.act["none"] == pytest.approx(2 * (saved[0] / 4 + saved[1] / 4) + gathered)
    # Under AC the executor gathers those inputs again in the backward (priced as time, not memory).
    sel = b.saved_partitioned["selective"]
    # Selective AC keeps the row linears' outputs whole (before their reduce-scatter) and, the
    # matmul's output being kept, their reduce-scattered shards as well.
    assert sel[2] > 0
    assert sm.coeffs.act["selective"] == pytest.approx(2 * (sel[0] / 4 + sel[1] / 4 + sel[2] * 5 / 4))
    assert sum(sel) < sum(saved)
    assert sm.coeffs.parts["selective"]["tp_comm"] > sm.coeffs.parts["none"]["tp_comm"]
    assert [sm.inflight(r) for r in range(4)] == [4, 3, 2, 1]
    nosp = StageModel(ctx, Config(tp=4, sp=False, pp=4, dp=2, mb=2))
    assert nosp.coeffs.act["none"] == pytest.approx(2 * (saved[0] / 4 + saved[1]))
    # Eager frameworks keep what autograd saves (more: Korthikanti's forms, test_analysis).
    eager = StageModel(dataclasses.replace(ctx, activations="autograd"), Config(tp=4, sp=True, pp=4, dp=2, mb=2))
    assert eager.coeffs.act["none"] == pytest.approx(2 * (b.saved["none"][0] / 4 + b.saved["none"][1] / 4))
    assert eager.coeffs.act["none"] > sm.coeffs.act["none"]
    gp = StageModel(ctx, Config(tp=4, pp=4, dp=2, mb=2, schedule="gpipe"))
    assert gp.inflight(0) == gp.M == 16
    il = StageModel(ctx, Config(tp=4, pp=4, dp=2, mb=2, schedule="interleaved", v=2))
    assert il.inflight(0) == pytest.approx(min(16 * 2, 4 + 2 * 3 + 1) / 2)


def test_pipeline_bubble_formula(llama8b):
    ctx = CostContext(llama8b, load_hardware("h100"), 64)
    for sched, v in (("1f1b", 1), ("interleaved", 2)):
        sm = StageModel(ctx, Config(pp=4, dp=2, mb=1, schedule=sched, v=v))
        t = [1.0, 1.0, 1.0, 1.0]
        M = sm.M
        assert sm.step_time(t) - sm.optimizer_time() - sm.dp_exposed() == pytest.approx(M + 3 / v)


def test_estimate_rejects_bad_configs(llama8b):
    ctx = CostContext(llama8b, load_hardware("h100"), 16)
    with pytest.raises(AutoparError, match=r"tp=16 does not divide .*heads \(8\)"):
        estimate(ctx, Config(tp=16, dp=1))
    with pytest.raises(AutoparError, match="microbatches cannot fill"):
        estimate(ctx, Config(pp=8, dp=2, mb=4))
    with pytest.raises(AutoparError, match="not divisible by mb"):
        estimate(ctx, Config(dp=8, mb=3))


def test_breakdown_sums_to_step_time(llama8b):
    ctx = CostContext(llama8b, load_hardware("h100"), 64)
    e = estimate(ctx, Config(tp=2, sp=True, pp=2, dp=16, dp_shard=16, fsdp=True, mb=1, schedule="1f1b"), ac="selective")
    assert sum(e.breakdown.values()) == pytest.approx(e.step_time_s)
    assert e.breakdown["bubble"] > 0 and e.breakdown["tp_comm"] > 0
    assert e.peak_memory_gb * GiB == pytest.approx(max(e.memory_bytes))


def test_bandwidth_curve_by_op_size():
    costs = NodeCosts(
        names=["small", "big"], flops=np.zeros(2), act_bytes=np.array([1e6, 1e9]), weight_bytes=np.zeros(2),
        kind=np.array([KIND_OTHER, KIND_OTHER], dtype=np.int8), tp=np.array([False, False]),
        causal=np.array([False, False]), recompute_selective=np.array([False, False]),
    )
    eff = HW.eff("memory")
    # 1e6 bytes lies halfway (in log size) between the 1e5 and 1e7 points; 1e9 is past the end.
    hw = load_hardware({**HW.to_dict(), "bandwidth_curve": [[1e5, 1000.0], [1e7, 3000.0], [1e8, 500.0]]})
    ct = node_times(costs, hw, mb=1, tp=1, sp=False, compiled=False)
    assert ct.fwd == pytest.approx(1e6 / (2000e9 * eff) + 1e9 / (500e9 * eff))
    flat = node_times(costs, HW, mb=1, tp=1, sp=False, compiled=False)
    assert flat.fwd == pytest.approx((1e6 + 1e9) / (HW.memory_bandwidth_gbps * 1e9 * eff))


def test_collective_transfer_drops_the_latency():
    hw = load_hardware({**HW.to_dict(), "collectives": {"all_gather": {"4": [300.0, 2.0]}}})
    assert collective_transfer(hw, "all_gather", 2e9, Group(4, 4)) == pytest.approx(1.0, rel=1e-6)
    # Analytic ring: (G-1) alpha of latency, the rest is the transfer.
    g = Group(8, 8)
    full = collective_time(HW, "all_gather", 1e9, g)
    assert collective_transfer(HW, "all_gather", 1e9, g) == pytest.approx(full - 7 * HW.latency_us["intra"] * 1e-6, rel=1e-3)


def _cpu_profile(**kw):
    base = {"name": "cpu-test", "peak_tflops": 0.1, "memory_gb": 8, "memory_bandwidth_gbps": 10, "gpus_per_node": 4,
            "intra_node_gbps": 1, "inter_node_gbps": 1, "precision": "fp32", "reserve_gb": 0,
            "collectives": {k: {"2": [200.0, 1.0], "4": [400.0, 1.0]} for k in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")}}
    return load_hardware({**base, **kw})


@pytest.mark.parametrize("cfg", [Config(dp=4, mb=2), Config(dp=4, dp_shard=4, fsdp=True, mb=2),
                                 Config(pp=4, mb=2, schedule="1f1b"), Config(tp=4, mb=8)])
def test_shared_cores_bound_the_step_by_total_busy_time(llama_small, cfg):
    """Four ranks on two compute slots: the step is at least the node's busy time over 2 (compute
    plus the processor time of overlapped comm), the breakdown names the difference, and ranks
    idle in a pipeline bubble give their share to the others."""
    own = _cpu_profile()
    shared = _cpu_profile(compute_slots=2)
    ctx_own, ctx_shared = (CostContext(llama_small, hw, 8, "fp32", compiled=False) for hw in (own, shared))
    e_own, e_shared = estimate(ctx_own, cfg), estimate(ctx_shared, cfg)
    sm = StageModel(ctx_shared, cfg)
    times = [sm.rank_time(r, a) for r, a in enumerate(uniform_assignment(sm, "none").ac)]
    busy = [sm.M * (t + sm.rank_hidden_comm(r)) + sm.optimizer_time() + sm.dp_busy() for r, t in enumerate(times)]
    assert e_shared.step_time_s == pytest.approx(max(sm.critical_path(times), 4 * (sum(busy) / len(busy)) / 2))
    assert e_shared.step_time_s >= e_own.step_time_s
    assert sum(e_shared.breakdown.values()) == pytest.approx(e_shared.step_time_s)
    assert e_shared.breakdown["shared_cores"] == pytest.approx(e_shared.step_time_s - e_own.step_time_s)
    if cfg.pp > 1:  # the bubble is absorbed: less than twice the dedicated-device step
        assert e_shared.step_time_s < 2 * e_own.step_time_s
    else:
        assert e_shared.step_time_s >= 2 * (e_own.step_time_s - e_own.breakdown["dp_comm"]) * 0.999


def test_eager_tp_and_pipeline_runtime_terms(llama_small):
    hw = _cpu_profile(tp_linear_us=1000.0, sp_op_us=50.0, pp_microbatch_us=700.0)
    b = llama_small.blocks[0]
    n_seq_ops = int(np.count_nonzero(~b.costs.tp))
    eager, compiled = (CostContext(llama_small, hw, 8, "fp32", compiled=c) for c in (False, True))
    tp_sp = Config(tp=2, sp=True, mb=8)
    e = estimate(eager, tp_sp)
    per_mb = llama_small.n_layers * (b.tp_linears * 1e-3 + n_seq_ops * 50e-6) + 2 * 1e-3  # + embedding and head
    assert e.breakdown["tp_eager_overhead"] == pytest.approx(per_mb)
    assert estimate(compiled, tp_sp).breakdown["tp_eager_overhead"] == 0.0
    no_sp = estimate(eager, Config(tp=2, mb=8)).breakdown["tp_eager_overhead"]
    assert no_sp == pytest.approx(llama_small.n_layers * b.tp_linears * 1e-3 + 2e-3)
    pp = estimate(eager, Config(pp=2, mb=2, schedule="interleaved", v=2))
    assert pp.breakdown["pp_runtime"] == pytest.approx(4 * 2 * 700e-6)  # M=4 microbatches, v=2 chunks each


def test_tied_head_under_pp_is_a_copy_and_an_all_reduce():
    """GPT-3 ties its head to the embedding. Under PP the last stage holds a copy (its memory
    grows by the table), the copies' gradients are summed once per step over the two pipeline
    ends (priced, in the breakdown and the collective list); without PP neither exists."""
    m = profile("gpt-1.7b")
    vocab_elems, _ = m.tied_outside
    assert vocab_elems == 51200 * 2304
    ctx = CostContext(m, load_hardware("a100"), 64)
    flat = estimate(ctx, Config(tp=2, pp=1, dp=4, mb=1))
    assert flat.breakdown["pp_tied_grads"] == 0
    assert not [c for c in flat.collectives if c["group"] == "pp ends"]
    cfg = Config(tp=2, pp=4, dp=1, mb=1, schedule="1f1b")
    e = estimate(ctx, cfg)
    (ar,) = [c for c in e.collectives if c["group"] == "pp ends"]
    assert ar["bytes"] == pytest.approx(vocab_elems / 2 * 4) and ar["group_size"] == 2
    assert e.breakdown["pp_tied_grads"] > 0
    sm = StageModel(ctx, cfg)
    assert sm.rank_params(3) - sm.rank_params(2) >= vocab_elems / 2  # the last stage's copy
    assert sum(e.breakdown.values()) == pytest.approx(e.step_time_s)


def test_fabric_share_divides_the_cross_node_bandwidth():
    # 16 ranks on 2 nodes; with fabric = 1/8 a ring drives one NIC of the node instead of eight.
    n = 1e9
    one = HW.with_efficiency(fabric=1 / 8)
    t = collective_time(one, "all_gather", n, Group(16, 8))
    assert t == pytest.approx(15 * 12e-6 + 7 / 8 * n / 450e9 + 0.5 * n / 50e9)
    assert collective_time(one, "all_gather", n, Group(8, 8)) == collective_time(HW, "all_gather", n, Group(8, 8))


@pytest.mark.parametrize("once", ["reduce", "gather"])
def test_fsdp_once_per_step_counts_and_memory(llama8b, once):
    """Reducing (and gathering) once per step instead of per microbatch: fewer collectives, less
    exposed FSDP time, unsharded gradients (and parameters) held across the microbatches."""
    ctx = CostContext(llama8b, load_hardware("h100"), 256)
    base = dict(tp=8, sp=True, pp=4, dp=8, dp_shard=8, fsdp=True, reshard=False, mb=1, schedule="1f1b")
    per_mb, per_step = (estimate(ctx, Config(**base, fsdp_once=o), ac="full") for o in ("", once))
    count = lambda e, kind: next(c["count"] for c in e.collectives if c["kind"] == kind and c["group"] == "dp_shard")  # noqa: E731, E501
    M = 256 // 8
    assert count(per_mb, "reduce_scatter") == M * count(per_step, "reduce_scatter")
    assert count(per_mb, "all_gather") == (M if once == "gather" else 1) * count(per_step, "all_gather")
    assert per_step.breakdown["fsdp_comm"] < per_mb.breakdown["fsdp_comm"]
    assert per_step.memory_breakdown["unsharded_params"] > per_mb.memory_breakdown["unsharded_params"]
    assert "once=" + once in per_step.config.short()


def test_fsdp_keeps_a_size_one_leading_dim_whole():
    """A gate Linear(h, 1)'s (1, h) weight stays whole (split on dim 1, its bucketed gather broke
    in a view); other weights split on their first dim that divides."""
    from torch.distributed.tensor import Replicate, Shard

    from autopar.passes.fsdp import dp_placements

    got = dp_placements([(1, 64), (64, 1), (8, 64)], {}, 4, True)
    assert got == {0: Replicate(), 1: Shard(0), 2: Shard(0)}


def test_fsdp_per_tensor_gathers_are_exposed_and_add_a_ring_latency_each(llama8b):
    """One all-gather per parameter tensor, each waited before the next (DeepSpeed ZeRO-3 of
    2021), moves the same bytes as one per layer but no compute hides it, and it pays the ring's
    latency once per tensor, in the forward and again in the backward: a cost that grows with the
    FSDP group, not with the model's bytes. The reduce-scatter still overlaps the backward."""
    hw = load_hardware("a100-80gb")
    k = len(llama8b.blocks[0].param_shapes)
    for dp in (64, 1024):
        ctx = CostContext(llama8b, hw, dp)
        base = dict(dp=dp, dp_shard=dp, fsdp=True, mb=1)
        layer, tensor = (StageModel(ctx, Config(**base, fsdp_unit=u)) for u in ("layer", "tensor"))
        p_local = llama8b.blocks[0].params_tp + llama8b.blocks[0].params_rep
        ag = collective_time(hw, "all_gather", p_local * 2, layer.g_shard)
        latency = collective_time(hw, "all_gather", 1.0, layer.g_shard)
        assert layer.coeffs.parts["none"]["fsdp_comm"] < 0.5 * ag  # hidden by the layer's compute
        got = tensor.coeffs.parts["none"]["fsdp_comm"]
        assert got >= 2 * ag + (k - 1) * 2 * latency - 1e-12
        assert got == pytest.approx(2 * ag + (k - 1) * 2 * latency, rel=1e-9)  # the reduce-scatter hidden
        assert layer.coeffs.time["none"] < tensor.coeffs.time["none"]
    assert "unit=tensor" in tensor.cfg.short()
    gathers = [c for c in estimate(ctx, tensor.cfg, ac="full").collectives if c["kind"] == "all_gather"]
    assert gathers and gathers[0]["count"] == 2 * llama8b.n_layers * k


def test_dp_all_reduce_after_the_backward_is_exposed_whole(llama8b):
    """Megatron-LM's local DDP (2021-22) and DeepSpeed's pipeline engine all-reduce the gradients
    once the backward is done: the whole all-reduce adds to the step, where autopar's bucketed
    all-reduce overlaps the last backward and exposes only what is longer than it plus one bucket."""
    hw = load_hardware("a100-80gb")
    ctx = CostContext(llama8b, hw, 64)
    base = dict(dp=64, mb=1)
    over, after = (StageModel(ctx, Config(**base, dp_overlap=o)) for o in (True, False))
    whole = collective_time(hw, "all_reduce", after.rank_params(0) * 4, after.g_dp)
    assert after.dp_exposed() == pytest.approx(whole, rel=1e-9)
    assert over.dp_exposed() < 0.5 * whole
    t_over, t_after = (estimate(ctx, sm.cfg, ac="none").step_time_s for sm in (over, after))
    assert t_after - t_over == pytest.approx(whole - over.dp_exposed(), rel=1e-6)
    assert "dp_overlap=0" in after.cfg.short() and "dp_overlap" not in over.cfg.short()


@pytest.mark.parametrize("tp", [1, 8])
def test_loss_memory_compiled_and_eager(llama8b, tp):
    """Compiled, the loss's backward is one fused kernel: beside the loss's saved tensors it writes
    only the logits' gradient, in the compute dtype (loss parallelism adds its fp32 target mask);
    eager, the log-softmax backward holds its output's and its input's gradients, two fp32
    logits-sized tensors (Llama 3 8B, 128k vocab, on the vocabulary shards under TP). That moment
    is the step's peak above the saved activations when it is the largest."""
    logits_fp32 = llama8b.seq_len * llama8b.vocab * 4 / tp
    for compiled in (True, False):
        ctx = CostContext(llama8b, load_hardware("h100"), 8, compiled=compiled)
        sm = StageModel(ctx, Config(tp=tp, sp=tp > 1, dp=8 // tp, mb=1))
        post = sm.outer["post"]
        if compiled:
            assert post["grad_out"] == pytest.approx(logits_fp32 / 4 * ctx.act_bytes, rel=1e-6)
            assert post["grad_ws"] < 2 * logits_fp32
            # Compiled blocks beside an eager loss (the published runs) price the eager loss.
            apart = StageModel(dataclasses.replace(ctx, fused_loss=False), sm.cfg).outer["post"]
            assert apart["grad_out"] == apart["grad_ws"] == pytest.approx(2 * logits_fp32, rel=1e-6)
        else:
            assert post["grad_ws"] == post["grad_out"] == pytest.approx(2 * logits_fp32, rel=1e-6)
        loss = post["act_vocab"] + post["grad_out"] + (logits_fp32 if tp > 1 else 0.0)
        assert loss > sm.coeffs.act["none"]
        outer = sm.outer["pre"]["act_vocab"] + sm.outer["pre"]["act_rep"] + post["act_rep"]
        peak = sm.rank_memory(0, (0, 0, 0))["activations"]
        if tp == 1:
            assert peak == pytest.approx(outer + loss, rel=1e-6)
        else:  # the embedding's backward (its output whole on every TP rank) is larger here
            assert peak >= outer + loss


@pytest.mark.parametrize("tp", [1, 8])
def test_context_parallel_splits_the_tokens_and_gathers_keys_and_values(llama8b, tp):
    """cp=2 gives each rank half of every sequence: its compute (attention included: half the
    queries against every key), activations and TP messages halve; FSDP shards the parameters
    over dp_shard x cp; each layer all-gathers the whole sequence's keys and values (forward and
    backward) and reduce-scatters their gradients over the cp group, on its own key/value heads."""
    hw = load_hardware("h100")
    ctx = CostContext(llama8b, hw, 8)
    one = StageModel(ctx, Config(tp=tp, sp=tp > 1, dp=8, dp_shard=8, fsdp=True, mb=1))
    two = StageModel(ctx, Config(tp=tp, sp=tp > 1, dp=8, dp_shard=8, fsdp=True, mb=1, cp=2))
    assert two.cfg.world == 2 * one.cfg.world == 16 * tp and "cp=2" in two.cfg.short()
    for ac in ("none", "full"):
        assert two.coeffs.parts[ac]["compute"] == pytest.approx(one.coeffs.parts[ac]["compute"] / 2, rel=0.02)
        assert two.coeffs.act[ac] == pytest.approx(one.coeffs.act[ac] / 2, rel=1e-9)
    assert two.coeffs.static == pytest.approx(one.coeffs.static / 2, rel=1e-9)
    b = llama8b.blocks[0]
    kv = 2 * llama8b.seq_len * (b.kv_heads // tp if b.kv_heads >= tp else b.kv_heads) * b.head_dim * 2
    g = two.g_cp
    assert g == Group(2, 2 if tp == 1 else 1)
    # Half of each rank's queries (and their outputs) swapped with the mirror rank, both ways.
    half = llama8b.seq_len / 4 * (b.heads // tp) * b.head_dim * 2
    want = (2 * collective_time(hw, "all_gather", kv, g) + collective_time(hw, "reduce_scatter", kv, g)
            + 4 * collective_time(hw, "send_recv", half, g))
    assert two.coeffs.parts["none"]["cp_comm"] == pytest.approx(want, rel=1e-9)
    assert one.coeffs.parts["none"]["cp_comm"] == 0.0
    e = estimate(ctx, two.cfg, ac="none")
    cp = [c for c in e.collectives if c["group"] == "cp"]
    assert {c["kind"] for c in cp} == {"all_gather", "reduce_scatter", "send_recv"}
    assert all(c["bytes"] == (half if c["kind"] == "send_recv" else kv) for c in cp)
    assert any(c["group"] == "dp_shard x cp" and c["group_size"] == 16 for c in e.collectives)
    if tp > 1:  # the sequence-parallel messages carry half the tokens
        tp_msgs = {c["bytes"] for c in e.collectives if c["group"] == "tp" and c["kind"] == "all_gather"}
        assert llama8b.seq_len * llama8b.hidden * 2 / 2 in tp_msgs


def test_context_parallel_is_planned_when_pinned(llama8b, tmp_path):
    from autopar import api, search
    from autopar.plan import Plan

    ctx = CostContext(llama8b, load_hardware("h100"), 8)
    with pytest.raises(AutoparError, match="multiple of 8"):
        estimate(CostContext(profile("llama-tiny", 60), load_hardware("h100"), 8), Config(dp=2, cp=4))
    with pytest.raises(AutoparError, match="multiple of 8"):
        search.check_pins(CostContext(profile("llama-tiny", 60), load_hardware("h100"), 8), 16,
                          search.parse_pins("cp=4"))
    search.check_pins(ctx, 16, search.parse_pins("cp=2"))
    plan, est, _ = api.estimate_plan("llama-tiny", 8, "dp=4,cp=2,fsdp=1", global_batch=8)
    assert est.config.cp == 2 and plan.cp == 2 and plan.mesh_shape == (1, 1, 4, 2, 1)
    from autopar.explain import render

    text = render(plan)
    assert "dp_shard=4 x cp=2 x tp=1" in text and "CP 2" in text
    with pytest.raises(AutoparError, match=r"tp\*pp\*dp\*cp = 1\*1\*2\*2 = 4 but there are 8 GPUs"):
        api.estimate_plan("llama-tiny", 8, "dp=2,cp=2", global_batch=8)
    path = tmp_path / "cp.json"
    plan.save(str(path))
    back = Plan.load(str(path))
    assert back.cp == 2 and back.as_config_string().endswith("cp=2") and back == plan
    # The search under a cp pin: the data-parallel degree is what is left of the world.
    planned = api.plan("llama-tiny", 8, global_batch=8, pin={"cp": 2, "fsdp": 1}, hardware="h100")
    assert planned.cp == 2 and planned.dp * planned.tp * planned.pp * 2 == 8


def test_fewer_microbatches_than_stages_priced_with_its_bubble_not_run(llama8b):
    """Megatron-LM ran pipelines with fewer microbatches than stages (SC21, Fig. 14): estimate
    prices them, (M + pp - 1) microbatch times; the search and the executor do not run them."""
    from autopar import api

    ctx = CostContext(llama8b, load_hardware("h100"), 4)
    with pytest.raises(AutoparError, match="microbatches cannot fill 8 pipeline stages"):
        estimate(ctx, Config(pp=8, mb=1))
    plan, est, _ = api.estimate_plan("llama3-8b", 8, "pp=8,dp=1,mb=1,schedule=1f1b", global_batch=4)
    assert plan.n_microbatches == 4 and any("4 microbatches over 8 pipeline stages" in n for n in plan.notes)
    _, full, _ = api.estimate_plan("llama3-8b", 8, "pp=8,dp=1,mb=1,schedule=1f1b", global_batch=8)
    # The pipeline part is M slowest-stage times plus the bubble (the other stages' once): half
    # the microbatches take more than half the time, and the bubble is a larger share of it.
    pipe = lambda e: e.step_time_s - e.breakdown["optimizer"] - e.breakdown["dp_comm"]  # noqa: E731
    assert 0.5 < pipe(est) / pipe(full) < 11 / 15
    assert est.breakdown["bubble"] == pytest.approx(full.breakdown["bubble"], rel=1e-6)
    assert est.breakdown["bubble"] / pipe(est) > full.breakdown["bubble"] / pipe(full)
    with pytest.raises(AutoparError, match="need at least one per stage"):
        api._resolve_plan(plan, None, 8, None, example_inputs=None, hardware=None, global_batch=None,
                          memory_limit_gb=None, loss_fn=None, device="cpu", precision="bf16-mixed")


def test_each_precision_priced_as_it_runs(llama8b):
    """What a precision holds and moves: bf16-mixed keeps fp32 masters, gradients and AdamW
    moments (16 bytes a parameter) and reduces gradients in fp32 (twice the gathered bytes);
    bf16 throughout holds half of that and reduces in bf16; fp32 computes at the GPU's fp32
    peak (PyTorch's fp32 matmuls do not use TF32 by default), not its bf16 one."""
    h100 = load_hardware("h100")
    cfg = Config(dp=8, dp_shard=8, fsdp=True, mb=1)
    est = {p: estimate(CostContext(llama8b, h100, 64, p), cfg) for p in ("bf16-mixed", "bf16-true", "fp32")}
    states = {p: e.memory_breakdown["parameters+grads+optimizer"] for p, e in est.items()}
    assert states["bf16-true"] == pytest.approx(states["bf16-mixed"] / 2)
    assert states["fp32"] == pytest.approx(states["bf16-mixed"])

    def moved(e, kind):
        return next(c["bytes"] for c in e.collectives if c["kind"] == kind)
    assert moved(est["bf16-mixed"], "reduce_scatter") == pytest.approx(2 * moved(est["bf16-mixed"], "all_gather"))
    assert moved(est["bf16-true"], "reduce_scatter") == pytest.approx(moved(est["bf16-true"], "all_gather"))
    assert moved(est["fp32"], "all_gather") == pytest.approx(2 * moved(est["bf16-mixed"], "all_gather"))
    compute = {p: e.breakdown["compute"] for p, e in est.items()}
    assert compute["fp32"] > 5 * compute["bf16-mixed"]
    assert compute["bf16-true"] == pytest.approx(compute["bf16-mixed"])


def test_precision_names():
    """Plans saved when "bf16" was the only mixed name load as bf16-mixed; an unknown name lists the choices."""
    from autopar.plan import precision

    assert precision("bf16").name == "bf16-mixed" and precision("fp16").name == "fp16-mixed"
    assert precision("bf16-true").param == "bfloat16" and precision("bf16-mixed").reduce == "float32"
    with pytest.raises(AutoparError, match="choose one of fp32, bf16-mixed, bf16-true, fp16-mixed"):
        precision("tf32")


def test_float8_priced_where_the_gpu_has_it(llama8b):
    """Float8 linears (torchtitan's Float8 runs) are a precision the planner prices on H100 and
    newer (matmuls at twice the bf16 peak); on an A100 it is refused, and compile does not run it."""
    import autopar
    from autopar import api

    h100 = load_hardware("h100")
    cfg = Config(dp=8, dp_shard=8, fsdp=True, mb=1)
    fp8, bf16 = (estimate(CostContext(llama8b, h100, 64, p), cfg) for p in ("float8", "bf16-mixed"))
    assert fp8.breakdown["compute"] < 0.75 * bf16.breakdown["compute"]
    assert fp8.memory_breakdown == bf16.memory_breakdown
    with pytest.raises(AutoparError, match="a100-80gb has no float8 matmuls"):
        api.make_context(llama8b, world=8, hardware="a100-80gb", precision="float8")
    from tests.dist_harness import batch, build

    with pytest.raises(AutoparError, match="float8 is priced but not run: float8 linears"):
        autopar.compile(build("llama-tiny"), 1, example_inputs=(batch(1)[0],), mp_policy="fp8")
