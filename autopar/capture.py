"""Capture: trace a model's training step to one ATen-level FX graph on fake tensors, without
allocating weights. The executor runs that graph; the planner's analysis reads it.

Algorithm
---------
1. Build (or take) the model; ``trace_model`` builds a preset or config under ``FakeTensorMode``:
   parameters are fake, nothing is allocated, so a 405B model costs a few hundred MB of host memory.
2. Find the *repeated layers* (``find_layers``): the largest group of modules that share a class and
   a parameter-shape signature, in whatever container (transformer layers).
3. ``trace_step``: ``make_fx`` of the forward and the loss of the whole model as a function of its
   parameters, buffers and inputs. Forward hooks annotate every node with the module that made it
   and the index of the layer it belongs to (``meta['custom']``); a ``saved_tensors_hooks`` records
   which node outputs autograd keeps for backward, and in which layer. For planning alone
   (``first_layers_only``) only the first layer runs and the others pass its output on, so
   capture time hardly grows with the layer count.
4. ``model_trace`` cuts what the analysis reads from that graph: the first layer's nodes as a graph
   of their own (parameters and other inputs as placeholders, what autograd saved in it), and every
   op outside the layers with its FLOPs and bytes, before ("pre") or after ("post") them.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import flop_registry

from autopar.errors import TraceError
from autopar.memory import gradient_in_kernel

log = logging.getLogger(__name__)

VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze",
    "squeeze", "slice", "select", "alias", "detach", "as_strided", "unflatten", "flatten",
    "split", "split_with_sizes", "chunk", "unbind", "_reshape_alias", "view_as_real",
    "view_as_complex", "contiguous", "clone", "_to_copy", "to", "lift_fresh_copy",
}


def op_name(target: Any) -> str:
    """'aten.mm.default' -> 'mm'."""
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))


def tensor_bytes(x: Any) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    fn = flop_registry.get(getattr(func, "overloadpacket", None))
    if fn is None:
        return 0
    shapes = pytree.tree_map(lambda x: x.shape if isinstance(x, torch.Tensor) else x, (args, kwargs, out))
    try:
        return int(fn(*shapes[0], **shapes[1], out_val=shapes[2]))
    except Exception:  # a formula that does not accept these arguments: count as no FLOPs
        return 0


@dataclass
class OpRecord:
    """One ATen op outside the repeated blocks (embedding, head, loss)."""

    name: str
    segment: str  # "pre" (before the first block) or "post" (after the last)
    flops: int
    bytes: int
    out_shapes: list[tuple[int, ...]]
    in_shapes: list[tuple[int, ...]]
    # Bytes of each output and input (0 for integer tensors, which have no gradient).
    out_bytes: list[int] = field(default_factory=list)
    in_bytes: list[int] = field(default_factory=list)
    # Its backward runs inside Inductor's fused kernels (memory.gradient_in_kernel): compiled,
    # its gradients are never buffers.
    fused_grad: bool = False


@dataclass
class BlockTrace:
    """The ATen FX graph of one distinct block, traced on fake tensors."""

    signature: str
    cls_name: str
    fqns: list[str]  # every instance of this block in the model, in order
    gm: torch.fx.GraphModule
    param_names: list[str]  # placeholder i (of the first len(param_names)) is this parameter
    param_shapes: dict[str, tuple[int, ...]]
    hidden_input_idx: list[int]  # indices (among non-param placeholders) of grad-requiring inputs
    saved_nodes: set[str]  # names of nodes whose output storage autograd saves for backward


@dataclass
class SavedRecord:
    bytes: int
    segment: str
    producer: str
    shape: tuple[int, ...]


@dataclass
class ModelTrace:
    """Everything capture learns about a model, independent of any parallel configuration."""

    name: str
    batch: int
    seq_len: int
    dtype: torch.dtype
    blocks: list[BlockTrace]
    block_container: str  # FQN of the ModuleList holding the repeated blocks
    ops: list[OpRecord]  # outside-block ops (pre/post)
    saved: list[SavedRecord]  # outside-block saved activations
    params: dict[str, tuple[tuple[int, ...], str]]  # every parameter: shape, segment/block
    tied: list[tuple[str, str]]  # parameters shared between two names
    module_types: dict[str, str]
    capture_s: float = 0.0
    fingerprint_src: str = ""
    extras: dict = field(default_factory=dict)


def _signature(m: nn.Module) -> str:
    shapes = ",".join(f"{n}:{tuple(p.shape)}" for n, p in m.named_parameters())
    return f"{type(m).__name__}[{shapes}]"


def _container(layers: list[str]) -> str:
    """The longest module path that holds all of ``layers``."""
    prefix = layers[0].split(".")[:-1] if layers else []
    for name in layers[1:]:
        parts = name.split(".")
        while prefix and parts[: len(prefix)] != prefix:
            prefix = prefix[:-1]
    return ".".join(prefix)


def _vocab_size(model: nn.Module, given: int | None) -> int:
    """``given``, or the largest ``nn.Embedding`` of ``model`` (256 without one)."""
    if given is not None:
        return given
    return max((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=256)


def _first_by_storage(nodes) -> dict:
    """Storage -> the name of the first of ``nodes`` whose value lives in it."""
    out: dict = {}
    for n in nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            out.setdefault(StorageWeakRef(v.untyped_storage()), n.name)
    return out


def logits_of(out: Any) -> torch.Tensor:
    """The logits tensor of a model output: a tensor, an HF ModelOutput, or a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TraceError(f"cannot find logits in the model output of type {type(out).__name__}")


def default_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = logits_of(out)
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), target.flatten())


