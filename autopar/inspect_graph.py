"""``autopar explain --graph``: the graphs the executor builds for a plan, with provenance, and
the memory those graphs hold beside what the plan predicts.

The plan is applied by the real executor (the same passes as ``autopar.compile``) on a fake
process group of the plan's size, in this one process: the model is built with a few layers
(storage left uninitialised: only shapes matter) in the plan's precision, and Inductor is skipped
(the graphs shown are the ones it would compile, in the order it keeps). Every collective of the
forward and backward graphs is listed with its kind, group size, bytes and the pass and node it
came from.

Memory: ``memory.step_peak`` walks the executed graphs at the plan's real shapes (sequence,
microbatch, mesh). A stack of identical layers holds memory affine in its layer counts per AC
mode, so the walk runs on 3 layers, 4 layers and, for each other AC mode in the plan, 3 + 1 layers
of that mode, and the plan's depth is read off that line (``tests/test_memory.py`` holds the
extrapolation against a walk at full depth). Three, not two: with each distinct layer compiled
once (``regions``), a 2-layer backward has nothing that repeats (its bottom layer, which hands
its gradient to the embedding, differs), so the program's shape settles only from 3 layers on. What the rank holds outside the step (parameter
shards, their gradients and AdamW's two moments, in the executed dtype) is added to give the
executed total beside the cost model's.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
import torch.distributed as dist

from autopar.plan import Plan, precision


def _cut(build, layers: int):
    """The model with ``layers`` repeated layers, parameters allocated but not initialised: made
    from its config at that depth, or, where the built model's modules are not what its config
    makes (the builder replaced some after construction), its own layers repeated in turn."""
    with torch.device("meta"):
        built = build()
    cut = _from_config(built, layers)
    if cut is not built and _module_types(cut) != _module_types(built):
        cut = _restacked(built, layers, getattr(cut, "config", None))
    return cut.to_empty(device="cpu")


def _module_types(model: torch.nn.Module) -> set:
    return {type(m) for m in model.modules()}


def _restacked(model: torch.nn.Module, layers: int, derived=None) -> torch.nn.Module:
    """``model`` (on the meta device) with ``layers`` layers in its stack of repeated layers:
    copies of its own in turn (layer ``i`` a copy of layer ``i mod n``), its config's depth and
    per-layer lists (layer types) taken from ``derived``, the config ``_from_config`` made for
    that depth."""
    import copy

    from autopar.capture import find_layers
    from autopar.errors import AutoparError

    names = find_layers(model)
    parents = {n.rpartition(".")[0] for n in names}
    stack = model.get_submodule(next(iter(parents))) if len(parents) == 1 else None
    if not isinstance(stack, torch.nn.ModuleList) or len(stack) != len(names):
        raise AutoparError("explain --graph: the model's layers are not one list of repeated layers and its "
                           "modules are not what its config builds, so it cannot be walked at another depth")
    n = len(stack)
    new = torch.nn.ModuleList(stack[i] if i < n else copy.deepcopy(stack[i % n]) for i in range(layers))
    parent, _, child = next(iter(parents)).rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
    cfg = getattr(model, "config", None)
    if derived is not None and getattr(cfg, "num_hidden_layers", None) == n:
        for k, v in list(vars(cfg).items()):
            if isinstance(v, list) and len(v) == n:
                setattr(cfg, k, getattr(derived, k))
        cfg.num_hidden_layers = layers
    return model


def _from_config(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """``model``'s class made from its config with ``layers`` layers (on the meta device), or
    ``model`` itself where it has no config that says its depth."""
    cfg = getattr(model, "config", None)
    if dataclasses.is_dataclass(cfg) and hasattr(cfg, "n_layers"):
        with torch.device("meta"):
            model = type(model)(dataclasses.replace(cfg, n_layers=layers))
    elif cfg is not None and hasattr(cfg, "num_hidden_layers"):
        d = cfg.to_dict()
        n = d["num_hidden_layers"]
        # A list with one entry per layer (layer_types, Llama 4's no_rope_layers and moe_layers): as the
        # config derives it for the new depth where it derives it when not given, else its pattern.
        per_layer = {k: v for k, v in d.items() if isinstance(v, list) and n and len(v) == n}
        try:
            derived = type(cfg).from_dict({**d, **dict.fromkeys(per_layer), "num_hidden_layers": layers}).to_dict()
        except Exception:  # noqa: BLE001 - a config that needs them given
            derived = {}
        for k, v in per_layer.items():
            got = derived.get(k)
            d[k] = got if isinstance(got, list) and len(got) == layers else [v[i % n] for i in range(layers)]
        cfg = type(cfg).from_dict({**d, "num_hidden_layers": layers})
        with torch.device("meta"):
            model = type(model)(cfg)
    return model


def _compile(build, plan: Plan, layers: int, ac: list[str] | None = None, *, dtype=None, batch: int | None = None):
    """``autopar.compile`` of the cut model under ``plan``'s shape (eager graphs), on the fake
    process group that is initialised. ``ac``: each layer's AC mode (default: the plan's first)."""
    import autopar

    model = _cut(build, layers)
    if dtype is not None:
        model = model.to(dtype)
    ids = torch.zeros((batch or plan.dp * plan.mb, plan.seq_len), dtype=torch.long)
    pins = {"tp": plan.tp, "dp": plan.dp, "pp": 1, "sp": int(plan.sp), "fsdp": int(plan.fsdp), "mb": plan.mb,
            "dp_shard": plan.dp_shard, "ac": plan.layers[0].ac, "reshard": int(plan.reshard_after_forward),
            "once": plan.fsdp_once or "microbatch",
            **{k: getattr(plan, k) for k in ("cp", "ep") if getattr(plan, k) > 1}}
    p = autopar.plan(model, plan.world_size, example_inputs=(ids,), pin=pins, hardware="h100",
                     global_batch=ids.shape[0], precision=plan.precision)
    if ac is not None:
        p = dataclasses.replace(p, layers=tuple(dataclasses.replace(l, ac=a) for l, a in zip(p.layers, ac)))
    return autopar.compile(model, plan.world_size, example_inputs=(ids,), plan=p, compile=False, hardware="h100")


def _fake_group(world: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.errors import AutoparError

    if dist.is_initialized():
        raise AutoparError("explain --graph runs on its own fake process group: call it outside a distributed job")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def rewritten_graph(build, plan: Plan, *, layers: int = 2) -> str:
    from autopar import explain
    from autopar.errors import AutoparError

    if plan.pp > 1:
        raise AutoparError("explain --graph shows non-pipelined plans; pin pp=1 to see one stage's graphs")
    _fake_group(plan.world_size)
    try:
        pm = _compile(build, plan, layers)
        text = (f"graphs of {plan.model_name} with {layers} layers under {pm.plan.as_config_string()} "
                f"on a fake process group of {plan.world_size}\n" + explain.render_executed(pm.info))
        del pm
        return text + render_memory(executed_memory(build, plan), plan)
    finally:
        dist.destroy_process_group()


def executed_memory(build, plan: Plan) -> dict:
    """The executed step's memory for ``plan`` at its real depth (bytes), from walks of small
    stacks (see the module docstring), on the fake process group that is initialised."""
    import gc

    from autopar import memory

    dtype = getattr(torch, precision(plan.precision).param)  # the masters: the plan's precision casts them
    modes = Counter(l.ac for l in plan.layers)
    base = modes.most_common(1)[0][0]
    M = max(1, plan.global_batch // (plan.dp * plan.mb))

    def walk(ac: list[str]) -> tuple[memory.Liveness, int]:
        pm = _compile(build, plan, len(ac), ac, dtype=dtype, batch=plan.dp * plan.mb)
        # The program Inductor makes of these graphs (what the default path runs), gradient shards
        # apart (they are states).
        live = memory.step_liveness(pm._step_runner.compiled, M, gradients=False, fused=True, held=memory.once_held(pm))
        held = sum(int(getattr(q, "_local_tensor", q).nbytes) for q in pm.parameters())
        del pm
        gc.collect()
        return live, held

    three, held3 = walk([base] * 3)
    four, held4 = walk([base] * 4)
    per = {base: four.peak_bytes - three.peak_bytes}
    held_per = held4 - held3
    for m in modes:
        if m != base:  # one layer of mode m first (the planner orders full, selective, none)
            other, _ = walk([m] + [base] * 3)
            per[m] = other.peak_bytes - three.peak_bytes
    n = len(plan.layers)
    peak = three.peak_bytes + sum(modes[m] * per[m] for m in modes) - 3 * per[base]
    params = held3 + (n - 3) * held_per  # parameter shards in the executed dtype
    states = params * 4  # + gradient shards + AdamW's two moments, all in the parameters' dtype
    return {"step_peak": peak, "per_layer": per, "states": states, "params": params, "layers": n,
            "peak_at": three.peak_at, "breakdown_3_layers": three.breakdown, "microbatches": M,
            "dtype": plan.precision}


def render_memory(ex: dict, plan: Plan) -> str:
    """The executed step's memory beside the plan's prediction of the same parts."""
    pred = plan.predicted.get("memory_breakdown_gb", {})
    gib = 2**30
    step_pred = (pred.get("unsharded_params", 0) + pred.get("activations", 0)) * gib
    lines = [
        f"memory per GPU, executed graphs ({ex['dtype']}, {ex['layers']} layers, {ex['microbatches']} microbatches; "
        f"liveness of 3- and 4-layer stacks extrapolated):",
        f"  step peak (gathered parameters, activations, gradients in flight): {ex['step_peak'] / gib:.2f} GiB "
        f"at {ex['peak_at'].split(':')[0]}; predicted {step_pred / gib:.2f} GiB "
        f"({(ex['step_peak'] / step_pred - 1) * 100 if step_pred else 0:+.1f}%)",
        "  per layer: " + ", ".join(f"{m} {v / gib:.3f} GiB" for m, v in ex["per_layer"].items()),
        f"  held outside the step (parameter shards, gradients, AdamW moments): {ex['states'] / gib:.2f} GiB; "
        f"predicted {pred.get('parameters+grads+optimizer', 0):.2f} GiB",
        f"  total {(ex['step_peak'] + ex['states']) / gib + pred.get('reserve', 0):.2f} GiB with the "
        f"{pred.get('reserve', 0):.1f} GiB reserve; predicted {plan.predicted.get('memory_gb_per_gpu', 0):.2f} GiB",
    ]
    return "\n".join(lines) + "\n"
