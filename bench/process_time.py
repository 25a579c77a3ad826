"""Whole processes, side by side (issue 11's targets): a bare ``import torch``, ``autopar
--version``, ``import torch, autopar``, and ``autopar explain llama3-8b --gpus 64`` with an empty
profile cache (the preset's profile ships with the package: no trace) and with the cache filled
by the run before; then the same model as a ``config.json`` with an empty cache, which is traced
(Dynamo's import included), reported without a target. Each is the median of 3 fresh processes;
the explain targets are relative to ``import torch``.

Targets: --version within 0.3 s of a bare Python start; import autopar within 0.5 s of import
torch; the whole explain within 1 s of import torch.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import write
from bench.planning_time import LLAMA3_8B_CONFIG

PY = sys.executable


def timed(argv: list[str], env: dict | None = None, reps: int = 3, fresh_cache: bool = False) -> float:
    out = []
    for _ in range(reps):
        e = dict(os.environ, **(env or {}))
        if fresh_cache:
            e["AUTOPAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-bench-")
        t = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, env=e)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> int:
    warm_cache = tempfile.mkdtemp(prefix="autopar-bench-warm-")
    config = os.path.join(warm_cache, "config.json")
    with open(config, "w") as f:
        json.dump(LLAMA3_8B_CONFIG, f)
    explain = [PY, "-m", "autopar", "explain", "llama3-8b", "--gpus", "64"]
    subprocess.run(explain, check=True, capture_output=True, env=dict(os.environ, AUTOPAR_CACHE_DIR=warm_cache))
    base = timed([PY, "-c", "pass"])
    torch_s = timed([PY, "-c", "import torch"])
    rows = [
        {"process": "python -c pass", "seconds": base, "over": "", "target_over_s": ""},
        {"process": "python -c 'import torch'", "seconds": torch_s, "over": "", "target_over_s": ""},
        {"process": "autopar --version", "seconds": timed([PY, "-m", "autopar", "--version"]), "over": "bare python",
         "target_over_s": 0.3},
        {"process": "python -c 'import torch, autopar'", "seconds": timed([PY, "-c", "import torch, autopar"]),
         "over": "import torch", "target_over_s": 0.5},
        {"process": "autopar explain llama3-8b --gpus 64 (profile cache empty)", "seconds": timed(explain, fresh_cache=True),
         "over": "import torch", "target_over_s": 1.0},
        {"process": "autopar explain llama3-8b --gpus 64 (profile cached)",
         "seconds": timed(explain, env={"AUTOPAR_CACHE_DIR": warm_cache}), "over": "import torch", "target_over_s": 1.0},
        # A model of the user's own (the same shapes as a config.json) is traced the first time.
        {"process": "autopar explain <Llama 3 8B config.json> --gpus 64 (profile cache empty: traced)",
         "seconds": timed([PY, "-m", "autopar", "explain", config, "--gpus", "64"], fresh_cache=True),
         "over": "import torch", "target_over_s": ""},
    ]
    for r in rows:
        ref = {"bare python": base, "import torch": torch_s}.get(r["over"])
        r["beyond_s"] = r["seconds"] - ref if ref is not None else ""
        r["meets"] = (r["beyond_s"] <= r["target_over_s"]) if ref is not None and r["target_over_s"] != "" else ""
        beyond = f"  (+{r['beyond_s']:.2f} s over {r['over']}" if ref is not None else ""
        if r["meets"] != "":
            beyond += f", target {r['target_over_s']} s: {'met' if r['meets'] else 'NOT met'})"
        elif beyond:
            beyond += ")"
        print(f"{r['process']:60s} {r['seconds']:.2f} s{beyond}")
    write("process_time", rows, {"targets met": all(r["meets"] for r in rows if r["meets"] != "")},
          ["process", "seconds", "over", "beyond_s", "target_over_s", "meets"],
          "Whole-process times (2-core CPU machine, median of 3 fresh processes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