def _trace_error(e: Exception, what: str, advice: str | None = None) -> TraceError:
    frames = traceback.extract_tb(e.__traceback__)
    here = os.path.dirname(os.path.abspath(__file__))
    user = [f for f in frames if "site-packages/torch" not in f.filename and not f.filename.startswith(here)]
    where = f" at {user[-1].filename}:{user[-1].lineno}: {user[-1].line}" if user else ""
    library = next((lib for lib in ("transformers", "diffusers", "timm") if user and
                    f"site-packages/{lib}/" in user[-1].filename.replace(os.sep, "/")), None)
    if advice is None and _data_dependent(e) and library:
        # Not the user's code: a form of the library's this version of autopar does not trace.
        advice = (f"That line is {library}' own code (not yours): it decides on tensor values (data-dependent "
                  "control flow, e.g. routing tokens to experts by a loop over the experts that received any), "
                  "which autopar's fake-tensor trace cannot follow, and autopar has no traceable form of this "
                  f"{library} module yet. Nothing to change in your model; a model whose modules autopar knows "
                  "(see the README's families) or a factory returning a traceable equivalent plans today.")
    elif advice is None and _data_dependent(e):
        advice = (
            "autopar traces the model on fake tensors, where values are unknown: Python control flow "
            "on a tensor's value, .item() or .tolist() cannot be traced. Rewrite that line with tensor "
            "ops (torch.where instead of an if on a value)."
        )
    elif advice is None:
        advice = (
            "The model failed on fake inputs of the planned shape: check the sequence length "
            "(--seq-len) and example inputs against what the model accepts."
        )
    return TraceError(f"cannot trace {what}{where}: {type(e).__name__}: {e}. {advice}")


def trace_model(
    build_or_model: Callable[[], nn.Module] | nn.Module,
    *,
    batch: int,
    seq_len: int,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    loss_fn: Callable | None = None,
    name: str = "model",
    example_inputs: tuple | None = None,
) -> ModelTrace:
    """Trace ``build_or_model`` on fake tensors at (batch, seq_len) token inputs."""
    t0 = time.perf_counter()
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    prev = torch.get_default_dtype()
    try:
        with mode:
            torch.set_default_dtype(dtype if dtype.is_floating_point else prev)
            model = build_or_model() if not isinstance(build_or_model, nn.Module) else build_or_model
    except Exception as e:
        raise _trace_error(e, f"the construction of {name}", (
            "The model is built under FakeTensorMode (shapes only, nothing allocated): the factory must "
            "build it from its config alone, without reading weights or data; load weights after "
            "autopar.compile")) from e
    finally:
        torch.set_default_dtype(prev)
    if not isinstance(model, nn.Module):
        raise TraceError(f"{name} returned a {type(model).__name__}, not an nn.Module: a model factory "
                         "takes no arguments and returns the model")
    model.train()
    # Tracing runs the model's Python code; an in-place update of a real buffer (a counter)
    # would happen for real: keep their values and put them back.
    kept = [(b, b.detach().clone()) for b in model.buffers() if not isinstance(b, FakeTensor) and b.device.type != "meta"]
    vocab_size = _vocab_size(model, vocab_size)
    if example_inputs is None:
        inputs: tuple = (torch.randint(0, vocab_size, (batch, seq_len)),)
    else:
        inputs = tuple(example_inputs)
    target = torch.randint(0, vocab_size, tuple(inputs[0].shape[:2]))
    try:
        sg = trace_step(model, inputs, target=target, loss_fn=loss_fn, name=name, first_layers_only=True,
                        target_kernels=True, param_dtype=dtype if dtype.is_floating_point else None)
    finally:
        with torch.no_grad():
            for b, v in kept:
                b.copy_(v)
    return model_trace(sg, model, name=name, batch=batch, seq_len=seq_len, dtype=dtype, vocab_size=vocab_size,
                       t0=t0)


def _data_dependent(e: BaseException) -> bool:
    """The trace stopped because the model branches on (or reads) a tensor's value, or an op's
    output shape depends on values (``nonzero``)."""
    text = f"{type(e).__name__} {e} {type(e.__cause__).__name__ if e.__cause__ else ''}"
    return "DataDependent" in text or "data-dependent" in text.lower() or "DynamicOutputShape" in text


def with_export_path_fallback(trace: Callable[[], Any], *, target_kernels: bool = False,
                              model: nn.Module | None = None) -> Any:
    """Run ``trace``; if the model branches on a tensor's value, trace it again the way
    ``torch.compile``/``torch.export`` see it (``torch.compiler.is_compiling()`` true), which is
    the documented signal for libraries to take their traceable path (transformers then skips,
    e.g., OPT's ``torch.all(attention_mask == 1)`` shortcut), with ``model``'s token-routed
    mixture-of-experts blocks in their fixed-shape form (``routed_experts``). If that fails too,
    the error names the line the second trace stopped at."""
    import contextlib

    import torch.compiler as tc

    def attempt():
        with contextlib.ExitStack() as stack:
            if target_kernels:
                stack.enter_context(_TargetKernels())
            if tc._is_compiling_flag:  # the second trace: decide random-threshold branches exactly
                stack.enter_context(_ScalarDraws())
                if model is not None:
                    stack.enter_context(_FixedShapeExperts(model))
            return trace()

    try:
        return attempt()
    except TraceError as first:
        if not _data_dependent(first) or tc._is_compiling_flag:
            raise
        tc._is_compiling_flag = True
        try:
            return attempt()
        except TraceError as second:
            if str(second) == str(first):
                raise first from None
            raise TraceError(f"{second} (traced twice: the first trace stopped at another value-dependent line, "
                             "and the export path, torch.compiler.is_compiling() true, passed it but stops here)") from None
        finally:
            tc._is_compiling_flag = False


