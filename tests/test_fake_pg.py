"""On a fake process group of 64 and 256 ranks, the graph the TP pass produces issues exactly the
collectives (kind, bytes, count) that the plan and ``explain`` promise, per microbatch."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "fake_pg_collectives.py")


@pytest.mark.parametrize("sp,world", [(0, 64), (1, 64), (1, 256)])
def test_collectives_match_plan(sp, world):
    r = subprocess.run([sys.executable, SCRIPT, str(sp), str(world)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])
    assert d["got"] == d["want"]
    assert sum(d["got"].values()) > 0
