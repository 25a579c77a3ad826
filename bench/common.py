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
        "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
    }


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


def spawn_ranks(world: int, worker, *args, timeout: float = 3000) -> dict:
    """Run ``worker(rank, world, port, *args)`` in ``world`` spawned processes (``autopar.launch``;
    a rank that fails stops the others). Returns {rank: its result, or why it has none (a str)}."""
    from autopar import launch

    res = launch.spawn(world, worker, *args, timeout=timeout)
    out = {}
    for r in range(world):
        got = res.results[r][0] if res.results[r] else None
        out[r] = (got.message if isinstance(got, launch.Failed) else got) if got is not None else (
            f"rank {r}: no result (exit code {res.exitcodes[r]}{', timed out' if res.timed_out else ''})")
    return out