class _ScalarDraw(float):
    """A uniform draw ``torch.rand([])`` whose only use is a comparison with a constant
    probability in Python control flow (LayerDrop: ``if torch.rand([]) < p: skip the layer``).
    The comparison is decided exactly when it is certain (``p <= 0`` never, ``p >= 1`` always);
    otherwise one static graph cannot represent the model and the trace stops, naming the line
    and what to set. Any other use of the value stops the trace too."""

    def __new__(cls, where: str):
        obj = float.__new__(cls, 0.0)
        obj.where = where
        return obj

    def _decide(self, p, below: bool) -> bool:
        if isinstance(p, torch.Tensor) or not isinstance(p, (int, float)):
            self._refuse(f"compared with {type(p).__name__}")
        if p <= 0:
            return not below
        if p >= 1:
            return below
        raise TraceError(
            f"{self.where}: the model draws a random number and skips work when it is below {p} (stochastic "
            "depth, e.g. LayerDrop); one static graph cannot do that: set that probability to 0 "
            "(e.g. config.layerdrop=0) to train it with autopar")

    def _refuse(self, what: str):
        raise TraceError(f"{self.where}: a random scalar (torch.rand([])) is {what}; autopar traces such a "
                         "draw only where it is compared with a constant probability")

    def __lt__(self, p):
        return self._decide(p, True)

    __le__ = __lt__

    def __gt__(self, p):
        return self._decide(p, False)

    __ge__ = __gt__

    def _value(self, *_):
        self._refuse("used as a value")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _value
    __float__ = __bool__ = __neg__ = __pow__ = __rpow__ = _value


class _ScalarDraws(torch.overrides.TorchFunctionMode):
    """``torch.rand([])`` (one scalar) becomes a ``_ScalarDraw`` while the export path traces."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.rand and _scalar_size(args, kwargs):
            return _ScalarDraw(_user_line())
        return func(*args, **kwargs)


def _scalar_size(args, kwargs) -> bool:
    size = kwargs.get("size", args[0] if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)) else args)
    return isinstance(size, (list, tuple, torch.Size)) and len(size) == 0


def _user_line() -> str:
    import traceback

    for fr in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in fr.filename and "/autopar/" not in fr.filename:
            return f"{os.path.basename(fr.filename)}:{fr.lineno}: {(fr.line or '').strip()}"
    return "the model"


# --------------------------------------------------------------------------------------------
# Token-routed mixture-of-experts blocks
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoutedExperts:
    """A mixture-of-experts block recognised by its structure: ``experts`` (a list of ``E``
    identical modules), ``top_k`` (or ``num_experts_per_tok``), one router, optionally shared
    experts. The router is either a linear with ``E`` outputs whose softmax top-k routes (Mixtral,
    Qwen2-MoE, OLMoE: the block returns its output and the router logits), or a gate module of its
    own, holding an ``(E, hidden)`` weight, that returns each token's chosen experts and their
    weights (DeepSeek-V2/V3: whatever scoring, grouping or scaling it does is its own code, run as
    it is; the block returns its output alone). Its own forward sends each expert the tokens routed
    to it, found with ``nonzero`` or by sorting: shapes that depend on values, which no static
    graph holds."""

    name: str
    module: nn.Module
    router: str
    top_k: int
    normalize: bool
    gate_module: bool = False  # the router is a gate module returning (experts, weights)

    @property
    def n_experts(self) -> int:
        return len(self.module.experts)


_MOE_PARTS = {"experts", "shared_expert", "shared_expert_gate", "shared_experts", "act_fn"}


def _router_kind(mod: nn.Module, n_experts: int) -> str | None:
    """``"linear"`` for a linear router with ``n_experts`` outputs, ``"gate"`` for a gate module
    whose own ``(n_experts, hidden)`` weight scores the experts, else None."""
    if isinstance(mod, nn.Linear):
        return "linear" if mod.out_features == n_experts else None
    w = getattr(mod, "weight", None)
    if isinstance(w, nn.Parameter) and w.dim() == 2 and w.shape[0] == n_experts and not list(mod.children()):
        return "gate"
    return None


def routed_experts(model: nn.Module) -> list[RoutedExperts]:
    out = []
    for name, m in model.named_modules():
        experts = getattr(m, "experts", None)
        if not isinstance(experts, nn.ModuleList) or len(experts) < 2 or len({type(e) for e in experts}) != 1:
            continue
        E = len(experts)
        routers = [(c, kind) for c, mod in m.named_children() if (kind := _router_kind(mod, E))]
        others = {c for c, _ in m.named_children()} - _MOE_PARTS - {c for c, _ in routers[:1]}
        # top_k on the block, on its gate (DeepSeek-V3), or in the config the block keeps.
        holders = (m, getattr(m, routers[0][0]) if routers else None, getattr(m, "config", None))
        k = next((v for h in holders for a in ("top_k", "num_experts_per_tok") if (v := getattr(h, a, None))), None)
        if not isinstance(k, int) or not 1 <= k <= E or len(routers) != 1 or others:
            continue
        out.append(RoutedExperts(name, m, routers[0][0], k, bool(getattr(m, "norm_topk_prob", True)),
                                 gate_module=routers[0][1] == "gate"))
    return out


def _gate_routing(r: RoutedExperts, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A gate module's routing: its own forward on the block's input, read as the chosen experts
    (an integer tensor of ``top_k`` columns) and their weights (a float tensor of the same shape)."""
    got = getattr(r.module, r.router)(hidden)
    parts = [t for t in (got if isinstance(got, (tuple, list)) else (got,)) if isinstance(t, torch.Tensor)]
    idx = [t for t in parts if not t.is_floating_point() and t.shape[-1] == r.top_k]
    wts = [t for t in parts if t.is_floating_point() and t.shape[-1] == r.top_k]
    if len(idx) != 1 or len(wts) != 1 or idx[0].shape != wts[0].shape:
        raise TraceError(f"the mixture-of-experts block {r.name}: its gate {r.router} "
                         f"({type(getattr(r.module, r.router)).__name__}) does not return one tensor of chosen experts "
                         f"and one of their weights ({r.top_k} per token), so autopar cannot trace the block in a "
                         "fixed-shape form")
    return idx[0].reshape(-1, r.top_k), wts[0].reshape(-1, r.top_k)


