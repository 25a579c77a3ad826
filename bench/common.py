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
