"""The backend: split the joint graph into forward and backward graphs (the ``partition`` pass),
and compile each (``compile_step``, after the passes).

The partition is functorch's min-cut partitioner (what ``torch.compile`` uses): it decides what
the forward saves for the backward, honours the recompute tags of ``passes/ac.py``, and returns
``fw: primals -> (*outputs, *saved)`` and ``bw: (*saved, *tangents) -> gradients``. Inductor
compiles each graph whole (``_inductor``, the one call into it: its graph compiler, without
AOTAutograd's front end; on CPU its C++ kernels are built a library per compile worker,
``cpp_kernels.py``); with
``compile=False`` the very same graphs run eagerly, so the debug path and the default path differ
only in code generation.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch._functorch.partitioners import min_cut_rematerialization_partition

# Importing overlap registers autopar::copy_out, which the compiled graphs call.
import autopar.passes.overlap  # noqa: F401
from autopar import cpu_isa
from autopar.cpp_kernels import batched_cpp_kernels
from autopar.passes import StepGraphs

log = logging.getLogger(__name__)


@dataclass
class CompiledStep:
    fw: Callable
    bw: Callable
    fw_graph: torch.fx.GraphModule
    bw_graph: torch.fx.GraphModule
    n_outputs: int
    compile_s: float = 0.0
    bw_strides: list = None  # the strides the backward graph's inputs were traced with
    # Zero-bubble schedules: the backward as input- and weight-gradient parts (passes/pp.py).
    bw_input: Callable | None = None
    bw_weight: Callable | None = None
    n_input_grads: int = 0
    bw_weight_strides: list = None
    inductor: bool = True  # compiled by Inductor (False: the graphs run as they are)
    # Graphs compiled with every layer inline after Inductor failed on their layer calls.
    fallbacks: list = field(default_factory=list)
    # The graphs this rank compiled for the ranks with the same graphs (the others it loaded).
    compiled_here: list = field(default_factory=list)


def partition(joint: torch.fx.GraphModule, plan, ctx) -> StepGraphs:
    """The pass: the joint graph as forward and backward graphs (``ctx.step.n_outputs``: the
    forward's own outputs, before what it saves for the backward)."""
    n = ctx.step.n_outputs
    return StepGraphs(*min_cut_rematerialization_partition(joint, None, num_fwd_outputs=n), n_outputs=n)


def _example(gm: torch.fx.GraphModule) -> list:
    return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]


def _fake_mode(vals: list):
    from torch._guards import detect_fake_mode

    return detect_fake_mode(vals)


def compile_graph(gm: torch.fx.GraphModule, inductor: bool) -> Callable:
    """``gm`` compiled (or, without Inductor, run as is) as a *boxed* callable: it takes one list
    of inputs and empties it, so an input whose only reference was that list is freed at its
    last use inside the graph (the backward frees each saved activation once it is consumed,
    as autograd does, instead of holding every one to the end)."""
    if not inductor:
        import copy

        from torch.fx.graph import _BoxedCodeGen

        boxed = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        boxed.graph.set_codegen(_BoxedCodeGen())
        boxed.recompile()
        return boxed
    # Inductor's peak-memory reordering is off: the graph's order (gathers at use, prefetch, the
    # reductions' waits: passes/overlap.py) is the schedule that runs and that memory.py prices.
    # A graph that calls layer subgraphs (passes/regions.py) is compiled without mix-order
    # reductions: where Inductor autotunes at compile time (``triton.autotune_at_compile_time``),
    # the tuning block it writes for the whole graph does not allocate the workspace such a kernel
    # inside a subgraph needs (torch 2.11 on an H200: "Failed to run autotuning code block: name
    # 'workspace_0' is not defined", RMSNorm's backward at 4 x 2048 tokens).
    vals = _example(gm)
    with (torch.no_grad(), torch._inductor.config.patch(_inductor_config(gm)), batched_cpp_kernels(),
          cpu_isa.waits()):
        key = _stored_key(gm, vals)
        compiled = _load_stored(key, vals) if key else None
        if compiled is None:
            compiled = _inductor(gm, vals)
            if key:
                _store(key, compiled)
        return compiled


