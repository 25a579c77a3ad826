"""Command line: ``autopar explain``, ``estimate``, ``show``, ``diff``, ``export``, ``tune``, ``--version``.

Errors autopar raises for bad input print as one line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from autopar import __version__
from autopar.errors import AutoparError
from autopar.plan import PIN_KEYS, PLANNED_KEYS, PRECISION_ALIASES, PRECISIONS


def _hardware_names() -> list[str]:
    from autopar.cost_models.hardware import ALIASES, builtin_names

    return sorted({*builtin_names(), *ALIASES})


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="preset (llama3-8b, gpt-175b, ...), HuggingFace config.json, or package.module:factory")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--hardware", default="h100", help="a built-in profile (" + ", ".join(_hardware_names())
                   + ") or a JSON profile file")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: 4M tokens)")
    p.add_argument("--precision", choices=(*PRECISIONS, *(a for a in PRECISION_ALIASES if a[0].isalpha())),
                   default="bf16-mixed", metavar="PRECISION",
                   help="; ".join(f"{p.name}: {p.about}" for p in PRECISIONS.values())
                   + " (bf16 = bf16-mixed, fp16 = fp16-mixed; default bf16-mixed)")
    p.add_argument("--memory-limit-gb", type=float, default=None, help="per-GPU limit in GiB (default: the profile's)")
    p.add_argument("--ep-imbalance", type=float, default=1.0,
                   help="under expert parallelism, the busiest rank's routed tokens over the mean (default 1: even)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="autopar", description="Automatic parallelism planner for PyTorch training")
    ap.add_argument("--version", action="version", version=f"autopar {__version__}")
    ap.add_argument("-v", "--verbose", action="store_true", help="log stage timings")
    ap.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = ap.add_subparsers(dest="cmd", required=True)

    ex = sub.add_parser("explain", help="plan a model and explain the plan")
    _common(ex)
    ex.add_argument("--pin", default=None, help="fix part of the plan, e.g. tp=8,pp=4,ac=full; keys: "
                    + ", ".join(sorted(PLANNED_KEYS))
                    + "; once=gather: FSDP gathered once per step (ZeRO-1)")
    ex.add_argument("--top", type=int, default=3, help="runners-up to show")
    ex.add_argument("-o", "--output", default=None, help="save the plan JSON here")
    ex.add_argument("--graph", action="store_true", help="also print the first layer's rewritten graph with provenance")
    ex.add_argument("--plot", default=None, metavar="FILE.png",
                    help="draw the pipeline schedule and each rank's memory over one step")
    ex.add_argument("--checkpoint", default=None,
                    help="a checkpoint directory written by pm.save_checkpoint: show how the new plan differs "
                         "from the one it was saved under")

    es = sub.add_parser("estimate", help="price a plan you give (a hand-written configuration)")
    _common(es)
    es.add_argument("--plan", required=True, help='e.g. "tp=8,pp=8,dp=1,sp=1,fsdp=0,mb=2,ac=full,schedule=interleaved,v=4"; '
                    "keys: " + ", ".join(sorted(PIN_KEYS)) + "; once=gather (ZeRO-1, which autopar runs); how another framework "
                    "ran: once=reduce (FSDP under PP, gradients reduced once per step), unit=tensor (one FSDP gather per tensor), dp_overlap=0 (gradient all-reduce "
                    "after the backward), ep_overlap=1 (the expert all-to-alls under another microbatch's compute, DeepSeek's "
                    "DualPipe), ep_nodes=N (each routed token sent once to each of at most N nodes, DeepSeek's node-limited routing), "
                    "ep_fp8=1 (the routed tokens dispatched in FP8), cp=N (context parallelism: each sequence over N ranks)")
    es.add_argument("-o", "--output", default=None, help="save the plan JSON here")

    sh = sub.add_parser("show", help="explain a saved plan JSON without searching again")
    sh.add_argument("plan_file")
    sh.add_argument("--json", action="store_true")
    sh.add_argument("--plot", default=None, metavar="FILE.png",
                    help="draw the pipeline schedule and each rank's memory over one step")

    tu = sub.add_parser("tune", help="measure this machine and candidate plans")
    tsub = tu.add_subparsers(dest="tune_cmd", required=True)
    ca = tsub.add_parser("calibrate", help="microbenchmarks -> a calibrated hardware profile JSON")
    ca.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with GPUs, else gloo")
    ca.add_argument("--nproc", type=int, default=2, help="local processes (GPUs)")
    ca.add_argument("--base", default=None, help="profile to start from (default: h100 with GPUs, cpu-gloo without)")
    ca.add_argument("--max-mb", type=int, default=None, help="largest collective message, MiB")
    ca.add_argument("--reps", type=int, default=5)
    ca.add_argument("-o", "--output", default="calibrated.json")
    ca.add_argument("--plot", default=None, help="PNG of measured against fitted collective curves")
    ca.add_argument("--model", default=None,
                    help="also fit the compute efficiencies to this model's own operators (preset, config.json, pkg.mod:factory)")
    ca.add_argument("--batch", type=int, default=1, help="sequences per process for --model")
    ca.add_argument("--seq-len", type=int, default=None, help="sequence length for --model")
    tp_ = tsub.add_parser("plans", help="run the planner's top plans for real and pick the fastest")
    tp_.add_argument("model")
    tp_.add_argument("--nproc", type=int, default=2)
    tp_.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    tp_.add_argument("--hardware", default=None, help="profile used to rank the candidates (e.g. a calibrated one)")
    tp_.add_argument("--seq-len", type=int, default=None)
    tp_.add_argument("--global-batch", type=int, default=None)
    tp_.add_argument("--memory-limit-gb", type=float, default=None)
    tp_.add_argument("--top", type=int, default=4)
    tp_.add_argument("--steps", type=int, default=3)
    tp_.add_argument("--db", default=None, help="SQLite file of measurements (default ~/.cache/autopar/measurements.sqlite)")
    tp_.add_argument("--json", action="store_true")
    tp_.add_argument("-o", "--output", default=None, help="save the chosen plan here")

    df = sub.add_parser("diff", help="differences between two saved plans")
    df.add_argument("a")
    df.add_argument("b")

    xp = sub.add_parser("export", help="a saved plan as another framework's configuration")
    xp.add_argument("plan_file")
    xp.add_argument("--to", required=True, choices=("torchtitan", "megatron"),
                    help="torchtitan: job TOML tables; megatron: Megatron-LM pretrain_gpt.py arguments")
    xp.add_argument("-o", "--output", default=None, help="write it here (default: print it)")
    return ap


class _Progress:
    """A rich progress bar on stderr while the search runs, shown only when it runs long (after
    ``after_s``) and stderr is a terminal; rich is imported then, not before."""

    def __init__(self, after_s: float = 0.5):
        import time

        self.clock, self.start, self.after_s = time.perf_counter, time.perf_counter(), after_s
        self.bar = self.task = None

    def update(self, done: int, total: int) -> None:
        if self.bar is None:
            if not sys.stderr.isatty() or self.clock() - self.start < self.after_s:
                return
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("searching plans"), BarColumn(),
                                TextColumn("{task.completed}/{task.total} configs"), TimeElapsedColumn(), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("search", total=total)
        self.bar.update(self.task, completed=done, total=total)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        return _run(args)
    except AutoparError as e:
        if args.debug:
            raise
        print(f"autopar: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


MIN_SEQ_LEN = 16  # shorter is not a language-model training run


def _check_args(args) -> None:
    """Argument errors, before anything is loaded (a model can take seconds to trace)."""
    import os

    what = {"gpus": "the GPU count", "seq_len": "the sequence length", "global_batch": "the global batch",
            "nproc": "--nproc", "steps": "--steps"}
    for name in what:
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise AutoparError(f"{what[name]} must be positive, got {v}")
    if getattr(args, "seq_len", None) is not None and 0 < args.seq_len < MIN_SEQ_LEN:
        raise AutoparError(f"--seq-len {args.seq_len} is not a training sequence (the default 4M tokens a step "
                           f"would be {(1 << 22) // args.seq_len:,} sequences of {args.seq_len}): give at least "
                           f"{MIN_SEQ_LEN}, or leave it out for the model's own length")
    if getattr(args, "top", None) is not None and args.top < 0:
        raise AutoparError(f"--top is how many runners-up to show: 0 or more, got {args.top}")
    if getattr(args, "memory_limit_gb", None) is not None and args.memory_limit_gb <= 0:
        raise AutoparError(f"memory limit must be positive, got {args.memory_limit_gb} GB")
    hw = getattr(args, "hardware", None)
    if isinstance(hw, str) and not os.path.exists(hw):
        from autopar.cost_models.hardware import load

        load(hw)  # an unknown name: the error lists the known ones
    for out in (getattr(args, "output", None), getattr(args, "plot", None)):
        if out and not os.path.isdir(os.path.dirname(os.path.abspath(out))):
            raise AutoparError(f"cannot save to {out}: directory {os.path.dirname(os.path.abspath(out))} does not "
                               "exist; create it first")


def _plot(p, args) -> None:
    if getattr(args, "plot", None):
        from autopar.plot import plot_plan

        plot_plan(p, args.plot)
        print(f"schedule and memory picture written to {args.plot}", file=sys.stderr)


def _run(args) -> int:
    _check_args(args)
    from autopar import api, explain
    from autopar.plan import Plan

    if args.cmd == "tune":
        return _tune(args)
    if args.cmd == "diff":
        lines = Plan.load(args.a).diff(Plan.load(args.b))
        print("\n".join(lines) if lines else "plans are identical")
        return 0
    if args.cmd == "export":
        from autopar.export import export

        text = export(Plan.load(args.plan_file), args.to)
        if args.output:
            with open(args.output, "w") as f:
                f.write(text)
            print(f"{args.to} configuration written to {args.output}")
        else:
            print(text, end="")
        return 0
    if args.cmd == "show":
        p = Plan.load(args.plan_file)
        print(json.dumps(explain.plan_json(p), indent=1) if args.json else explain.render(p), end="" if not args.json else "\n")
        _plot(p, args)
        return 0
    common = dict(hardware=args.hardware, global_batch=args.global_batch, precision=args.precision,
                  memory_limit_gb=args.memory_limit_gb, seq_len=args.seq_len, ep_imbalance=args.ep_imbalance)
    if args.cmd == "explain":
        with _Progress() as prog:
            p = api.plan(args.model, args.gpus, pin=args.pin, top_k=args.top, progress=prog.update, **common)
    else:
        p, _, _ = api.estimate_plan(args.model, args.gpus, args.plan, **common)
    if args.output:
        p.save(args.output)
    _plot(p, args)
    if getattr(args, "graph", False) and not args.json:
        from autopar import inspect_graph, models

        src = models.resolve(args.model, seq_len=args.seq_len)
        print(inspect_graph.rewritten_graph(src.build, p), end="")
    old = _checkpoint_plan(args.checkpoint) if getattr(args, "checkpoint", None) else None
    if args.json:
        out = explain.plan_json(p)
        if old is not None:
            out["checkpoint"] = {"path": args.checkpoint, "saved_under": old.as_config_string(),
                                 "saved_world_size": old.world_size, "changes": old.diff(p)}
        print(json.dumps(out, indent=1))
    else:
        print(explain.render(p, top=getattr(args, "top", None)), end="")
        if old is not None:
            print(explain.render_checkpoint_change(args.checkpoint, old, p), end="")
        if args.output:
            print(f"plan saved to {args.output}")
    # A priced configuration that does not fit is an answer, not an error: said in words above,
    # and exit status 1 so that scripts notice.
    return 1 if args.cmd == "estimate" and not p.predicted.get("fits", True) else 0


def _checkpoint_plan(path: str):
    import os

    from autopar.errors import AutoparError
    from autopar.plan import Plan
    from autopar.runtime import ParallelModule

    plan_file = os.path.join(path, ParallelModule.PLAN_FILE)
    if not os.path.isdir(path):
        raise AutoparError(f"--checkpoint {path}: no such directory")
    if not os.path.exists(plan_file):
        raise AutoparError(f"--checkpoint {path}: no {ParallelModule.PLAN_FILE} there; checkpoints written with "
                           "pm.save_checkpoint(dir, optimizer) keep their plan beside the weights")
    return Plan.load(plan_file)


if __name__ == "__main__":
    sys.exit(main())


def _tune(args) -> int:
    import torch

    from autopar import explain, launch, tune
    from autopar.errors import AutoparError
    from autopar.plan import Plan

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and torch.cuda.device_count() < args.nproc:
        raise AutoparError(f"--nproc {args.nproc} needs {args.nproc} GPUs; {torch.cuda.device_count()} visible")
    if args.tune_cmd == "calibrate":
        base = args.base or ("h100" if backend == "nccl" else "cpu-gloo")
        max_bytes = args.max_mb * (1 << 20) if args.max_mb else None
        cal = launch.run(args.nproc, backend, tune.calibrate_rank, base, max_bytes, args.reps, args.model,
                         args.batch, args.seq_len)[0]
        with open(args.output, "w") as f:
            json.dump(cal.profile, f, indent=1)
        print(f"calibrated profile written to {args.output}: peak {cal.profile['peak_tflops']:.3g} TFLOP/s, "
              f"efficiency matmul {cal.profile['efficiency']['matmul']:.2f} attention "
              f"{cal.profile['efficiency']['attention']:.2f} memory {cal.profile['efficiency']['memory']:.2f}, memory "
              f"{cal.profile['memory_bandwidth_gbps']:.1f} GB/s, per-op {cal.profile['launch_us']:.1f} us")
        slots = cal.profile['compute_slots']
        print(f"  shared compute slots {f'{slots:.2f}' if slots else 'none (a device per rank)'}; eager overheads: "
              f"{cal.profile['tp_linear_us']:.0f} us per TP linear, {cal.profile['sp_op_us']:.0f} us per SP op, "
              f"{cal.profile['pp_microbatch_us']:.0f} us per pipeline microbatch and stage")
        if "model" in cal.points:
            m = cal.points["model"]
            print(f"  fitted to {m['model']}: measured " + ", ".join(
                f"{k} {v * 1e3:.1f} ms (at full efficiency {m['predicted_at_full_efficiency_s'][k] * 1e3:.1f} ms)"
                for k, v in m["measured_s"].items()))
        for kind, by_g in cal.profile["collectives"].items():
            print("  " + kind + ": " + ", ".join(f"{g} ranks alpha {a:.1f} us beta {b:.2f} GB/s" for g, (a, b) in by_g.items()))
        if args.plot and tune.plot(cal, args.plot):
            print(f"plot written to {args.plot}")
        return 0
    kw = {"seq_len": args.seq_len, "global_batch": args.global_batch, "hardware": args.hardware,
          "memory_limit_gb": args.memory_limit_gb}
    rows = launch.run(args.nproc, backend, tune._tune_rank, args.model, args.nproc, args.top, args.steps, kw, args.db)[0]
    best = Plan.from_json(rows[0]["plan_json"])
    if args.output:
        best.save(args.output)
    if args.json:
        print(json.dumps([{**{k: v for k, v in r.items() if k != "plan_json"},
                           "plan": Plan.from_json(r["plan_json"]).as_config_string()} for r in rows], indent=1))
    else:
        print(explain.render_tuning(rows), end="")
        reused = sum(r["reused"] for r in rows)
        print(f"chosen: {best.as_config_string()} (measured fastest that fits); "
              f"{reused} of {len(rows)} measurements reused from the database")
    return 0
