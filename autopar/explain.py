"""Render a Plan for people (rich tables) and for programs (one JSON object).

Everything shown comes from the Plan itself, so a saved plan explains itself without a search.
"""

from __future__ import annotations

import io
from itertools import groupby

from rich.console import Console
from rich.table import Table

from autopar.plan import MESH_DIMS, Plan, precision

BREAKDOWN_LABELS = {
    "compute": "compute (fwd + bwd)",
    "recompute": "recompute (activation checkpointing)",
    "tp_comm": "exposed TP/SP collectives",
    "cp_comm": "exposed CP key/value all-gathers and reduce-scatters",
    "ep_comm": "EP all-to-alls (routed rows, experts' weights)",
    "fsdp_comm": "exposed FSDP all-gather / reduce-scatter",
    "dp_comm": "exposed DP gradient all-reduce",
    "pp_p2p": "pipeline send/recv",
    "pp_tied_grads": "tied-weight gradient all-reduce (pipeline ends)",
    "pp_runtime": "pipeline schedule runtime",
    "tp_eager_overhead": "eager DTensor dispatch (TP/SP)",
    "bubble": "pipeline bubble",
    "shared_cores": "waiting for shared cores",
    "optimizer": "optimizer step",
}


def plan_json(p: Plan) -> dict:
    """The CLI's --json object: ``plan`` with the estimate keys, and the predictions beside it."""
    pr = p.predicted
    return {
        "plan": {
            "tp": p.tp, "pp": p.pp, "dp": p.dp, "sp": int(p.sp), "fsdp": int(p.fsdp), "mb": p.mb,
            "ac": p.ac_summary(), "schedule": p.schedule, "v": p.v, "dp_shard": p.dp_shard,
            "dp_replicate": p.dp // p.dp_shard, "reshard_after_forward": p.reshard_after_forward,
            "n_microbatches": p.n_microbatches, "mesh_shape": list(p.mesh_shape),
            "mesh_dim_names": list(MESH_DIMS),
            "layers": [{"fqn": l.fqn, "stage": l.stage, "chunk": l.chunk, "ac": l.ac} for l in p.layers],
        },
        "model": p.model_name, "gpus": p.world_size, "hardware": p.hardware, "global_batch": p.global_batch,
        "seq_len": p.seq_len, "precision": p.precision,
        "step_time_s": pr["step_time_s"], "tokens_per_s_per_gpu": pr["tokens_per_s_per_gpu"],
        "mfu": pr["mfu"], "memory_gb_per_gpu": pr["memory_gb_per_gpu"], "fits": pr["fits"],
        "breakdown": pr["breakdown"], "memory_breakdown_gb": pr["memory_breakdown_gb"],
        "collectives": list(p.collectives), "runners_up": list(p.runners_up),
    }


def _layer_rows(p: Plan):
    """Consecutive layers of one stack (an encoder's, a decoder's) with the same stage, chunk and
    AC mode, collapsed into one row."""
    for (stage, chunk, ac, _), grp in groupby(p.layers, key=lambda l: (l.stage, l.chunk, l.ac, l.fqn.rsplit(".", 1)[0])):
        g = list(grp)
        name = g[0].fqn if len(g) == 1 else f"{g[0].fqn} .. {g[-1].fqn.rsplit('.', 1)[-1]}"
        yield name, len(g), stage, chunk, ac


def _console(buf, width: int | None) -> Console:
    """Plain text: tables at the terminal's width (``COLUMNS`` honoured; 110 when not a
    terminal); a line of prose is left whole for the terminal to wrap (it stays greppable and
    pasteable)."""
    import shutil

    width = width or max(40, shutil.get_terminal_size((110, 24)).columns)
    return Console(file=buf, width=width, force_terminal=False, color_system=None, emoji=False, soft_wrap=True)


