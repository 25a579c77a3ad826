"""Making models traceable to one static graph on fake tensors: what ``capture`` runs a model
under while it traces it.

- The export path (``with_export_path_fallback``): a model that branches on a tensor's value is
  traced again as ``torch.compile`` sees it, the signal libraries take their traceable path on.
- Random scalar draws compared with a constant probability (LayerDrop), decided exactly where
  certain (``_ScalarDraws``).
- Token-routed mixture-of-experts blocks in a fixed-shape form that runs each expert on its own
  tokens (``routed_experts_forward``, ``grouped_mm``), checked against the block's own forward on
  its own weights before training (``check_routed_experts``); experts held as 3-D parameters
  (gpt-oss, transformers 5) run their own loop once, for every expert at a time
  (``stacked_experts_forward``), checked likewise.
- Attention priced as the target GPU runs it (``_TargetKernels``): no dropout outside the kernel,
  the fused kernel where this CPU would take the math path.
- A causal language model's attention traced as causal, not with an explicit mask, where the mask
  is provably the causal one (``_CausalMask``): the flash kernel skips the masked half.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.errors import TraceError
from autopar.fxops import additive_mask
from autopar.grouped_mm import grouped_mm


def data_dependent(e: BaseException) -> bool:
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
    mixture-of-experts blocks in their fixed-shape form (``routed_experts``; a model with such
    blocks is traced that way at once). If that fails too, the error names the line the second
    trace stopped at."""

    import torch.compiler as tc

    def attempt():
        with contextlib.ExitStack() as stack:
            stack.enter_context(_CausalMask())
            if target_kernels:
                stack.enter_context(_TargetKernels())
            if tc._is_compiling_flag:  # the second trace: decide random-threshold branches exactly
                stack.enter_context(_ScalarDraws())
                if model is not None:
                    stack.enter_context(_RoutedForm(model))
            return trace()

    def exported():
        tc._is_compiling_flag = True
        try:
            return attempt()
        finally:
            tc._is_compiling_flag = False

    if model is not None and not tc._is_compiling_flag and (routed_experts(model) or stacked_experts(model)
                                                            or looped_experts(model) or scored_experts(model)):
        # A routed-experts block's own loop is value-dependent (tokens per expert): a first trace
        # would stop there after tracing what comes before; go straight to the export path.
        return exported()
    try:
        return attempt()
    except TraceError as first:
        if not data_dependent(first) or tc._is_compiling_flag:
            raise
        try:
            return exported()
        except TraceError as second:
            if str(second) == str(first):
                raise first from None
            raise TraceError(f"{second} (traced twice: the first trace stopped at another value-dependent line, "
                             "and the export path, torch.compiler.is_compiling() true, passed it but stops here)") from None


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
class _ExpertList:
    """A block (``self.module``) whose ``experts`` are a list of identical modules."""

    @property
    def n_experts(self) -> int:
        return len(self.module.experts)

    @property
    def linears(self) -> tuple[str, ...] | None:
        """The experts' linears (every parameter of theirs in one), else None (``_linears``)."""
        return _linears(self.module.experts[0])


@dataclass(frozen=True)
class RoutedExperts(_ExpertList):
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
        experts = m._modules.get("experts")  # (a walk over DeepSeek-V3's 75k modules: no getattr misses)
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
    if len(idx) == 1 and len(wts) > 1:
        # top_k = the experts' number: a router's logits have the weights' shape too (transformers
        # 5's return (logits, weights, chosen)); the weights are the float next to the chosen.
        at = next(i for i, t in enumerate(parts) if t is idx[0])
        wts = [t for t in wts if any(t is parts[j] for j in (at - 1, at + 1) if 0 <= j < len(parts))]
    if len(idx) != 1 or len(wts) != 1 or idx[0].shape != wts[0].shape:
        raise TraceError(f"the mixture-of-experts block {r.name}: its gate {r.router} "
                         f"({type(getattr(r.module, r.router)).__name__}) does not return one tensor of chosen experts "
                         f"and one of their weights ({r.top_k} per token), so autopar cannot trace the block in a "
                         "fixed-shape form")
    return idx[0].reshape(-1, r.top_k), wts[0].reshape(-1, r.top_k)


def _linears(expert: nn.Module) -> tuple[str, ...] | None:
    """The names of an expert's linears when every parameter it has belongs to one of them (what
    the grouped form applies per expert), else None."""
    names = tuple(n for n, m in expert.named_modules() if isinstance(m, nn.Linear))
    owned = {id(p) for n in names for p in expert.get_submodule(n).parameters(recurse=False)}
    return names if names and all(id(p) in owned for p in expert.parameters()) else None


def refuse_jitter(block: nn.Module, name: str) -> None:
    """A mixture-of-experts block that multiplies its input by random noise while training
    (Mixtral's ``router_jitter_noise``, in either way transformers holds the experts) is refused:
    every rank would draw its own noise where the one-device model draws one."""
    if block.training and float(getattr(block, "jitter_noise", 0.0) or 0.0) > 0:
        raise TraceError(f"the mixture-of-experts block {name} multiplies its input by random jitter noise "
                         f"(router_jitter_noise={block.jitter_noise}) while training, which one static graph "
                         "cannot reproduce; set router_jitter_noise=0 in the config")