def fixed_shape_experts_forward(r: RoutedExperts, hidden: torch.Tensor):
    """The block's output with fixed shapes: every expert runs on every token and its output is
    weighted by the token's routing weight, exactly 0 where the token was not routed to it; the
    sum runs in expert order, as the routed form's ``index_add_`` does, so each token gets the
    same additions. Expert FLOPs are marked ``moe_active = top_k / E`` (what a routed kernel runs).
    A linear router's block returns ``(output, router logits)``; a gate module's block its output
    (accumulated in the routing weights' precision, as DeepSeek's own combine does)."""
    m = r.module
    if m.training and float(getattr(m, "jitter_noise", 0.0) or 0.0) > 0:
        raise TraceError(f"the mixture-of-experts block {r.name} multiplies its input by random jitter noise "
                         f"(router_jitter_noise={m.jitter_noise}) while training, which one static graph cannot "
                         "reproduce; set router_jitter_noise=0 in the config")
    b, s, h = hidden.shape
    x = hidden.reshape(-1, h)
    if r.gate_module:
        chosen, weights = _gate_routing(r, hidden)
        acc = weights.dtype
    else:
        logits = getattr(m, r.router)(x)
        weights = F.softmax(logits, dim=1, dtype=torch.float)
        weights, chosen = torch.topk(weights, r.top_k, dim=-1)
        if r.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        acc = x.dtype
    dense = torch.zeros(x.shape[0], r.n_experts, dtype=acc, device=x.device).scatter(1, chosen, weights.to(acc))
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    with fx_traceback.annotate({"moe_active": r.top_k / r.n_experts}):
        for e, expert in enumerate(m.experts):
            out = out + expert(x).to(acc) * dense[:, e:e + 1]
    out = out.to(x.dtype)
    shared = getattr(m, "shared_expert", None) or getattr(m, "shared_experts", None)
    if shared is not None:
        gate = getattr(m, "shared_expert_gate", None)
        y = shared(x)
        out = out + (torch.sigmoid(gate(x)) * y if gate is not None else y)
    if r.gate_module:
        return out.reshape(b, s, h)
    return out.reshape(b, s, h), logits


class _FixedShapeExperts:
    """While tracing, each routed-experts block of ``model`` runs ``fixed_shape_experts_forward``."""

    def __init__(self, model: nn.Module):
        self.blocks = routed_experts(model)

    def __enter__(self):
        self.kept = [r.module.__dict__.get("forward") for r in self.blocks]  # a hook's own patch, if any
        for r in self.blocks:
            r.module.forward = lambda hidden, r=r: fixed_shape_experts_forward(r, hidden)
        return self

    def __exit__(self, *exc):
        for r, kept in zip(self.blocks, self.kept):
            r.module.__dict__.pop("forward", None)
            if kept is not None:
                r.module.forward = kept


