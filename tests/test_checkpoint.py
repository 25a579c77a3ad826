"""Checkpoints survive a change of plan: torch.distributed.checkpoint saves pm.state_dict() and the
optimizer's state (``get_optimizer_state_dict``) under one plan; another plan (or a single process
with the plain model) loads them, the weights come back bit for bit under their original names and
training goes on along the single-process loss trajectory. 4 gloo processes, default options
(Inductor on)."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests import dist_harness, zoo
from tests.test_parity import CP, MP_TOL, PLANS, PP4, TRAJ_TOL

PAIRS = [("cp2_fsdp2", "tp2_fsdp2_sp"), ("tp2_fsdp2_sp", "pp2_fsdp2"), ("pp2_ddp2", "fsdp4"), ("pp2_fsdp2", "tp2_fsdp2_sp"),
         ("fsdp4", "pp2_fsdp2")]
# Pairs trained in mixed precision (fp32 masters, bf16 compute): the masters come back bit for bit.
MIXED = {("fsdp4", "pp2_fsdp2"): "bf16-mixed"}
# GPT: a fused QKV (TP holds each rank's heads of q, k and v: not one chunk of the weight) and a
# head tied to the embedding (under PP a copy on both end stages).
MODEL = {("tp2_fsdp2_sp", "pp2_fsdp2"): "gpt-tiny", ("pp2_fsdp2", "tp2_fsdp2_sp"): "gpt-tiny"}
ALL = {**PLANS, **PP4, **CP}  # a checkpoint saved with the sequence split over cp loads without it


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    cases = [{"name": f"{a}->{b}", "model": MODEL.get((a, b), "llama-tiny"), "save_plan": ALL[a], "load_plan": ALL[b],
              "dir": str(tmp_path_factory.mktemp(f"ckpt_{a}")), "mp": MIXED.get((a, b))} for a, b in PAIRS]
    res = dist_harness.run(4, cases)
    return cases, {c["name"]: [per_rank[i] for per_rank in res] for i, c in enumerate(cases)}


@pytest.mark.slow
@pytest.mark.xdist_group("checkpoint")
@pytest.mark.parametrize("pair", [f"{a}->{b}" for a, b in PAIRS])
def test_load_under_another_plan(launched, pair):
    per_rank = launched[1][pair]
    for r in per_rank:
        assert "error" not in r, f"{pair}: {r['error']}\n{r.get('tb', '')}"
        assert r["identical"], f"{pair}: weights differ after loading under {r['plans'][1]}: {r['differ']}"
        assert r["n"] == len(zoo.build(MODEL.get(tuple(pair.split("->")), "llama-tiny")).state_dict())
    r = per_rank[0]
    tol = MP_TOL if tuple(pair.split("->")) in MIXED else TRAJ_TOL  # the reference trains in fp32
    assert r["losses_after_load"] == pytest.approx(r["ref_losses"], abs=tol), \
        f"{pair}: after loading, {r['losses_after_load']} against one process's {r['ref_losses']}"
    assert len({tuple(r["losses_after_load"]) for r in per_rank}) == 1, "every rank trains on from the same state"


@pytest.mark.slow
@pytest.mark.xdist_group("checkpoint")
def test_another_gpu_count_replans_and_resumes(launched):
    """Written by 4 processes under FSDP 4; two processes plan afresh (plan="auto") and load it:
    the saved plan comes back with it, and training resumes on the same trajectory."""
    cases = launched[0]
    c = {"name": "4->2 auto", "model": "llama-tiny", "load_plan": "auto", "dir": cases[0]["dir"]}
    per_rank = [x[0] for x in dist_harness.run(2, [c])]
    for r in per_rank:
        assert "error" not in r, f"{r['error']}\n{r.get('tb', '')}"
        assert r["identical"] and r["saved_world"] == 4
        assert r["losses_after_load"] == pytest.approx(r["ref_losses"], abs=TRAJ_TOL)
    saved_under = launched[1][cases[0]["name"]][0]["saved_plan"]
    assert per_rank[0]["plans"][0] == saved_under  # the plan stored beside the checkpoint


@pytest.mark.slow
@pytest.mark.xdist_group("checkpoint")
def test_single_process_loads_a_distributed_checkpoint(launched):
    cases, _ = launched
    for c in cases:
        torch.manual_seed(2)
        model = zoo.build(c["model"])
        # The model alone (the optimizer's entries stay unread), each tensor once: a tied weight
        # is stored under its first name only.
        sd, seen = {}, set()
        for k, v in model.state_dict().items():
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                sd[k] = v
        dcp.load({"model": sd}, checkpoint_id=c["dir"])
        want = torch.load(f"{c['dir']}/full_state_dict.pt")
        got = model.state_dict()
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want), c["name"]
