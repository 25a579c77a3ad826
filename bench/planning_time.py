"""Planning time on this machine, from model to plan (capture, analysis, costing, search), with
``import torch, autopar`` excluded, and peak RSS. Each case runs in a fresh process with an empty
profile cache, so that the numbers include the first fake-tensor use (whose ``FakeTensorMode``
imports Dynamo, about 1 s here) and nothing is cached between cases.

Targets (issue 11): planning beyond ``import torch, autopar`` within 0.3 s for llama3-8b on 64
H100 and within 1 s for llama3-405b on 16,384 (issue 2's were 1 s and 10 s, RSS < 4 GB). Each
row also says whether the search alone (the profile taken from the cache, as on every plan of a
model after its first) meets the target.
"""

import json
import os
import subprocess
import sys
import tempfile

from bench.common import write

CASES = [("llama3-8b", 64, 0.3), ("llama3-70b", 512, None), ("gpt-175b", 1024, None), ("llama3-405b", 16384, 1.0)]

CHILD = r"""
import json, resource, sys, time
import torch, autopar
from autopar import api
name, gpus = sys.argv[1], int(sys.argv[2])
t0 = time.perf_counter()
prof = api.profile_model(name)
t1 = time.perf_counter()
plan = api.plan(name, gpus, profiled=prof)
t2 = time.perf_counter()
print(json.dumps({"capture_s": t1 - t0, "search_s": t2 - t1, "total_s": t2 - t0,
                  "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "plan": plan.as_config_string(), "mfu": plan.predicted["mfu"]}))
"""


def main() -> int:
    rows, ok = [], True
    for name, gpus, target in CASES:
        env = dict(os.environ, AUTOPAR_CACHE_DIR=tempfile.mkdtemp(prefix="autopar-planning-"))
        out = subprocess.run([sys.executable, "-c", CHILD, name, str(gpus)], capture_output=True, text=True, check=True,
                             env=env)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r.update(model=name, gpus=gpus, target_s=target or "", meets=(r["total_s"] < target) if target else "",
                 search_meets=(r["search_s"] < target) if target else "")
        if target and not r["meets"]:
            ok = False
        rows.append(r)
        print(f"{name:12s} {gpus:6d} GPUs  capture {r['capture_s']:.2f}s  search {r['search_s']:.2f}s  "
              f"total {r['total_s']:.2f}s  RSS {r['rss_gb']:.2f} GB  -> {r['plan']}")
    write("planning_time", rows, {"all targets met": ok},
          ["model", "gpus", "capture_s", "search_s", "total_s", "target_s", "meets", "search_meets", "rss_gb", "plan"],
          "Planning time (2-core CPU machine, fresh process per case)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