def _inductor_config(gm: torch.fx.GraphModule) -> dict:
    """Inductor's settings for ``gm`` that differ from its defaults (see ``compile_graph``)."""
    calls = any(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes)
    return {"reorder_for_peak_memory": False, **({"triton.mix_order_reduction": False} if calls else {})}


# Compiled graphs found again by autopar's own digest of the graph, before Inductor's trace and
# passes (``_stored_key``): a file per digest in Inductor's cache directory names the entry of
# Inductor's FX graph cache that the first compile of that graph made. A rank that loads what
# another rank compiled, and the next run, skip the decompositions' trace, Inductor's joint-graph
# passes and its hashing of the traced graph (a second or more a graph), and load the entry.
_STORE = "autopar-compiled"


def _stored_key(gm: torch.fx.GraphModule, vals: list) -> str | None:
    """The digest of what decides Inductor's output for ``gm``: the code of the graph and of its
    layer subgraphs, each input's shape, strides, offset, dtype and device, Inductor's
    configuration (with the patches in force), torch's version and the machine (``_system``).
    None (no store) where an
    input is not a tensor of static shape, or Inductor's cache is off."""
    import hashlib

    from torch._inductor import config

    if (config.force_disable_caches or not config.fx_graph_cache or config.cudagraph_policy is not None
            or os.environ.get("AUTOPAR_COMPILED_STORE") == "0"):
        return None
    h = hashlib.sha256()
    for v in vals:
        if not isinstance(v, torch.Tensor) or not all(isinstance(x, int) for x in (*v.shape, *v.stride())):
            return None
        h.update(repr((tuple(v.shape), v.stride(), int(v.storage_offset()), v.dtype, v.device, v.layout,
                       v.requires_grad)).encode())
    for m in gm.modules():
        if isinstance(m, torch.fx.GraphModule):
            h.update(m.code.encode())
    h.update(config.get_hash())
    h.update(repr((torch.__version__, _system(any(v.device.type == "cpu" for v in vals)))).encode())
    return h.hexdigest()


def _system(cpu: bool) -> tuple:
    """What of the machine Inductor's code depends on: its accelerator and toolchain versions
    (what Inductor's own cache key holds) and, for CPU kernels, the CPU's vector instructions
    (the set ATen picked, and the variable that picks Inductor's; not Inductor's probe, which
    may still run in the background)."""
    from torch._inductor.codecache import CacheBase

    isa = (torch.backends.cpu.get_cpu_capability(), os.environ.get("ATEN_CPU_CAPABILITY")) if cpu else None
    return json.dumps(CacheBase.get_system(), sort_keys=True), isa


def _store_path(key: str) -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), _STORE, key[:2], key)


def _store(key: str, compiled) -> None:
    """Note which FX graph cache entry ``compiled`` is (nothing where Inductor did not cache it)."""
    from torch._inductor.codecache import write_atomic

    fx_key = getattr(compiled, "_fx_graph_cache_key", None)
    if fx_key:
        write_atomic(_store_path(key), fx_key, make_dirs=True)


def _load_stored(key: str, vals: list) -> Callable | None:
    """The compiled graph of digest ``key`` from Inductor's FX graph cache, made ready as
    ``compile_fx_inner`` makes a cache hit ready; None where there is none (or it is gone)."""
    from torch._inductor.codecache import FxGraphCache
    from torch._inductor.output_code import CompiledFxGraphConstants
    from torch._inductor.utils import BoxedBool
    from torch._inductor.virtualized import V

    try:
        with open(_store_path(key)) as f:
            fx_key = f.read().strip()
    except OSError:
        return None
    fake = _fake_mode(vals)
    try:
        with torch._guards.tracing(torch._guards.TracingContext(fake)), V.set_fake_mode(fake):
            compiled, _ = FxGraphCache.load_with_key(fx_key, [], vals, True, None, is_backward=False,
                                                     constants=CompiledFxGraphConstants())
            if compiled is None:
                return None
            compiled._fx_graph_cache_key = fx_key
            compiled.autopar_loaded = True  # for the progress line
            compiled.post_compile(vals, CompiledFxGraphConstants(),
                                  {"cudagraphs": BoxedBool(torch._inductor.config.triton.cudagraphs),
                                   "is_backward": False, "is_inference": True, "boxed_forward_device_index": None,
                                   "static_input_idxs": ()})
    except Exception as e:  # noqa: BLE001 - the entry does not load here: compile the graph
        log.debug("backend: the stored compiled graph %s did not load (%s: %s)", key[:12], type(e).__name__, e)
        return None
    log.debug("backend: loaded the compiled graph %s (FX graph cache entry %s)", key[:12], fx_key)
    return compiled


