"""Benchmark-driven tuning: fits, the measurements database, tuned choice, calibrate command."""

import copy
import dataclasses
import json
import os
import subprocess
import sys

import pytest

import autopar
from autopar import launch, tune
from autopar.cost_models.hardware import load as load_hardware
from tests.dist_harness import batch, build


def test_alpha_beta_fit_recovers_line():
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    alpha_us, beta = 25.0, 3.0
    times = [alpha_us * 1e-6 + n / (beta * 1e9) for n in sizes]
    a, b = tune.fit_alpha_beta(sizes, times)
    assert a == pytest.approx(alpha_us, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


def test_spearman():
    assert tune.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert tune.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_tune_picks_measured_fastest_and_reuses(tmp_path):
    db = str(tmp_path / "m.sqlite")
    model = build("llama-tiny")
    ids, tgt = batch(1)
    pm = autopar.compile(copy.deepcopy(model), 1, example_inputs=(ids,), tune=True, tune_top=3, tune_steps=1,
                         tune_db=db)
    rows = pm.tuning
    assert len(rows) >= 2 and not any(r["reused"] for r in rows)
    fitting = [r for r in rows if r["fits"]]
    # The applied plan is the fastest measured one (compile adds the parameters' placements to it).
    assert dataclasses.replace(pm.plan, placements=(), tp_notes=()) == rows[0]["plan"]
    assert rows[0]["measured_s"] == min(r["measured_s"] for r in fitting)
    assert "tuning: predicted vs measured" in pm.explain()
    # The tuned model still trains exactly like one process.
    ref = build("llama-tiny")
    from autopar.capture import default_loss

    default_loss(ref(ids), tgt).backward()
    pm.step(ids, target=tgt)
    ref_g = dict(ref.named_parameters())
    assert max(float((p.grad - ref_g[n].grad).abs().max()) for n, p in pm.named_parameters()) < 1e-6
    again = autopar.compile(copy.deepcopy(model), 1, example_inputs=(ids,), tune=True, tune_top=3, tune_steps=1,
                            tune_db=db)
    assert all(r["reused"] for r in again.tuning)
    assert [r["measured_s"] for r in again.tuning] == [r["measured_s"] for r in rows]


def test_calibrate_command_four_processes(tmp_path):
    out = tmp_path / "cal.json"
    png = tmp_path / "cal.png"
    r = subprocess.run([sys.executable, "-m", "autopar", "tune", "calibrate", "--nproc", "4", "--max-mb", "1",
                        "--reps", "2", "-o", str(out), "--plot", str(png)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    prof = json.loads(out.read_text())
    hw = load_hardware(str(out))  # a profile the planner accepts
    assert hw.peak_tflops > 0 and hw.memory_bandwidth_gbps > 0 and hw.launch_us > 0
    for kind in tune.COLLECTIVES:
        for g in (("2",) if kind == "send_recv" else ("2", "4")):
            alpha, beta = prof["collectives"][kind][g]
            assert alpha >= 0 and beta > 0
    assert png.exists() and png.stat().st_size > 1000
    # Four processes share this machine's cores when it has fewer than four (one thread each).
    slots = min(4, os.cpu_count() or 1)
    assert hw.compute_slots == (slots if slots < 4 else 0)
    # Eager DTensor costs about a millisecond per TP linear on this CPU: it must be measured (the
    # TP and plain runs are timed in back-to-back pairs, so load from elsewhere hits both alike).
    assert hw.tp_linear_us > 0 and hw.sp_op_us >= 0 and hw.pp_microbatch_us >= 0
    assert len(hw.bandwidth_curve) >= 1 and all(b > 0 for _, b in hw.bandwidth_curve)
    assert "eager overheads" in r.stdout


def test_model_fit_reproduces_the_measured_step():
    """Efficiencies fitted to the model's own operators: priced with the fitted profile, the
    model's forward and backward at the calibration batch takes what was measured (each kind's
    share of the wall clock), unless an efficiency hit its bound."""
    from autopar import api
    from autopar.analysis import KIND_ATTN, KIND_MATMUL, KIND_OTHER
    from autopar.cost_models.compute import node_times

    ids, _ = batch(2)
    base = load_hardware("cpu-gloo")
    fit = tune.calibrate_model(base, lambda: build("llama-tiny"), (ids,), reps=2)
    hw = load_hardware(fit.profile)
    pts = fit.points
    assert pts["wall_s"] > 0 and sum(pts["measured_s"].values()) == pytest.approx(pts["wall_s"])
    prof = api.profile_model(build("llama-tiny"), example_inputs=(ids,)).profile
    names = {KIND_MATMUL: "matmul", KIND_ATTN: "attention", KIND_OTHER: "memory"}
    for kind, name in names.items():
        e = hw.eff(name)
        assert 0.01 <= e <= (4.0 if name == "memory" else 1.0)
        if not 0.01 < e < (4.0 if name == "memory" else 1.0):
            continue  # clamped: the fit cannot reproduce it
        t = 0.0
        for costs in [b.costs for b in prof.layer_sequence()] + [prof.pre.costs, prof.post.costs]:
            ct = node_times(costs.subset(costs.kind == kind), hw, mb=ids.shape[0], tp=1, sp=False, compiled=False)
            t += ct.fwd + ct.bwd
        assert t == pytest.approx(pts["measured_s"][name], rel=1e-6), name


def _turn_members(slots):
    import torch.distributed as dist

    out = tune._in_turns(slots, lambda group: sorted(dist.get_process_group_ranks(group)) if group is not None else None)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, out)
    return everyone


def test_in_turns_groups_ranks_by_slots():
    """Four ranks, two slots (also as a measured, fractional 2.3): ranks 0-1 take the first turn,
    2-3 the second; with as many slots as ranks, all run at once (no turn group)."""
    assert launch.run(4, "gloo", _turn_members, 2.3)[0] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert launch.run(4, "gloo", _turn_members, 4)[0] == [None] * 4
