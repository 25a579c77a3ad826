"""``make bench``: every benchmark, results under bench/results/ (JSON + Markdown).

In order: micro benchmarks (pytest-benchmark: trace, pricing, search, compile setup), planning
time by model and cluster size, compile time by stage, step-time ratios against hand-written
baselines, cost-model error against measurements on this machine (before and after
calibration), and against the published torchtitan runs; one step's peak memory against FSDP2. ``--quick`` skips the multi-process
measurements (step ratios, tuning), which take most of the ~25 minutes on a 2-core machine.
"""

import os
import subprocess
import sys

from bench import (
    compile_time,
    memory,
    planning_time,
    process_time,
    reference_runs,
    step_ratio,
    tune_cpu,
)
from bench.common import RESULTS


def micro() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", os.path.join(here, "test_micro.py"),
                           f"--benchmark-json={os.path.join(RESULTS, 'micro.json')}"]).returncode


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    steps = [("micro (pytest-benchmark)", micro), ("planning_time", planning_time.main), ("process_time", process_time.main),
             ("reference_runs", reference_runs.main)]
    if "--quick" not in argv:
        steps += [("compile_time", lambda: compile_time.main([])), ("step_ratio", lambda: step_ratio.main([])),
                  ("memory", lambda: memory.main([])), ("tune_cpu", lambda: tune_cpu.main([]))]
    rc = 0
    for name, fn in steps:
        print(f"== {name}", flush=True)
        rc |= fn() or 0
    return rc


if __name__ == "__main__":
    sys.exit(main())
