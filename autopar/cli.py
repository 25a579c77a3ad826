"""Command line: ``autopar explain``, ``autopar estimate``, ``autopar diff``, ``autopar --version``.

Errors autopar raises for bad input print as one line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from autopar import __version__
from autopar.errors import AutoparError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="preset (llama3-8b, gpt-175b, ...), HuggingFace config.json, or package.module:factory")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--hardware", default="h100", help="built-in profile name or a JSON profile file")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: 4M tokens)")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--memory-limit-gb", type=float, default=None, help="per-GPU limit in GiB (default: the profile's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="autopar", description="Automatic parallelism planner for PyTorch training")
    ap.add_argument("--version", action="version", version=f"autopar {__version__}")
    ap.add_argument("-v", "--verbose", action="store_true", help="log stage timings")
    sub = ap.add_subparsers(dest="cmd", required=True)

    ex = sub.add_parser("explain", help="plan a model and explain the plan")
    _common(ex)
    ex.add_argument("--pin", default=None, help="fix part of the plan: tp=8,pp=4,ac=full,...")
    ex.add_argument("--top", type=int, default=3, help="runners-up to show")
    ex.add_argument("-o", "--output", default=None, help="save the plan JSON here")

    es = sub.add_parser("estimate", help="price a plan you give (a hand-written configuration)")
    _common(es)
    es.add_argument("--plan", required=True, help='e.g. "tp=8,pp=8,dp=1,sp=1,fsdp=0,mb=2,ac=full,schedule=interleaved,v=4"')
    es.add_argument("-o", "--output", default=None, help="save the plan JSON here")

    sh = sub.add_parser("show", help="explain a saved plan JSON without searching again")
    sh.add_argument("plan_file")
    sh.add_argument("--json", action="store_true")

    df = sub.add_parser("diff", help="differences between two saved plans")
    df.add_argument("a")
    df.add_argument("b")
    return ap


def _progress():
    """A rich progress bar on stderr while the search runs (silent when stderr is not a terminal)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn("searching plans"), BarColumn(), TextColumn("{task.completed}/{task.total} configs"),
                    TimeElapsedColumn(), transient=True, disable=not sys.stderr.isatty())
    task = prog.add_task("search", total=None)

    def update(done: int, total: int) -> None:
        prog.update(task, completed=done, total=total)

    return prog, update


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        return _run(args)
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from autopar import api, explain
    from autopar.plan import Plan

    if args.cmd == "diff":
        lines = Plan.load(args.a).diff(Plan.load(args.b))
        print("\n".join(lines) if lines else "plans are identical")
        return 0
    if args.cmd == "show":
        p = Plan.load(args.plan_file)
        print(json.dumps(explain.plan_json(p), indent=1) if args.json else explain.render(p), end="" if not args.json else "\n")
        return 0
    common = dict(hardware=args.hardware, global_batch=args.global_batch, precision=args.precision,
                  memory_limit_gb=args.memory_limit_gb, seq_len=args.seq_len)
    if args.cmd == "explain":
        prog, update = _progress()
        with prog:
            p = api.plan(args.model, args.gpus, pin=args.pin, top_k=args.top, progress=update, **common)
    else:
        p, _, _ = api.estimate_plan(args.model, args.gpus, args.plan, **common)
    if args.output:
        p.save(args.output)
    if args.json:
        print(json.dumps(explain.plan_json(p), indent=1))
    else:
        print(explain.render(p, top=getattr(args, "top", None)), end="")
        if args.output:
            print(f"plan saved to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
