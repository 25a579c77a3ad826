"""Benchmark-driven tuning: fits, the measurements database, tuned choice, calibrate command."""

import copy
import json
import subprocess
import sys

import pytest
import torch

import autopar
from autopar import tune
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
                         tune_db=db, compile=False)
    rows = pm.tuning
    assert len(rows) >= 2 and not any(r["reused"] for r in rows)
    fitting = [r for r in rows if r["fits"]]
    assert pm.plan == rows[0]["plan"] and rows[0]["measured_s"] == min(r["measured_s"] for r in fitting)
    assert "tuning: predicted vs measured" in pm.explain()
    # The tuned model still trains exactly like one process.
    ref = build("llama-tiny")
    from autopar.capture import default_loss

    default_loss(ref(ids), tgt).backward()
    pm.step(ids, target=tgt)
    ref_g = dict(ref.named_parameters())
    assert max(float((p.grad - ref_g[n].grad).abs().max()) for n, p in pm.named_parameters()) < 1e-6
    again = autopar.compile(copy.deepcopy(model), 1, example_inputs=(ids,), tune=True, tune_top=3, tune_steps=1,
                            tune_db=db, compile=False)
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
