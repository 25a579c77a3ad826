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
4. ``cut.for_analysis`` cuts what the analysis reads from that graph (``trace_model`` does all
   three for the planner).

What makes a model traceable to one static graph (the export path, random scalar draws, routed
experts in a fixed-shape form, attention as the GPU runs it) is in ``traceable.py``; the helpers
over ATen graphs every stage shares (op names and sets, FLOPs, tied parameters) in ``fxops.py``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.errors import AutoparError, TraceError
from autopar.fxops import first_by_storage, out_of_place, unique_parameters
from autopar.traceable import data_dependent, refuse_batched_experts, with_export_path_fallback

if TYPE_CHECKING:
    from autopar.cut import ModelTrace

log = logging.getLogger(__name__)


def _param_listing(m: nn.Module, own: dict) -> list[tuple[str, tuple, int]]:
    """``m``'s parameters as ``named_parameters`` lists them, ``(name, shape, id)``, from its
    children's listings (``own``: id(module) -> listing, shared so each module is listed once)."""
    if id(m) in own:
        return own[id(m)]
    seen, out = set(), []
    for n, p in m._parameters.items():
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            out.append((n, tuple(p.shape), id(p)))
    for c, child in m._modules.items():
        if child is None:
            continue
        for n, shape, pid in _param_listing(child, own):
            if pid not in seen:
                seen.add(pid)
                out.append((f"{c}.{n}", shape, pid))
    own[id(m)] = out
    return out


def _signature(m: nn.Module, listing: list) -> str:
    return f"{type(m).__name__}[{','.join(f'{n}:{shape}' for n, shape, _ in listing)}]"


def layer_signature(m: nn.Module) -> str:
    """A module's class and its parameters' names and shapes: equal for repeated layers."""
    return _signature(m, _param_listing(m, {}))


def layer_signatures_of(mods: list[nn.Module]) -> list[str]:
    """``layer_signature`` of each of ``mods``, a submodule they share listed once."""
    own: dict = {}
    return [_signature(m, _param_listing(m, own)) for m in mods]


def _module_params(model: nn.Module) -> dict[str, list[tuple[str, tuple, int]]]:
    """Each module of ``model`` holding parameters, by name, with its ``_param_listing``, built once
    from the leaves up (each parameter listed once per enclosing module, not walked again for
    each: DeepSeek-V3's 15,000 experts in 61 layers)."""
    own: dict = {}
    return {name: ps for name, m in model.named_modules() if (ps := _param_listing(m, own))}


def layer_signatures(model: nn.Module, params: dict | None = None, mods: dict | None = None) -> dict[str, str]:
    """``layer_signature`` of every module of ``model`` holding parameters, by name."""
    params = _module_params(model) if params is None else params
    mods = dict(model.named_modules()) if mods is None else mods
    return {name: _signature(mods[name], ps) for name, ps in params.items()}


