"""The public entry points. This is the only module that knows the whole order of the flow:

    capture (fake-tensor trace) -> analysis (profile) -> cost model -> search -> Plan
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import pickle
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from autopar import analysis, capture, cut, fxops, memory, models, roles, traceable, zero
from autopar import search as search_mod
from autopar.cost_models.hardware import Hardware
from autopar.cost_models.hardware import load as load_hardware
from autopar.cost_models.step import (
    AC_MODES,
    ZERO_BUBBLE,
    Config,
    CostContext,
    Estimate,
    StageModel,
    ep_owned,
    uniform_assignment,
    validate_config,
    validate_ep,
)
from autopar.errors import AutoparError, PlanMismatchError
from autopar.plan import PRECISIONS, LayerPlan, Plan, ShardRule, stage_rank
from autopar.plan import precision as precision_of

log = logging.getLogger(__name__)
DEFAULT_TOKENS_PER_STEP = 1 << 22  # 4M tokens, when the user gives no global batch


@dataclass
class Profiled:
    """A traced and analysed model, reusable across plans."""

    profile: analysis.ModelProfile
    source_name: str
    seconds: float
    notes: tuple[str, ...] = ()


def profile_model(
    model: Any, *, seq_len: int | None = None, example_inputs: tuple | None = None,
    example_target: torch.Tensor | None = None, precision: str = "bf16", loss_fn: Callable | None = None,
    step: capture.StepGraph | None = None,
) -> Profiled:
    """Trace and analyse ``model``: an ``nn.Module``, a preset name, a model source or a factory.
    ``step``: the module's training step already traced at ``example_inputs`` (what the executor
    runs), which the analysis then reads instead of tracing again."""
    t0 = time.perf_counter()
    if isinstance(model, str):
        model = models.resolve(model, seq_len=seq_len)
    vocab = None
    name = type(model).__name__
    notes: tuple[str, ...] = ()
    traced_on = None  # what a source that is not a language model is traced on
    source_loss = None  # and the loss it trains with
    if isinstance(model, models.ModelSource):
        notes = model.notes
        if example_inputs is None and model.inputs:
            if seq_len is not None:
                raise AutoparError(f"{model.name} takes {model.takes}: its sequence is the patches its layers see, "
                                   "not a length to choose; leave out seq_len (--seq-len)")
            traced_on, source_loss = model.example(1), model.loss_fn
        elif example_inputs is None:
            seq_len, seq_notes = models.planning_seq_len(model, seq_len)
            notes += seq_notes
        vocab = model.vocab_size
        name = model.name
        build: Any = model.build
    elif isinstance(model, nn.Module):
        build = model
        cfg = getattr(model, "config", None)
        vocab = getattr(cfg, "vocab_size", None)
    elif callable(model):
        build = model
    else:
        raise AutoparError(f"cannot plan a {type(model).__name__}: give an nn.Module, a preset name or a factory")
    batch = 1
    if example_inputs is not None:
        example_inputs = check_example_inputs(example_inputs, example_target)
        batch = int(example_inputs[0].shape[0])
        # token ids: their sequence; other inputs: found in the trace (the layers' tokens per sample)
        seq_len = int(example_inputs[0].shape[1]) if capture.is_token_ids(example_inputs[0]) else None
    elif not seq_len and traced_on is None:
        raise AutoparError(f"the sequence length of {name} is unknown: pass seq_len (--seq-len)")
    dtype = getattr(torch, precision_of(precision).compute)  # what the step computes in
    key = _profile_key(model, batch, seq_len, dtype) if example_inputs is None and loss_fn is None else None
    prof = _profile_cache_get(key)
    if prof is None and step is not None:
        if seq_len is None:
            seq_len, vocab = capture.sample_tokens(step, batch, vocab)
        key = _step_profile_key(step, build, name=name, batch=batch, seq_len=seq_len, dtype=dtype, vocab=vocab)
        prof = _profile_cache_get(key)
        if prof is None:
            prof = analysis.analyze(cut.for_analysis(step, build, name=name, batch=batch, seq_len=seq_len,
                                                        dtype=dtype, vocab_size=vocab, t0=t0))
            _profile_cache_put(key, prof)
    elif prof is None:
        tr = capture.trace_model(build, batch=batch, seq_len=seq_len, vocab_size=vocab, dtype=dtype,
                                 loss_fn=loss_fn or source_loss, name=name, example_inputs=example_inputs or traced_on,
                                 example_target=example_target)
        prof = analysis.analyze(tr)
        _profile_cache_put(key, prof)
    if not prof.blocks:
        raise AutoparError(
            f"{name} has no repeated blocks (no two or more modules of one class with the same parameter "
            "shapes, in whatever container): autopar plans models built from a stack of identical layers"
        )
    return Profiled(prof, name, time.perf_counter() - t0, notes)


def check_example_inputs(example_inputs: Any, example_target: torch.Tensor | None = None) -> tuple:
    """The inputs of the model's forward for one batch (token ids, images, latents, masks,
    timesteps), as a tuple of tensors whose first dimension is the batch; the target's too."""
    if not isinstance(example_inputs, tuple) or not example_inputs or not all(
            isinstance(x, torch.Tensor) for x in example_inputs):
        raise AutoparError("example_inputs must be a tuple of the tensors the model's forward takes, batch first "
                           "(e.g. (token_ids,) or (images,)); got "
                           f"{type(example_inputs).__name__}")
    first = example_inputs[0]
    if first.dim() == 0:
        raise AutoparError("example_inputs[0] is a scalar: every input is batch first")
    named = [(f"example_inputs[{i}]", x) for i, x in enumerate(example_inputs)]
    if example_target is not None:
        if not isinstance(example_target, torch.Tensor):
            raise AutoparError(f"example_target must be a tensor, got {type(example_target).__name__}")
        named.append(("example_target", example_target))
    for what, x in named:
        if x.dim() == 0 or x.shape[0] != first.shape[0]:
            raise AutoparError(f"{what} has shape {tuple(x.shape)}, but every input and the target are batch first: "
                               f"its first dimension must be the batch of example_inputs[0], {first.shape[0]}")
    if first.dtype in (torch.int64, torch.int32) and first.dim() != 2:
        raise AutoparError(f"example_inputs[0] holds integers of shape {tuple(first.shape)}: token ids are a 2-D "
                           "integer tensor (batch, seq)")
    return example_inputs


def _profile_key(model: Any, batch: int, seq_len: int, dtype: torch.dtype) -> str | None:
    """Cache key of a preset's or config file's profile: its spec, the shapes, torch and the
    source of the modules that produce a profile (so any change to them invalidates it).
    Models given as modules or factories are user code and are traced every time."""
    if not isinstance(model, models.ModelSource) or model.spec.get("kind") not in ("preset", "hf"):
        return None
    h = hashlib.sha256(json.dumps([model.name, model.spec, model.vocab_size, batch, seq_len, str(dtype),
                                   torch.__version__], sort_keys=True, default=str).encode())
    h.update(_analysis_code())
    return h.hexdigest()[:32]


@functools.lru_cache(maxsize=1)
def _analysis_code() -> bytes:
    """The source of the modules that produce a profile."""
    code = b""
    for mod in (capture, traceable, cut, fxops, memory, roles, analysis, models):
        with open(mod.__file__, "rb") as f:
            code += f.read()
    return code


def _step_profile_key(step: capture.StepGraph, model: nn.Module, **shapes) -> str:
    """Cache key of the profile of a module's traced step: everything the analysis reads (each
    node of the step graph with its annotations and its values' shapes, the step's bookkeeping,
    the module tree's classes and parameter shapes), the shapes, torch and the analysis code. The
    same model traced again (another rank, another plan, the next run) is analysed once."""
    from autopar.passes.shared import step_digest

    h = hashlib.sha256(repr(sorted(shapes.items())).encode() + torch.__version__.encode() + _analysis_code())
    step_digest(h, step)
    for name, m in model.named_modules(remove_duplicate=False):
        h.update(repr((name, type(m).__module__, type(m).__qualname__, getattr(m, "num_embeddings", None),
                       [(pn, tuple(q.shape), str(q.dtype), q.requires_grad)
                        for pn, q in m.named_parameters(recurse=False, remove_duplicate=False)])).encode())
    return h.hexdigest()[:32]


