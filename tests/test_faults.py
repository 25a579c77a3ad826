"""Bounded failure: an exception on one rank inside step() stops every rank within seconds,
each with an error that names the failing rank (4 real processes over gloo, default options)."""

import os
import subprocess
import sys
import time

import pytest

from autopar.launch import free_port

WORLD, FAIL = 4, 2


def _launch(script: str, extra: dict, timeout: float = 900):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(WORLD),
               PYTHONPATH=root, OMP_NUM_THREADS="1", **extra)
    procs = [subprocess.Popen([sys.executable, os.path.join(root, "tests", "scripts", script)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(WORLD)]
    return procs


@pytest.mark.slow
def test_an_error_every_rank_meets_is_raised_on_every_rank():
    """A bad pin fails on every rank alike: each raises its own AutoparError to the caller (a
    user's ``except AutoparError`` runs on all of them); none is stopped as if left in a collective."""
    procs = _launch("every_rank_same_error.py", {})
    outs = [p.communicate(timeout=300) for p in procs]
    for r, (out, err) in enumerate(outs):
        assert procs[r].returncode == 0, (r, out, err[-2000:])
        assert f"CAUGHT rank {r}: unknown pin 'tensor'" in out, (r, out, err[-2000:])
        assert "stops: it was waiting" not in err


@pytest.mark.slow
@pytest.mark.parametrize("hold", ["", "0"], ids=["all_in_step", "rank0_between_steps"])
def test_one_rank_raises_every_rank_stops(hold):
    """``rank0_between_steps``: rank 0, which serves the store, is between calls when rank 2 fails,
    so it raises at its next call and its process ends while ranks 1 and 3 still wait in the
    step's collective (before FailureWatch kept the store up for them, they hung at exit)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(WORLD),
               FAIL_RANK=str(FAIL), HOLD_RANK=hold, PYTHONPATH=root, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.join(root, "tests", "scripts", "one_rank_fails.py")],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(WORLD)]
    outs, ended = {}, {}
    deadline = time.time() + 900
    while len(ended) < WORLD and time.time() < deadline:
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = time.time()
        time.sleep(0.2)
    for r, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
        outs[r] = p.communicate()
    assert len(ended) == WORLD, f"ranks {sorted(set(range(WORLD)) - set(ended))} still running: " + outs[0][1][-2000:]
    err = outs[FAIL][1]
    assert procs[FAIL].returncode != 0 and "RAISED" in err, err[-3000:]
    assert "step() takes ids as integer token ids, got torch.float32" in err
    raised_at = float(err.split("RAISED ")[1].split()[0])
    for r in range(WORLD):
        if r == FAIL:
            continue
        out, e = outs[r]
        # (a rank may still be inside its first step's guarded call when the failure arrives: it stops there)
        assert procs[r].returncode != 0 and "NOT STOPPED" not in out, (r, out, e[-2000:])
        assert f"rank {FAIL} failed in step(): AutoparError: step() takes ids as integer token ids" in e, e[-2000:]
        assert ended[r] - raised_at < 30, f"rank {r} stopped {ended[r] - raised_at:.0f} s after rank {FAIL} failed"