def vocab_size_of(model: nn.Module, given: int | None) -> int:
    """``given``, or the largest ``nn.Embedding`` of ``model`` (256 without one)."""
    if given is not None:
        return given
    return max((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=256)


def logits_of(out: Any) -> torch.Tensor:
    """The logits tensor of a model output: a tensor, an HF ModelOutput, or a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    items = out.to_tuple() if hasattr(out, "to_tuple") else ()  # another library's record (diffusers' ``sample``)
    if items and isinstance(items[0], torch.Tensor):
        return items[0]
    raise TraceError(f"cannot find logits in the model output of type {type(out).__name__}")


def default_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = logits_of(out)
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), target.flatten())


def noise_mse(out: Any, target: torch.Tensor) -> torch.Tensor:
    """A diffusion model's loss: the mean squared error of its prediction (the noise) against the
    target, of the output's shape."""
    return torch.nn.functional.mse_loss(logits_of(out).float(), target.float())


def is_token_ids(t: Any) -> bool:
    """A (batch, seq) integer tensor: what a language model takes."""
    return isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype in (torch.int64, torch.int32)


def output_logits(model: nn.Module, inputs: tuple) -> torch.Tensor:
    """The logits ``model`` returns for ``inputs``, as a fake tensor: a forward on fake tensors
    (shapes only, nothing computed, the model's own tensors untouched) through the first layer of
    each kind, the others passing its output on (a model built for planning holds only their shapes)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = detect_fake_mode([*model.parameters(), *inputs]) or FakeTensorMode(allow_non_fake_inputs=True)
    fakes = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
                  for x in inputs)
    own = next((q.dtype for q in model.parameters() if q.is_floating_point()), None)
    if own is not None:  # floating inputs in the parameters' dtype, as the step casts them
        with mode:
            fakes = tuple(x.to(own) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in fakes)
    layers, repeats = layers_and_repeats(model)
    undo = _pass_on_repeats(model, layers, repeats)
    try:
        with mode, torch.no_grad():
            return logits_of(model(*fakes))
    except TraceError:
        raise
    except Exception as e:
        raise _trace_error(e, f"the forward of {type(model).__name__}") from e
    finally:
        for u in undo:
            u()


def default_target(model: nn.Module, inputs: tuple, loss_fn: Callable | None = None) -> torch.Tensor:
    """An example target of the loss, for tracing: for token ids, ids (next-token labels); for
    other inputs (images, latents), class indices of the logits' leading shape, what
    ``default_loss`` reads, or for ``noise_mse`` a prediction's shape of zeros. A loss of the
    user's own needs its target given."""
    first = inputs[0]
    if is_token_ids(first):
        return torch.zeros_like(first)
    if loss_fn is noise_mse:
        return torch.zeros(output_logits(model, inputs).shape, device=first.device)
    if loss_fn is not None and loss_fn is not default_loss:
        raise AutoparError(
            f"the model takes {first.dtype} inputs of shape {tuple(first.shape)}, not token ids, and the loss is "
            "your own: autopar cannot tell what target it expects. Pass example_target= (one batch's target, "
            "e.g. the noise a diffusion model predicts, or the class labels)")
    return torch.zeros(output_logits(model, inputs).shape[:-1], dtype=torch.long, device=first.device)


def sample_tokens(sg: StepGraph, batch: int, vocab_size: int | None = None) -> tuple[int, int]:
    """For a model not fed token ids (images, latents): its sequence, the tokens per sample where
    the repeated layers run (the hidden state entering the first layer is (batch, tokens...,
    features): a ViT's patches and class token, a DiT's latent patches), and its "vocabulary",
    the logits' last dimension (classes, or features per patch), what a TP head splits."""
    params = set(sg.placeholders()[: sg.n_params])
    entering = (a.meta.get("val") for n in sg.gm.graph.nodes if n.meta.get("custom", {}).get("layer") == 0
                for a in n.all_input_nodes if a not in params and a.meta.get("custom", {}).get("layer") is None)
    hidden = next((v for v in entering if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 3
                   and v.shape[0] == batch), None)
    seq_len = math.prod(hidden.shape[1:-1]) if hidden is not None else None
    if seq_len is None:
        raise TraceError("cannot find the model's sequence: no (batch, tokens, features) hidden state enters its "
                         "first repeated layer")
    if vocab_size is None:
        vocab_size = sg.logits_shape[-1] if sg.logits_shape else 1
    return seq_len, vocab_size


def _trace_error(e: Exception, what: str, advice: str | None = None) -> TraceError:
    frames = traceback.extract_tb(e.__traceback__)
    here = os.path.dirname(os.path.abspath(__file__))
    user = [f for f in frames if "site-packages/torch" not in f.filename and not f.filename.startswith(here)]
    where = f" at {user[-1].filename}:{user[-1].lineno}: {user[-1].line}" if user else ""
    library = next((lib for lib in ("transformers", "diffusers", "timm") if user and
                    f"site-packages/{lib}/" in user[-1].filename.replace(os.sep, "/")), None)
    if advice is None and data_dependent(e) and library:
        # Not the user's code: a form of the library's this version of autopar does not trace.
        advice = (f"That line is {library}' own code (not yours): it decides on tensor values (data-dependent "
                  "control flow, e.g. routing tokens to experts by a loop over the experts that received any), "
                  "which autopar's fake-tensor trace cannot follow, and autopar has no traceable form of this "
                  f"{library} module yet. Nothing to change in your model; a model whose modules autopar knows "
                  "(see the README's families) or a factory returning a traceable equivalent plans today.")
    elif advice is None and "'indices'" in str(e) and "Long, Int" in str(e):
        advice = ("An embedding lookup got non-integer indices: the model takes token ids, so its input must "
                  "be a 2-D integer tensor of token ids (batch, seq), a LongTensor.")
    elif advice is None and data_dependent(e):
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


@contextlib.contextmanager
def no_init():
    """``torch.nn.init``'s in-place initialisers as no-ops: on fake tensors values do not exist,
    and some initialisers decide on them (a truncated normal redraws out-of-range samples:
    ViT's and ModernBERT's weights). A module first imported meanwhile that kept one of them
    (transformers 5's ``initialization`` keeps every one in a table at import, through which all
    its models initialise) gets the real one back: else every model built later in the process
    would keep its constructors' values, and parameters made with ``torch.empty`` (5.x's 3-D
    experts) whatever memory held."""
    import sys

    import torch.nn.init as init

    kept = {k: v for k, v in vars(init).items() if k.endswith("_") and not k.startswith("_") and callable(v)}
    noops = {k: _noop_init() for k in kept}
    before = set(sys.modules)
    try:
        for k, f in noops.items():
            setattr(init, k, f)
        yield
    finally:
        for k, v in kept.items():
            setattr(init, k, v)
        real = {id(noops[k]): v for k, v in kept.items()}
        for name in set(sys.modules) - before:
            _rebind(sys.modules.get(name), real)


def _noop_init():
    return lambda tensor, *args, **kwargs: tensor


def _rebind(module, real: dict) -> None:
    """``module``'s globals, and the dicts among them, that hold a no-op of ``no_init`` (by id in
    ``real``) made the real initialiser again."""
    space = getattr(module, "__dict__", None)
    if not isinstance(space, dict):
        return
    for table in (space, *[v for v in list(space.values()) if type(v) is dict]):
        for k, v in list(table.items()):
            if id(v) in real:
                table[k] = real[id(v)]


def _built_on_meta(build: Callable[[], nn.Module], mode) -> tuple[nn.Module, tuple[list[str], list[str]] | None]:
    """``build()`` on the meta device: shapes only, nothing allocated and no fake-tensor dispatch
    per parameter (DeepSeek-V3's 45k expert linears). A constructor that reads a value it computed
    (Swin's drop-path rates, ``torch.linspace(..., device="cpu").item()``) works: a factory call
    that names the CPU runs for real there. The parameters and buffers a planning trace reads,
    those outside the layers after the first of their kind (``_repeats``), are then made fake CPU
    tensors of ``mode`` (so are tensors kept as plain attributes); the repeats' stay meta (their
    shapes are all the planner reads), a parameter they share with the rest becoming the same
    fake. Returns the model and its layers and repeats (``layers_and_repeats``)."""
    from torch._subclasses.fake_tensor import FakeTensor

    with torch.device("meta"), no_init():
        model = build()
    if not isinstance(model, nn.Module):
        return model, None
    cpu = torch.device("cpu")
    layers, repeats = layers_and_repeats(model)
    skip = tuple(f"{n}." for n in repeats)
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            f = FakeTensor(mode, t.to("meta"), cpu)
            made[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
        return made[id(t)]

    passed_over = []  # the repeats' modules
    for name, mod in model.named_modules():
        for k, t in list(vars(mod).items()):  # a tensor kept as a plain attribute (GPT-J's scale)
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                setattr(mod, k, fake(t))
        if skip and f"{name}.".startswith(skip):
            passed_over.append(mod)
            continue
        for slots in (mod._parameters, mod._buffers):
            for k, t in list(slots.items()):
                if t is not None:
                    slots[k] = fake(t)
    for mod in passed_over:
        for slots in (mod._parameters, mod._buffers):
            for k, t in list(slots.items()):
                if t is not None and id(t) in made:
                    slots[k] = made[id(t)]
    return model, (layers, repeats)


def trace_model(
    build_or_model: Callable[[], nn.Module] | nn.Module,
    *,
    batch: int,
    seq_len: int | None,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    loss_fn: Callable | None = None,
    name: str = "model",
    example_inputs: tuple | None = None,
    example_target: torch.Tensor | None = None,
) -> ModelTrace:
    """Trace ``build_or_model`` on fake tensors at (batch, seq_len) token inputs, or at
    ``example_inputs`` (then the sequence is the tokens per sample where the layers run)."""
    t0 = time.perf_counter()
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    prev = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype if dtype.is_floating_point else prev)
        model, found = (build_or_model, None) if isinstance(build_or_model, nn.Module) else \
            _built_on_meta(build_or_model, mode)
    except Exception as e:
        raise _trace_error(e, f"the construction of {name}", (
            "The model is built on the meta device (shapes only, nothing allocated): the factory must "
            "build it from its config alone, without reading weights or data; load weights after "
            "autopar.compile")) from e
    finally:
        torch.set_default_dtype(prev)
    if not isinstance(model, nn.Module):
        raise TraceError(f"{name} returned a {type(model).__name__}, not an nn.Module: a model factory "
                         "takes no arguments and returns the model")
    model.train()
    refuse_batched_experts(model)  # as autopar.compile does: never priced as something it cannot run
    # Tracing runs the model's Python code; an in-place update of a real buffer (a counter)
    # would happen for real: keep their values and put them back.
    kept = [(b, b.detach().clone()) for b in model.buffers() if not isinstance(b, FakeTensor) and b.device.type != "meta"]
    if example_inputs is None:
        inputs: tuple = (torch.randint(0, vocab_size_of(model, vocab_size), (batch, seq_len)),)
    else:
        inputs = tuple(example_inputs)
    target = example_target if example_target is not None else default_target(model, inputs, loss_fn)
    try:
        sg = trace_step(model, inputs, target=target, loss_fn=loss_fn, name=name, first_layers_only=True,
                        target_kernels=True, param_dtype=dtype if dtype.is_floating_point else None,
                        layers=found and found[0], repeats=found and found[1])
    finally:
        with torch.no_grad():
            for b, v in kept:
                b.copy_(v)
    if is_token_ids(inputs[0]):
        vocab_size = vocab_size_of(model, vocab_size)
    else:
        seq_len, vocab_size = sample_tokens(sg, batch, vocab_size)
    from autopar.cut import for_analysis

    return for_analysis(sg, model, name=name, batch=batch, seq_len=seq_len, dtype=dtype, vocab_size=vocab_size,
                       t0=t0)


# --------------------------------------------------------------------------------------------
# The training step as one graph (what the executor runs)
# --------------------------------------------------------------------------------------------
def find_layers(model: nn.Module) -> list[str]:
    """The repeated layers of ``model``, in the order their modules are registered (the order
    they run in a model built as a sequence of stacks). A *kind* of layer is a group of at least
    two modules that share a class and parameter shapes and do not nest, lifted to the modules
    of one class that enclose them one each (``_lift``) and widened to the modules of its class
    beside them in their container (DeepSeek's first dense layers before the MoE ones; T5's first
    block, which holds the position bias). The largest kind (by the repeated modules' parameters)
    is taken, and every other kind that is a container's whole sequence of blocks outside it
    (BART's and T5's encoder layers beside the decoder's, a vision tower beside a text one).
    Found from the modules themselves, whatever holds them (a ModuleList, a ModuleDict, plain
    attributes)."""
    return layers_and_repeats(model)[0]


def layers_and_repeats(model: nn.Module) -> tuple[list[str], list[str]]:
    """``find_layers(model)`` and, of those, the layers after the first of their kind (class and
    parameter shapes): what a planning trace passes over. One walk of the modules for both
    (DeepSeek-V3 has 75k)."""
    mods = dict(model.named_modules())
    params = _module_params(model)
    sigs = layer_signatures(model, params, mods)
    groups: dict[str, list[str]] = {}
    for name, sig in sigs.items():
        if name:
            groups.setdefault(sig, []).append(name)
    kinds = []
    for names in groups.values():
        inside = set(names)  # drop the ones nested in another of the group
        names = [n for n in names if not any(".".join(n.split(".")[:k]) in inside for k in range(1, n.count(".") + 1))]
        if len(names) >= 2:  # ranked by the repeated modules' own parameters, before lifting
            size = sum(math.prod(shape) for n in names for _, shape, _ in params[n])
            kinds.append((size, -len(names), _beside(_lift(names, mods), mods, params)))
    if not kinds:
        return [], []
    kinds.sort(key=lambda k: k[:2], reverse=True)
    chosen = set(kinds[0][2])
    for _, _, kind in kinds[1:]:
        if not _overlaps(kind, chosen) and not _overlaps(chosen, kind) and _is_stack(kind, mods, params):
            chosen |= kind
    layers = [n for n in mods if n in chosen]
    return layers, _first_of_kind_after(layers, [sigs.get(n) or _signature(mods[n], []) for n in layers])


def _first_of_kind_after(layers: list[str], sigs: list[str]) -> list[str]:
    """The layers whose signature an earlier one has."""
    seen, out = set(), []
    for name, sig in zip(layers, sigs):
        (out.append(name) if sig in seen else seen.add(sig))
    return out


def _overlaps(names, outer: set[str]) -> bool:
    """Whether one of ``names`` is one of ``outer`` or nested in one."""
    for n in names:
        parts = n.split(".")
        if any(".".join(parts[:k]) in outer for k in range(1, len(parts) + 1)):
            return True
    return False


def _lift(names: list[str], mods: dict) -> list[str]:
    """The repeated modules' enclosing layers: while each sits in its own module, all of one
    class, take those (ModernBERT's first layer has no attention norm, so only its MLPs repeat
    exactly; T5's blocks differ, their feed-forward sublayers do not)."""
    while True:
        up = [n.rpartition(".")[0] for n in names]
        if not all(up) or len(set(up)) < len(up) or len({type(mods[u]).__name__ for u in up}) > 1:
            return names
        names = up


def _container_children(names, mods: dict, params: dict) -> set[str] | None:
    """The children holding parameters of the one container of ``names``; None for several."""
    parents = {n.rpartition(".")[0] for n in names}
    if len(parents) != 1:
        return None
    (parent,) = parents
    return {n for c, _ in mods[parent].named_children() if (n := f"{parent}.{c}" if parent else c) in params}


def _beside(names: list[str], mods: dict, params: dict) -> set[str]:
    """``names`` with the modules of their classes beside them in their one container."""
    classes = {type(mods[n]).__name__ for n in names}
    children = _container_children(names, mods, params) or set()
    return set(names) | {n for n in children if type(mods[n]).__name__ in classes}


def _is_stack(kind: set[str], mods: dict, params: dict) -> bool:
    """A kind that is every block of its container (a ModuleList of encoder layers), each block
    holding at least two weight matrices (not a list of norms or of single projections)."""
    return _container_children(kind, mods, params) == kind and all(
        sum(len(shape) >= 2 for _, shape, _ in params[n]) >= 2 for n in kind)


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
    logits_shape: tuple[int, ...] | None = None  # the model's logits (what the loss reads), when found
    final: bool = True  # its outputs are the model's (False for all but the last pipeline stage)
    n_received: int = 0  # a pipeline stage's first inputs, the activations the stage before sends
    first: bool = True  # its inputs are the model's (False for all but the first pipeline stage)
    # What autograd saves for backward, in order: (the first node holding the saved storage, the
    # layer whose forward saved it or None outside the layers, whether a layer had started).
    saved: list[tuple[str, int | None, bool]] = field(default_factory=list)

    @property
    def n_params(self) -> int:
        return len(self.param_names)

    def placeholders(self) -> list[torch.fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]


def _module_annotations(model: nn.Module, layers: list[str], skip: tuple[str, ...] = ()):
    """Forward hooks that annotate every node traced inside a module with its name, and inside a
    layer with the layer's index (``torch.fx.traceback.annotate``, copied into ``meta['custom']``).
    ``skip``: prefixes of modules that do not run in the trace (the repeats a planning trace passes
    over, whose own layer keeps its hook: DeepSeek-V3's 75k modules are otherwise hooked twice)."""
    index = {name: i for i, name in enumerate(layers)}
    stack: list = []
    handles = []
    for name, mod in model.named_modules():
        if not name or (skip and name.startswith(skip)):
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
    layers: list[str] | None = None, repeats: list[str] | None = None,
) -> StepGraph:
    """Trace ``model``'s forward on ``inputs`` (and the loss against ``target`` when given) to one
    ATen graph, on fake tensors: nothing is computed and no memory of the model's size is used.

    This is the one capture: the executor runs this graph, and the planner's analysis reads it
    (``cut.for_analysis``). ``first_layers_only`` (planning without running, e.g. 126 layers) traces
    only the first of the repeated layers; the others pass its output on, which has the right
    shape for everything after them, and have no placeholders for their parameters and buffers.
    ``target_kernels`` prices what the target GPU runs rather than this host (``_TargetKernels``).
    ``param_dtype``: the floating-point parameters and inputs enter in this dtype (mixed precision:
    the forward as FSDP2 runs it, on parameters and inputs cast to the compute dtype; buffers keep theirs);
    ``output_dtype``: the model's floating-point outputs are cast to it (FSDP2's ``output_dtype``);
    ``layers``, ``repeats``: ``layers_and_repeats(model)`` when the caller has them."""
    if layers is None:
        layers, found = layers_and_repeats(model)
        repeats = found if repeats is None else repeats
    if not first_layers_only:
        repeats = []
    elif repeats is None:
        repeats = _repeats(model, layers)
    unused = tuple(f"{layer}." for layer in repeats)
    pnames, params, aliases = unique_parameters(model, skip=unused)
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
    for first, held_as in [(n, n) for n in pnames + bnames] + [(f, o) for f, others in aliases.items() for o in others]:
        owner, _, attr = held_as.rpartition(".")
        slot = (id(model.get_submodule(owner)), attr)
        if slot not in slots:
            slots.add(slot)
            distinct[held_as] = first

    def step(ps, bs, xs, *tgt):
        if param_dtype is not None:  # floating-point inputs enter in the compute dtype (FSDP2's cast_forward_inputs)
            xs = [x.to(param_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in xs]
        held = {**dict(zip(pnames, ps)), **dict(zip(bnames, bs))}
        state = {name: held[first] for name, first in distinct.items()}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = torch.func.functional_call(model, state, tuple(xs), tie_weights=False)
            if output_dtype is not None:
                out = _cast_outputs(out, output_dtype)
            try:
                box["logits"] = tuple(logits_of(out).shape)
            except TraceError:
                pass  # a loss of the user's own reads what it reads
            if tgt:
                return (loss_fn or default_loss)(out, tgt[0])
        if not isinstance(out, torch.Tensor):
            box["type"] = type(out)
        return logits_of(out)

    def trace():
        packed.clear()
        box.clear()
        handles = _module_annotations(model, layers, unused)
        if layers:
            handles.append(mods[layers[0]].register_forward_pre_hook(lambda *_: box.__setitem__("entered", True)))
        undo = _pass_on_repeats(model, layers, repeats)
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
    _drop_empty_cat_operands(gm)
    holder = first_by_storage(gm.graph.nodes)  # what autograd saved, before writes get values of their own
    # A write into a tensor the step made and nothing else aliases (a router's scatter_ into fresh
    # zeros, experts' index_add_ of their rows) as its out-of-place form: a sharded value cannot be
    # written in place where the write changes its placement.
    out_of_place(gm, restrides=False)
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
    saved, seen = [], set()
    for ref, layer, entered in packed:
        if ref in holder and (ref, layer) not in seen:
            seen.add((ref, layer))
            saved.append((holder[ref], layer, entered))
    out_type = box.get("type")
    return StepGraph(gm, pnames, aliases, bnames, len(inputs), target is not None, layers,
                     [tuple(x.shape) for x in inputs], out_type, box.get("logits"), saved=saved)


def _drop_empty_cat_operands(gm: torch.fx.GraphModule) -> None:
    """``torch.cat`` skips one-dimensional empty operands (``cat([tensor([]), x], -2)`` is a copy
    of ``x``): a key/value cache starts so (transformers' ``DynamicCache``, which its models build
    whenever ``config.use_cache`` is on, training included). No sharding rule knows that exception
    (DTensor would shard the empty operand along the heads), so they leave the graph: the same values.
    A cat left with one operand becomes the contiguous copy it makes: Inductor would decompose it to
    a clone that keeps the operand's strides, under the views traced on the contiguous result."""
    def empty_1d(a: Any) -> bool:
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == 0

    changed = False
    for n in list(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.cat.default)):
        dropped = [a for a in n.args[0] if empty_1d(a)]
        keep = [a for a in n.args[0] if a not in dropped]
        if not dropped or not keep:
            continue
        changed = True
        if len(keep) == 1 and n.meta["val"].is_contiguous():
            n.target, n.args, n.kwargs = torch.ops.aten.clone.default, (keep[0],), {"memory_format": torch.contiguous_format}
        else:
            n.args = (keep, *n.args[1:])
        for a in dropped:  # the empty constant and what made it, once nothing else reads them
            while isinstance(a, torch.fx.Node) and not a.users and a.op in ("call_function", "get_attr"):
                ins = list(a.all_input_nodes)
                gm.graph.erase_node(a)
                a = ins[0] if len(ins) == 1 else None
    if changed:
        gm.recompile()


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
    """Of ``layers``, those after the first of their kind (class and parameter shapes)."""
    return _first_of_kind_after(layers, layer_signatures_of([model.get_submodule(n) for n in layers]))


def _pass_on_repeats(model: nn.Module, layers: list[str], repeats: list[str]) -> list[Callable[[], None]]:
    """Make every layer after the first of its kind return the output of the last layer that
    ran (same shapes and types), so a trace holds one layer of each kind; ``repeats``: those
    layers (``_repeats``). Returns what undoes it."""
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