def _profile_cache_get(key: str | None) -> analysis.ModelProfile | None:
    """The profile cached for ``key``: in this user's cache, else among the presets' profiles that
    ship with the package (made by the same code, torch and shapes, since all are in the key)."""
    if key is None:
        return None
    path = os.path.join(models.cache_dir(), "profiles", key + ".pkl")
    try:
        with open(path, "rb") as f:
            prof = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        prof = shipped_profiles().get(key)
    return prof if isinstance(prof, analysis.ModelProfile) else None


SHIPPED_PROFILES = os.path.join(os.path.dirname(__file__), "data", "preset_profiles.pkl.xz")


@functools.lru_cache(maxsize=1)
def shipped_profiles() -> dict[str, analysis.ModelProfile]:
    """The presets' profiles at their default shapes, computed when the package was made (``make
    profiles``), so that explaining a preset never traces it (tracing imports Dynamo: about 1 s).
    Keyed like the cache: a key made by other code or another torch finds nothing and traces."""
    import lzma

    try:
        with lzma.open(SHIPPED_PROFILES, "rb") as f:
            table = pickle.load(f)
    except (OSError, lzma.LZMAError, pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        log.info("no shipped preset profiles: %s", e)
        return {}
    return table if isinstance(table, dict) else {}


def preset_profile_key(name: str) -> str:
    """The cache key of preset ``name`` at the shapes ``autopar explain NAME`` plans."""
    src = models.resolve(name)
    seq_len, _ = models.planning_seq_len(src, None)
    return _profile_key(src, 1, seq_len, torch.bfloat16)


def write_shipped_profiles(path: str = SHIPPED_PROFILES) -> dict[str, analysis.ModelProfile]:
    """Trace every preset at its default shapes and write the table ``shipped_profiles`` reads."""
    import lzma

    table = {}
    for name in models.PRESETS:
        src = models.resolve(name)
        seq_len, _ = models.planning_seq_len(src, None)
        tr = capture.trace_model(src.build, batch=1, seq_len=seq_len, vocab_size=src.vocab_size,
                                 dtype=torch.bfloat16, name=src.name)
        table[preset_profile_key(name)] = analysis.analyze(tr)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with lzma.open(path, "wb", preset=9) as f:
        pickle.dump(table, f, protocol=pickle.HIGHEST_PROTOCOL)
    shipped_profiles.cache_clear()
    return table


def _profile_cache_put(key: str | None, prof: analysis.ModelProfile) -> None:
    """Keep the profile for the next process (written atomically; a read-only home is not an error)."""
    if key is None:
        return
    d = os.path.join(models.cache_dir(), "profiles")
    try:
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(prof, f)
        os.replace(tmp, os.path.join(d, key + ".pkl"))
    except OSError as e:
        log.info("profile cache not written: %s", e)


def model_precision(model: Any) -> str:
    """The precision a module trains in when no mixed-precision policy is given: its own
    parameters' (fp32, or bf16 throughout); what is not a module is planned bf16-mixed."""
    if isinstance(model, nn.Module):
        p = next(model.parameters(), None)
        if p is not None and p.dtype == torch.float32:
            return "fp32"
        if p is not None and p.dtype == torch.bfloat16:
            return "bf16-true"
        if p is not None and p.dtype == torch.float16:
            return "fp16-mixed"  # refused when run: fp16 without loss scaling
    return "bf16-mixed"


def default_global_batch(seq_len: int, world: int = 1) -> int:
    """4M tokens per step, and at least one sequence per 8 GPUs (Llama 3 405B: 16M tokens on 16K)."""
    return max(1, DEFAULT_TOKENS_PER_STEP // seq_len, world // 8)


def make_context(
    prof: analysis.ModelProfile, *, world: int = 1, hardware: str | dict | Hardware = "h100", global_batch: int | None = None,
    precision: str = "bf16", memory_limit_gb: float | None = None, compiled: bool = True,
    async_tp: bool = False, fp8: bool = False, ep_imbalance: float = 1.0,
) -> CostContext:
    prec = precision_of(precision)
    precision = prec.name
    if global_batch is None:
        global_batch = default_global_batch(prof.seq_len, world)
    if global_batch < 1:
        raise AutoparError(f"global batch must be at least 1 sequence, got {global_batch}")
    hw = load_hardware(hardware)
    if (fp8 or prec.float8) and not hw.float8:
        raise AutoparError(f"{hw.name} has no float8 matmuls (H100 and newer do): choose bf16-mixed, or a hardware "
                           "profile with \"float8\": true")
    if memory_limit_gb is not None and memory_limit_gb <= 0:
        raise AutoparError(f"memory limit must be positive, got {memory_limit_gb} GB")
    if not ep_imbalance >= 1.0:
        raise AutoparError(f"ep imbalance {ep_imbalance}: the busiest expert-parallel rank's routed rows over the mean, "
                           "at least 1 (1: routing spread evenly)")
    return CostContext(prof, hw, int(global_batch), precision, compiled, async_tp, fp8, memory_limit_gb,
                       ep_imbalance=float(ep_imbalance))


def _world(world_size_or_mesh: Any) -> int:
    if isinstance(world_size_or_mesh, int):
        if world_size_or_mesh < 1:
            raise AutoparError(f"the GPU count must be positive, got {world_size_or_mesh}")
        return world_size_or_mesh
    if hasattr(world_size_or_mesh, "size"):
        return int(world_size_or_mesh.size())
    raise AutoparError(f"expected a GPU count or a DeviceMesh, got {type(world_size_or_mesh).__name__}")


@contextlib.contextmanager
def fewer_collections():
    """Python's cyclic garbage collector run less often while inside: tracing, the passes and
    Inductor make hundreds of thousands of objects (graph nodes, fake tensors, symbolic
    expressions) that live until the compile ends, and each full collection walks all of them
    and torch's own (HF Llama, 32 layers, one process: 2.1 s of a 17 s compile). Collections
    still run, every 50,000 allocations instead of 700 (the cycles the passes leave behind cost
    80 MiB more at the peak there); the thresholds are restored on exit."""
    import gc

    before = gc.get_threshold()
    gc.set_threshold(max(before[0], 50_000), max(before[1], 50), max(before[2], 50))
    try:
        yield
    finally:
        gc.set_threshold(*before)


@fewer_collections()
def plan(
    model: Any, world_size_or_mesh: Any, *, example_inputs: tuple | None = None,
    example_target: torch.Tensor | None = None,
    hardware: str | dict | Hardware = "h100", global_batch: int | None = None, pin: str | dict | None = None,
    memory_limit_gb: float | None = None, precision: str = "bf16", seq_len: int | None = None,
    top_k: int = 3, loss_fn: Callable | None = None, progress: Callable | None = None,
    profiled: Profiled | None = None, ep_imbalance: float = 1.0,
) -> Plan:
    """Plan ``model`` for a mesh: the fastest TP/SP/PP/FSDP/AC layout that fits in memory.
    ``example_inputs`` (and ``example_target`` for a loss of one's own on inputs other than token
    ids), as ``compile`` takes them; without them, a preset or config is planned on token ids.
    ``ep_imbalance``: under expert parallelism, the busiest rank's routed rows over the mean."""
    world = _world(world_size_or_mesh)
    prof = profiled or profile_model(model, seq_len=seq_len, example_inputs=example_inputs,
                                     example_target=example_target, precision=precision, loss_fn=loss_fn)
    ctx = make_context(prof.profile, world=world, hardware=hardware, global_batch=global_batch,
                       precision=precision, memory_limit_gb=memory_limit_gb, ep_imbalance=ep_imbalance)
    pins = search_mod.parse_pins(pin)
    res = search_mod.search(ctx, world, pins=pins, top_k=top_k, progress=progress)
    log.info("planned %s on %d GPUs: capture+analysis %.2fs, search %.2fs (%d configs, %d MILPs)",
             prof.source_name, world, prof.seconds, res.seconds, res.n_configs, res.n_milp)
    p = to_plan(ctx, res.best, world, pins=pins, runners_up=res.runners_up, schedules=res.schedules)
    return dataclasses.replace(p, notes=prof.notes + _batch_notes(ctx, global_batch, world) + p.notes)


def _batch_notes(ctx: CostContext, given: int | None, world: int) -> tuple[str, ...]:
    """Say so when the default global batch is not the default's 4M tokens (one sequence per 8
    GPUs at least, so that every data-parallel rank has work)."""
    seq = ctx.model.seq_len
    if given is not None or ctx.global_batch * seq <= DEFAULT_TOKENS_PER_STEP:
        return ()
    return (f"global batch {ctx.global_batch:,} sequences ({ctx.global_batch * seq / 1e6:,.0f}M tokens): the default "
            f"4M tokens raised to one sequence per 8 of the {world:,} GPUs; pass --global-batch to plan another",)


def plan_candidates(
    model: Any, world_size_or_mesh: Any, *, k: int = 4, example_inputs: tuple | None = None,
    hardware: str | dict | Hardware = "h100", global_batch: int | None = None, pin: str | dict | None = None,
    memory_limit_gb: float | None = None, precision: str | None = None, seq_len: int | None = None,
    loss_fn: Callable | None = None, profiled: Profiled | None = None,
) -> list[Plan]:
    """The planner's best plan and runners-up (distinct shapes) as Plans, best first: what
    ``autopar tune plans`` measures."""
    world = _world(world_size_or_mesh)
    precision = precision or model_precision(model)
    prof = profiled or profile_model(model, seq_len=seq_len, example_inputs=example_inputs, precision=precision,
                                     loss_fn=loss_fn)
    ctx = make_context(prof.profile, world=world, hardware=hardware, global_batch=global_batch,
                       precision=precision, memory_limit_gb=memory_limit_gb)
    pins = search_mod.parse_pins(pin)
    res = search_mod.search(ctx, world, pins=pins, top_k=max(0, k - 1), distinct="config")
    return [to_plan(ctx, e, world, pins=pins) for e in [res.best, *res.runners_up]]


def estimate_plan(
    model: Any, world: int, config: str | dict, *, hardware="h100", global_batch=None, precision="bf16",
    memory_limit_gb=None, seq_len=None, profiled: Profiled | None = None, ep_imbalance: float = 1.0,
) -> tuple[Plan, Estimate, CostContext]:
    """Price a configuration the user gives (``tp=8,pp=8,dp=1,...``) with the planner's model."""
    prof = profiled or profile_model(model, seq_len=seq_len, precision=precision)
    ctx = make_context(prof.profile, world=world, hardware=hardware, global_batch=global_batch,
                       precision=precision, memory_limit_gb=memory_limit_gb, ep_imbalance=ep_imbalance)
    kv = search_mod.parse_pins(config)
    tp, pp, cp = kv.get("tp", 1), kv.get("pp", 1), kv.get("cp", 1)
    dp = kv.get("dp", world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else 0)
    if tp * pp * dp * cp != world:
        names, degrees = ("tp*pp*dp", f"{tp}*{pp}*{dp}") if cp == 1 else ("tp*pp*dp*cp", f"{tp}*{pp}*{dp}*{cp}")
        raise AutoparError(f"{names} = {degrees} = {tp * pp * dp * cp} but there are {world} GPUs; make the product equal {world}")
    fsdp = kv.get("fsdp", False)
    for k in ("once", "unit"):
        if kv.get(k) and not fsdp:
            raise AutoparError(f"{k}={kv[k]} describes FSDP's collectives: add fsdp=1 (or drop {k})")
    if "dp_overlap" in kv and fsdp:
        raise AutoparError("dp_overlap describes the all-reduce of data parallelism without FSDP: drop fsdp=1 "
                           "(FSDP's collectives overlap per layer) or drop dp_overlap")
    for k in ("ep_overlap", "ep_nodes", "ep_fp8"):
        if kv.get(k) and kv.get("ep", 1) == 1:
            raise AutoparError(f"{k} describes expert parallelism's all-to-alls: add ep=N (or drop {k})")
    cfg = Config(
        tp=tp, pp=pp, dp=dp, dp_shard=kv.get("dp_shard", dp) if fsdp else 1, sp=kv.get("sp", False),
        fsdp=fsdp, reshard=kv.get("reshard", True), mb=kv.get("mb", 1),
        schedule=kv.get("schedule", "1f1b"), v=kv.get("v", 2 if kv.get("schedule") in ("interleaved", *ZERO_BUBBLE) else 1),
        fsdp_once=kv.get("once", ""), fsdp_unit=kv.get("unit", "layer"), dp_overlap=kv.get("dp_overlap", True),
        cp=cp, prefetch=kv.get("prefetch", 1), ep=kv.get("ep", 1), ep_overlap=kv.get("ep_overlap", False),
        ep_nodes=kv.get("ep_nodes", 0), ep_fp8=kv.get("ep_fp8", False),
    )
    validate_config(ctx, cfg, priced_only=True)
    sm = StageModel(ctx, cfg)
    est = sm.evaluate(uniform_assignment(sm, kv.get("ac", "none")))
    p = to_plan(ctx, est, world, pins=kv)
    if pp > 1 and sm.M < pp:
        p = dataclasses.replace(p, notes=(*p.notes, f"{sm.M} microbatches over {pp} pipeline stages: priced with "
                                          f"its bubble ({pp - 1} of {sm.M + pp - 1} microbatch times idle); "
                                          "autopar's pipeline schedules need at least one microbatch per stage"))
    others = [f"{k}={v} ({search_mod.ESTIMATE_ONLY[k]})" for k, v in search_mod.estimate_only(kv).items()]
    if others:
        p = dataclasses.replace(p, notes=(*p.notes, "priced as another framework runs it, which autopar's executor "
                                          "does not: " + "; ".join(others)))
    return p, est, ctx


def why_lost(winner: Estimate, other: Estimate) -> str:
    """The components on which ``other`` pays most over ``winner``."""
    deltas = {k: other.breakdown.get(k, 0.0) - winner.breakdown.get(k, 0.0) for k in winner.breakdown}
    worst = sorted(((v, k) for k, v in deltas.items() if v > 5e-4), reverse=True)[:2]
    pct = (other.step_time_s / winner.step_time_s - 1) * 100
    parts = ", ".join(f"{k.replace('_', ' ')} +{v * 1e3:.0f} ms" for v, k in worst)
    return f"{pct:+.1f}% step time" + (f" ({parts})" if parts else "")


def _summary(ctx: CostContext, e: Estimate) -> dict:
    return {
        "step_time_s": e.step_time_s,
        "tokens_per_s_per_gpu": e.tokens_per_s_per_gpu,
        "mfu": e.mfu,
        "memory_gb_per_gpu": e.peak_memory_gb,
        "memory_gb_per_stage": [m / (1 << 30) for m in e.memory_bytes],
        "activations_gb_per_stage": [m / (1 << 30) for m in e.activation_bytes],
        "breakdown": e.breakdown,
        "memory_breakdown_gb": {k: v / (1 << 30) for k, v in e.memory_breakdown.items()},
        "memory_limit_gb": ctx.limit_bytes / (1 << 30),
        "fits": e.fits(ctx.limit_bytes),
        "model_flops_per_token": ctx.model.model_flops_per_token(),
    }


def to_plan(ctx: CostContext, e: Estimate, world: int, *, pins: dict, runners_up=(), schedules=()) -> Plan:
    m, cfg, a = ctx.model, e.config, e.assignment
    fqns = m.layer_fqns()
    layers = [LayerPlan(f, r, c, ac) for f, (r, c, ac) in zip(fqns, layer_placement(a, cfg.pp, cfg.v, cfg.schedule))]
    rules = shard_rules(m)
    runners = tuple(
        {"config": r.config.short(), "ac": _ac_text(r), **_summary(ctx, r), "why_lost": why_lost(e, r)}
        for r in runners_up
    )
    return Plan(
        model_name=m.name, model_fingerprint=m.fingerprint, world_size=world, hardware=ctx.hw.name,
        precision=ctx.precision, global_batch=ctx.global_batch, seq_len=m.seq_len, tp=cfg.tp,
        pp=cfg.pp, dp=cfg.dp, dp_shard=cfg.dp_shard if cfg.fsdp else 1, sp=cfg.sp, fsdp=cfg.fsdp,
        reshard_after_forward=cfg.reshard and cfg.fsdp_once != "gather", fsdp_prefetch=cfg.prefetch,
        fsdp_once=cfg.fsdp_once if cfg.fsdp else "", cp=cfg.cp, ep=cfg.ep, mb=cfg.mb, n_microbatches=ctx.global_batch // cfg.dp // cfg.mb,
        schedule=cfg.schedule if cfg.pp > 1 else "none", v=cfg.v, layers=tuple(layers),
        shard_rules=tuple(rules), predicted=_summary(ctx, e), collectives=tuple(e.collectives),
        runners_up=runners, pins={k: v for k, v in pins.items()}, block_container=m.block_container,
        outer_modules=tuple((mod, seg, m.module_types.get(mod, "")) for mod, seg in m.outside_segments.items()),
        schedules=tuple({"schedule": s.config.schedule, "v": s.config.v, "step_time_s": s.step_time_s,
                         "bubble_s": s.breakdown.get("bubble", 0.0), "memory_gb_per_gpu": s.peak_memory_gb}
                        for s in schedules),
        notes=(f"expert parallelism priced with the busiest rank routed {ctx.ep_imbalance:g}x the mean rows "
               "(--ep-imbalance)",) if cfg.ep > 1 and ctx.ep_imbalance != 1.0 else (),
    )


def layer_placement(a, pp: int, v: int, schedule: str = "1f1b") -> list[tuple[int, int, str]]:
    """(rank, chunk, ac) of every layer in model order. Rank ``r`` holds ``a.layers[r]`` layers in
    ``v`` chunks; pipeline stage ``s = chunk * pp + rank`` (loop order, as interleaved 1F1B runs
    them; V order for ``zbv``, see ``Plan.stage_rank``), so model order walks stage 0, 1, ...
    Within a rank the fully checkpointed layers come first (their activations live longest), then
    selective, then none."""
    chunks = [[n // v + (1 if c < n % v else 0) for c in range(v)] for n in a.layers]
    modes = [["full"] * f + ["selective"] * s + ["none"] * k for (k, s, f) in a.ac]
    out = []
    for stage in range(pp * v):
        c, r = stage // pp, stage_rank(stage, pp, schedule)
        start = sum(chunks[r][:c])
        out += [(r, c, modes[r][start + j]) for j in range(chunks[r][c])]
    return out


def shard_rules(m: analysis.ModelProfile) -> tuple[ShardRule, ...]:
    """TP styles per module, from the analysis (roles of linears, norms, vocabulary dims)."""
    rules = []
    for b in m.blocks:
        linear_mods = {}
        for l in b.linears:
            for w in l.group or (l.weight,):
                linear_mods[w.rsplit(".", 1)[0]] = {"column": "colwise", "row": "rowwise"}.get(l.role, "replicate")
        rules += [ShardRule(b.cls_name, mod, st) for mod, st in linear_mods.items()]
        rules += [ShardRule(b.cls_name, g[0], "tp_input") for g in b.tp_groups if g[0] is not None]
        rules += [ShardRule(b.cls_name, mod, "sequence") for mod in b.sequence_modules]
    for name, shape in m.outside_params.items():
        mod = name.rsplit(".", 1)[0]
        mtype = m.module_types.get(mod, "")
        if mtype == "Embedding" and shape[0] == m.vocab:
            style = "vocab_embedding"
        elif mtype == "Linear" and shape[0] == m.vocab:
            style = "vocab_head"
        elif len(shape) == 1 and mtype != "Linear":
            style = "sequence"
        else:
            style = "replicate"
        if not any(r.scope == "outside" and r.module == mod for r in rules):
            rules.append(ShardRule("outside", mod, style))
    for _a, b_ in m.tied:  # a tied head shares the embedding's weight: it follows the embedding
        mod = b_.rsplit(".", 1)[0]
        if m.module_types.get(mod) == "Linear":
            rules.append(ShardRule("outside", mod, "replicate"))
    return tuple(rules)


def _ac_text(e: Estimate) -> str:
    acs = e.assignment.per_layer_ac()
    return ",".join(f"{k}:{acs.count(k)}" for k in AC_MODES if k in acs)


# --------------------------------------------------------------------------------------------
# compile: plan, trace the step, run the passes, compile, wrap
# --------------------------------------------------------------------------------------------
MESH_NAMES = ("pp", "dp", "dp_replicate", "dp_shard", "cp", "tp")


def mesh_pins(mesh: Any) -> dict:
    """The plan a named DeviceMesh asks for: ``("dp", "tp")`` of shape (2, 4) pins tp=4, dp=2.
    A mesh without names (or 1-D) only gives the world size."""
    names = getattr(mesh, "mesh_dim_names", None)
    if not names or not hasattr(mesh, "mesh"):
        return {}
    if len(set(names)) != len(names):
        raise AutoparError(f"the mesh names a dimension twice: {tuple(names)}; give each dimension its own name")
    unknown = [n for n in names if n not in MESH_NAMES]
    if unknown:
        if len(names) == 1:
            return {}
        raise AutoparError(
            f"mesh dimension(s) {', '.join(repr(n) for n in unknown)} are not ones autopar places: name the "
            f"dimensions from {', '.join(MESH_NAMES)} (or pass the world size and let autopar choose)")
    if "dp" in names and ("dp_shard" in names or "dp_replicate" in names):
        raise AutoparError(f"the mesh has 'dp' beside 'dp_shard'/'dp_replicate' {tuple(names)}: use either 'dp' or the "
                           "pair dp_replicate x dp_shard")
    size = dict(zip(names, mesh.mesh.shape))
    pins = {k: int(size[k]) for k in ("tp", "pp", "cp") if k in size}
    dp = int(size.get("dp", 1) * size.get("dp_replicate", 1) * size.get("dp_shard", 1))
    if any(k in size for k in ("dp", "dp_replicate", "dp_shard")):
        pins["dp"] = dp
    if "dp_shard" in size:
        pins["dp_shard"] = int(size["dp_shard"])
        pins["fsdp"] = int(size["dp_shard"] > 1)
    return pins


def _loaded(plan_arg: Any) -> Any:
    """``plan`` as given, with a JSON path read into its Plan."""
    if isinstance(plan_arg, str) and plan_arg != "auto" and ("=" not in plan_arg or os.path.exists(plan_arg)):
        return Plan.load(plan_arg)
    return plan_arg


def _plan_argument(plan_arg: Any, from_mesh: dict) -> Plan | dict:
    """What the user passed as ``plan`` ("auto", pins as a dict or ``"tp=2,sp=1"``, a Plan or a
    JSON path) as a Plan or a dict of pins, with the mesh's pins added; a contradiction between
    the two is an error."""
    plan_arg = _loaded(plan_arg)
    if isinstance(plan_arg, Plan):
        got = {"tp": plan_arg.tp, "pp": plan_arg.pp, "dp": plan_arg.dp, "dp_shard": plan_arg.dp_shard, "cp": plan_arg.cp}
        if any(k in got and got[k] != v for k, v in from_mesh.items()):
            raise PlanMismatchError(
                f"the plan ({plan_arg.as_config_string()}) does not match the mesh's dimensions "
                f"({', '.join(f'{k}={v}' for k, v in from_mesh.items())}); pass a mesh of the plan's shape or the world size")
        return plan_arg
    pins = search_mod.parse_pins(None if plan_arg == "auto" else plan_arg)
    for k, v in from_mesh.items():
        if k in pins and pins[k] != v:
            raise AutoparError(f"plan pins {k}={pins[k]} but the mesh's '{k}' dimension has {v}; pin what the mesh has")
    return {**pins, **from_mesh}


def _mesh_world(mesh: Any) -> tuple[int, str]:
    """The rank count of ``mesh`` (a DeviceMesh or an int) and the device type its ranks compute on."""
    if not isinstance(mesh, int) and not hasattr(mesh, "device_type"):
        raise AutoparError(f"mesh must be a DeviceMesh or a world size, got {type(mesh).__name__}")
    if hasattr(mesh, "device_type"):
        return _world(mesh), mesh.device_type
    from autopar.runtime import rank_device

    return _world(mesh), rank_device().type


def _resolve_plan(plan_arg: Plan | dict, model: nn.Module, world: int, prof: Profiled, *, example_inputs, hardware,
                  global_batch, memory_limit_gb, loss_fn, device: str, precision: str) -> Plan:
    """The given Plan checked against this model's fingerprint and the world size, or a new plan
    under the given pins (see ``_plan_argument``)."""
    if isinstance(plan_arg, Plan):
        for k, v in search_mod.estimate_only(plan_arg.pins).items():
            raise PlanMismatchError(
                f"the plan was priced by `autopar estimate` with {k}={v}, which autopar does not run "
                f"({search_mod.ESTIMATE_ONLY[k]}); plan with `autopar explain` or pass plan=\"auto\" or pins")
        if plan_arg.pp > 1 and plan_arg.n_microbatches < plan_arg.pp:
            raise PlanMismatchError(
                f"the plan runs {plan_arg.n_microbatches} microbatches over {plan_arg.pp} pipeline stages (priced by "
                "`autopar estimate`); autopar's pipeline schedules need at least one per stage: use a larger "
                "global batch or a smaller mb")
        plan_arg.check(model_fingerprint=prof.profile.fingerprint, world_size=world)
        if plan_arg.precision != precision:
            raise PlanMismatchError(
                f"the plan was priced for {plan_arg.precision} ({precision_of(plan_arg.precision).about}) but this "
                f"run trains {precision} ({precision_of(precision).about}); pass mp_policy={plan_arg.precision!r} "
                "or plan again for this precision")
        return plan_arg
    hw = hardware or ("cpu-gloo" if device == "cpu" else "h100")
    gb = global_batch or int(example_inputs[0].shape[0])
    return plan(model, world, example_inputs=example_inputs, hardware=hw, global_batch=gb, pin=plan_arg or None,
                memory_limit_gb=memory_limit_gb, precision=precision, loss_fn=loss_fn, profiled=prof)


@dataclass(frozen=True)
class RunPrecision:
    """The precision a compiled module trains in, and the dtypes the executor applies for it."""

    precision: str  # a name in plan.PRECISIONS
    compute: torch.dtype | None = None  # parameters cast to it where the step reads them (None: not cast)
    reduce: torch.dtype | None = None  # gradients reduced in it
    output: torch.dtype | None = None  # the model's floating-point outputs cast to it

    @property
    def trace_kw(self) -> dict:
        return {"param_dtype": self.compute, "output_dtype": self.output}


def _dtype_name(d: torch.dtype | None) -> str | None:
    return None if d is None else str(d).removeprefix("torch.")


def run_precision(model: nn.Module, mp_policy: Any, plan_arg: Any) -> RunPrecision:
    """What ``compile`` runs: ``mp_policy`` (a ``MixedPrecisionPolicy`` or a precision name), else
    the given plan's precision (``plan_arg`` read by ``_loaded``), else the parameters' own dtype. The parameters are never
    converted: the precision's master dtype must be theirs."""
    own = next((q.dtype for q in model.parameters() if q.is_floating_point()), torch.float32)
    output = None
    if mp_policy is None:
        name = plan_arg.precision if isinstance(plan_arg, Plan) else model_precision(model)
    elif isinstance(mp_policy, str):
        name = mp_policy
    elif hasattr(mp_policy, "param_dtype") and hasattr(mp_policy, "reduce_dtype"):
        compute = mp_policy.param_dtype or own
        reduce = mp_policy.reduce_dtype or compute  # FSDP2: reduced in the compute dtype unless told
        output = getattr(mp_policy, "output_dtype", None)
        want = (_dtype_name(own), _dtype_name(compute), _dtype_name(reduce))
        name = next((p.name for p in PRECISIONS.values() if (p.param, p.compute, p.reduce) == want), None)
        if name is None:
            runs = ", ".join(f"{p.name} ({p.about})" for p in PRECISIONS.values() if not p.runs)
            raise AutoparError(
                f"mp_policy {mp_policy} on {want[0]} parameters computes in {want[1]} and reduces gradients in "
                f"{want[2]}, which is none of the precisions autopar runs: {runs}; e.g. "
                "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")
    else:
        raise AutoparError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or a precision name "
                           f"({', '.join(PRECISIONS)}), got {type(mp_policy).__name__}")
    prec = precision_of(name)
    if prec.runs:
        raise AutoparError(f"precision {prec.name} is priced but not run: {prec.runs}")
    if prec.param != _dtype_name(own):
        raise AutoparError(
            f"precision {prec.name} keeps the parameters in {prec.param}, but the model's are {_dtype_name(own)}; "
            f"autopar does not convert them: {'call model.float() first' if prec.param == 'float32' else 'convert the model'}"
            f" or choose a precision whose masters are {_dtype_name(own)}")
    compute = getattr(torch, prec.compute)
    return RunPrecision(prec.name, compute if compute != own else None,
                        getattr(torch, prec.reduce) if compute != own else None, output)


@dataclass
class StepState:
    """What the graph passes need beside the graph: the traced step, where each parameter lives,
    the TP rules, the example primals (local shards, buffers, inputs), how many outputs the
    forward has of its own, the data-parallel collectives ``overlap`` schedules (None without
    data parallelism) and, under a zero-bubble schedule, how many gradients are the weights'."""

    graph: Any
    layout: Any
    rules: Any
    example: list
    n_outputs: int
    dp: Any = None
    split_weight: int | None = None
    accumulate: list | None = None  # once per step: the backward outputs added into buffers (passes/accumulate.py)


def _layout(sg, p: Plan, mesh, mixed: RunPrecision, split_head: bool):
    from autopar.passes.cp import ActMesh
    from autopar.passes.distribute import Layout
    from autopar.passes.fsdp import dp_placements, sub_meshes
    from autopar.passes.tp import tp_rules

    shapes = [tuple(ph.meta["val"].shape) for ph in sg.placeholders()[: sg.n_params]]
    rules = None
    tp_pl: dict = {}
    if p.tp > 1:
        rules = tp_rules(sg, roles.step_roles(sg), p.tp, p.sp, split_head)
        tp_pl = rules.placements
    dp_pl = dp_placements(shapes, tp_pl, p.dp_shard * p.cp, p.fsdp)
    lay = Layout(shapes, tp_pl, dp_pl, dp_size=p.dp, compute=mixed.compute, reduce=mixed.reduce,
                 once=p.fsdp and p.fsdp_once == "gather")
    if mesh is None:
        return lay, rules
    # Under CP the parameters are sharded (FSDP) or their gradients reduced (DDP) over dp_shard
    # and cp together: one flattened dim, as torchtitan's dp_shard_cp.
    shard = "dp_shard_cp" if p.cp > 1 else "dp_shard"
    sizes = {"dp_replicate": p.dp // p.dp_shard, shard: p.dp_shard * p.cp, "tp": p.tp}
    dims = tuple(d for d in ("dp_replicate", shard, "tp") if sizes[d] > 1)
    if dims:
        lay.param_dims, lay.param_mesh = dims, sub_mesh(mesh, dims)
    dp_dims = tuple(d for d in ("dp_replicate", shard) if sizes[d] > 1)
    if dp_dims:
        lay.dp_dims, lay.dp_mesh = dp_dims, sub_mesh(mesh, dp_dims)
        lay.dp_submeshes = sub_meshes(lay.dp_mesh)
    if p.tp > 1:
        lay.tp_mesh = mesh["tp"]
    lay.act_mesh = ActMesh.of(mesh, tuple(d for d in ("cp", "tp") if getattr(p, d) > 1))
    if p.ep > 1:
        from autopar.passes.ep import EPGroup
        from autopar.passes.groups import register_group

        pg = ep_mesh(mesh, p).get_group()
        register_group(mesh, f"ep{p.ep}", pg)  # one name on every rank: ep groups' graphs are the same text
        # Experts sharded over the ep ranks (or a multiple): each rank reads only its own experts' weights.
        shard_pg = ep_shard_mesh(mesh, p).get_group() if ep_owned(p) and p.dp_shard > p.ep else None
        if shard_pg is not None:  # the experts' FSDP shards spread beyond the ep ranks
            register_group(mesh, f"ep{p.ep}_shard", shard_pg)
        lay.ep = EPGroup(pg.group_name, p.ep, owners_read=ep_owned(p), shard_group=shard_pg.group_name if shard_pg else "",
                         shard_size=p.dp_shard // p.ep if shard_pg else 1)
    return lay, rules


def ep_mesh(mesh, p: Plan):
    """The ``ep`` ranks of this rank: ``ep`` consecutive ranks of the data-parallel ones
    (``dp_replicate x dp_shard`` flattened, innermost first), a 1-D mesh."""
    dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return dp._unflatten(0, (p.dp // p.ep, p.ep), ("dp_mod_ep", "ep"))["ep"]


def ep_shard_mesh(mesh, p: Plan):
    """The ranks of this rank's ``dp_shard`` group at its place in their ep groups (``dp_shard /
    ep`` of them, ``ep`` apart; ``p.ep`` divides ``p.dp_shard``): where FSDP spreads an expert's
    shards beyond its ep group, the ones its owner gathers the rest from. A 1-D mesh."""
    return mesh["dp_shard"]._unflatten(0, (p.dp_shard // p.ep, p.ep), ("dp_shard_mod_ep", "ep_in_shard"))["dp_shard_mod_ep"]


@contextlib.contextmanager
def own_sharding_caches():
    """DTensor's sharding propagation caches emptied on entry and on exit. They are keyed by
    meshes compared by ranks, shape and dimension names, not by process groups: a mesh of the
    caller's equal to autopar's (torchtitan names its dimensions as autopar does) would otherwise
    hand one side's cached output placements, and with them its process groups, to the other's
    trace, which then bakes the other's groups into its graph, on some ranks and not others (a
    torchtitan TP 2 x FSDP 2 step traced after autopar.compile hung so on 4 processes)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    try:
        yield
    finally:
        _clear_sharding_prop_cache()


def world_mesh(device: str, p: Plan):
    """The plan's device mesh (``MESH_DIMS``), with ``dp_shard x cp`` flattened under CP."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.plan import MESH_DIMS

    mesh = init_device_mesh(device, p.mesh_shape, mesh_dim_names=MESH_DIMS)
    if p.cp > 1:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def sub_mesh(mesh, dims: tuple):
    """``mesh[dims]`` (one dim or several, a flattened one among them)."""
    import warnings

    with warnings.catch_warnings():  # slicing a flattened dim from the root mesh: what torchtitan does too
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[dims if len(dims) > 1 else dims[0]]


def _distribute_parameters(model: nn.Module, sg, lay) -> list[torch.Tensor]:
    """Replace each parameter of ``model`` (under every name it has) by its DTensor shard on the
    mesh; the values come from rank 0. Returns the local shards, in the step graph's order."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    locals_ = []
    for i, name in enumerate(sg.param_names):
        p = model.get_parameter(name)
        if lay.param_mesh is None or isinstance(p.data, DTensor):  # one process, or placed by another stage
            locals_.append(getattr(p.data, "_local_tensor", p.detach()))
            continue
        with torch.no_grad():
            dt = distribute_tensor(p.detach(), lay.param_mesh, lay.placements(i), src_data_rank=0)
        new = nn.Parameter(dt, requires_grad=p.requires_grad)
        for n in [name, *sg.aliases.get(name, [])]:
            owner, _, attr = n.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, new)
        locals_.append(dt._local_tensor)
    return locals_


def _local_shards(model: nn.Module, sg) -> list[torch.Tensor]:
    return [getattr(q, "_local_tensor", q).detach() for q in (model.get_parameter(n) for n in sg.param_names)]


def _build_runner(sg, p: Plan, mesh, lay, rules, locals_, model, *, inductor: bool, disabled: set,
                  inputs: list, info, key: str):
    """The registered passes (``passes.step_passes``) and the backend on one step graph
    (``inputs``: its example inputs after the parameters and buffers); its collectives, notes
    and pass times go into ``info`` (a ``runtime.CompileInfo``) under ``key``."""
    from autopar import backend
    from autopar.passes import PassContext, step_passes
    from autopar.passes.distribute import grad_inputs, grad_outputs, output_values
    from autopar.passes.overlap import DPCollectives
    from autopar.passes.shared import run_step_passes
    from autopar.runtime import StepRunner

    params = [model.get_parameter(n) for n in sg.param_names]
    buffers = [model.get_buffer(n) for n in sg.buffer_names]
    if lay.once:  # each parameter whole (its TP shard), as the runtime gathers it (zero.py);
        # owned experts holding what the runtime's collectives received: (shard groups, *shard)
        # and 3-D experts this rank's own, gathered over their shard group: (E / ep, ...)
        owned = {i for idx, _ in lay.owned_experts(sg) for i in idx}
        stacked = set(lay.owned_stacked(sg))

        def held(i, x):
            if i in owned:
                return (lay.ep.shard_size, *x.shape)
            if i in stacked:
                return (lay.ep.shard_size * x.shape[0], *x.shape[1:])
            return lay.tp_local_shape(i)

        locals_ = [torch.empty(held(i, x), dtype=zero.cast_dtype(x, lay.compute), device=x.device)
                   for i, x in enumerate(locals_)]
    example = [x.detach().requires_grad_(q.requires_grad) for x, q in zip(locals_, params)] + buffers + inputs
    grad_index = grad_inputs(sg, example)
    state = StepState(sg, lay, rules, example, len(output_values(sg)))
    if lay.dp_mesh is not None and not lay.once:
        state.dp = DPCollectives(param_layer=[analysis.layer_index(n, sg.layers) for n in sg.param_names],
                                 grad_param=[i if i < len(params) else None for i in grad_index],
                                 groups={mesh.get_group(d).group_name for d in lay.dp_dims})
    if p.pp > 1 and p.schedule in ZERO_BUBBLE:
        state.split_weight = sum(i < len(params) for i in grad_index)
    if lay.once:
        state.accumulate = [j for j, i in enumerate(grad_index) if i < len(params)]
    ctx = PassContext(mesh, p, compile=inductor, disabled=set(disabled), step=state)
    graphs = run_step_passes(sg, ctx, step_passes())
    compiled = backend.compile_step(graphs, inductor=inductor and "inductor" not in disabled)
    for line in compiled.fallbacks:
        ctx.note("regions", line)
    info.collectives[key] = _collective_records(compiled, mesh)
    info.compiled_here[key] = compiled.compiled_here
    if key != "forward":  # the forward graph is built at the user's first call, after compile: not its time
        prefix = "" if key == "step" else f"{key} "
        info.notes.update({prefix + k: v for k, v in ctx.notes.items()})
        info.timings.update({prefix + k: v for k, v in {**ctx.timings, "inductor": compiled.compile_s}.items()})
    n_args = len(params) + len(buffers) + len(inputs)
    return StepRunner(compiled, list(sg.param_names), n_args, grad_index, grad_outputs(sg), [tuple(x.shape) for x in inputs],
                      accumulate=state.accumulate)


def _collective_records(compiled, mesh) -> list[dict]:
    """Each collective of the compiled forward and backward graphs (``passes.collective_record``),
    with the graph it is in and its mesh dim; backward nodes carry no annotation of their own, so
    the pass is named from the dim of their group."""
    from autopar.passes import collective_record, collectives
    from autopar.passes.groups import dim_of

    recs = []
    for g, gm in (("forward", compiled.fw_graph), ("backward", compiled.bw_graph)):
        for n in collectives(gm):
            r = dict(collective_record(n), graph=g, dim=dim_of(n.args[-1]) or "?")
            if r["pass"] == "?" and r["kind"] == "mirror_swap":
                r["pass"] = "cp"  # the query/output swap
            elif r["pass"] == "?" and r["kind"].startswith("all_to_all"):
                r["pass"] = "ep"  # the rows' all-to-alls, also where the ep group is all of dp_shard
            elif r["pass"] == "?":
                # An ep group ("ep4") or its shard group ("ep2_shard") is no mesh dim: named by its split.
                r["pass"] = {"tp": "tp", "dp_shard": "fsdp", "dp_replicate": "ddp", "cp": "cp",
                             "dp_shard_cp": "ddp" if r["kind"].startswith("all_reduce") else "fsdp"}.get(
                                 r["dim"], "ep" if r["dim"].startswith("ep") else "?")
            recs.append(r)
    return recs


def _compile_pipeline(model: nn.Module, p: Plan, mesh, inputs: tuple, target: torch.Tensor, loss_fn: Callable,
                      name: str, split_head: bool, *,
                      inductor: bool, disabled: set, mixed: RunPrecision):
    """Pipeline plans: the forward graph cut into stage graphs (``passes/pp.py``); this rank's
    stages each go through the same passes and backend; parameters of other ranks' stages are
    dropped from the module."""
    from autopar import capture
    from autopar.passes import PassContext, run_passes, split_passes
    from autopar.passes import cp as cp_pass
    from autopar.passes import pp as pp_mod
    from autopar.passes.tp import placement_str
    from autopar.runtime import CompileInfo, ParallelModule

    mb_inputs = [x[: p.mb] for x in inputs]
    sg = capture.trace_step(model, tuple(mb_inputs), name=name, **mixed.trace_kw)
    n_stages = p.pp * p.v
    split_ctx = PassContext(mesh, p, compile=inductor, disabled=set(disabled))
    stages = run_passes(sg, split_ctx, split_passes())
    shared = pp_mod.shared_params(stages)
    rank = mesh.get_local_rank("pp")
    mine = [s for s in range(n_stages) if p.stage_rank(s) == rank]
    keep = {n for s in mine for n in stages[s].param_names}
    for pname in sg.param_names:
        if pname not in keep:
            for n in [pname, *sg.aliases.get(pname, [])]:
                owner, _, attr = n.rpartition(".")
                (model.get_submodule(owner) if owner else model)._parameters[attr] = None
    runners, placements, notes = {}, [], []
    info = CompileInfo(sorted(keep), inputs=[*mb_inputs, target[: p.mb]])
    info.timings.update(split_ctx.timings)
    layouts = {s: _layout(stages[s], p, mesh, mixed, split_head)
               for s in set(mine) | {s for ss in shared.values() for s in ss}}
    for pname, ss in shared.items():
        got = {s: layouts[s][0].placements(stages[s].param_names.index(pname)) for s in ss}
        if len(set(map(str, got.values()))) > 1:
            raise AutoparError(f"parameter {pname} is shared by pipeline stages {ss}, which would place it "
                               f"differently ({', '.join(f'stage {s}: {v}' for s, v in got.items())}); pin tp=1")
    info.tied = _tied_groups(shared, p, mesh, rank)
    info.collectives["tied gradients"] = [
        {"graph": "after backward", "kind": "all_reduce", "group_size": group.size(), "pass": "pp tied",
         "bytes": int(getattr(model.get_parameter(name).data, "_local_tensor", model.get_parameter(name)).nbytes),
         "source": name, "module": ""} for name, group, _ in info.tied]
    for s in mine:
        st = stages[s]
        lay, rules = layouts[s]
        placements += [(n, placement_str(lay.tp[i]) if i in lay.tp else "R", placement_str(lay.dp[i]))
                       for i, n in enumerate(st.param_names)]
        notes += list(rules.notes if rules else ())
        locals_ = _distribute_parameters(model, st, lay)
        # A stage's inputs: what the stage before sends (activations, which carry gradients), then
        # the model's inputs (which do not); under CP each rank's own tokens of both.
        phs = st.placeholders()[st.n_params + len(st.buffer_names):]
        seq = cp_pass.seq_len(st) if p.cp > 1 and not st.first else None

        def sent(shape):
            return cp_pass.message_shape(shape, seq, p.cp) if seq is not None else tuple(shape)

        st_inputs = [torch.zeros(sent(ph.meta["val"].shape), dtype=ph.meta["val"].dtype, device=mb_inputs[0].device
                                 ).requires_grad_(ph.meta["val"].is_floating_point()) for ph in phs[:st.n_received]]
        st_model_inputs = [x[tuple(slice(0, n) for n in sent(x.shape))] for x in mb_inputs]
        runners[s] = (st, _build_runner(st, p, mesh, lay, rules, locals_, model, inductor=inductor,
                                        disabled=disabled, inputs=st_inputs + st_model_inputs, info=info,
                                        key=f"stage {s}"))
    p = dataclasses.replace(p, placements=tuple(placements), tp_notes=tuple(notes))
    return ParallelModule(model, p, mesh, step_runner=None, forward_factory=None, loss_fn=loss_fn, info=info,
                          stages=runners, once=zero.plan_once(lay, [st for st, _ in runners.values()]))


def _tied_groups(shared: dict, p: Plan, mesh, rank: int) -> list[tuple[str, Any, bool]]:
    """For each parameter shared by stages on different pipeline ranks (a tied embedding and
    head): the process group of exactly the ranks that hold a copy (one per pipeline line, as
    Megatron-LM's embedding group), over which the copies' gradients are summed after backward;
    and whether this rank counts it in the gradient norm (the first holder does). Every rank
    creates every group, in the same order (``new_group`` is collective)."""
    import torch.distributed as dist

    out, groups = [], {}
    pp_group = mesh["pp"].get_group()
    lines = mesh.mesh.reshape(p.pp, -1)
    me = dist.get_rank()
    for pname, ss in sorted(shared.items()):
        holders = sorted({p.stage_rank(s) for s in ss})
        if len(holders) < 2:
            continue  # one rank holds every stage that uses it: its gradient accumulates in place
        key = tuple(holders)
        if key not in groups:
            if len(holders) == p.pp:
                groups[key] = pp_group
            else:
                mine = None
                for col in range(lines.shape[1]):
                    ranks = lines[holders, col].tolist()
                    g = dist.new_group(ranks)
                    if me in ranks:
                        mine = g
                groups[key] = mine
        if rank in holders:
            out.append((pname, groups[key], rank == holders[0]))
    return out


def compile(
    model: nn.Module, mesh: Any, *, example_inputs: tuple, example_target: torch.Tensor | None = None,
    loss_fn: Callable | None = None, plan: Any = "auto", hardware: Any = None, global_batch: int | None = None,
    memory_limit_gb: float | None = None, compile: bool = True, disable_passes: tuple = (),
    tune: bool = False, tune_top: int = 4, tune_steps: int = 2, tune_db: str | None = None,
    mp_policy: Any = None,
):
    """Plan (or take a plan) and apply it: returns a ``ParallelModule`` that trains across ``mesh``.

    The flow, in order: capture and plan (``plan``), trace the single-device training step to one
    graph (``capture.trace_step``), place every parameter (``passes/tp.py``, ``passes/fsdp.py``),
    run the registered passes on it (``passes.step_passes``: distribute, ac, partition, overlap,
    zero-bubble split, regions; pipeline plans cut it into stage graphs first), compile each graph
    (``backend.compile_step``), and wrap it (``runtime.ParallelModule``). ``compile=False`` runs the same
    graphs without Inductor. ``tune=True`` measures the planner's top ``tune_top`` plans for
    ``tune_steps`` real steps on copies of the model and applies the fastest one that fits.
    ``mp_policy``: mixed precision, a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (FSDP2's
    meaning) or a precision name (``bf16-mixed``: fp32 masters, bf16 compute and gathers, fp32
    gradient reduction); by default a given plan's precision, else the parameters' own dtype.
    ``disable_passes``: optional passes (``ac``, ``overlap``) or switches (``bucket``,
    ``inductor``, ``regions``, ``stamp``) to turn off, for debugging; anything else is refused.
    """
    from autopar.runtime import guarded

    t0 = time.perf_counter()
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    # Graph modules made while compiling generate their Python code only when run or read
    # (passes.graph_module).
    with guarded("autopar.compile"), _use_lazy_graph_module(True), own_sharding_caches(), fewer_collections():
        pm = _compile(model, mesh, example_inputs=example_inputs, example_target=example_target, loss_fn=loss_fn,
                      plan=plan, hardware=hardware,
                      global_batch=global_batch, memory_limit_gb=memory_limit_gb, compile=compile,
                      disable_passes=disable_passes, tune=tune, tune_top=tune_top, tune_steps=tune_steps,
                      tune_db=tune_db, mp_policy=mp_policy)
    pm.info.compile_s = time.perf_counter() - t0
    return pm


def _compile(model, mesh, *, example_inputs, example_target, loss_fn, plan, hardware, global_batch, memory_limit_gb, compile,
             disable_passes, tune, tune_top, tune_steps, tune_db, mp_policy):
    import copy

    import torch.distributed as dist

    from autopar import capture
    from autopar.passes import check_pass_names
    from autopar.runtime import ParallelModule

    if not isinstance(model, nn.Module):
        raise AutoparError(f"autopar.compile takes an nn.Module, got {type(model).__name__}")
    disabled = check_pass_names(disable_passes)
    world, device = _mesh_world(mesh)
    from_mesh = mesh_pins(mesh)
    if dist.is_initialized() and world != dist.get_world_size():
        raise AutoparError(f"the mesh has {world} ranks but the process group has {dist.get_world_size()}; "
                           "pass a mesh over the whole world")
    if not dist.is_initialized() and world != 1:
        raise AutoparError(f"a world of {world} needs torch.distributed initialised (torchrun, or autopar.runtime.init_distributed())")
    example_inputs = check_example_inputs(example_inputs, example_target)
    if compile and device == "cpu" and "inductor" not in disabled:
        from autopar import cpu_isa

        cpu_isa.warm()  # Inductor's CPU probe runs beside the trace and the passes
    traceable.check_routed_experts(model)  # before the fixed-shape experts form trains anything
    if device == "cuda":
        # Traced where it runs: the device arguments the model's code records (an ``arange`` on
        # the ids' device, a mask built on the weights') are this rank's GPU in every graph.
        gpu = torch.device("cuda", torch.cuda.current_device())
        model.to(gpu)
        example_inputs = tuple(x.to(gpu) for x in example_inputs)
        example_target = example_target.to(gpu) if example_target is not None else None
    # One capture: the training step is traced once; the planner analyses this graph and, when the
    # plan runs the whole batch at once, the executor runs it.
    target = example_target if example_target is not None else capture.default_target(model, example_inputs, loss_fn)
    loss_fn = loss_fn or capture.default_loss
    plan = _loaded(plan)  # a plan file read once: its precision decides how the step is traced
    mixed = run_precision(model, mp_policy, plan)
    step = capture.trace_step(model, example_inputs, target=target, loss_fn=loss_fn, name=type(model).__name__,
                              **mixed.trace_kw)
    prof = profile_model(model, example_inputs=example_inputs, precision=mixed.precision, loss_fn=loss_fn,
                         step=step)
    batch = int(example_inputs[0].shape[0])
    tuning = None
    if tune:
        from autopar import tune as tune_mod

        hw = hardware or ("cpu-gloo" if device == "cpu" else "h100")
        cands = plan_candidates(model, world, k=tune_top, example_inputs=example_inputs, hardware=hw,
                                global_batch=global_batch or batch, memory_limit_gb=memory_limit_gb,
                                pin=plan if isinstance(plan, dict) else None, loss_fn=loss_fn, profiled=prof,
                                precision=mixed.precision)
        db = tune_mod.MeasurementDB(tune_db) if (not dist.is_initialized() or dist.get_rank() == 0) else None
        tuning = tune_mod.tune_plans(lambda: copy.deepcopy(model), cands, example_inputs,
                                     hardware=load_hardware(hw).name, db=db, steps=tune_steps, loss_fn=loss_fn,
                                     compile=compile, memory_limit_gb=memory_limit_gb)
        plan = tuning[0]["plan"]
    plan = _plan_argument(plan, from_mesh)
    p = _resolve_plan(plan, model, world, prof, example_inputs=example_inputs, hardware=hardware,
                      global_batch=global_batch, memory_limit_gb=memory_limit_gb, loss_fn=loss_fn, device=device,
                      precision=mixed.precision)
    if p.ep > 1 and p.cp > 1:
        raise AutoparError(f"expert parallelism (ep={p.ep}) does not run with context parallelism (cp={p.cp}) yet: "
                           "plan with ep=1 or cp=1")
    validate_ep(prof.profile, p.ep, p.dp)  # a saved plan's too: the experts it splits are this model's
    if p.cp > 1 and not capture.is_token_ids(example_inputs[0]):
        raise AutoparError(f"context parallelism (cp={p.cp}) splits sequences of token ids over ranks; this model "
                           f"takes {tuple(example_inputs[0].shape)} {example_inputs[0].dtype} inputs: plan with cp=1")
    if p.seq_len != prof.profile.seq_len:
        raise PlanMismatchError(f"the plan is for sequences of {p.seq_len} tokens, the example inputs have "
                                f"{prof.profile.seq_len}")
    # The head's logits stay split along the vocabulary only for a cross-entropy (loss parallelism):
    # decided once, from the step with its loss, for every graph that holds the head.
    split_head = p.tp > 1 and roles.head_feeds_cross_entropy(step)
    dmesh = None
    if world > 1:
        dmesh = world_mesh(device, p)
    if p.pp > 1:
        pm = _compile_pipeline(model, p, dmesh, example_inputs, target, loss_fn, prof.source_name, split_head,
                               inductor=compile,
                               disabled=disabled, mixed=mixed)
        pm.tuning = tuning
        return pm
    mb_inputs = [x[: p.mb] for x in example_inputs]
    mb_tgt = target[: p.mb]
    sg = step if p.mb == batch else capture.trace_step(model, tuple(mb_inputs), target=mb_tgt, loss_fn=loss_fn,
                                                       name=prof.source_name, **mixed.trace_kw)
    lay, rules = _layout(sg, p, dmesh, mixed, split_head)
    from autopar.passes.tp import placement_str

    placements = tuple((n, placement_str(lay.tp.get(i)) if i in lay.tp else "R", placement_str(lay.dp[i]))
                       for i, n in enumerate(sg.param_names))
    p = dataclasses.replace(p, placements=placements, tp_notes=tuple(rules.notes if rules else ()))
    locals_ = _distribute_parameters(model, sg, lay)
    from autopar.runtime import CompileInfo

    info = CompileInfo(sg.param_names, inputs=[*mb_inputs, mb_tgt], buffers=[model.get_buffer(n) for n in sg.buffer_names])
    step_runner = _build_runner(sg, p, dmesh, lay, rules, locals_, model, inductor=compile,
                                disabled=disabled, inputs=info.inputs, info=info, key="step")

    def forward_factory(inputs: tuple):
        """The forward graph for the user's own loop, built at the first call with a shape."""
        from autopar.passes.tp import tp_rules

        with own_sharding_caches():
            fsg = capture.trace_step(model, tuple(inputs), name=prof.source_name, **mixed.trace_kw)
            frules = tp_rules(fsg, roles.step_roles(fsg), p.tp, p.sp, split_head) if p.tp > 1 else None
            runner = _build_runner(fsg, p, dmesh, lay, frules, _local_shards(model, fsg), model, inductor=compile,
                                   disabled=disabled, inputs=list(inputs), info=info, key="forward")
        info.output_type = fsg.output_type
        return runner

    pm = ParallelModule(model, p, dmesh, step_runner=step_runner, forward_factory=forward_factory,
                        loss_fn=loss_fn, info=info, once=zero.plan_once(lay, [sg]))
    pm.tuning = tuning
    return pm
