"""``autopar explain --plot FILE.png``: the plan's pipeline schedule and each rank's memory over
one step, as a picture.

The schedule is the one the runtime runs (``torch.distributed.pipelining``'s action lists for
the plan's schedule, ranks, microbatches and virtual stages), timed in units of one stage's
forward: a backward is two (three under full AC, which runs the forward again), split into
input and weight gradients (one each) in the zero-bubble schedules; an action starts when its
rank is free and its producer (the previous stage's forward, the next stage's backward) is done.
Memory follows the same actions: each forward adds one microbatch's saved activations to its
rank, each backward (input-gradient half) frees them, on top of what the rank holds throughout;
both are the plan's predictions (each rank's activations at its peak over its most microbatches
in flight), so the curve's top on each rank is that rank's predicted peak.
Without a pipeline the one rank runs its microbatches' forward and backward in turn.
"""

from __future__ import annotations

from autopar.errors import AutoparError
from autopar.plan import SCHEDULE_NAMES, Plan

_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#DD8452", "W": "#55A868"}


def shown_microbatches(plan: Plan) -> int:
    """At most four rounds of the pipeline (the steady state repeats): a multiple of pp."""
    cap = 4 * plan.pp if plan.pp > 1 else 4
    return min(plan.n_microbatches, cap)


def actions(plan: Plan) -> list[list[tuple[str, int, int]]]:
    """Per rank, its compute actions in order: (kind F/B/I/W, stage, microbatch)."""
    M = shown_microbatches(plan)
    if plan.pp == 1:
        return [[a for m in range(M) for a in (("F", 0, m), ("B", 0, m))]]
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(SCHEDULE_NAMES[plan.schedule], plan.pp, M, plan.v)
    out = []
    for rank_ops in ops:
        row = []
        for a in rank_ops:
            kind = _KINDS.get(a.computation_type.name) if a is not None else None
            if kind is not None:  # compute only (not the gradient reduction)
                row.append((kind, a.stage_index, a.microbatch_index))
        out.append(row)
    return out


def timeline(plan: Plan) -> list[list[tuple[str, int, int, float, float]]]:
    """Each rank's actions with start and end times (units of one stage forward)."""
    full_ac = any(l.ac == "full" for l in plan.layers)
    dur = {"F": 1.0, "B": 3.0 if full_ac else 2.0, "I": 2.0 if full_ac else 1.0, "W": 1.0}
    last = plan.pp * plan.v - 1
    todo = actions(plan)
    done: dict = {}  # (kind, stage, mb) -> end time
    free = [0.0] * len(todo)
    out: list[list] = [[] for _ in todo]
    pos = [0] * len(todo)

    def ready(kind, s, m):
        if kind == "F":
            return 0.0 if s == 0 else done.get(("F", s - 1, m))
        if kind == "W":
            return done.get(("I", s, m))
        own = done.get(("F", s, m))
        if s == last or own is None:
            return own
        nxt = done.get(("B", s + 1, m), done.get(("I", s + 1, m)))
        return None if nxt is None else max(own, nxt)

    while any(p < len(t) for p, t in zip(pos, todo)):
        progressed = False
        for r, row in enumerate(todo):
            while pos[r] < len(row):
                kind, s, m = row[pos[r]]
                t = ready(kind, s, m)
                if t is None:
                    break
                start = max(free[r], t)
                end = start + dur[kind]
                done[(kind, s, m)] = free[r] = end
                out[r].append((kind, s, m, start, end))
                pos[r] += 1
                progressed = True
        if not progressed:
            raise AutoparError(f"the {plan.schedule} schedule's actions could not be ordered for the picture")
    return out


def memory_curves(plan: Plan, tl) -> list[list[tuple[float, float]]]:
    """Each rank's memory (GiB) over the step: what it holds throughout, plus one microbatch's
    activations from each forward to its backward, scaled so that the rank's top is its predicted
    peak (less the reserve)."""
    pr = plan.predicted
    reserve = pr["memory_breakdown_gb"].get("reserve", 0.0)
    per_rank = pr.get("memory_gb_per_stage") or [pr["memory_gb_per_gpu"]]
    acts = pr.get("activations_gb_per_stage") or [pr["memory_breakdown_gb"]["activations"]] * len(per_rank)
    curves = []
    for r, row in enumerate(tl):
        level, peak, steps = 0, 0, []
        for t, d in sorted((e, +1 if k == "F" else -1) for k, _, _, _, e in row if k in ("F", "B", "I")):
            level += d
            peak = max(peak, level)
            steps.append((t, level))
        unit = acts[r] / max(1, peak)
        held = per_rank[r] - reserve - acts[r]
        curves.append([(0.0, held)] + [(t, held + unit * n) for t, n in steps])
    return curves


def plot_plan(plan: Plan, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise AutoparError("--plot needs matplotlib: pip install matplotlib") from e
    tl = timeline(plan)
    curves = memory_curves(plan, tl)
    shown = shown_microbatches(plan)
    span = max(e for row in tl for *_, e in row)
    fig, (ax, am) = plt.subplots(2, 1, figsize=(min(18, 4 + span * 0.25), 2.5 + 0.5 * len(tl) + 3), sharex=True,
                                 gridspec_kw={"height_ratios": [max(1, len(tl)), 3]})
    for r, row in enumerate(tl):
        for kind, s, m, start, end in row:
            ax.barh(r, end - start, left=start, color=_COLOURS[kind], edgecolor="white", linewidth=0.5, height=0.8)
            if end - start >= 0.8:
                ax.text((start + end) / 2, r, f"{m}" + (f"/{s}" if plan.v > 1 else ""), ha="center", va="center",
                        fontsize=7, color="white")
    ax.set_yticks(range(len(tl)), [f"pp rank {r}" for r in range(len(tl))])
    ax.invert_yaxis()
    name = f"{plan.schedule}, v={plan.v}" if plan.pp > 1 else "no pipeline"
    ax.set_title(f"{plan.model_name} on {plan.world_size} GPUs: {plan.as_config_string()}\n"
                 f"{name}, {plan.n_microbatches} microbatches of {plan.mb}"
                 + (f" (the first {shown} shown)" if shown < plan.n_microbatches else "") + " (label: microbatch"
                 + ("/stage" if plan.v > 1 else "") + f"); predicted {plan.predicted['step_time_s']:.3f} s/step",
                 fontsize=9)
    kinds = sorted({k for row in tl for k, *_ in row}, key="FIBW".index)
    ax.legend(handles=[Patch(color=_COLOURS[k], label={"F": "forward", "B": "backward", "I": "input gradient",
                                                       "W": "weight gradient"}[k]) for k in kinds],
              fontsize=7, loc="upper right")
    for r, curve in enumerate(curves):
        xs, ys = zip(*curve)
        am.step(xs, ys, where="post", label=f"pp rank {r}")
    limit = plan.predicted["memory_limit_gb"] - plan.predicted["memory_breakdown_gb"].get("reserve", 0.0)
    am.axhline(limit, color="red", linestyle="--", linewidth=1, label="limit less the reserve")
    am.set_ylabel("GiB per GPU")
    am.set_xlabel("time (units of one stage's forward of a microbatch)")
    am.set_ylim(bottom=0)
    am.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
