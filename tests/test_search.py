"""Search against brute force, determinism, pins, and clear errors."""

import itertools

import pytest

from autopar import search
from autopar.cost_models import CostContext, load_hardware
from autopar.cost_models.step import AC_MODES, Assignment, StageModel
from autopar.errors import AutoparError, InfeasibleError

SMALL_HW = {"name": "small", "peak_tflops": 100, "memory_gb": 1, "memory_bandwidth_gbps": 1000,
            "gpus_per_node": 4, "intra_node_gbps": 100, "inter_node_gbps": 10, "reserve_gb": 0.0}


def _splits(n, v):
    for s in range(n + 1):
        for f in range(n - s + 1):
            yield (n - s - f, s, f)


def _compositions(L, pp, lo):
    if pp == 1:
        if L >= lo:
            yield (L,)
        return
    for first in range(lo, L - lo * (pp - 1) + 1):
        for rest in _compositions(L - first, pp - 1, lo):
            yield (first,) + rest


def brute_force(ctx, world, pins=None):
    best, count = None, 0
    for cfg in search.enumerate_configs(ctx, world, pins or {}):
        sm = StageModel(ctx, cfg)
        L = ctx.model.n_layers
        for layers in _compositions(L, cfg.pp, cfg.v):
            for ac in itertools.product(*[list(_splits(n, cfg.v)) for n in layers]):
                if pins and "ac" in pins:
                    i = AC_MODES.index(pins["ac"])
                    if any(x[j] for x in ac for j in range(3) if j != i):
                        continue
                count += 1
                e = sm.evaluate(Assignment(layers, ac))
                if e.fits(ctx.limit_bytes) and (best is None or e.step_time_s < best.step_time_s - 1e-15):
                    best = e
    return best, count


@pytest.mark.parametrize("limit_frac", [1.2, 0.55, 0.35])
def test_search_equals_enumeration(llama_small, limit_frac):
    hw = load_hardware(SMALL_HW)
    ctx0 = CostContext(llama_small, hw, 8)
    # A limit relative to the no-AC, single-stage, unsharded memory, so AC and PP matter.
    base = StageModel(ctx0, search.enumerate_configs(ctx0, 4, {"tp": 1, "pp": 1, "fsdp": False, "mb": 2})[0])
    limit = sum(base.rank_memory(0, (8, 0, 0)).values()) * limit_frac / 2**30
    ctx = CostContext(llama_small, hw, 8, memory_limit_gb=limit)
    bf, n = brute_force(ctx, 4)
    assert n >= 10_000
    try:
        got = search.search(ctx, 4)
    except InfeasibleError:
        assert bf is None
        return
    assert bf is not None
    assert got.best.step_time_s == pytest.approx(bf.step_time_s, rel=1e-9)


def test_search_equals_enumeration_with_pins(llama_small):
    hw = load_hardware(SMALL_HW)
    ctx = CostContext(llama_small, hw, 16, memory_limit_gb=0.02)
    pins = {"pp": 2}
    bf, n = brute_force(ctx, 8, pins)
    got = search.search(ctx, 8, pins=pins)
    assert n >= 10_000
    assert got.best.config.pp == 2
    assert got.best.step_time_s == pytest.approx(bf.step_time_s, rel=1e-9)