def _routing(r: RoutedExperts, hidden: torch.Tensor, x: torch.Tensor):
    """Each token's chosen experts and routing weights ``(tokens, top_k)``, the dtype the block
    accumulates its experts' outputs in, and the router's logits (None for a gate module)."""
    m = r.module
    refuse_jitter(m, r.name)
    if r.gate_module:
        chosen, weights = _gate_routing(r, hidden)
        return chosen, weights, weights.dtype, None
    logits = getattr(m, r.router)(x)
    weights = F.softmax(logits, dim=1, dtype=torch.float)
    weights, chosen = torch.topk(weights, r.top_k, dim=-1)
    if r.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return chosen, weights, x.dtype, logits


def _by_expert(chosen: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``tokens x top_k`` (token, slot) pairs of ``chosen`` (each token's experts), flattened:
    their order sorted by expert (stable: ties in token order), each pair's expert in that order,
    and each expert's end offset among them."""
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=chosen.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, flat[order], counts.cumsum(0)


def _summed_per_token(ys: torch.Tensor, order: torch.Tensor, n_tok: int, k: int, dtype) -> torch.Tensor:
    """Rows ``ys`` in expert order (``order``) added onto zeros per token, each token's ``k`` rows
    in expert order, as a block's loop or sum over its experts adds them."""
    back = ys[order.argsort()].reshape(n_tok, k, -1)  # each token's k rows, in expert order
    out = torch.zeros((n_tok, ys.shape[-1]), dtype=dtype, device=ys.device)
    for j in range(k):
        out = out + back[:, j]
    return out


def _grouped_experts(r: RoutedExperts, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, acc) -> torch.Tensor:
    """The experts applied to their tokens only: the ``tokens x top_k`` (token, expert) pairs sorted
    by expert, each expert's linears run on its rows as one ``grouped_mm`` (the first expert's own
    forward with its linears swapped for the grouped ones, so activations and gating are the
    expert's own), each row weighted, and each token's rows added in expert order onto zeros, as
    the block's loop over experts adds them."""
    k = r.top_k
    chosen, perm = chosen.sort(dim=1)
    weights = weights.gather(1, perm)
    order, expert_of_row, offs = _by_expert(chosen, r.n_experts)
    ys = _rows_through_experts(r.module.experts, r.linears, x[order // k], offs, expert_of_row)
    ys = ys.to(acc) * weights.reshape(-1)[order].to(acc).unsqueeze(1)
    return _summed_per_token(ys, order, x.shape[0], k, acc)


def _rows_through_experts(experts: nn.ModuleList, linears: tuple[str, ...], rows: torch.Tensor, offs: torch.Tensor,
                     expert_of_row: torch.Tensor) -> torch.Tensor:
    """``rows`` sorted by expert (expert ``e``'s end at ``offs[e]``) through the first expert's own
    forward with each of its linears swapped for one ``grouped_mm`` over every expert's weight
    (each row's expert's bias added): each row through its own expert, the activations and
    gating the experts' own."""
    first = experts[0]
    swapped = []
    for name in linears:
        lin = first.get_submodule(name)
        ws = [e.get_submodule(name).weight for e in experts]
        bs = [e.get_submodule(name).bias for e in experts] if lin.bias is not None else None

        def grouped(t, ws=ws, bs=bs):
            y = grouped_mm(t, ws, offs)
            return y if bs is None else y + torch.stack(bs)[expert_of_row]

        swapped.append(lin)
        lin.forward = grouped
    try:
        return first(rows)
    finally:
        for lin in swapped:
            lin.__dict__.pop("forward", None)


def _dense_experts(r: RoutedExperts, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, acc) -> torch.Tensor:
    """Every expert on every token, weighted by the token's routing weight (exactly 0 where the
    token was not routed to it), summed in expert order: for experts with parameters outside
    linears, which the grouped form does not apply. It spends every expert's FLOPs on every token
    and is priced so."""
    dense = torch.zeros(x.shape[0], r.n_experts, dtype=acc, device=x.device).scatter(1, chosen, weights.to(acc))
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for e, expert in enumerate(r.module.experts):
        out = out + expert(x).to(acc) * dense[:, e:e + 1]
    return out


def routed_experts_forward(r: RoutedExperts, hidden: torch.Tensor):
    """The block's output with fixed shapes: routed (``_grouped_experts``) where every expert
    parameter is a linear's, else dense (``_dense_experts``); then the shared experts. A linear
    router's block returns ``(output, router logits)``; a gate module's block its output
    (accumulated in the routing weights' precision, as DeepSeek's own combine does)."""
    m = r.module
    b, s, h = hidden.shape
    x = hidden.reshape(-1, h)
    chosen, weights, acc, logits = _routing(r, hidden, x)
    experts = _grouped_experts if r.linears else _dense_experts
    out = experts(r, x, chosen, weights, acc).to(x.dtype)
    shared = getattr(m, "shared_expert", None) or getattr(m, "shared_experts", None)
    if shared is not None:
        gate = getattr(m, "shared_expert_gate", None)
        y = shared(x)
        out = out + (torch.sigmoid(gate(x)) * y if gate is not None else y)
    if r.gate_module:
        return out.reshape(b, s, h)
    return out.reshape(b, s, h), logits


# Experts held as 3-D parameters ------------------------------------------------------------
@dataclass(frozen=True)
class StackedExperts:
    """Experts held as 3-D parameters, every expert's weight in one (``E`` leading; biases
    ``(E, out)``): gpt-oss, and every mixture-of-experts of transformers 5 (its experts
    interface). Their forward takes the tokens, each token's chosen experts (an integer
    ``(tokens, top_k)`` tensor) and its routing weights, finds the experts that received tokens
    (``one_hot(...).sum(...).nonzero()``) and loops over them, each expert's tokens found with
    ``torch.where``: shapes that depend on values. ``stacked_experts_forward`` runs that same
    code once, for every expert at a time."""

    name: str
    module: nn.Module

    @property
    def n_experts(self) -> int:
        return int(self.module.num_experts)


def stacked_experts(model: nn.Module) -> list[StackedExperts]:
    """The modules with a ``num_experts`` and only parameters of that many leading entries, one
    of them 3-D (the experts' weights)."""
    out = []
    for name, m in model.named_modules():
        ps = [p for p in m._parameters.values() if p is not None]
        if not any(p.dim() == 3 for p in ps):
            continue
        E = getattr(m, "num_experts", None)
        if isinstance(E, int) and E >= 2 and all(p.shape[0] == E for p in ps):
            out.append(StackedExperts(name, m))
    return out


class _Marker:
    """What stands for a value of the experts' loop while ``_EveryExpertAtOnce`` runs it: torch
    functions given one are handled by that mode (an object with ``__torch_function__`` passes
    torch's argument parsing to reach it)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TraceError(f"{getattr(func, '__name__', func)} of the experts' loop values outside their fixed-shape form")


class _EveryExpert(_Marker):
    """The loop's expert index while ``stacked_experts_forward`` runs: all experts at once. It is
    never the masked class (``if expert_idx == self.num_experts: continue``)."""

    def __eq__(self, other):
        return False

    __hash__ = object.__hash__


_EVERY = _EveryExpert()


class _ExpertMask(_Marker):
    """What the loop computes from ``one_hot(top_k_index, ...)``: the experts hit (one pass of
    the loop, with every expert) and each expert's (top-k slot, token) pairs (every row)."""

    def permute(self, *a):
        return self

    def sum(self, *a, **k):
        return self

    def __getitem__(self, i):
        return self

    def squeeze(self, *a):
        return self

    def nonzero(self, *a, **k):
        return [[_EVERY]]


@dataclass
class _Grouped(_Marker):
    """``weight[expert_idx]`` of a 3-D expert weight, for all experts: its matmul with the rows
    is one ``grouped_mm`` (each expert's weight on its own rows)."""

    weight: torch.Tensor


def _has_every(i) -> bool:
    return i is _EVERY or (isinstance(i, (tuple, list)) and any(x is _EVERY for x in i))


class _EveryExpertAtOnce(torch.overrides.TorchFunctionMode):
    """The experts' own loop body run once on the ``tokens x top_k`` (token, expert) pairs sorted
    by expert (ties in token order, as each expert's ``torch.where`` finds them): the expert mask's
    ``torch.where`` gives every row's (top-k slot, token), an expert-indexed parameter gives each
    row its expert's entry (a bias, a routing weight), and a 3-D weight's matmul with the rows is
    ``grouped_mm``. The model's own ``index_add_`` then adds each row onto its token, in expert
    order as the loop adds them. Anything else done with the loop's index stops the trace, in words."""

    def __init__(self, s: StackedExperts | LoopedExperts, idx: torch.Tensor | None = None):
        super().__init__()
        self.s, self.idx = s, idx
        if idx is not None:
            self._sort(idx)
        self.weights = {id(p) for p in s.module.parameters(recurse=False) if p.dim() == 3}
        self.masked = False  # the loop made its expert mask (one_hot of the chosen experts)

    def _sort(self, idx: torch.Tensor) -> None:
        """The (token, expert) pairs of the chosen experts ``idx`` (tokens, top_k), sorted by expert."""
        self.idx = idx
        k = idx.shape[-1]
        order, self.expert, self.offs = _by_expert(idx, self.s.n_experts)
        self.tok, self.pos = order // k, order % k

    def grouped(self, rows: torch.Tensor) -> torch.Tensor:
        """``experts[i]`` of a list of expert modules, for all experts, on the rows sorted by expert."""
        return _rows_through_experts(self.s.module.experts, self.s.linears, rows, self.offs, self.expert)

    def _refuse(self, what: str):
        raise TraceError(f"the experts {self.s.name} ({type(self.s.module).__name__}) {what}, which autopar's "
                         "fixed-shape form of a loop over experts does not know (it runs the loop over the "
                         "experts hit once, for all experts: one_hot of the chosen experts, nonzero, torch.where, "
                         "each expert's weight in a matmul with its rows or each expert module on its rows, "
                         "index_add_ of the rows)")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        vals = (*args, *kwargs.values())
        if func is F.one_hot and args and self.idx is None and not args[0].is_floating_point() and args[0].dim() == 2:
            self._sort(args[0])  # a block that routes in its own forward (LoopedExperts): its chosen experts
        if func is F.one_hot and args and args[0] is self.idx:
            self.masked = True
            return _ExpertMask()
        if any(isinstance(a, _ExpertMask) for a in vals):
            if func is torch.where and len(args) == 1:
                return self.pos, self.tok
            if func in (torch.greater, torch.gt) and isinstance(args[0], _ExpertMask):
                return args[0]
            self._refuse(f"computes {getattr(func, '__name__', func)} of its expert mask")
        if func is torch.Tensor.__getitem__ and _has_every(args[1]):
            t, i = args
            if isinstance(i, list) and len(i) == 1:  # the loop's index as nonzero's row gives it
                i = i[0]
            if i is _EVERY and id(t) in self.weights:
                return _Grouped(t)
            i = self.expert if i is _EVERY else tuple(self.expert if x is _EVERY else x for x in i)
            return t[i]
        if any(isinstance(a, _Grouped) for a in vals):
            if func is F.linear and isinstance(args[1], _Grouped):
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                y = grouped_mm(args[0], list(args[1].weight.unbind(0)), self.offs)
                return y if bias is None else y + bias
            if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and isinstance(args[1], _Grouped):
                return grouped_mm(args[0], [w.t() for w in args[1].weight.unbind(0)], self.offs)
            self._refuse(f"uses an expert's weight in {getattr(func, '__name__', func)}")
        if any(a is _EVERY for a in vals):
            self._refuse(f"uses its expert index in {getattr(func, '__name__', func)}")
        return func(*args, **kwargs)


def _own_forward(m: nn.Module):
    """``m``'s forward as its class wrote it, under transformers 5's experts interface (which
    dispatches on ``config._experts_implementation``) too."""
    import inspect

    return inspect.unwrap(type(m).forward)


class _Count(_Marker):
    """Every entry of a router's ``tolist()`` of its rows per expert while tracing
    (``_ExpertSizes``: the list holds this one object once per expert): the experts called with
    it (their rows already sorted by expert) run as one grouped matmul with those counts. Its end
    offsets are made once, so every grouped matmul of the block reads the same ones (one routing
    under EP)."""

    def __init__(self, counts: torch.Tensor):
        self.counts = counts

    @functools.cached_property
    def offs(self) -> torch.Tensor:
        return self.counts.cumsum(0)


class _ExpertSizes(torch.overrides.TorchFunctionMode):
    """A router's ``tolist()`` of a 1-D integer tensor with one entry per expert of a module of
    experts held as 3-D parameters (Granite MoE's rows per expert, which its experts split their
    sorted rows by) gives ``_Count``s instead of values no fixed-shape graph holds. (``tolist``
    reaches a mode as ``unbind`` and an ``item`` of each piece while tracing, as itself in eager.)"""

    def __init__(self, experts: list[StackedExperts]):
        super().__init__()
        self.experts = experts
        self.n_experts = {st.n_experts for st in experts}
        self.pieces: dict[int, _Count] = {}  # id of an unbound piece of the counts -> its _Count

    def _counts(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.dim() == 1 and not t.is_floating_point() \
            and t.shape[0] in self.n_experts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, _Count) or (isinstance(a, (list, tuple)) and any(isinstance(c, _Count) for c in a))
               for a in (*args, *kwargs.values())):
            st = self.experts[0]
            raise TraceError(f"the experts {st.name} ({type(st.module).__name__}) and their block read a tensor of "
                             f"one value per expert (their rows per expert?) as a list and use it in "
                             f"{getattr(func, '__name__', func)}, which autopar's fixed-shape form does not know (it "
                             "passes such a list to experts that split their rows by it, Granite MoE's loop)")
        if func is torch.Tensor.tolist and self._counts(args[0]):
            return [_Count(args[0])] * args[0].shape[0]
        if func is torch.Tensor.item and id(args[0]) in self.pieces:
            return self.pieces[id(args[0])]
        out = func(*args, **kwargs)
        if func is torch.Tensor.unbind and self._counts(args[0]) and (args[1:] or kwargs.get("dim", 0)) in ((0,), 0):
            count = _Count(args[0])
            self.pieces.update({id(p): count for p in out})
        return out


def _sized(forward: Callable, experts: list[StackedExperts], *args, **kwargs):
    with _ExpertSizes(experts):
        return forward(*args, **kwargs)


def _sized_experts(s: StackedExperts, rows: torch.Tensor, sizes: list) -> torch.Tensor:
    """Experts given their rows sorted by expert and each expert's count: each row through its own
    expert's matrix (``weight[e]`` applied as a linear's), one ``grouped_mm``."""
    (w, *more) = list(s.module.parameters(recurse=False))
    if more or w.dim() != 3:
        raise TraceError(f"the experts {s.name} ({type(s.module).__name__}) are called with their rows per expert "
                         "but hold other parameters than one 3-D weight, which autopar's grouped form of them "
                         "does not know")
    if len({id(c) for c in sizes}) != 1 or len(sizes) != w.shape[0]:
        raise TraceError(f"the experts {s.name} ({type(s.module).__name__}) are called with row counts of other "
                         "experts than theirs")
    return grouped_mm(rows, list(w.unbind(0)), sizes[0].offs)


def stacked_experts_forward(s: StackedExperts, *args, **kwargs):
    """The experts' own forward with fixed shapes: every expert applied to its own rows only (the
    active FLOPs), by ``_EveryExpertAtOnce``. The chosen experts are the one integer 2-D tensor
    the call is given; experts called with their rows per expert (``_Count``s) apply each row's
    matrix as one grouped matmul; experts called with neither run their own forward as it is."""
    sizes = [a for a in (*args, *kwargs.values()) if isinstance(a, list) and a and all(isinstance(c, _Count) for c in a)]
    rows = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if len(sizes) == 1 and len(rows) == 1:
        return _sized_experts(s, rows[0], sizes[0])
    idx = [a for a in (*args, *kwargs.values())
           if isinstance(a, torch.Tensor) and not a.is_floating_point() and a.dim() == 2]
    if len(idx) != 1:  # not given the chosen experts: a form of their own (Llama 4's every expert on every row)
        return _own_forward(s.module)(s.module, *args, **kwargs)
    mode = _EveryExpertAtOnce(s, idx[0])
    try:
        with mode:
            out = _own_forward(s.module)(s.module, *args, **kwargs)
    except (AttributeError, TypeError, IndexError) as e:
        mode._refuse(f"loop over their experts otherwise ({type(e).__name__}: {e})")
    if not mode.masked:
        mode._refuse("find their experts' tokens without one_hot of the chosen experts")
    return out


# Expert modules looped over by their block's own routing code ---------------------------------
@dataclass(frozen=True)
class LoopedExperts(_ExpertList):
    """A mixture-of-experts block, not one ``routed_experts`` knows, whose ``experts`` are a list
    of identical modules of linears and whose own forward scores and chooses the experts (its own
    code: Ernie 4.5's bias-corrected top-k, Hunyuan's gate module) and then loops over the experts
    hit as Mixtral's does: one_hot of the chosen experts, nonzero, ``experts[i]`` on the rows
    ``torch.where`` finds, index_add_ of the rows. ``looped_experts_forward`` runs that forward
    once, for every expert at a time."""

    name: str
    module: nn.Module


def looped_experts(model: nn.Module) -> list[LoopedExperts]:
    """The blocks of a list of identical expert modules of linears, scored by a ``(experts, hidden)``
    weight of the block's own (its router), that ``routed_experts`` does not take."""
    out = []
    for name, m in model.named_modules():
        experts = m._modules.get("experts")
        if not isinstance(experts, nn.ModuleList) or len(experts) < 2 \
                or len({type(e) for e in experts}) != 1 or _linears(experts[0]) is None:
            continue
        if _router_weight(m, len(experts)) is not None:
            out.append(LoopedExperts(name, m))
    if out:
        known = {r.name for r in routed_experts(model)}
        out = [lp for lp in out if lp.name not in known]
    return out


def _router_weight(block: nn.Module, n_experts: int) -> torch.Tensor | None:
    """The ``(n_experts, hidden)`` weight of ``block`` outside its experts that scores them."""
    outside = [p for p in block._parameters.values() if p is not None]
    outside += [p for c, mod in block._modules.items() if c != "experts" and mod is not None for p in mod.parameters()]
    return next((p for p in outside if p.dim() == 2 and p.shape[0] == n_experts), None)


class _GroupedExperts:
    """A block's ``experts`` list while ``looped_experts_forward`` runs: indexed by the loop's
    every-expert index it is every expert at once (``_EveryExpertAtOnce.grouped``)."""

    def __init__(self, experts: nn.ModuleList, mode: _EveryExpertAtOnce):
        self.experts, self.mode = experts, mode

    def __getitem__(self, i):
        return self.mode.grouped if _has_every(i) else self.experts[i]

    def __len__(self):
        return len(self.experts)

    def __iter__(self):
        return iter(self.experts)


def looped_experts_forward(lp: LoopedExperts, *args, **kwargs):
    """The block's own forward with fixed shapes: its routing as it is, then its loop over the
    experts once, every expert on its own rows only (the active FLOPs)."""
    m = lp.module
    mode = _EveryExpertAtOnce(lp)
    m.__dict__["experts"] = _GroupedExperts(m.experts, mode)  # found before the registered module
    try:
        with mode:
            out = _own_forward(m)(m, *args, **kwargs)
    except (AttributeError, TypeError, IndexError) as e:
        mode._refuse(f"loop over their experts otherwise ({type(e).__name__}: {e})")
    finally:
        m.__dict__.pop("experts", None)
    if not mode.masked:
        mode._refuse("find their experts' tokens without one_hot of the chosen experts")
    return out


# Experts run on every token scaled by its score (Llama 4) ------------------------------------
@dataclass(frozen=True)
class ScoredExperts:
    """Llama 4's mixture of experts, recognised by its structure: a block of ``router`` (a linear
    with ``E`` outputs and a ``top_k``, whose own forward returns every expert's score per token,
    0 where not chosen, and its logits), ``experts`` (3-D ``gate_up_proj`` ``(E, hidden, 2 ffn)``
    and ``down_proj`` ``(E, ffn, hidden)``, an ``act_fn``) and ``shared_expert``. Its own forward
    runs every expert on every token scaled by that expert's score (so E / top_k times the active
    FLOPs) and sums them; ``scored_experts_forward`` runs each token's chosen experts only."""

    name: str
    module: nn.Module

    @property
    def n_experts(self) -> int:
        return int(self.module.experts.num_experts)


def scored_experts(model: nn.Module) -> list[ScoredExperts]:
    """The blocks of exactly a ``router``, 3-D ``experts`` and a ``shared_expert`` as
    ``ScoredExperts`` describes them."""
    out = []
    for name, m in model.named_modules():
        if m._modules.keys() != {"router", "experts", "shared_expert"}:
            continue
        router, ex = m.router, m.experts
        if not isinstance(router, nn.Linear) or not isinstance(getattr(router, "top_k", None), int):
            continue
        E = router.out_features
        gu, down = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
        if getattr(ex, "num_experts", None) == E and isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter) \
                and gu.dim() == down.dim() == 3 and gu.shape[0] == down.shape[0] == E \
                and gu.shape[2] == 2 * down.shape[1] and gu.shape[1] == down.shape[2] \
                and len(list(ex.parameters())) == 2 and callable(getattr(ex, "act_fn", None)):
            out.append(ScoredExperts(name, m))
    return out


def scored_experts_forward(b: ScoredExperts, hidden: torch.Tensor):
    """The block's output with fixed shapes: the router's own scores, each token's ``top_k``
    highest (every expert the router chose; an expert it did not scores 0 and adds 0) in expert
    order, the token scaled by each score through its expert (one grouped matmul per 3-D weight),
    each token's rows added in expert order onto zeros as the block's sum over experts adds them,
    then onto the shared expert's output. Returns ``(output, router logits)`` as the block does."""
    m = b.module
    ex = m.experts
    x = hidden.reshape(-1, hidden.shape[-1])
    scores, logits = m.router(x)
    k = m.router.top_k
    order, expert, offs = _by_expert(scores.topk(k, dim=1).indices.sort(dim=1).values, b.n_experts)
    tok = order // k
    rows = x[tok] * scores[tok, expert].unsqueeze(1)
    gate, up = grouped_mm(rows, [w.t() for w in ex.gate_up_proj.unbind(0)], offs).chunk(2, dim=-1)
    ys = grouped_mm(up * ex.act_fn(gate), [w.t() for w in ex.down_proj.unbind(0)], offs)
    return m.shared_expert(x) + _summed_per_token(ys, order, x.shape[0], k, x.dtype), logits


@contextlib.contextmanager
def _forward_as(m: nn.Module, fn: Callable):
    """``m`` runs ``fn`` as its forward inside the block; after it, a forward patched on the
    instance before (a hook's own) is back, or the class's."""
    kept = m.__dict__.get("forward")
    m.forward = fn
    try:
        yield
    finally:
        m.__dict__.pop("forward", None)
        if kept is not None:
            m.forward = kept


class _RoutedForm(contextlib.ExitStack):
    """While tracing, each routed-experts block of ``model`` runs ``routed_experts_forward`` and
    each module of experts held as 3-D parameters ``stacked_experts_forward``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.blocks = routed_experts(model)
        self.stacked = stacked_experts(model)
        self.looped = looped_experts(model)
        self.scored = scored_experts(model)

    def __enter__(self):
        super().__enter__()
        for r in self.blocks:
            self.enter_context(_forward_as(r.module, lambda hidden, r=r: routed_experts_forward(r, hidden)))
        for b in self.scored:
            self.enter_context(_forward_as(b.module, lambda hidden, b=b: scored_experts_forward(b, hidden)))
        for lp in self.looped:
            self.enter_context(_forward_as(lp.module, lambda *a, lp=lp, **k: looped_experts_forward(lp, *a, **k)))
        # A router's rows per expert as a list (``_Count``s), inside the blocks of such experts (a
        # mode entered here, outside the trace, would sit below the tracer's own).
        for b in (*self.scored, *self.looped):
            refuse_jitter(b.module, b.name)
        for block in dict.fromkeys(st.name.rpartition(".")[0] for st in self.stacked):
            parent = self.model.get_submodule(block)
            refuse_jitter(parent, block)
            sts = [st for st in self.stacked if st.name.rpartition(".")[0] == block]
            self.enter_context(_forward_as(parent, lambda *a, f=parent.forward, sts=sts, **k: _sized(f, sts, *a, **k)))
        for s in self.stacked:
            self.enter_context(_forward_as(s.module, lambda *a, s=s, **k: stacked_experts_forward(s, *a, **k)))
        return self


def refuse_batched_experts(model: nn.Module) -> None:
    """Refuse, in words, experts held as 3-D parameters that ``stacked_experts`` does not
    recognise (no ``num_experts``, or parameters of other leading sizes): before planning prices
    them and before anything trains."""
    from autopar.errors import AutoparError

    known = {id(s.module) for s in stacked_experts(model)}
    for name, m in model.named_modules():
        if id(m) not in known and hasattr(m, "_is_expert_parallel") and any(q.dim() == 3 for q in m.parameters(recurse=False)):
            impl = getattr(getattr(m, "config", None), "_experts_implementation", None)
            raise AutoparError(
                f"the experts {name} ({type(m).__name__}) hold every expert's weights in 3-D parameters "
                f"(transformers 5's experts interface{f', {impl!r}' if impl else ''}) without a num_experts that "
                "every one of them leads with; autopar runs such experts by their num_experts")


def _differs(own, mine) -> str | None:
    """Why two forwards' outputs are not the same (other shapes, values apart beyond fp32
    summation order), or None."""
    own = own if isinstance(own, tuple) else (own,)
    mine = mine if isinstance(mine, tuple) else (mine,)
    if len(own) != len(mine) or any(not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor)
                                    or a.shape != b.shape for a, b in zip(own, mine)):
        return "its outputs have other shapes"
    diff = max(float((a - b).abs().max() / max(1.0, float(a.abs().max()))) for a, b in zip(own, mine))
    return f"outputs differ by {diff:.2g}" if diff > 1e-5 else None


def _real(w: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    return w.device.type != "meta" and not isinstance(w, (FakeTensor, DTensor))


@contextlib.contextmanager
def _same_draws(device: torch.device):
    """A function that rewinds the random number generators of the CPU and of ``device`` to where
    they stood on entry (restored on exit too): a block that samples its routing in training
    (PhiMoE's sparsemixer draws Gumbel noise) draws the same numbers in both runs of a check."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        cpu = torch.get_rng_state()
        gpu = torch.cuda.get_rng_state(device) if devices else None

        def rewind() -> None:
            torch.set_rng_state(cpu)
            if gpu is not None:
                torch.cuda.set_rng_state(gpu, device)

        yield rewind


def _tokens_for(w: torch.Tensor, hidden: int, tokens: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(0)
    return torch.randn(1, tokens, hidden, generator=gen, dtype=w.dtype).to(w.device)


def check_routed_experts(model: nn.Module, *, tokens: int = 16) -> list[RoutedExperts]:
    """Before a model with routed experts trains in a fixed-shape form, prove on its own weights
    that the form computes what the model's own code computes (random tokens, every output): a
    block of expert modules (routed by autopar's form or looped by its own code) and Llama 4's
    block against their own forward, experts held as 3-D parameters within their block (its
    router's choice) against their own loop. A block that routes otherwise is refused rather than
    trained as a different model."""
    from autopar.errors import AutoparError

    refuse_batched_experts(model)
    blocks = routed_experts(model)
    # Each block in a form of autopar's: (name, block, its router's weight, the form, what the
    # form is, why a block may differ from it).
    forms = [(r.name, r.module, getattr(r.module, r.router).weight, lambda x, r=r: routed_experts_forward(r, x),
              "fixed-shape routed-experts form", "; its routing (e.g. sigmoid scores, grouped or biased top-k, "
              "capacity limits) is not the softmax top-k autopar knows,") for r in blocks]
    forms += [(b.name, b.module, b.module.router.weight, lambda x, b=b: scored_experts_forward(b, x),
               "form of it, each token through its chosen experts only,", ",") for b in scored_experts(model)]
    forms += [(lp.name, lp.module, _router_weight(lp.module, lp.n_experts),
               lambda x, lp=lp: looped_experts_forward(lp, x), "fixed-shape form of its loop over the experts", ",")
              for lp in looped_experts(model)]
    for name, m, w, form, what, because in forms:
        if not _real(w):  # nothing real to run
            continue
        x = _tokens_for(w, w.shape[1], tokens)
        with torch.no_grad(), _same_draws(x.device) as rewind:
            own = m(x)
            rewind()
            why = _differs(own, form(x))
        if why:
            raise AutoparError(f"the mixture-of-experts block {name} ({type(m).__name__}) does not compute what "
                               f"autopar's {what} computes ({why}){because} so it is not trained rather than "
                               "trained as a different model")
    by_block: dict[str, list[StackedExperts]] = {}
    for st in stacked_experts(model):
        by_block.setdefault(st.name.rpartition(".")[0], []).append(st)
    for block, sts in by_block.items():  # every module of experts of a block in its form at once
        st, m = sts[0], sts[0].module
        if not _real(next(m.parameters())):
            continue
        parent = model.get_submodule(block)
        inside = {id(p) for x in sts for p in x.module.parameters()}
        # The block's router scores the experts: a (num_experts, hidden) weight beside them.
        hidden = next((p.shape[1] for p in parent.parameters()
                       if id(p) not in inside and p.dim() == 2 and p.shape[0] == st.n_experts), None)
        if hidden is None:
            raise AutoparError(f"the experts {st.name} ({type(m).__name__}): their block {type(parent).__name__} has "
                               f"no ({st.n_experts}, hidden) router weight, so autopar cannot check its fixed-shape "
                               "form of them against their own loop; they are not trained rather than trained as "
                               "a different model")
        x = _tokens_for(next(m.parameters()), hidden, tokens)
        try:
            with torch.no_grad(), _same_draws(x.device) as rewind:
                with contextlib.ExitStack() as own_form:
                    for e in sts:
                        own_form.enter_context(_forward_as(e.module, _own_forward(e.module).__get__(e.module)))
                    own = parent(x)
                rewind()
                with contextlib.ExitStack() as form:
                    for e in sts:
                        form.enter_context(_forward_as(e.module, lambda *a, e=e, **k: stacked_experts_forward(e, *a, **k)))
                    form.enter_context(_ExpertSizes(sts))
                    why = _differs(own, parent(x))
        except (TraceError, AutoparError):
            raise
        except Exception as e:  # noqa: BLE001 - a block that is not called on tokens alone
            raise AutoparError(
                f"the experts {st.name} ({type(m).__name__}): their block {type(parent).__name__} cannot be run on "
                f"tokens alone ({type(e).__name__}: {e}), so autopar cannot check its fixed-shape form of them "
                "against their own code; they are not trained rather than trained as a different model") from e
        if why:
            raise AutoparError(f"the experts {', '.join(e.name for e in sts)} ({type(m).__name__}) do not compute what "
                               f"autopar's fixed-shape form of them computes ({why}), so they are not trained rather "
                               "than trained as a different model")
    return blocks


# --------------------------------------------------------------------------------------------
# Attention as the target GPU runs it
# --------------------------------------------------------------------------------------------
class _CausalMask:
    """transformers (``masking_utils``) hands SDPA ``attn_mask=None, is_causal=True`` only when it
    can see the mask is the plain causal one, and it never sees that while a model is traced:
    without an attention mask it ANDs the causal mask with a packed-sequence mask computed from the
    position ids (``find_packed_sequence_indices``: one sequence unless the positions restart), and
    under ``torch.compiler.is_compiling()`` (the export path) it keeps every mask, in case the
    exported graph is later called with other lengths. Either way the step would run attention with
    an explicit (s x s) mask: a GPU then takes the memory-efficient kernel, which cannot skip the
    masked half, instead of causal flash attention.

    autopar's step is traced at its real shapes: position ids the trace made with ``arange``
    (the model's own, from ``cache_position``, when the caller passes none) are one sequence, so
    there is no packed-sequence mask; and the skip test runs as it does outside a trace where there
    is no padding mask (its other conditions are shapes). Everything else (a padding mask, sliding
    windows shorter than the sequence, bidirectional image tokens, position ids that come from the
    caller) keeps transformers' own mask. Versions without ``masking_utils`` are left as they are."""

    NAMES = ("find_packed_sequence_indices", "_ignore_causal_mask_sdpa")

    def __enter__(self):
        import sys

        # Loaded by any transformers model that builds a mask: a model that never imported it
        # (autopar's own, a user's) does not pay transformers' import here.
        self.mu = mu = sys.modules.get("transformers.masking_utils")
        if mu is None:
            return self
        self.kept = {name: getattr(mu, name, None) for name in self.NAMES}
        skip, packed = self.kept["_ignore_causal_mask_sdpa"], self.kept["find_packed_sequence_indices"]
        if skip is not None:
            def ignore_causal_mask(padding_mask, *args, **kwargs):
                if padding_mask is not None:
                    return skip(padding_mask, *args, **kwargs)
                import torch.compiler as tc

                compiling, tc._is_compiling_flag = tc._is_compiling_flag, False
                try:
                    return skip(padding_mask, *args, **kwargs)
                finally:
                    tc._is_compiling_flag = compiling

            mu._ignore_causal_mask_sdpa = ignore_causal_mask
        if packed is not None:
            mu.find_packed_sequence_indices = lambda position_ids: None if _counts_up(position_ids) else packed(position_ids)
        return self

    def __exit__(self, *exc):
        if self.mu is not None:
            for name, fn in self.kept.items():
                if fn is not None:
                    setattr(self.mu, name, fn)


_SAME_VALUES = {"unsqueeze", "expand", "view", "_unsafe_view", "alias", "clone", "_to_copy", "lift_fresh_copy"}


def _counts_up(t: torch.Tensor) -> bool:
    """Whether the trace made ``t`` as 0, 1, 2, ... (from any start) along its last dim: an
    ``arange`` of step 1, unsqueezed, expanded or viewed; False where the trace cannot say (an
    input of the step, or no trace running)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None or not isinstance(t, torch.Tensor):
        return False
    try:
        node = get_proxy_slot(t, mode.tracer).proxy.node
    except (KeyError, AttributeError, RuntimeError):
        return False
    while node.op == "call_function" and getattr(node.target, "_opname", None) in _SAME_VALUES:
        src, out = node.args[0].meta.get("val"), node.meta.get("val")
        if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor) or not src.dim() or \
                not out.dim() or src.shape[-1] != out.shape[-1]:
            return False  # the last dim reshaped, or broadcast from one position
        node = node.args[0]
    target = node.target if node.op == "call_function" else None
    if target in (torch.ops.aten.arange.default, torch.ops.aten.arange.start):
        return True
    return target is torch.ops.aten.arange.start_step and len(node.args) > 2 and node.args[2] == 1


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
        mask = additive_mask(mask, q.dtype)
    elif mask is not None:
        mask = mask.to(q.dtype)
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, bool(a.get("is_causal", False)), attn_mask=mask, scale=a.get("scale"))
    return out[..., :dv]