def render(p: Plan, *, width: int | None = None, top: int | None = None) -> str:
    buf = io.StringIO()
    con = _console(buf, width)
    pr = p.predicted
    dims = [(n, s) for n, s in zip(MESH_DIMS, p.mesh_shape) if n != "cp" or s > 1]
    cp = p.cp
    mesh = " x ".join(f"{n}={s}" for n, s in dims)
    con.print(f"[b]autopar plan[/b] for {p.model_name} on {p.world_size} x {p.hardware} "
              f"({p.precision}, global batch {p.global_batch} x {p.seq_len} tokens)")
    for note in p.notes:
        con.print(f"note: {note}")
    con.print(f"precision: {p.precision} ({precision(p.precision).about})")
    con.print(f"mesh: {mesh}")
    extras = []
    if p.tp > 1:
        extras.append(f"TP {p.tp}" + (" + SP" if p.sp else ""))
    if cp > 1:
        extras.append(f"CP {cp} (each sequence over {cp} ranks; FSDP shards over dp_shard x cp)")
    if p.ep > 1:
        beyond = f"; their FSDP shards over all {p.dp_shard} ranks of dp_shard" if p.fsdp and p.dp_shard > p.ep else ""
        extras.append(f"EP {p.ep} (each routed experts' block's experts over {p.ep} data-parallel ranks{beyond})")
    if p.pp > 1:
        extras.append(f"PP {p.pp} ({p.schedule}" + (f", v={p.v}" if p.v > 1 else "") + f", {p.n_microbatches} microbatches of {p.mb})")
    else:
        extras.append(f"microbatch {p.mb} x {p.n_microbatches} accumulation steps")
    if p.fsdp:
        hs = f"HSDP {p.dp // p.dp_shard} x {p.dp_shard}" if p.dp_shard != p.dp else f"FSDP {p.dp}"
        if p.fsdp_once == "gather":
            extras.append(hs + ", gathered once per step and gradients reduced once (ZeRO-1)")
        else:
            extras.append(hs + (", reshard after forward" if p.reshard_after_forward else ", no reshard after forward"))
    elif p.dp > 1:
        extras.append(f"DDP {p.dp}")
    extras.append(f"AC {p.ac_summary()}")
    con.print("plan: " + "; ".join(extras))
    if p.pins:
        con.print(f"pinned: {', '.join(f'{k}={v}' for k, v in p.pins.items())}")
    con.print(f"predicted: {pr['step_time_s']:.3f} s/step, {pr['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
              f"MFU {pr['mfu'] * 100:.1f}%, {pr['memory_gb_per_gpu']:.1f} GiB/GPU of {pr['memory_limit_gb']:.1f}")
    for line in memory_warnings(pr):
        con.print(line)

    t = Table(title="layers", show_lines=False)
    for c in ("layers", "count", "pp rank", "chunk", "AC"):
        t.add_column(c)
    for name, n, stage, chunk, ac in _layer_rows(p):
        t.add_row(name, str(n), str(stage), str(chunk), ac)
    con.print(t)

    if p.tp > 1:
        t = Table(title=f"tensor-parallel sharding (TP {p.tp}" + (" + SP)" if p.sp else ")"))
        for c in ("scope", "module", "style"):
            t.add_column(c)
        for scope, module, style in _collapse_numbered([(r.scope, r.module, r.style) for r in p.shard_rules
                                                        if r.style != "sequence" or p.sp]):
            t.add_row(scope, module, style)
        con.print(t)

    t = Table(title="step time breakdown")
    t.add_column("component")
    t.add_column("seconds", justify="right")
    t.add_column("share", justify="right")
    total = pr["step_time_s"]
    for k, v in pr["breakdown"].items():
        if abs(v) < 1e-9:
            continue
        t.add_row(BREAKDOWN_LABELS.get(k, k), f"{v:.4f}", f"{v / total * 100:.1f}%")
    t.add_row("total", f"{total:.4f}", "100%")
    con.print(t)

    t = Table(title="memory per GPU (peak pipeline rank)")
    t.add_column("component")
    t.add_column("GiB", justify="right")
    for k, v in pr["memory_breakdown_gb"].items():
        t.add_row(k, f"{v:.2f}")
    t.add_row("total", f"{pr['memory_gb_per_gpu']:.2f}")
    con.print(t)

    t = Table(title="collectives inserted (busiest rank, per step)")
    for c in ("kind", "group", "size", "bytes each", "count", "why"):
        t.add_column(c)
    for c in p.collectives:
        t.add_row(c["kind"], c["group"], str(c["group_size"]), _bytes(c["bytes"]), f"{c['count']:,}", c["why"])
    con.print(t)

    if len(p.schedules) > 1:
        t = Table(title=f"pipeline schedules on this mesh (pp={p.pp}, {p.n_microbatches} microbatches of {p.mb})")
        for c in ("schedule", "v", "s/step", "bubble s", "GiB/GPU", "vs chosen"):
            t.add_column(c)
        for r in p.schedules:
            chosen = r["schedule"] == p.schedule and r["v"] == p.v
            t.add_row(r["schedule"], str(r["v"]), f"{r['step_time_s']:.3f}", f"{r['bubble_s']:.3f}",
                      f"{r['memory_gb_per_gpu']:.1f}",
                      "chosen" if chosen else f"{(r['step_time_s'] / p.predicted['step_time_s'] - 1) * 100:+.1f}%")
        con.print(t)

    runners = p.runners_up[:top] if top is not None else p.runners_up
    if runners:
        # One plan a line, never cut (it can be pasted into --pin / estimate --plan); the numbers
        # and the reason on the next line, wrapped to the terminal.
        con.print("runners-up (best plan of each other shape):")
        for r in runners:
            con.print(f"  {r['config']}  AC {r['ac']}")
            con.print(f"      {r['step_time_s']:.3f} s/step, MFU {r['mfu'] * 100:.1f}%, "
                      f"{r['memory_gb_per_gpu']:.1f} GiB/GPU: {r['why_lost']}")
    return buf.getvalue()