def check_routed_experts(model: nn.Module, *, tokens: int = 16) -> list[RoutedExperts]:
    """Before a model with routed experts trains in the fixed-shape form, prove on its own weights
    that the form computes what the block's own forward computes (random tokens, both outputs);
    a block that routes otherwise is refused rather than trained as a different model."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    from autopar.errors import AutoparError

    blocks = routed_experts(model)
    for r in blocks:
        w = getattr(r.module, r.router).weight
        if w.device.type == "meta" or isinstance(w, (FakeTensor, DTensor)):  # nothing real to run
            continue
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(1, tokens, w.shape[1], generator=gen, dtype=w.dtype).to(w.device)
        with torch.no_grad():
            own = r.module(x)
            mine = fixed_shape_experts_forward(r, x)
        own_t = own if isinstance(own, tuple) else (own,)
        mine = mine if isinstance(mine, tuple) else (mine,)
        if len(own_t) != len(mine) or any(not isinstance(a, torch.Tensor) or a.shape != b.shape
                                          for a, b in zip(own_t, mine)):
            why = "its outputs have other shapes"
        else:
            diff = max(float((a - b).abs().max() / max(1.0, float(a.abs().max()))) for a, b in zip(own_t, mine))
            why = f"outputs differ by {diff:.2g}" if diff > 1e-5 else None
        if why:
            raise AutoparError(
                f"the mixture-of-experts block {r.name} ({type(r.module).__name__}) does not compute what autopar's "
                f"fixed-shape routed-experts form computes ({why}); its routing (e.g. sigmoid scores, grouped or "
                "biased top-k, capacity limits) is not the softmax top-k autopar knows, so it is not trained "
                "rather than trained as a different model")
    return blocks


class _TargetKernels(torch.overrides.TorchFunctionMode):
    """Price what the target GPU runs, not what this host's kernels choose. Attention with
    dropout has no fused kernel on CPU, so the trace would take (and price) the unfused math
    decomposition; a GPU runs flash/efficient attention with dropout inside the kernel. The
    planner's trace therefore calls attention without dropout (same shapes, same fused op);
    the executor traces the real model, dropout included."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention:
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            elif "dropout_p" in kwargs:
                kwargs["dropout_p"] = 0.0
            fused = _fused_attention(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _cpu_fuses(a: dict) -> bool:
    """Whether this CPU's SDPA picks a fused kernel for these arguments: asked of torch's own
    choice on two-token stand-ins of the same dtypes and head counts (fake tensors always say math)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        q, k, v = (torch.zeros(1, t.shape[-3], 2, t.shape[-1], dtype=t.dtype) for t in (a["query"], a["key"], a["value"]))
        mask = a.get("attn_mask")
        if mask is not None:
            mask = torch.zeros(*(1 for _ in mask.shape[:-2]), 2, 2, dtype=mask.dtype)
        choice = torch.ops.aten._fused_sdp_choice(q, k, v, mask, 0.0, bool(a.get("is_causal", False)),
                                                  scale=a.get("scale"), enable_gqa=bool(a.get("enable_gqa", False)))
    return choice != 0


def _fused_attention(*args, **kwargs) -> torch.Tensor | None:
    """Attention with an explicit mask or fewer key/value heads than query heads (Falcon's
    multi-query, GQA without ``repeat_kv``) takes the unfused math path on this CPU, while a GPU
    runs a fused kernel (memory-efficient attention takes the mask; flash and cuDNN take shared
    KV heads). The planner's trace calls the fused kernel itself, with the key/value heads
    repeated and the mask as an additive float tensor: same shapes, priced as the fused op (not
    causal: a mask's blocks are not skipped). Other calls are left as they are (None)."""
    a = dict(zip(_SDPA_ARGS, args), **kwargs)
    q, k, v, mask = a["query"], a["key"], a["value"], a.get("attn_mask")
    if q.dim() != 4 or k.dim() != 4 or not k.shape[-3] or q.shape[-3] % k.shape[-3] or _cpu_fuses(a):
        return None
    rep = q.shape[-3] // k.shape[-3]
    if rep > 1:
        k, v = (t.repeat_interleave(rep, dim=-3) for t in (k, v))
    dv = v.shape[-1]
    if dv < q.shape[-1]:  # a narrower value head (DeepSeek's MLA): padded in, sliced out, as flash kernels do
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - dv))
    elif dv > q.shape[-1]:
        return None
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    elif mask is not None:
        mask = mask.to(q.dtype)
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, bool(a.get("is_causal", False)), attn_mask=mask, scale=a.get("scale"))
    return out[..., :dv]


# --------------------------------------------------------------------------------------------
# The training step as one graph (what the executor runs)
# --------------------------------------------------------------------------------------------
def find_layers(model: nn.Module) -> list[str]:
    """The repeated layers of ``model``, in call order of their names: the largest group (by
    parameters) of at least two modules that share a class and parameter shapes and do not nest.
    Found from the modules themselves, whatever holds them (a ModuleList, a ModuleDict, plain
    attributes)."""
    groups: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    mods = dict(model.named_modules())
    for name, mod in mods.items():
        if not name or not any(True for _ in mod.parameters()):
            continue
        sig = _signature(mod)
        groups.setdefault(sig, []).append(name)
        sizes[sig] = sum(p.numel() for p in mod.parameters())
    best: tuple[int, int, list[str]] = (0, 0, [])
    for sig, names in groups.items():
        inside = set(names)  # drop the ones nested in another of the group
        names = [n for n in names if not any(".".join(n.split(".")[:k]) in inside for k in range(1, n.count(".") + 1))]
        if len(names) < 2:
            continue
        key = (sizes[sig] * len(names), -len(names))
        if key > best[:2]:
            best = (*key, names)
    # The same class beside them in their container is a layer too, with other shapes (DeepSeek's
    # first dense layers before the MoE ones): the layer sequence is the container's.
    chosen = set(best[2])
    parents = {n.rpartition(".")[0] for n in chosen}
    classes = {type(mods[n]).__name__ for n in chosen}
    if len(parents) == 1:
        (parent,) = parents
        chosen |= {n for n, m in mods.items() if n and n.rpartition(".")[0] == parent and type(m).__name__ in classes
                   and any(True for _ in m.parameters())}
    return [n for n in mods if n in chosen]


@dataclass
class StepGraph:
    """The single-device forward (and loss) of a model as one ATen graph on fake tensors.

    Placeholders, in order: every parameter (tied parameters once, under their first name), every
    buffer, the model inputs, then the target when the loss is in the graph. Outputs: the loss, or
    the model's logits. Each node's ``meta["custom"]`` holds ``module`` (the innermost module
    whose forward made it) and ``layer`` (the index of the repeated layer it belongs to).
    """

    gm: torch.fx.GraphModule
    param_names: list[str]
    aliases: dict[str, list[str]]  # parameter -> the other names it is registered under
    buffer_names: list[str]
    n_inputs: int
    with_loss: bool
    layers: list[str]
    input_shapes: list[tuple[int, ...]]
    output_type: Any = None  # the model output's class when it is not a tensor (HF ModelOutput)
    final: bool = True  # its outputs are the model's (False for all but the last pipeline stage)
    # What autograd saves for backward, in order: (the first node holding the saved storage, the
    # layer whose forward saved it or None outside the layers, whether a layer had started).
    saved: list[tuple[str, int | None, bool]] = field(default_factory=list)

    @property
    def n_params(self) -> int:
        return len(self.param_names)

    def placeholders(self) -> list[torch.fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]