def _inductor(gm: torch.fx.GraphModule, vals: list) -> Callable:
    """Inductor's compilation of a graph that is already what AOTAutograd would hand it: ATen
    operations, functional (the distribute pass made it so; the accumulate pass's additions into
    the step's gradient buffers are the one in-place operation, which Inductor runs in place: the
    buffers are inputs), forward and backward apart
    (the partition pass), the parameters among the inputs. So it goes straight to Inductor's
    graph compiler (what ``torch.compile`` calls for an inference graph: its joint- and post-grad
    passes, lowering, code generation, its FX graph cache, from which ranks with the same graph
    load what the first compiled) after one trace that applies Inductor's decompositions, instead
    of through ``standalone_compile``, whose AOTAutograd front end traces the whole step twice
    more (HF Llama, 32 layers: Inductor's part of the compile 40 -> 30 s). The trace runs in a tracing context,
    where each layer subgraph is traced once for all its calls. The result is boxed: Inductor's
    code takes the list of inputs and empties it."""
    import inspect

    import torch.fx.traceback as fx_traceback
    from torch._inductor import compile_fx as cfx
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V
    from torch.fx.experimental.proxy_tensor import make_fx

    fake = _fake_mode(vals)
    ctx = torch._guards.TracingContext(fake)

    def run(*args):
        return torch.fx.Interpreter(gm).run(*args)

    with fake, torch._guards.tracing(ctx), fx_traceback.preserve_node_meta():
        gm = make_fx(run, decomposition_table=select_decomp_table(), tracing_mode="fake")(*vals)
    n_out = len(next(iter(gm.graph.find_nodes(op="output"))).args[0])
    # (its argument is the graph in torch 2.13, Inductor's config module before)
    takes_gm = next(iter(inspect.signature(cfx.create_compiler_config_extra).parameters)) == "gm"
    extra = cfx.create_compiler_config_extra(gm if takes_gm else torch._inductor.config)
    # Inductor's passes read the fake mode from its virtualized handler (``V.fake_mode``), as
    # ``torch.compile`` sets it: a graph drawing random numbers (an ``exponential_``, a ``rand``)
    # has its seeds made there.
    with torch._guards.tracing(ctx), V.set_fake_mode(fake):
        return cfx.compile_fx_forward(gm, vals, num_orig_model_outputs=n_out, num_example_inputs=len(vals),
                                      compiler_config_extra=extra, is_inference=True)


def _static_stride(v) -> tuple | None:
    """A traced input's strides where they are numbers (not a tensor, or sized by the data: None)."""
    if not isinstance(v, torch.Tensor):
        return None
    st = tuple(v.stride())
    return st if all(isinstance(x, int) for x in st) else None


_WHAT = {"fw": "forward", "bw": "backward", "bw_input": "backward (input gradients)",
         "bw_weight": "backward (weight gradients)"}


