"""Parity: the parallel model is the same model. Real processes over gloo, fp32, compared with one
process: the loss and every gradient after one step, and the loss over three AdamW steps."""

import pytest

from tests import dist_harness

GRAD_TOL = 5e-7
LOSS_TOL = 2e-6  # first step: the same computation up to reduction order
TRAJ_TOL = 2e-5  # later steps: AdamW divides by sqrt(v) and amplifies rounding on tiny gradients

REF_CASES = [
    {"name": "fsdp4", "plan": {"dp": 4, "fsdp": 1, "pp": 1}},
    {"name": "hsdp2x2", "plan": {"dp": 4, "fsdp": 1, "dp_shard": 2, "pp": 1}},
    {"name": "ddp4", "plan": {"dp": 4, "fsdp": 0, "pp": 1}, "clip": True},
    {"name": "tp4", "plan": {"tp": 4, "sp": 0, "pp": 1}},
    {"name": "tp4_sp", "plan": {"tp": 4, "sp": 1, "pp": 1}, "clip": True},
    {"name": "ac_full_fsdp4", "plan": {"dp": 4, "fsdp": 1, "ac": "full", "pp": 1}},
    {"name": "ac_selective_tp2_fsdp2", "plan": {"tp": 2, "sp": 1, "dp": 2, "fsdp": 1, "ac": "selective", "pp": 1}},
    {"name": "fsdp2_tp2", "plan": {"tp": 2, "sp": 1, "dp": 2, "fsdp": 1, "pp": 1}, "clip": True},
    {"name": "auto4", "plan": "auto"},
]
PP4_CASES = [
    {"name": "pp2_tp2", "plan": {"pp": 2, "tp": 2, "sp": 1, "schedule": "1f1b", "mb": 2, "dp": 1}, "clip": True},
    {"name": "pp2_fsdp2", "plan": {"pp": 2, "dp": 2, "fsdp": 1, "tp": 1, "schedule": "1f1b", "mb": 1}},
    {"name": "hf_pp2_ddp2", "model": "hf-llama", "plan": {"pp": 2, "dp": 2, "fsdp": 0, "tp": 1, "schedule": "1f1b", "mb": 1}},
]
PP2_CASES = [
    {"name": "pp2_gpipe", "plan": {"pp": 2, "schedule": "gpipe", "mb": 2, "dp": 1, "tp": 1}},
    {"name": "pp2_1f1b", "plan": {"pp": 2, "schedule": "1f1b", "mb": 2, "dp": 1, "tp": 1}, "clip": True},
    {"name": "pp2_interleaved_v2", "plan": {"pp": 2, "schedule": "interleaved", "v": 2, "mb": 2, "dp": 1, "tp": 1}},
    {"name": "pp2_ac_selective", "plan": {"pp": 2, "schedule": "1f1b", "mb": 2, "dp": 1, "tp": 1, "ac": "selective"}},
]
HF_CASES = [
    {"name": "hf_fsdp4", "model": "hf-llama", "plan": {"dp": 4, "fsdp": 1, "pp": 1}},
    {"name": "hf_tp4", "model": "hf-llama", "plan": {"tp": 4, "sp": 0, "pp": 1}},
    {"name": "hf_tp2_sp", "model": "hf-llama", "plan": {"tp": 2, "sp": 1, "dp": 2, "fsdp": 0, "pp": 1}},
    {"name": "hf_fsdp2_tp2_ac", "model": "hf-llama", "plan": {"tp": 2, "sp": 0, "dp": 2, "fsdp": 1, "ac": "full", "pp": 1}},
]


def check(results, cases):
    by_name = {c["name"]: c for c in cases}
    assert len(results) == len(cases), results
    for r in results:
        assert "error" not in r, f"{r['name']}: {r['error']}\n{r.get('tb', '')}"
        want = by_name[r["name"]]["plan"]
        want = {} if want == "auto" else want
        got = dict(kv.split("=") for kv in r["plan"].split(","))
        for k, v in want.items():
            assert got.get(k) == str(int(v) if isinstance(v, bool) else v) or k in ("dp_shard",), (r["name"], k, got)
        if "pp" not in r["plan"] or "pp=1," in r["plan"]:
            assert r["n_params"] == r["n_ref_params"]
        assert r["grad_max_diff"] < GRAD_TOL, f"{r['name']}: {r['worst_param']} differs by {r['grad_max_diff']}"
        assert r["losses"][0] == pytest.approx(r["ref_losses"][0], abs=LOSS_TOL)
        for a, b in zip(r["losses"][1:], r["ref_losses"][1:]):
            assert a == pytest.approx(b, abs=TRAJ_TOL), (r["name"], r["losses"], r["ref_losses"])
        if "clip_norm_diff" in r:
            assert r["clip_norm_diff"] < 1e-5


@pytest.fixture(scope="module")
def world4_results():
    return dist_harness.run(4, REF_CASES + HF_CASES + PP4_CASES)


def _covers_model(per_rank):
    """Under PP each rank holds its stages' parameters; together they are the whole model."""
    names = set().union(*(r["param_names"] for r in per_rank))
    assert len(names) == per_rank[0]["n_ref_params"]


@pytest.mark.parametrize("name", [c["name"] for c in REF_CASES + HF_CASES + PP4_CASES])
def test_parity_world4(world4_results, name):
    cases = REF_CASES + HF_CASES + PP4_CASES
    i = [c["name"] for c in cases].index(name)
    per_rank = [res[i] for res in world4_results]
    check(per_rank, [cases[i]] * len(per_rank))
    # Every rank reports the same loss.
    assert len({tuple(r["losses"]) for r in per_rank}) == 1
    _covers_model(per_rank)


@pytest.mark.parametrize("name", [c["name"] for c in PP2_CASES])
def test_parity_pipeline_world2(world2_pp_results, name):
    i = [c["name"] for c in PP2_CASES].index(name)
    per_rank = [res[i] for res in world2_pp_results]
    check(per_rank, [PP2_CASES[i]] * 2)
    assert len({tuple(r["losses"]) for r in per_rank}) == 1
    _covers_model(per_rank)


@pytest.fixture(scope="module")
def world2_pp_results():
    return dist_harness.run(2, PP2_CASES)


def test_parity_world2_auto_and_tp2():
    cases = [{"name": "auto2", "plan": "auto"}, {"name": "tp2_sp", "plan": {"tp": 2, "sp": 1, "pp": 1}}]
    res = dist_harness.run(2, cases)
    for per_case in zip(*res):
        check(list(per_case), [c for c in cases if c["name"] == per_case[0]["name"]] * 2)
        assert all(r["logits_contiguous"] for r in per_case), "the TP head must hand the loss contiguous logits"


def test_parity_world1_auto():
    r = dist_harness.run_case(1, {"name": "auto1", "plan": "auto"})
    assert r["grad_max_diff"] < GRAD_TOL
    assert r["losses"] == pytest.approx(r["ref_losses"], abs=TRAJ_TOL)


@pytest.mark.slow
def test_parity_compiled():
    cases = [
        {"name": "fsdp4_compiled", "plan": {"dp": 4, "fsdp": 1, "pp": 1}, "compile": True, "steps": 2},
        {"name": "tp4_sp_compiled", "plan": {"tp": 4, "sp": 1, "pp": 1}, "compile": True, "steps": 2},
    ]
    res = dist_harness.run(4, cases)
    for per_case in zip(*res):
        check(list(per_case), [c for c in cases if c["name"] == per_case[0]["name"]] * 4)
