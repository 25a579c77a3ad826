"""For one model and several plans: autopar's graphs checked against what a slower, plainer way
makes, node for node, on a fake process group of ``world`` ranks (no process group for 1), with
default options (Inductor compiles every graph; nothing runs on the fake group). ``CHECK`` names
the check, set as its environment variable: ``AUTOPAR_STAMP`` (the joint graph built with runs of
identical layers copied against the replay of every layer, ``passes/stamp.py``), which raises
where the graphs differ. A plan's ``"mp"`` names the mixed
precision (passed as FSDP2's policy). Prints, per plan, JSON: what the distribute pass noted
(which layers were copied) or the error.
Usage: graph_check.py CHECK KIND WORLD PLAN_JSON..."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(check: str, kind: str, world: int, plans: list) -> list[dict]:
    """This script in a fresh process, each plan's line, asserted free of errors."""
    r = subprocess.run([sys.executable, os.path.abspath(__file__), check, kind, str(world), *map(json.dumps, plans)],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-3000:]
    out = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(out) == len(plans), r.stdout[-2000:] + r.stderr[-2000:]
    for o in out:
        assert "error" not in o, o
    return out


def main(check: str, kind: str, world: int, plans: list[str]) -> None:
    os.environ[check] = "check"
    os.environ["AUTOPAR_QUIET"] = "1"

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autopar
    from tests import zoo
    from tests.dist_harness import policy

    if world > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    base = kind.rsplit("-", 1)[0] if kind.endswith("layers") else kind
    for plan in plans:
        torch.manual_seed(0)
        model = zoo.build(kind)
        inputs, target = zoo.example(base, 0, B=8, S=16)
        p = json.loads(plan)
        mp = policy(p.pop("mp")) if "mp" in p else None
        try:
            pm = autopar.compile(model, world, example_inputs=inputs, example_target=target, plan=p,
                                 loss_fn=zoo.loss_of(kind), mp_policy=mp)
            print(json.dumps({"plan": plan, "copied": pm.info.notes.get("distribute", [])}), flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the test
            print(json.dumps({"plan": plan, "error": f"{type(e).__name__}: {e}"[:3000]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