def test_tp_across_nodes_only_where_nothing_fits_inside_one(llama_small):
    """TP stays inside a node (here one GPU a node: tp=1) unless nothing fits there: under a limit
    that only TP's split weights and activations meet, the search tries every TP degree and finds
    brute force's optimum."""
    hw = load_hardware({**SMALL_HW, "gpus_per_node": 1})
    assert search.search(CostContext(llama_small, hw, 8), 4).best.config.tp == 1
    need: dict = {}  # the least memory of each TP degree: balanced layers, all fully checkpointed
    ctx = CostContext(llama_small, hw, 8)
    for cfg in search.enumerate_configs(ctx, 4, {}):
        sm = StageModel(ctx, cfg)
        full = max(sum(sm.rank_memory(r, (0, 0, n)).values()) for r, n in enumerate(sm.balanced_layers()))
        need[cfg.tp > 1] = min(need.get(cfg.tp > 1, float("inf")), full)
    assert need[True] < need[False]
    ctx = CostContext(llama_small, hw, 8, memory_limit_gb=(need[True] + need[False]) / 2 / 2**30)
    bf, _ = brute_force(ctx, 4)
    got = search.search(ctx, 4)
    assert bf.config.tp > 1 and got.best.step_time_s == pytest.approx(bf.step_time_s, rel=1e-9)


def test_milp_under_a_bound_that_prunes_every_solution_has_none():
    """``_highs_milp`` given an objective bound (the best time the search found): min x, x >= 1
    integral, has its optimum under a bound of 2 and none under 0.5 (HiGHS then says optimal with
    an undefined solution, which must not read as one)."""
    import numpy as np

    args = (np.array([1.0]), np.array([[1.0]]), np.array([1.0]), np.array([np.inf]), np.array([0.0]),
            np.array([10.0]), np.array([1.0]))
    assert list(search._highs_milp(*args, 2.0)) == [1.0]
    assert search._highs_milp(*args, 0.5) is None


def test_deterministic(llama8b):
    ctx = CostContext(llama8b, load_hardware("h100"), 256)
    a = search.search(ctx, 64)
    b = search.search(ctx, 64)
    assert a.best.config == b.best.config and a.best.assignment == b.best.assignment
    assert [r.config for r in a.runners_up] == [r.config for r in b.runners_up]


def test_pins_are_honoured(llama8b):
    ctx = CostContext(llama8b, load_hardware("h100"), 256)
    r = search.search(ctx, 64, pins=search.parse_pins("tp=8,pp=2,ac=full"))
    c = r.best.config
    assert (c.tp, c.pp, c.dp) == (8, 2, 4)
    assert all(x == (0, 0, n) for x, n in zip(r.best.assignment.ac, r.best.assignment.layers))


def test_bad_pins(llama8b):
    ctx = CostContext(llama8b, load_hardware("h100"), 256)
    with pytest.raises(AutoparError, match=r"tp=16 does not divide .*heads \(8\).*valid TP degrees: 1, 2, 4, 8"):
        search.search(ctx, 64, pins={"tp": 16})
    with pytest.raises(AutoparError, match=r"product 24\) do not divide the 64 GPUs"):
        search.search(ctx, 64, pins={"tp": 8, "pp": 3})
    with pytest.raises(AutoparError, match="unknown pin 'zz'"):
        search.parse_pins("zz=1")
    with pytest.raises(AutoparError, match="must be an integer"):
        search.parse_pins("tp=x")


def test_infeasible_names_the_shortfall(llama8b):
    ctx = CostContext(llama8b, load_hardware("h100"), 8, memory_limit_gb=20)
    with pytest.raises(InfeasibleError, match=r"closest.*needs [\d.]+ GiB per GPU \([\d.]+ GiB over\).*more GPUs"):
        search.search(ctx, 1)