class _Progress:
    """``compile_graph`` that tells the terminal which graph Inductor compiles and how long it
    took, or loaded from the cache (rank 0 only; ``AUTOPAR_QUIET=1`` silences it)."""

    def __init__(self, inductor: bool, show: bool, total: int):
        self.inductor, self.total, self.done = inductor, total, 0
        self.fallbacks: list[str] = []
        self.show = inductor and show and not os.environ.get("AUTOPAR_QUIET")

    def __call__(self, graphs: StepGraphs, name: str) -> Callable:
        what = _WHAT[name]
        self.done += 1
        gm = graphs.to_compile(name)
        if self.show:
            ops = sum(n.op == "call_function" for n in gm.graph.nodes)
            print(f"autopar: Inductor compiles the {what} graph ({self.done}/{self.total}, {ops} ops)...",
                  file=sys.stderr, flush=True)
        t = time.perf_counter()
        try:
            out = compile_graph(gm, self.inductor)
        except Exception as e:  # noqa: BLE001 - Inductor's own failure on the subgraph calls
            flat = getattr(graphs, name)
            if gm is flat:
                raise
            # The same computation, every layer inline: slower to compile, never a different model.
            log.warning("backend: Inductor failed on the %s graph's layer calls (%s: %s); compiling it "
                        "with every layer inline", what, type(e).__name__, str(e).splitlines()[0][:200])
            self.fallbacks.append(f"{what}: compiled with every layer inline, Inductor failed on its layer "
                                  f"calls ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            for n in flat.graph.nodes:  # no call boundaries left for memory.py to price
                n.meta.pop("segment", None)
                n.meta.pop("segment_out", None)
            out = compile_graph(flat, self.inductor)
        if self.show:
            how = "loaded (compiled before)" if getattr(out, "autopar_loaded", False) else "compiled"
            print(f"autopar: {what} graph {how} in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        return out


def _graph_key(graphs: StepGraphs) -> str:
    """A digest of the code of every graph Inductor will compile (layer subgraphs included):
    ranks with equal keys compile equal graphs."""
    import hashlib

    h = hashlib.sha256()
    for name in ("fw", "bw", "bw_input", "bw_weight"):
        if getattr(graphs, name) is not None:
            for m in graphs.to_compile(name).modules():
                if isinstance(m, torch.fx.GraphModule):
                    h.update(m.code.encode())
    return h.hexdigest()


def _first_graphs(graphs: StepGraphs, names: list[str], inductor: bool) -> tuple[list[str], bool]:
    """(the graphs this rank compiles before the others load them, whether there is such an
    order). With several processes, on each machine the ranks with the same graphs (the same
    set of texts: ``passes/groups.py`` makes SPMD ranks' graphs equal) share them out, graph ``i``
    to the set's rank ``i`` (mod its size), compile their shares side by side, and then load the
    others' from Inductor's cache (a machine's ranks share its cache directory): the forward and
    the backward compile at once. A rank whose graphs are its own compiles them all; so does each
    machine."""
    import socket

    import torch.distributed as dist

    if not (inductor and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"):
        return names, False
    keys = [None] * dist.get_world_size()
    dist.all_gather_object(keys, (_graph_key(graphs), socket.gethostname()))
    rank = dist.get_rank()
    same = [r for r, k in enumerate(keys) if k == keys[rank]]
    return [n for i, n in enumerate(names) if same[i % len(same)] == rank], True


def compile_step(graphs: StepGraphs, inductor: bool) -> CompiledStep:
    """Compile each graph of the step. With several processes, the ranks with the same graphs
    compile each once between them (``_first_graphs``) and load the rest from Inductor's cache."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    split = graphs.bw_weight is not None
    names = ["fw", "bw_input", "bw_weight"] if split else ["fw", "bw"]  # split: the backward runs as its parts only
    first, ordered = _first_graphs(graphs, names, inductor)
    compiled = _Progress(inductor, not dist.is_initialized() or dist.get_rank() == 0, len(names))
    done = {}
    try:
        for n in first:
            done[n] = compiled(graphs, n)
    finally:
        if ordered:
            dist.barrier()  # also after a failure: the others then meet it compiling that graph
    for n in names:
        if n not in done:
            done[n] = compiled(graphs, n)
    step = CompiledStep(done["fw"], done.get("bw"), graphs.fw, graphs.bw, graphs.n_outputs)
    if split:
        step.n_input_grads = graphs.n_input_grads
        step.bw_input, step.bw_weight = done["bw_input"], done["bw_weight"]
        step.bw_weight_strides = [_static_stride(v) for v in _example(graphs.bw_weight)]
    step.inductor = inductor
    step.fallbacks = compiled.fallbacks
    step.compiled_here = first
    step.bw_strides = [_static_stride(v) for v in _example(graphs.bw)]
    step.compile_s = time.perf_counter() - t0
    log.info("backend: %s in %.1fs", "Inductor" if inductor else "eager", step.compile_s)
    return step
