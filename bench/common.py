"""Shared helpers for the benchmark scripts: machine description and result writing."""

import json
import os
import platform
import time

import torch

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def machine() -> dict:
    return {
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "cpus": os.cpu_count(), "cpu": _cpu_model(), "python_loop_s": _python_speed(), "date": time.strftime("%Y-%m-%d"),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def _python_speed() -> float:
    """Seconds for ten million iterations of a Python loop (the best of three): how fast this
    machine runs Python, which most of a compile is, so runs on different machines compare."""
    best = float("inf")
    for _ in range(3):
        t, s = time.perf_counter(), 0
        for i in range(10_000_000):
            s += i
        best = min(best, time.perf_counter() - t)
    return round(best, 2)


def run_depths(argv, world: int, run, finish) -> list[dict]:
    """``--layers 4,8 --steps 3`` from ``argv``: ``run(layers, steps)`` on ``world`` gloo processes
    per depth (a fresh Inductor cache unless one is set), each row the worst rank's
    (``worst_rank``), completed by ``finish(row, layers)`` and printed."""
    import argparse
    import tempfile

    from autopar import launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="4")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="autopar-inductor-"))
    rows = []
    for layers in map(int, args.layers.split(",")):
        row = worst_rank(launch.run(world, "gloo", run, layers, args.steps))
        finish(row, layers)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        rows.append(row)
    return rows


def add_ratios(row: dict, ratios: dict) -> None:
    """``row[name] = row[a] / row[b]`` for each ``name: (a, b)`` of ``ratios``."""
    for name, (a, b) in ratios.items():
        row[name] = row[a] / row[b]


def worst_rank(per: list[dict]) -> dict:
    """Rank 0's row with every time (``_s``) and memory (``_mib``) the largest over the ranks."""
    row = dict(per[0])
    for k in row:
        if k.endswith(("_mib", "_s")):
            row[k] = max(x[k] for x in per)
    return row


def write(name: str, rows: list[dict], summary: dict, columns: list[str], title: str, extra: dict | None = None) -> None:
    """``name``.json (machine, summary, rows and ``extra``) and ``name``.md (a table of ``columns``)."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump({"machine": machine(), "summary": summary, "rows": rows, **(extra or {})}, f, indent=1, default=str)
    lines = [f"# {title}", "", f"Machine: {machine()}", ""]
    lines += [f"- {k}: {v}" for k, v in summary.items()] + [""]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
