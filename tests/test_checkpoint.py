"""Checkpoints survive a change of plan: torch.distributed.checkpoint saves pm.state_dict() and the
optimizer's state (``get_optimizer_state_dict``) under one plan; another plan (or a single process
with the plain model, or another number of processes) loads them, the weights come back bit for bit
under their original names and training goes on along the single-process trajectory. The savers and
loaders are parity cases (``test_parity.CKPT``): their graphs are compiled once, for both. Gloo
processes, default options (Inductor on)."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests import dist_harness, zoo
from tests.test_parity import CKPT, CKPT_DIRS, GROUP, MP_TOL, TRAJ_TOL, _launch


def _resumed(per_rank: list[dict], model: str, tol: float) -> dict:
    """The loader's resumed run, checked: no error, the saved weights bit for bit on every rank,
    the single-process trajectory from the saved state, the same losses on every rank."""
    for r in per_rank:
        assert "error" not in r, f"{r['name']}: {r['error']}\n{r.get('tb', '')}"
        x = r["resumed"]
        assert x["identical"], f"{r['name']}: weights differ after loading under {x['plans'][1]}: {x['differ']}"
        assert x["n"] == len(zoo.build(model).state_dict())
    x = per_rank[0]["resumed"]
    assert x["losses"] == pytest.approx(x["ref_losses"], abs=tol), \
        f"after loading under {x['plans'][1]}: {x['losses']} against one process's {x['ref_losses']}"
    assert len({tuple(r["resumed"]["losses"]) for r in per_rank}) == 1, "every rank trains on from the same state"
    return x


def _single_process_load(saver: str) -> None:
    """The plain model loads the checkpoint alone (the optimizer's entries stay unread), each
    tensor once: a tied weight is stored under its first name only."""
    torch.manual_seed(2)
    model = zoo.build(saver.split("/")[0])
    sd, seen = {}, set()
    for k, v in model.state_dict().items():
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            sd[k] = v
    dcp.load({"model": sd}, checkpoint_id=CKPT_DIRS[saver])
    want = torch.load(f"{CKPT_DIRS[saver]}/full_state_dict.pt")
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want), saver


@pytest.mark.slow
@pytest.mark.parametrize("launch,saver,loader", [
    pytest.param(launch, s, d, id=f"{s}->{d.split('/')[1]}", marks=pytest.mark.xdist_group(GROUP[launch]))
    for launch, s, d in CKPT])
def test_load_under_another_plan(launch, saver, loader):
    res = _launch(launch)
    tol = MP_TOL if loader.endswith("_bf16") else TRAJ_TOL  # the reference trains in fp32
    x = _resumed(res[loader], loader.split("/")[0], tol)
    assert x["plans"][0] == res[saver][0]["saved_plan"]  # the plan stored beside the checkpoint
    _single_process_load(saver)


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP["plans"])
def test_another_gpu_count_replans_and_resumes():
    """Written by 4 processes under FSDP 4; two processes plan afresh (plan="auto") and load it:
    the saved plan comes back with it, and training resumes on the same trajectory."""
    saver = "llama-tiny/fsdp4"
    saved_under = _launch("plans")[saver][0]["saved_plan"]
    c = {"name": "4->2 auto", "model": "llama-tiny", "plan": "auto", "steps": 0, "load_ckpt": CKPT_DIRS[saver]}
    per_rank = [x[0] for x in dist_harness.run(2, [c])]
    x = _resumed(per_rank, "llama-tiny", TRAJ_TOL)
    assert x["saved_world"] == 4
    assert x["plans"][0] == saved_under  # the plan stored beside the checkpoint