def _module_annotations(model: nn.Module, layers: list[str]):
    """Forward hooks that annotate every node traced inside a module with its name, and inside a
    layer with the layer's index (``torch.fx.traceback.annotate``, copied into ``meta['custom']``)."""
    index = {name: i for i, name in enumerate(layers)}
    stack: list = []
    handles = []
    for name, mod in model.named_modules():
        if not name:
            continue
        ann = {"module": name}
        if name in index:
            ann["layer"] = index[name]

        def pre(m, args, ann=ann):
            cm = fx_traceback.annotate(ann)
            cm.__enter__()
            stack.append(cm)

        def post(m, args, out):
            if stack:
                stack.pop().__exit__(None, None, None)

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    class _Unwind:  # a forward that raised leaves its annotations open: close them, innermost first
        @staticmethod
        def remove():
            while stack:
                stack.pop().__exit__(None, None, None)

    return [_Unwind, *handles]


def _mutated_inputs(gm: torch.fx.GraphModule, n_params: int, bnames: list[str]) -> list[str]:
    """Buffers the traced step writes to (an in-place op on the buffer or a view of it)."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    root = {ph: bnames[i - n_params] for i, ph in enumerate(phs) if n_params <= i < n_params + len(bnames)}
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        args = n.args
        if n.target.is_view and args and args[0] in root:
            root[n] = root[args[0]]
            continue
        # native_batch_norm writes its running statistics without declaring it in its schema.
        writes_stats = "batch_norm" in n.target.name() and len(args) > 5 and args[5] is True  # training
        for a, spec in zip(args, n.target._schema.arguments):
            written = (spec.alias_info is not None and spec.alias_info.is_write) or (
                writes_stats and spec.name in ("running_mean", "running_var"))
            if a in root and written and root[a] not in out:
                out.append(root[a])
    return out


def trace_step(
    model: nn.Module, inputs: tuple, *, target: torch.Tensor | None = None, loss_fn: Callable | None = None,
    name: str = "model", first_layers_only: bool = False, target_kernels: bool = False,
    param_dtype: torch.dtype | None = None, output_dtype: torch.dtype | None = None,
) -> StepGraph:
    """Trace ``model``'s forward on ``inputs`` (and the loss against ``target`` when given) to one
    ATen graph, on fake tensors: nothing is computed and no memory of the model's size is used.

    This is the one capture: the executor runs this graph, and the planner's analysis reads it
    (``model_trace``). ``first_layers_only`` (planning without running, e.g. 126 layers) traces
    only the first of the repeated layers; the others pass its output on, which has the right
    shape for everything after them, and have no placeholders for their parameters and buffers.
    ``target_kernels`` prices what the target GPU runs rather than this host (``_TargetKernels``).
    ``param_dtype``: the floating-point parameters enter in this dtype (mixed precision: the
    forward as FSDP2 runs it, on parameters cast to the compute dtype; buffers keep theirs);
    ``output_dtype``: the model's floating-point outputs are cast to it (FSDP2's ``output_dtype``)."""
    layers = find_layers(model)
    unused = tuple(f"{layer}." for layer in _repeats(model, layers)) if first_layers_only else ()
    pnames, params, aliases = [], [], {}
    by_id: dict[int, str] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        if unused and pname.startswith(unused):
            continue
        if id(p) in by_id:
            aliases.setdefault(by_id[id(p)], []).append(pname)
            continue
        by_id[id(p)] = pname
        pnames.append(pname)
        params.append(p)
    named_buffers = [(n, b) for n, b in model.named_buffers() if not (unused and n.startswith(unused))]
    bnames = [n for n, _ in named_buffers]
    buffers = [b for _, b in named_buffers]
    # Everything enters the trace as fake tensors of the global shapes (parameters may already be
    # DTensor shards: the step is traced as the single-device model). Parameters that train
    # require grad, so what autograd saves for backward is seen.
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, FakeTensor) or t.device.type == "meta":  # another mode's, or no data at all
            with mode:
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return mode.from_tensor(t)

    with mode:
        params = [torch.empty_strided(p.shape, p.stride(), device=p.device,
                                      dtype=param_dtype if param_dtype and p.is_floating_point() else p.dtype
                                      ).requires_grad_(p.requires_grad and p.is_floating_point()) for p in params]
    buffers = [fresh(b) for b in buffers]
    inputs = tuple(fresh(x) if isinstance(x, torch.Tensor) else x for x in inputs)
    target = fresh(target) if target is not None else None
    mods = dict(model.named_modules())
    box: dict = {}
    packed: list[tuple[Any, int | None, bool]] = []

    def pack(t):
        if isinstance(t, torch.Tensor):
            packed.append((StorageWeakRef(t.untyped_storage()), fx_traceback.current_meta.get("custom", {}).get("layer"),
                           "entered" in box))
        return t

    # One name per (module, attribute): a module reachable under two paths (T5's
    # encoder.embed_tokens is its ``shared``) would be swapped twice, and restored to the fake.
    slots: set = set()
    distinct: dict[str, str] = {}  # name to swap -> the traced parameter or buffer it holds
    for first, name in [(n, n) for n in pnames + bnames] + [(f, o) for f, others in aliases.items() for o in others]:
        owner, _, attr = name.rpartition(".")
        slot = (id(model.get_submodule(owner)), attr)
        if slot not in slots:
            slots.add(slot)
            distinct[name] = first

    def step(ps, bs, xs, *tgt):
        held = {**dict(zip(pnames, ps)), **dict(zip(bnames, bs))}
        state = {name: held[first] for name, first in distinct.items()}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = torch.func.functional_call(model, state, tuple(xs), tie_weights=False)
            if output_dtype is not None:
                out = _cast_outputs(out, output_dtype)
            if tgt:
                return (loss_fn or default_loss)(out, tgt[0])
        if not isinstance(out, torch.Tensor):
            box["type"] = type(out)
        return logits_of(out)

    def trace():
        packed.clear()
        box.clear()
        handles = _module_annotations(model, layers)
        if layers:
            handles.append(mods[layers[0]].register_forward_pre_hook(lambda *_: box.__setitem__("entered", True)))
        undo = _pass_on_repeats(model, layers) if first_layers_only else []
        try:
            with fx_traceback.preserve_node_meta():
                from torch.fx.experimental.proxy_tensor import make_fx

                try:
                    return make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(
                        params, buffers, list(inputs), *([target] if target is not None else []))
                finally:
                    handles[0].remove()  # inside preserve_node_meta, which restores what they changed
        except Exception as e:
            raise _trace_error(e, f"the training step of {name}") from e
        finally:
            for h in handles:
                h.remove()
            for u in undo:
                u()

    gm = with_export_path_fallback(trace, model=model, target_kernels=target_kernels)
    for ph, p in zip(gm.graph.find_nodes(op="placeholder"), params):
        ph.meta["trained"] = p.requires_grad
    mutated = _mutated_inputs(gm, len(pnames), bnames)
    if mutated:
        raise TraceError(
            f"{name} updates the buffer(s) {', '.join(mutated[:4])} in its forward pass (running statistics such as "
            "BatchNorm's, or a counter): under data parallelism and microbatches each rank would keep different "
            "values from a different share of the batch, so it would not be the same model. Use a normalisation "
            "without running state (LayerNorm, RMSNorm, GroupNorm), or keep the buffer out of training "
            "(track_running_stats=False); the model was not changed")
    first_by_storage = _first_by_storage(gm.graph.nodes)
    saved, seen = [], set()
    for ref, layer, entered in packed:
        if ref in first_by_storage and (ref, layer) not in seen:
            seen.add((ref, layer))
            saved.append((first_by_storage[ref], layer, entered))
    out_type = box.get("type")
    return StepGraph(gm, pnames, aliases, bnames, len(inputs), target is not None, layers,
                     [tuple(x.shape) for x in inputs], out_type, saved=saved)


def _cast_outputs(out: Any, dtype: torch.dtype) -> Any:
    """The model's output with its floating-point tensors cast to ``dtype`` (a tensor, a tuple,
    named tuple or list, or a mapping such as an HF ``ModelOutput``, whose fields are set in place)."""
    cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    if isinstance(out, torch.Tensor):
        return cast(out)
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        return type(out)(*map(cast, out))
    if isinstance(out, (tuple, list)):
        return type(out)(map(cast, out))
    if hasattr(out, "items") and hasattr(out, "__setitem__"):
        for k, v in list(out.items()):
            out[k] = cast(v)
    return out


def _repeats(model: nn.Module, layers: list[str]) -> list[str]:
    """The layers after the first of their kind (class and parameter shapes)."""
    mods, seen, out = dict(model.named_modules()), set(), []
    for name in layers:
        sig = _signature(mods[name])
        (out.append(name) if sig in seen else seen.add(sig))
    return out


def _pass_on_repeats(model: nn.Module, layers: list[str]) -> list[Callable[[], None]]:
    """Make every layer after the first of its kind return the output of the last layer that
    ran (same shapes and types), so a trace holds one layer of each kind; returns what undoes it."""
    repeats = _repeats(model, layers)
    if not repeats:
        return []
    mods = dict(model.named_modules())
    last: dict = {}
    undo: list[Callable[[], None]] = []
    for name in layers:
        if name not in repeats:
            undo.append(mods[name].register_forward_hook(lambda mod, args, out: last.__setitem__("out", out)).remove)
    for name in repeats:
        m = mods[name]
        own = m.__dict__.get("forward")  # an instance-level forward of the user's (a hook's patch)
        m.forward = lambda *a, **k: last["out"]
        undo.append(lambda m=m, own=own: m.__dict__.pop("forward") if own is None else setattr(m, "forward", own))
    return undo


def model_trace(sg: StepGraph, model: nn.Module, *, name: str, batch: int, seq_len: int, dtype: torch.dtype,
                vocab_size: int | None = None, t0: float | None = None) -> ModelTrace:
    """What the planner's analysis reads, cut from the step graph ``sg`` of ``model``: the graph
    of the first instance of the repeated layers (its parameters, then its other inputs, as
    placeholders) with what autograd saves in it, and every op outside the layers with its FLOPs
    and bytes ("pre" before the first layer, "post" after it)."""
    t0 = time.perf_counter() if t0 is None else t0
    mods = dict(model.named_modules())
    members = [(n, mods[n]) for n in sg.layers]
    vocab_size = _vocab_size(model, vocab_size)
    gm = sg.gm
    nodes = {n.name: n for n in gm.graph.nodes}
    layer_of = {n.name: n.meta.get("custom", {}).get("layer") for n in gm.graph.nodes}
    phs = sg.placeholders()
    param_nodes = set(phs[: sg.n_params])

    ops: list[OpRecord] = []
    segment = "pre"
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if layer_of[n.name] is not None:
            segment = "post"
            continue
        op = op_name(n.target)
        if op == "getitem":
            continue
        args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda a: a.meta.get("val"), (n.args, n.kwargs))
        out = n.meta.get("val")
        ins = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        nbytes = 0 if op in VIEW_OPS else sum(map(tensor_bytes, ins + outs))
        grad_bytes = lambda ts: [tensor_bytes(t) if t.is_floating_point() else 0 for t in ts]  # noqa: E731
        ops.append(OpRecord(op, segment, op_flops(n.target, args, kwargs, out), nbytes,
                            [tuple(o.shape) for o in outs], [tuple(i.shape) for i in ins],
                            grad_bytes(outs), grad_bytes(ins), gradient_in_kernel(n)))
    saved = []
    for node_name, layer, entered in sg.saved:
        node = nodes[node_name]
        if layer is not None or node in param_nodes:
            continue
        v = node.meta["val"]
        saved.append(SavedRecord(v.untyped_storage().nbytes(), "post" if entered else "pre",
                                 "input" if node.op == "placeholder" else op_name(node.target), tuple(v.shape)))

    by_sig: dict[str, list[tuple[str, nn.Module]]] = {}
    for fqn, m in members:
        by_sig.setdefault(_signature(m), []).append((fqn, m))
    index = {fqn: i for i, fqn in enumerate(sg.layers)}
    blocks = [_layer_graph(sg, index[insts[0][0]], insts) for insts in by_sig.values()]

    block_fqns = {fqn for fqn, _ in members}
    params: dict[str, tuple[tuple[int, ...], str]] = {}
    tied: list[tuple[str, str]] = []
    by_id: dict[int, str] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        if id(p) in by_id:
            tied.append((by_id[id(p)], pname))
            continue
        by_id[id(p)] = pname
        owner = next((b for b in block_fqns if pname.startswith(b + ".")), None)
        params[pname] = (tuple(p.shape), owner or "outside")
    module_types = {n: type(m).__name__ for n, m in model.named_modules()}
    fp_src = repr(sorted((k, v[0]) for k, v in params.items())) + repr(sorted(set(module_types.values())))
    return ModelTrace(
        name=name, batch=batch, seq_len=seq_len, dtype=dtype, blocks=blocks,
        block_container=_container(sg.layers), ops=ops, saved=saved, params=params, tied=tied,
        module_types=module_types, capture_s=time.perf_counter() - t0, fingerprint_src=fp_src,
        extras={"vocab_size": vocab_size},
    )


def _layer_graph(sg: StepGraph, layer: int, insts: list[tuple[str, nn.Module]]) -> BlockTrace:
    """The nodes of layer ``layer`` of ``sg`` as a graph of their own: a placeholder for each of
    the layer's parameters (in ``named_parameters`` order), then one for each other value it
    reads (the hidden state, rotary tables, masks); ``hidden_input_idx`` marks those computed
    from trained parameters (the residual stream)."""
    fqn, block = insts[0]
    gm = sg.gm
    phs = sg.placeholders()
    by_name = {n: phs[i] for i, n in enumerate(sg.param_names)}
    for first, others in sg.aliases.items():
        by_name.update({o: by_name[first] for o in others})
    names = [n for n, _ in block.named_parameters()]
    shapes = {n: tuple(p.shape) for n, p in block.named_parameters()}
    inside = [n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("custom", {}).get("layer") == layer]
    if not inside:
        raise TraceError(f"layer {fqn} ({type(block).__name__}) made no operations in the traced step")
    inside_set = set(inside)
    trained = {ph for ph in phs[: sg.n_params] if ph.meta.get("trained")}
    for n in gm.graph.nodes:  # what depends on a trained parameter
        if n.op == "call_function" and any(a in trained for a in n.all_input_nodes):
            trained.add(n)
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for rel in names:
        ph = g.placeholder(rel.replace(".", "_"))
        src = by_name[f"{fqn}.{rel}"]
        ph.meta["val"] = src.meta["val"]
        env.setdefault(src, ph)
    extra: list[torch.fx.Node] = []
    for n in inside:
        for a in n.all_input_nodes:
            if a not in inside_set and a not in env:
                extra.append(a)
                env[a] = None  # placeholder made below, after the parameters
    hidden_idx = []
    for j, a in enumerate(extra):
        if a.op == "get_attr":
            env[a] = g.get_attr(a.target)
        else:
            env[a] = g.placeholder(f"in_{j}_{a.name}")
        env[a].meta = dict(a.meta)
        v = a.meta.get("val")
        if a in trained and isinstance(v, torch.Tensor) and v.is_floating_point():
            hidden_idx.append(j)
    for n in inside:
        env[n] = g.node_copy(n, lambda a: env[a])
    outs = [env[n] for n in inside if any(u not in inside_set for u in n.users)]
    g.output(tuple(outs))
    lgm = torch.fx.GraphModule(gm, g)
    # What autograd saved while this layer ran, as nodes of the new graph (the first holding
    # the storage: a saved view of the layer's input is its placeholder).
    first_by_storage = _first_by_storage(g.nodes)
    nodes = {n.name: n for n in gm.graph.nodes}
    saved_nodes = set()
    for node_name, lay, _ in sg.saved:
        v = nodes[node_name].meta.get("val")
        if lay == layer and isinstance(v, torch.Tensor):
            ref = StorageWeakRef(v.untyped_storage())
            if ref in first_by_storage:
                saved_nodes.add(first_by_storage[ref])
    return BlockTrace(
        signature=_signature(block), cls_name=type(block).__name__, fqns=[f for f, _ in insts], gm=lgm,
        param_names=names, param_shapes=shapes, hidden_input_idx=hidden_idx, saved_nodes=saved_nodes,
    )
