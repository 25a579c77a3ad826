"""Search: the fastest configuration that fits, found exactly by branch and bound over a MILP.

Two levels.

**Outer (enumerated).** Every mesh ``pp x dp x tp = N`` (``tp`` divides every head count and
sharded dimension, ``pp <= layers``), sequence parallelism, FSDP (shard degree ``dp_shard | dp``,
HSDP when smaller, reshard after forward or not), microbatch size ``mb | B/dp``, schedule and
virtual stages, expert parallelism (``ep | dp_shard`` and the experts). TP stays inside a node
unless pinned or nothing fits there. Pins remove whatever they fix. Each such *configuration* ``c`` has a
``StageModel`` whose per-layer coefficients do not depend on how layers are placed.

**Inner (MILP, HiGHS through ``highspy``).** For configuration ``c`` with ``pp`` ranks,
``L`` layers and ``M`` microbatches, integer variables per rank ``r``: ``n_r`` layers, of which
``s_r`` use selective and ``f_r`` full AC; a continuous ``z`` for the bottleneck::

    minimise   a z + b sum_r t_r                    a = M - zeta/v,  b = zeta/v    (PP)
                                                    a = 0, b = M                   (no PP)
    t_r   = n_r T_none + s_r (T_sel - T_none) + f_r (T_full - T_none) + C_r       (time, per mb)
    mem_r = F_r + n_r (S + i_r A_none) + s_r i_r (A_sel - A_none) + f_r i_r (A_full - A_none)
    s.t.   t_r <= z,   mem_r <= limit,   s_r + f_r <= n_r,   sum_r n_r = L,   n_r >= v

(``zeta``: the share of the bubble the schedule leaves, 1 but for zero-bubble schedules; the
objective is then exactly ``StageModel.critical_path`` less its constant terms), where ``T, A, S``
are the layer's time, saved activations and static bytes, ``i_r`` the rank's
microbatches in flight (``StageModel.inflight``) and ``C_r, F_r`` the embedding/head/p2p terms
on the first and last rank. Layer repetition is what makes this small: the variables are counts,
not layers, so the solve time does not grow with depth.

**Branch and bound.** Every configuration gets a closed-form *lower bound* (balanced
fractional layers, the cheapest allowed AC, no memory limit); in order of it, configurations get
an *upper bound* (balanced layers, the cheapest AC mix per rank that fits, found by enumeration)
until no configuration left can enter the top ``top_k + 1`` shapes. A pipelined configuration
among those whose bounds differ then gets its MILP's LP relaxation (about a millisecond): a
tighter lower bound and, rounded, a better upper bound. In order of LP bound, while a bound is
below the best time found, the MILP proves or improves the configuration's time: the winner is
the exact optimum of the model over the whole space (a runner-up is the best assignment found for
its shape). Ties are broken by the configuration key, so the same input always gives the same plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from autopar.cost_models.step import (
    AC_MODES,
    SCHEDULES,
    Assignment,
    Config,
    CostContext,
    Estimate,
    StageModel,
    divisors,
    valid_tp_degrees,
    validate_cp,
    validate_ep,
)
from autopar.errors import AutoparError, InfeasibleError
from autopar.plan import ESTIMATE_ONLY, PIN_KEYS, RUNS

log = logging.getLogger(__name__)



@dataclass
class Candidate:
    sm: StageModel
    lower: float
    upper: float
    upper_assignment: Assignment | None
    solved: Estimate | None = None


@dataclass
class SearchResult:
    best: Estimate
    runners_up: list[Estimate]
    n_configs: int
    n_priced: int  # configurations that fit, among those given an upper bound
    n_milp: int
    seconds: float
    stats: dict = field(default_factory=dict)
    # The best plan of each pipeline schedule on the winner's mesh and microbatching, fastest first.
    schedules: list[Estimate] = field(default_factory=list)


def parse_pins(text: str | dict | None) -> dict:
    """``"tp=8,pp=4,ac=full"`` -> ``{"tp": 8, "pp": 4, "ac": "full"}``, checked."""
    if not text:
        return {}
    items = text.items() if isinstance(text, dict) else (kv.split("=", 1) for kv in text.split(",") if kv.strip())
    out: dict = {}
    seen: dict[str, str] = {}
    for item in items:
        if len(item) != 2:
            raise AutoparError(f"pin {'='.join(item)!r} is not key=value; keys: {', '.join(sorted(PIN_KEYS))}")
        k, v = (str(int(x)) if isinstance(x, bool) else str(x).strip() for x in item)
        if k not in PIN_KEYS:
            raise AutoparError(f"unknown pin {k!r}; known: {', '.join(sorted(PIN_KEYS))}")
        if k in seen:
            what = "repeated" if seen[k] == v else f"given twice with different values ({k}={seen[k]} and {k}={v})"
            raise AutoparError(f"pin {k!r} is {what}; give each key once")
        seen[k] = v
        if k == "ac":
            if v not in AC_MODES:
                raise AutoparError(f"ac={v!r}: choose one of {', '.join(AC_MODES)}")
            out[k] = v
        elif k == "once":
            if v not in ("microbatch", "reduce", "gather", ""):  # "": microbatch, as a parsed pin holds it
                raise AutoparError(f"once={v!r}: choose microbatch (FSDP gathers and reduces per microbatch), "
                                   "reduce (gradients reduced once per step) or gather (parameters also kept "
                                   "gathered for the step)")
            out[k] = "" if v == "microbatch" else v
        elif k == "unit":
            if v not in ("layer", "tensor"):
                raise AutoparError(f"unit={v!r}: choose layer (one FSDP all-gather per layer) or tensor (one per "
                                   "parameter tensor, each waited before the next, as DeepSpeed ZeRO-3 until mid-2021)")
            out[k] = v
        elif k == "schedule":
            v = {"interleaved1f1b": "interleaved", "interleaved_1f1b": "interleaved", "zb": "interleaved_zb",
                 "zero_bubble": "interleaved_zb", "interleavedzerobubble": "interleaved_zb",
                 "zbvzerobubble": "zbv"}.get(v.lower(), v.lower())
            if v not in SCHEDULES:
                raise AutoparError(f"schedule={v!r}: choose one of {', '.join(SCHEDULES)}")
            out[k] = v
        else:
            try:
                iv = int(v)
            except ValueError:
                raise AutoparError(f"pin {k}={v!r} must be an integer") from None
            flag = k in ("sp", "fsdp", "reshard", "dp_overlap", "ep_overlap", "ep_fp8")
            if iv < (0 if flag or k in ("prefetch", "ep_nodes") else 1) or (flag and iv > 1):
                raise AutoparError(f"pin {k}={iv} is out of range" + (" (0 or 1)" if flag else ""))
            out[k] = bool(iv) if flag else iv
    return out


def estimate_only(pins: dict) -> dict:
    """The pins that ask for something only ``autopar estimate`` prices (``ESTIMATE_ONLY`` away
    from its default: what autopar's executor does)."""
    return {k: v for k, v in pins.items() if k in ESTIMATE_ONLY and v not in RUNS[k]}


def check_pins(ctx: CostContext, world: int, pins: dict) -> None:
    """Clear errors for pins that can never work, before searching."""
    m = ctx.model
    for k, v in estimate_only(pins).items():
        raise AutoparError(f"{k}={v} is priced by `autopar estimate` only: {ESTIMATE_ONLY[k]}, so the planner does "
                           "not choose it")
    prod = 1
    for k in ("tp", "pp", "dp", "cp"):
        prod *= pins.get(k, 1)
    if world % prod:
        fixed = " x ".join(f"{k}={pins[k]}" for k in ("tp", "pp", "dp", "cp") if k in pins)
        raise AutoparError(f"pins {fixed} (product {prod}) do not divide the {world} GPUs; choose degrees whose product divides {world}")
    if "tp" in pins and pins["tp"] > 1 and m.max_tp_check(pins["tp"]):
        raise AutoparError(
            f"tp={pins['tp']} does not divide {', '.join(m.max_tp_check(pins['tp']))} of {m.name}; "
            f"valid TP degrees: {', '.join(str(t) for t in valid_tp_degrees(m, world) if world % t == 0)}"
        )
    if "pp" in pins and pins["pp"] > m.n_layers:
        raise AutoparError(f"pp={pins['pp']} exceeds the {m.n_layers} layers of {m.name}")
    if "dp" in pins and ctx.global_batch % pins["dp"]:
        raise AutoparError(f"dp={pins['dp']} does not divide the global batch of {ctx.global_batch} sequences")
    if pins.get("sp") and pins.get("tp", 2) == 1:
        raise AutoparError("sp=1 needs tp > 1")
    validate_cp(m, pins.get("cp", 1))
    validate_ep(m, pins.get("ep", 1), pins.get("dp"))
    if pins.get("sp") and pins.get("tp", 1) > 1 and m.seq_len % pins["tp"]:
        raise AutoparError(f"sp=1 splits each {m.seq_len}-token sequence over tp={pins['tp']} ranks, which does not "
                           f"divide it; use sp=0, or a tp that divides {m.seq_len}")


def schedule_options(pp: int, M: int, n_layers: int) -> list[tuple[str, int]]:
    """The (schedule, virtual stages) a pipeline of ``pp`` stages and ``M`` microbatches can run."""
    if pp == 1:
        return [("1f1b", 1)]
    return [("gpipe", 1), ("1f1b", 1)] + [
        (s, v) for s in ("interleaved", "interleaved_zb") for v in (2, 4, 8) if pp * v <= n_layers and M % pp == 0
    ] + ([("zbv", 2)] if pp * 2 <= n_layers else [])


# Schedules the cost model never prefers, and the one that beats each on the same mesh: GPipe
# prices 1F1B's time with every microbatch's activations held; interleaved 1F1B prices interleaved
# zero bubble's memory with a bubble as large or larger. The search skips them unless pinned
# (brute force over every schedule checks it); ``explain``'s schedule table still prices them.
DOMINATED = {"gpipe": "1f1b", "interleaved": "interleaved_zb"}


def enumerate_configs(ctx: CostContext, world: int, pins: dict) -> list[Config]:
    m, B = ctx.model, ctx.global_batch
    out = []
    tps = [t for t in divisors(world) if not m.max_tp_check(t)]
    for tp in tps:
        if "tp" in pins and tp != pins["tp"]:
            continue
        for pp, cp in ((p, c) for p in divisors(world // tp) for c in cp_options(ctx, world // tp // p, pins)):
            if pp > m.n_layers or ("pp" in pins and pp != pins["pp"]):
                continue
            dp = world // (tp * pp * cp)
            if B % dp or ("dp" in pins and dp != pins["dp"]) or dp % pins.get("ep", 1):
                continue
            for mb in divisors(B // dp):
                if "mb" in pins and mb != pins["mb"]:
                    continue
                M = B // dp // mb
                if pp > 1 and M < pp:
                    continue
                for sched, v in schedule_options(pp, M, m.n_layers):
                    if "schedule" in pins and pp > 1 and sched != pins["schedule"]:
                        continue
                    if "v" in pins and v != pins["v"]:
                        continue
                    for sp in ([False, True] if tp > 1 and m.seq_len % tp == 0 else [False]):
                        if "sp" in pins and sp != pins["sp"]:
                            continue
                        fs_opts = [(False, 1, True, "")]  # (fsdp, shard degree, reshard, once)
                        if dp > 1:
                            # HSDP shard groups span whole nodes (or are all of dp).
                            gpn = ctx.hw.gpus_per_node
                            shards = [d for d in divisors(dp) if d > 1 and
                                      (d == dp or (d * tp) % gpn == 0 or pins.get("dp_shard") == d)]
                            fs_opts += [(True, d, r, "") for d in shards for r in (True, False)]
                            # Several microbatches (or pinned): also gathered and reduced once per step (ZeRO-1).
                            if M > 1 or pins.get("once") == "gather":
                                fs_opts += [(True, d, False, "gather") for d in shards]
                        for fsdp, shard, reshard, once in fs_opts:
                            if "fsdp" in pins and fsdp != pins["fsdp"]:
                                continue
                            if "dp_shard" in pins and shard != pins["dp_shard"]:
                                continue
                            if "reshard" in pins and fsdp and reshard != pins["reshard"] and not once:
                                continue
                            if "once" in pins and (once != pins["once"] if fsdp else pins["once"]):
                                continue
                            for ep in ep_options(m, cp, dp, shard if fsdp else 1, pins):
                                out.append(Config(tp, pp, dp, shard, sp, fsdp, reshard, mb, sched, v, fsdp_once=once,
                                                  prefetch=pins.get("prefetch", 1), cp=cp, ep=ep))
    return out


# Sequences from this length on are also tried split over ranks (context parallelism): shorter
# ones keep each rank's share of tokens large enough for its matmuls.
CP_FROM_SEQ_LEN = 16384


def cp_options(ctx: CostContext, ranks: int, pins: dict) -> list[int]:
    """Context-parallel degrees to try on ``ranks`` ranks: the pinned one; else 1 and, for long
    sequences of a model whose attention heads the analysis found, each degree up to 32 that
    divides the ranks and leaves every rank two equal chunks of at least 1,024 tokens."""
    if "cp" in pins:
        return [pins["cp"]] if ranks % pins["cp"] == 0 else []
    m = ctx.model
    if m.seq_len < CP_FROM_SEQ_LEN or not m.blocks or any(not (b.kv_heads and b.head_dim) for b in m.blocks):
        return [1]
    return [1] + [c for c in (2, 4, 8, 16, 32) if ranks % c == 0 and m.seq_len % (2 * c) == 0
                  and m.seq_len // (2 * c) >= 1024]


def ep_options(m, cp: int, dp: int, shard: int, pins: dict) -> list[int]:
    """Expert-parallel degrees to try: the pinned one (if it divides dp); else 1 and, for a model
    with routed experts, each divisor of the FSDP shard degree that divides every block's
    experts: each rank then reads only its own experts' weights (``ep_owned``), what makes EP
    pay, their FSDP shards spread over the ``shard / ep`` ranks left. autopar's executor runs EP
    with data, tensor and pipeline parallelism, not yet with CP."""
    if "ep" in pins:
        return [pins["ep"]] if dp % pins["ep"] == 0 else []
    counts = {b.experts[0] for b in m.blocks if b.experts}
    if not counts or cp > 1 or shard < 2:
        return [1]
    return [1] + [e for e in range(2, shard + 1) if shard % e == 0 and not any(c % e for c in counts)]


def _allowed(pins: dict) -> tuple[bool, bool, bool]:
    ac = pins.get("ac")
    return tuple(ac is None or ac == a for a in AC_MODES)


def best_mix(n: int, t0, tc, m0, mc, limit: float, allowed) -> tuple[float, tuple[int, int, int]] | None:
    """Cheapest (none, sel, full) split of n layers on one rank that fits.

    For each count ``f`` of fully checkpointed layers, more selective layers only cost time, so
    the best ``s`` is the smallest that fits: ``s >= (m(n-f, 0, f) - limit) / (mc_none - mc_sel)``.
    Exact, O(n).
    """
    best = None
    for f in (range(n + 1) if allowed[2] else (0,)):
        rest = n - f
        base = m0 + rest * mc[0] + f * mc[2]
        if not allowed[0]:
            s = rest if allowed[1] else (0 if rest == 0 else None)
        elif base <= limit:
            s = 0
        elif allowed[1] and mc[0] > mc[1]:
            s = math.ceil((base - limit) / (mc[0] - mc[1]) - 1e-9)
            s = s if s <= rest else None
        else:
            s = None
        if s is None or (s and not allowed[1]):
            continue
        k0 = rest - s
        if m0 + k0 * mc[0] + s * mc[1] + f * mc[2] > limit * (1 + 1e-12):
            continue
        t = t0 + k0 * tc[0] + s * tc[1] + f * tc[2]
        if best is None or t < best[0] - 1e-15:
            best = (t, (k0, s, f))
    return best


def _lower_bound(sm: StageModel, pins: dict) -> float:
    """A time no assignment of ``sm``'s configuration beats: balanced fractional layers at the
    cheapest allowed AC mode, no memory limit. The sum of rank times is at least the layers' total
    plus each rank's fixed part, and the bottleneck at least their mean. Needs no memory terms,
    so every configuration gets one before any gets an upper bound."""
    cfg = sm.cfg
    if cfg.v > 1 and any(n < cfg.v for n in sm.balanced_layers()):
        return math.inf
    allowed = _allowed(pins)
    cheapest = min(sm.coeffs.time[a] for a, ok in zip(AC_MODES, allowed) if ok)
    total = sm.ctx.model.n_layers * cheapest + sum(sm.rank_time(r, (0, 0, 0)) for r in range(cfg.pp))
    return sm.step_time([total / cfg.pp] * cfg.pp)


def _upper_bound(sm: StageModel, pins: dict, limit: float) -> tuple[float, Assignment | None]:
    """The step time of balanced layers with each rank's cheapest AC mix that fits (``best_mix``),
    and that assignment; ``inf, None`` when some rank cannot fit."""
    allowed = _allowed(pins)
    layers = sm.balanced_layers()
    times, acs = [], []
    for r, n in enumerate(layers):
        got = best_mix(n, *sm.rank_affine(r), limit, allowed)
        if got is None:
            return math.inf, None
        times.append(got[0])
        acs.append(got[1])
    return sm.step_time(times), Assignment(tuple(layers), tuple(acs))


def solve_milp(sm: StageModel, pins: dict, limit: float, below: float | None = None) -> Assignment | None:
    """Exact layer counts and AC mix per rank for one configuration (see module docstring), or
    None when nothing fits (or, given ``below``, nothing whose pipeline time is under it: the
    solver prunes what cannot beat a time already found)."""
    cfg, L = sm.cfg, sm.ctx.model.n_layers
    pp = cfg.pp
    if pp == 1:
        got = best_mix(L, *sm.rank_affine(0), limit, _allowed(pins))
        return Assignment((L,), (got[1],)) if got else None
    x = _stage_program(sm, pins, limit, integral=True, below=below)[0]
    if x is None:
        return None
    x = np.round(x[:3 * pp]).astype(int)
    layers = tuple(int(v) for v in x[:pp])
    ac = tuple((int(x[r] - x[pp + r] - x[2 * pp + r]), int(x[pp + r]), int(x[2 * pp + r])) for r in range(pp))
    return Assignment(layers, ac)


def solve_lp(sm: StageModel, pins: dict, limit: float) -> tuple[list[float], list[float]] | None:
    """The MILP's LP relaxation (fractional counts, a fraction of the MILP's time) for a pipelined
    configuration: the rank times at its optimum, whose ``critical_path`` no assignment beats (the
    bound that decides whether the MILP is worth solving), and the fractional layer counts; None
    when nothing fits."""
    x, affine = _stage_program(sm, pins, limit, integral=False)
    if x is None:
        return None
    pp = sm.cfg.pp
    times = [t0 + tc[0] * (x[r] - x[pp + r] - x[2 * pp + r]) + tc[1] * x[pp + r] + tc[2] * x[2 * pp + r]
             for r, (t0, tc, _, _) in enumerate(affine)]
    return times, list(x[:pp])


def _stage_program(sm: StageModel, pins: dict, limit: float, integral: bool, below: float | None = None):
    """The per-stage program of the module docstring for a pipelined configuration, solved:
    its solution vector (None if infeasible, or if ``below`` is given and no solution's
    pipeline time is under it) and each rank's ``rank_affine``."""
    cfg, L, M = sm.cfg, sm.ctx.model.n_layers, sm.M
    pp = cfg.pp
    allowed = _allowed(pins)
    nv = 3 * pp + 1  # n_r, s_r, f_r, z
    iz = 3 * pp
    # The pipeline's time as StageModel.critical_path has it: M z + (sum_r t_r / v + (v-1)/v z - z)
    # times the bubble's share the schedule leaves (1, or less for zero-bubble schedules).
    zb = sm.zero_bubble_factor()
    a = M - zb / cfg.v
    b = zb / cfg.v
    c = np.zeros(nv)
    c[iz] = a
    rows, lo, hi = [], [], []
    affine = [sm.rank_affine(r) for r in range(pp)]
    for r, (t0, tc, m0, mc) in enumerate(affine):
        n, s, f = r, pp + r, 2 * pp + r
        # objective: b * t_r
        c[n] += b * tc[0]
        c[s] += b * (tc[1] - tc[0])
        c[f] += b * (tc[2] - tc[0])
        # t_r - z <= -t0
        row = np.zeros(nv)
        row[n], row[s], row[f], row[iz] = tc[0], tc[1] - tc[0], tc[2] - tc[0], -1.0
        rows.append(row), lo.append(-np.inf), hi.append(-t0)
        # memory
        row = np.zeros(nv)
        row[n], row[s], row[f] = mc[0], mc[1] - mc[0], mc[2] - mc[0]
        rows.append(row), lo.append(-np.inf), hi.append(limit - m0)
        # s + f <= n
        row = np.zeros(nv)
        row[n], row[s], row[f] = -1.0, 1.0, 1.0
        rows.append(row), lo.append(-np.inf), hi.append(0.0)
        if not allowed[0]:  # every layer checkpointed somehow: s + f == n
            lo[-1] = 0.0
    row = np.zeros(nv)
    row[:pp] = 1.0
    rows.append(row), lo.append(L), hi.append(L)
    lb = np.zeros(nv)
    ub = np.full(nv, float(L))
    lb[:pp] = max(1, cfg.v)
    if not allowed[1]:
        ub[pp:2 * pp] = 0
    if not allowed[2]:
        ub[2 * pp:3 * pp] = 0
    lb[iz], ub[iz] = 0.0, np.inf
    integrality = np.full(nv, 1.0 if integral else 0.0)
    integrality[iz] = 0
    # Time in milliseconds for a well-conditioned objective; the objective is the pipeline time
    # less the ranks' fixed parts (b * sum t0), so ``below`` bounds it less those.
    bound = None if below is None else (below - b * sum(t0 for t0, _, _, _ in affine)) * 1e3
    if bound is not None:
        bound += abs(bound) * 1e-9  # a solution exactly at ``below`` is kept
    return _highs_milp(c * 1e3, np.array(rows), np.array(lo), np.array(hi), lb, ub, integrality, bound), affine


def _highs_milp(c, A, lo, hi, lb, ub, integrality, bound: float | None = None) -> np.ndarray | None:
    """``min c.x`` subject to ``lo <= A x <= hi``, ``lb <= x <= ub``, ``x[i]`` integral where
    ``integrality[i]``; the optimum, or None. HiGHS's own binding (``highspy``, 20 ms to import,
    where ``scipy.optimize`` takes 0.3 s), its core object: the public ``Highs`` class prints a
    banner on stdout when made, before any option can silence it, which would corrupt
    ``autopar explain --json``."""
    from highspy import HighsLp, HighsModelStatus, HighsVarType, MatrixFormat
    from highspy._core import _Highs

    f64 = lambda v: np.asarray(v, dtype=np.float64)  # infinite bounds are HiGHS's kHighsInf (inf)
    lp = HighsLp()
    lp.num_col_, lp.num_row_ = len(c), len(A)
    lp.col_cost_ = f64(c)
    lp.col_lower_, lp.col_upper_ = f64(lb), f64(ub)
    lp.row_lower_, lp.row_upper_ = f64(lo), f64(hi)
    rows, cols = np.nonzero(A)
    lp.a_matrix_.format_ = MatrixFormat.kRowwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = len(c), len(A)
    lp.a_matrix_.start_ = np.searchsorted(rows, np.arange(len(A) + 1)).astype(np.int32)
    lp.a_matrix_.index_ = cols.astype(np.int32)
    lp.a_matrix_.value_ = A[rows, cols].astype(np.float64)
    lp.integrality_ = [HighsVarType.kInteger if i else HighsVarType.kContinuous for i in integrality]
    h = _Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", 1e-9)
    if bound is not None:  # prune what cannot come under it: no solution there reads as none
        h.setOptionValue("objective_bound", float(bound))
    h.passModel(lp)
    h.run()
    if h.getModelStatus() != HighsModelStatus.kOptimal:
        return None
    # Under an objective bound that prunes every solution HiGHS may still say optimal, its
    # solution undefined (NaN).
    x = np.array(h.getSolution().col_value)
    return x if np.all(np.isfinite(x)) else None


def search(
    ctx: CostContext, world: int, *, pins: dict | None = None, top_k: int = 5,
    progress: Callable[[int, int], None] | None = None, distinct: str = "shape",
) -> SearchResult:
    """``distinct="shape"``: runners-up differ in (tp, pp, dp, fsdp, sp), for explaining;
    ``"config"``: any configuration difference (microbatch, schedule, reshard...), for tuning."""
    with _collector_paused():
        return _search_all(ctx, world, pins, top_k, progress, distinct)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while the search runs: it makes and keeps (in its
    caches) hundreds of thousands of small objects, over which each full collection walks again
    for nothing (DeepSeek-V3's search spent a third of its time there); what it frees is freed by
    reference counting as before, the collector resumes after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _search_all(ctx: CostContext, world: int, pins: dict | None, top_k: int,
                progress: Callable[[int, int], None] | None, distinct: str) -> SearchResult:
    t_start = time.perf_counter()
    pins = parse_pins(pins) if not isinstance(pins, dict) else dict(pins)
    check_pins(ctx, world, pins)
    configs = enumerate_configs(ctx, world, pins)
    if not configs:
        if pins:
            why = f"the pins {pins} exclude every configuration of {world} GPUs"
        else:
            why = f"no mesh of {world} GPUs fits the model's layers and heads"
        raise AutoparError(
            f"{why} with a global batch of {ctx.global_batch} sequences (each data-parallel rank needs "
            "whole microbatches, a pipeline of pp stages at least pp of them, interleaving a multiple "
            "of pp); relax a pin or change the global batch"
        )
    if "schedule" not in pins:
        configs = [c for c in configs if c.schedule not in DOMINATED]
    # TP across nodes moves every layer's activations over the network (Megatron-LM and
    # torchtitan keep TP inside a node): tried only where nothing fits with TP inside one, or pinned.
    within = configs if "tp" in pins else [c for c in configs if c.tp <= ctx.hw.gpus_per_node]
    if len(within) < len(configs):
        try:
            return _search(ctx, world, within, pins, top_k, progress, distinct, t_start)
        except InfeasibleError:
            pass
    return _search(ctx, world, configs, pins, top_k, progress, distinct, t_start)


def _search(ctx: CostContext, world: int, configs: list[Config], pins: dict, top_k: int,
            progress: Callable[[int, int], None] | None, distinct: str, t_start: float) -> SearchResult:
    limit = ctx.limit_bytes
    cache: dict = {}
    cands: list[Candidate] = []
    for i, cfg in enumerate(configs):
        sm = StageModel(ctx, cfg, cache)
        cands.append(Candidate(sm, _lower_bound(sm, pins), math.inf, None))
        if progress and i % 256 == 0:
            progress(i, len(configs))
    # Upper bounds in order of lower bound, until no configuration left can enter the top
    # ``top_k + 1`` shapes (the winner and its runners-up): its time is at least its lower bound.
    shape_of = (lambda cfg: (cfg.tp, cfg.pp, cfg.dp, cfg.fsdp, cfg.sp)) if distinct == "shape" else Config.key
    by_shape: dict[tuple, float] = {}
    feasible: list[Candidate] = []
    closest: tuple[float, Config] | None = None
    cands.sort(key=lambda c: (c.lower, c.sm.cfg.key()))
    cutoff = math.inf
    for c in cands:
        if c.lower > cutoff * (1 + 1e-12) or c.lower == math.inf:
            break
        c.upper, c.upper_assignment = _upper_bound(c.sm, pins, limit)
        if c.upper_assignment is None:
            sm = c.sm
            full = tuple((0, 0, n) if _allowed(pins)[2] else (n, 0, 0) for n in sm.balanced_layers())
            need = max(sum(sm.rank_memory(r, ac).values()) for r, ac in enumerate(full))
            if closest is None or need < closest[0]:
                closest = (need, sm.cfg)
            continue
        feasible.append(c)
        cutoff = _record(by_shape, shape_of(c.sm.cfg), c.upper, top_k, cutoff)
    if not feasible:
        raise _infeasible(ctx, world, closest, pins)
    # Branch and bound for the winner. A pipelined configuration whose bounds differ and whose
    # lower bound is below the (top_k + 1)-th best shape's time gets its MILP's LP relaxation: a
    # tighter lower bound (about a millisecond), and, its layer counts rounded with each rank's
    # cheapest AC mix, a better upper bound (most often the MILP's optimum). Then, in order of LP
    # bound, while a bound is below the best time found, the MILP proves or improves it: the
    # winner is the model's exact optimum; a runner-up is the best assignment found for its shape.
    n_milp = 0
    relaxed: list[tuple[float, Candidate]] = []
    for c in sorted(feasible, key=lambda c: (c.lower, c.sm.cfg.key())):
        if c.lower > cutoff * (1 + 1e-12):
            break
        if c.sm.cfg.pp == 1 or c.upper <= c.lower * (1 + 1e-12):
            continue
        got = solve_lp(c.sm, pins, limit)
        if got is None:
            continue  # nothing of this configuration fits
        times, frac = got
        rounded = _rounded(c.sm, pins, limit, frac)
        if rounded is not None and rounded[0] < c.upper:
            c.upper, c.upper_assignment = rounded
        cutoff = _record(by_shape, shape_of(c.sm.cfg), c.upper, top_k, cutoff)
        relaxed.append((c.sm.critical_path(times), c))
    best_time = min(by_shape.values())
    for bound, c in sorted(relaxed, key=lambda x: (x[0], x[1].sm.cfg.key())):
        if bound >= best_time * (1 - 1e-9):
            break
        if bound >= c.upper * (1 - 1e-9):
            continue  # the rounded assignment is this configuration's optimum
        n_milp += 1
        a = solve_milp(c.sm, pins, limit, below=best_time)
        if a is not None:
            est = c.sm.evaluate(a)
            if est.fits(limit * (1 + 1e-9)) and est.step_time_s < c.upper:
                c.solved = est
                c.upper = est.step_time_s
                best_time = min(best_time, c.upper)
    # Runners-up: the best plan of each other shape (tp, pp, dp, fsdp, sp), so they differ in a
    # way a user cares about.
    best_of: dict[tuple, Candidate] = {}
    for c in feasible:
        old = best_of.get(shape_of(c.sm.cfg))
        if old is None or (c.upper, c.sm.cfg.key()) < (old.upper, old.sm.cfg.key()):
            best_of[shape_of(c.sm.cfg)] = c
    ranked = sorted(best_of.values(), key=lambda c: (c.upper, c.sm.cfg.key()))[: top_k + 1]
    results = [c.solved or c.sm.evaluate(c.upper_assignment) for c in ranked]
    if progress:
        progress(len(configs), len(configs))
    best = results[0]
    return SearchResult(
        best=best, runners_up=results[1:top_k + 1], n_configs=len(configs), n_priced=len(feasible),
        n_milp=n_milp, seconds=time.perf_counter() - t_start,
        schedules=_schedules_of(ranked[0], cands, pins, limit, cache),
    )


def _record(by_shape: dict, shape: tuple, t: float, top_k: int, cutoff: float) -> float:
    """Note time ``t`` for ``shape``; the new cutoff: the (top_k + 1)-th best shape's time."""
    if t < by_shape.get(shape, math.inf):
        by_shape[shape] = t
        if len(by_shape) > top_k:
            return heapq.nsmallest(top_k + 1, by_shape.values())[-1]
    return cutoff


def _rounded(sm: StageModel, pins: dict, limit: float, frac: list[float]) -> tuple[float, Assignment] | None:
    """An assignment near the LP optimum: its fractional layer counts rounded by largest
    remainder, each rank's cheapest AC mix that fits; and its step time."""
    cfg, L = sm.cfg, sm.ctx.model.n_layers
    allowed = _allowed(pins)
    counts = [max(cfg.v, math.floor(x + 1e-9)) for x in frac]
    for r in sorted(range(cfg.pp), key=lambda r: (counts[r] - frac[r], r))[: max(0, L - sum(counts))]:
        counts[r] += 1
    if sum(counts) != L:
        return None
    out, acs = [], []
    for r, n in enumerate(counts):
        got = best_mix(n, *sm.rank_affine(r), limit, allowed)
        if got is None:
            return None
        out.append(got[0])
        acs.append(got[1])
    return sm.step_time(out), Assignment(tuple(counts), tuple(acs))


def _schedules_of(winner: Candidate, cands: list, pins: dict, limit: float, cache: dict) -> list[Estimate]:
    """Under PP: every (schedule, v) the winner's mesh, SP, FSDP and microbatching can run, each
    at its best assignment found, so ``explain`` can say why the chosen schedule won (priced here
    where the search stopped before them or skipped them as dominated)."""
    w = winner.sm.cfg
    if w.pp == 1:
        return []
    have = {c.sm.cfg.key(): c for c in cands}
    out: list[Candidate] = []
    for sched, v in schedule_options(w.pp, winner.sm.M, winner.sm.ctx.model.n_layers):
        if ("schedule" in pins and sched != pins["schedule"]) or ("v" in pins and v != pins["v"]):
            continue
        cfg = dataclasses.replace(w, schedule=sched, v=v)
        c = have.get(cfg.key())
        if c is None:
            sm = StageModel(winner.sm.ctx, cfg, cache)
            c = Candidate(sm, _lower_bound(sm, pins), math.inf, None)
        if c.lower == math.inf:
            continue
        if c.upper_assignment is None:
            c.upper, c.upper_assignment = _upper_bound(c.sm, pins, limit)
            if c.upper_assignment is None:
                continue
        if c.solved is None and (got := solve_lp(c.sm, pins, limit)) is not None:
            rounded = _rounded(c.sm, pins, limit, got[1])  # as good as the search's own runners-up
            if rounded is not None and rounded[0] < c.upper:
                c.upper, c.upper_assignment = rounded
        out.append(c)
    ranked = sorted(out, key=lambda c: (c.upper, c.sm.cfg.key()))
    return [c.solved or c.sm.evaluate(c.upper_assignment) for c in ranked]


def _infeasible(ctx: CostContext, world: int, closest, pins: dict) -> InfeasibleError:
    limit_gb = ctx.limit_bytes / (1 << 30)
    if closest is None:
        return InfeasibleError(f"no configuration of {world} GPUs is valid for {ctx.model.name} with pins {pins}")
    need, cfg = closest
    need_gb = need / (1 << 30)
    hints = []
    if pins.get("ac") not in (None, "full"):
        hints.append("allow activation checkpointing (drop the ac pin or pin ac=full)")
    if cfg.mb > 1:
        hints.append("a smaller microbatch")
    hints.append(f"more GPUs (try --gpus {world * max(2, 2 ** math.ceil(math.log2(need_gb / limit_gb)))})")
    hints.append("a larger memory limit or a GPU with more memory")
    return InfeasibleError(
        f"no plan of {ctx.model.name} fits in {limit_gb:.1f} GiB per GPU on {world} GPUs. The closest, "
        f"{cfg.short()} with full activation checkpointing, needs {need_gb:.1f} GiB per GPU "
        f"({need_gb - limit_gb:.1f} GiB over). What would fit: {'; '.join(hints)}."
    )