def test_sensible_choices(llama8b):
    from tests.conftest import profile

    h100 = load_hardware("h100")
    # 8B on 8 GPUs with room: no tensor parallelism.
    assert search.search(CostContext(llama8b, h100, 32), 8).best.config.tp == 1
    # 175B-class: TP inside the node and PP across nodes (when sharding data parallelism is off,
    # as in Megatron-LM's setting).
    gpt = profile("gpt-175b")
    c = search.search(CostContext(gpt, h100, 1536), 1024, pins={"fsdp": 0}).best.config
    assert 1 < c.tp <= 8 and c.pp > 1
    # 405B on 16,384: TP 8 in the node, PP across nodes (the Llama 3 paper's layout).
    big = profile("llama3-405b")
    c = search.search(CostContext(big, h100, 2048), 16384).best.config
    assert c.tp == 8 and c.pp > 1
    # When the bubble is large (few microbatches per pipeline): a zero-bubble schedule, which fills
    # it with the deferred weight gradients; among the 1F1B family, interleaving.
    res = search.search(CostContext(big, h100, 2048), 16384, pins={"pp": 16})
    assert res.best.config.schedule in ("interleaved_zb", "zbv") and res.best.config.v > 1
    assert [e.config.schedule for e in res.schedules][0] == res.best.config.schedule
    assert {e.config.schedule for e in res.schedules} >= {"1f1b", "interleaved", "interleaved_zb", "zbv"}
    by = {e.config.schedule: e for e in res.schedules}
    assert by["zbv"].breakdown["bubble"] < by["interleaved"].breakdown["bubble"] < by["1f1b"].breakdown["bubble"]
    c = search.search(CostContext(big, h100, 2048), 16384, pins={"pp": 16, "schedule": "interleaved"}).best.config
    assert c.schedule == "interleaved" and c.v > 1


def test_rank_affine_is_the_rank_model(llama8b):
    """The search prices ranks from ``rank_affine``'s few evaluations: on every configuration of
    64 GPUs, every rank, and mixes of layer counts, its time equals ``rank_time`` and its memory
    bounds ``rank_memory`` from above, equal to it where every AC mode is in the mix (the peak's
    layer moment, recompute or gradient reduction, is then the bound's own)."""
    ctx = CostContext(llama8b, load_hardware("h100"), 256)
    checked = 0
    for cfg in search.enumerate_configs(ctx, 64, {})[::7]:
        sm = StageModel(ctx, cfg)
        for r in range(cfg.pp):
            t0, tc, m0, mc = sm.rank_affine(r)
            for ac in ((0, 0, 0), (3, 0, 0), (1, 2, 0), (0, 1, 4), (2, 2, 2)):
                assert t0 + sum(n * c for n, c in zip(ac, tc)) == pytest.approx(sm.rank_time(r, ac), rel=1e-12)
                affine, exact = m0 + sum(n * c for n, c in zip(ac, mc)), sum(sm.rank_memory(r, ac).values())
                assert affine >= exact * (1 - 1e-12)
                if all(ac):
                    assert affine == pytest.approx(exact, rel=1e-12)
                checked += 1
    assert checked > 1000


def test_long_sequences_are_split_over_ranks():
    """At 131,072 tokens Llama 3 8B's activations leave no room without context parallelism:
    the search tries cp for sequences from ``CP_FROM_SEQ_LEN`` tokens and picks it; the
    winner's runners-up include plans without it. Short sequences are not split."""
    from autopar.api import profile_model

    long = profile_model("llama3-8b", seq_len=131072).profile
    r = search.search(CostContext(long, load_hardware("h100"), 32), 64)
    assert r.best.config.cp > 1 and r.best.config.world == 64
    short = CostContext(profile_model("llama3-8b", seq_len=8192).profile, load_hardware("h100"), 64)
    assert search.cp_options(short, 64, {}) == [1]
    assert search.cp_options(CostContext(long, load_hardware("h100"), 32), 64, {}) == [1, 2, 4, 8, 16, 32]


def test_the_collector_is_paused_during_the_search_only():
    """The search runs with Python's cyclic collector off (its caches' objects are not walked
    again and again) and turns it back on after, also when the search fails."""
    import gc

    from autopar import api

    ctx = api.make_context(api.profile_model("llama3-8b").profile, world=64, hardware="h100")
    seen = []
    search.search(ctx, 64, progress=lambda i, n: seen.append(gc.isenabled()))
    assert seen and not any(seen) and gc.isenabled()
    with pytest.raises(AutoparError):
        search.search(ctx, 64, pins={"tp": 64, "pp": 64})
    assert gc.isenabled()