def _collapse_numbered(rows: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """Rows that differ only in a module index (``mlp.experts.7.up_proj``) as one row
    (``mlp.experts.0..255.up_proj``), in the order of their first."""
    import re

    groups: dict = {}
    for scope, module, style in rows:
        key = (scope, re.sub(r"\.\d+(?=\.|$)", ".#", module), style)
        groups.setdefault(key, []).append(module)
    out = []
    for (scope, pattern, style), modules in groups.items():
        modules = list(dict.fromkeys(modules))  # a rule listed twice is one row
        if len(modules) == 1:
            out.append((scope, modules[0], style))
            continue
        idx = [int(re.findall(r"\.(\d+)(?=\.|$)", m)[0]) for m in modules]
        out.append((scope, pattern.replace("#", f"{min(idx)}..{max(idx)}", 1) + f" ({len(modules)})", style))
    return out


def _bytes(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def render_tuning(rows: list[dict], width: int | None = None) -> str:
    """Predicted against measured step time of the plans ``autopar tune`` ran."""
    buf = io.StringIO()
    con = _console(buf, width)
    t = Table(title="tuning: predicted vs measured (fastest fitting plan first)")
    for c in ("plan", "predicted s", "measured s", "measured/predicted", "peak GiB", "fits", "reused"):
        t.add_column(c)
    for r in rows:
        p = r["plan"] if isinstance(r["plan"], Plan) else Plan.from_json(r["plan_json"])
        t.add_row(p.as_config_string(), f"{r['predicted_s']:.4f}", f"{r['measured_s']:.4f}",
                  f"{r['measured_s'] / r['predicted_s']:.2f}", f"{r['peak_memory_gb']:.3f}",
                  "yes" if r["fits"] else "no", "yes" if r["reused"] else "")
    con.print(t)
    return buf.getvalue()


# How far published runs' peak memory (the allocator's reserved peak: fragmentation included) sat
# above the cost model's prediction for the same runs (bench/reference_runs, torchtitan's Llama 3
# runs on H100): the 75th percentile of published / predicted - 1 over the runs that publish it
# (0.135 over 20 runs with the moment-based peak, 2026-11-27).
MEMORY_UNDERPREDICTION = 0.13


def memory_warnings(pr: dict) -> list[str]:
    """Lines for a plan over the memory limit, or within the memory model's error of it."""
    mem, limit = pr.get("memory_gb_per_gpu", 0.0), pr.get("memory_limit_gb", 0.0)
    if not limit:
        return []
    if not pr.get("fits", mem <= limit):
        return [f"DOES NOT FIT: {mem:.1f} GiB/GPU predicted, {limit:.1f} GiB available "
                f"({mem - limit:.1f} GiB over); add GPUs, activation checkpointing (ac=full), TP or FSDP"]
    if mem * (1 + MEMORY_UNDERPREDICTION) > limit:
        return [f"warning: {limit - mem:.1f} GiB below the limit; published runs used up to "
                f"{MEMORY_UNDERPREDICTION:.0%} more than predicted (75th percentile, bench/reference_runs), "
                "so this plan may not fit; plan with a lower --memory-limit-gb to leave room"]
    return []


def render_executed(info, *, width: int | None = None) -> str:
    """What the executor did: each collective of the compiled graphs (kind, group size, bytes,
    the pass that inserted it and the node or parameter it came from) and the passes' notes."""
    buf = io.StringIO()
    con = _console(buf, width)
    for name, recs in info.collectives.items():
        where = "run once per step, outside the graphs" if name == "once per step" else f"in the compiled {name} graphs"
        t = Table(title=f"collectives {where} ({len(recs)})")
        for c in ("graph", "kind", "group", "MiB", "dtype", "pass", "from"):
            t.add_column(c, min_width=14 if c == "kind" else None)  # "reduce_scatter" whole
        for r in recs:
            kind = r["kind"].removesuffix("_into_tensor").removesuffix("_tensor")  # all_gather, reduce_scatter
            t.add_row(r["graph"], kind, str(r["group_size"]), _mib(r["bytes"]), r.get("dtype", ""),
                      r["pass"], r["source"] or r["module"])
        con.print(t)
    for name, lines in info.notes.items():
        for line in lines:
            con.print(f"[{name}] {line}")
    if info.timings:
        con.print("pass times: " + ", ".join(f"{k} {v:.2f}s" for k, v in info.timings.items()))
    return buf.getvalue()


def _mib(nbytes: int | None) -> str:
    return f"{nbytes / 2**20:.3f}" if nbytes is not None else "routed"  # None: sized by the routed rows


def render_compile_time(info) -> str:
    """How long ``autopar.compile`` took on this rank (``runtime.CompileInfo``), and how much of it Inductor."""
    if info.compile_s is None:
        return ""
    t = info.timings
    inductor = sum(v for k, v in t.items() if k.split()[-1] == "inductor")
    passes = sum(v for k, v in t.items() if k.split()[-1] != "inductor")
    return (f"autopar.compile took {info.compile_s:.1f} s on this rank: graph passes {passes:.1f} s, "
            f"Inductor {inductor:.1f} s, the rest capture and planning\n")


def render_checkpoint_change(path: str, old: Plan, new: Plan) -> str:
    """How a new plan differs from the one a checkpoint was saved under, and how to load it."""
    lines = [f"checkpoint {path}: saved under {old.as_config_string()} on {old.world_size} GPUs",
             f"this plan:  {new.as_config_string()} on {new.world_size} GPUs"]
    if old.model_fingerprint != new.model_fingerprint:
        lines.append(f"note: the checkpoint's model ({old.model_name}) traces differently from {new.model_name}; "
                     "loading fails on any parameter whose name or shape differs")
    changes = [c for c in old.diff(new) if not c.startswith(("placements", "tp_notes", "schedules", "notes"))]
    lines += ["changes:"] + [f"  {c}" for c in changes[:40]]
    if len(changes) > 40:
        lines.append(f"  ... {len(changes) - 40} more")
    lines.append("load it under this plan with pm.load_checkpoint(path, optimizer): each rank reads the pieces "
                 "its shards need (torch.distributed.checkpoint resharding)")
    return "\n".join(lines) + "\n"
