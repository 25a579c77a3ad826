"""What the executed step holds at its peak: liveness over the graphs that run.

The forward and backward graphs (``backend.CompiledStep``, after every pass, in the order they
run: ``passes/overlap.py`` placed the collectives and Inductor keeps that order) are walked node
by node on their fake-tensor metadata:

- a node's output is a buffer from the node that makes it to its last reader; a view, a
  collective's wait and an in-place op's result share their base's buffer (fake tensors share
  the storage), so a buffer lives until the last reader of any alias;
- a collective's inputs stay alive until its wait (the transport reads them until then);
- the forward's outputs (the loss and what it saves for the backward) stay alive into the
  backward, which frees each at its last use there (the runtime passes them to the boxed
  backward graph, which owns them); the backward's outputs (the gradient shards) stay alive
  until the step ends;
- what the rank holds before the step (parameter shards, buffers, the batch) is not counted:
  the result is the step's peak above that, what ``allocator_peaks`` measures (``bench/memory.py``).

With several microbatches the gradients of the earlier ones are held through the later ones.

Inductor (the default path) generates element-wise ops, reductions, dtype casts, softmax and the
loss's own ops inside fused kernels: a value such an op makes and only such ops read (through any
view), or a concatenation or scatter that computes it inline while writing its own output, is a
register inside a kernel, never a buffer; not across a layer segment's call
(``passes/regions.py``: each distinct layer compiled once), whose inputs and outputs are
buffers. ``fused=True`` walks that program (the one that runs by default); ``fused=False`` the
eager graphs of ``compile=False``, which allocate every node's output. The difference is largest
at the loss, where the fp32 logits, their log-softmax and its gradient are vocabulary-wide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autopar.fxops import hinted, is_view, op_name, size_hints

_c10d = torch.ops._c10d_functional
_WAIT = _c10d.wait_tensor.default
_GATHERS = {_c10d.all_gather_into_tensor.default, _c10d.all_gather_into_tensor_out.default,
            _c10d.all_gather_into_tensor_coalesced.default}
_COLLECTIVES = _GATHERS | {_c10d.reduce_scatter_tensor.default, _c10d.reduce_scatter_tensor_coalesced.default,
                           _c10d.all_reduce.default, _c10d.all_to_all_single.default}


@dataclass
class GraphLiveness:
    peak_bytes: int  # the most this graph's buffers (and what it started with) hold at once
    peak_node: str
    peak_kinds: dict  # at the peak: bytes by kind (gathered parameters, held, other)
    out_bytes: int  # what its outputs hold when it ends
    curve: list = field(default_factory=list)  # (node name, live bytes) after each node
    peak_buffers: list = field(default_factory=list)  # at the peak: (bytes, node that made it), largest first
    out_kinds: dict = field(default_factory=dict)  # what its outputs hold, by kind


@dataclass
class Liveness:
    """One rank's step: the peak above what the rank held before it, and where it is."""

    peak_bytes: int
    peak_at: str  # "forward:<node>" or "backward:<node>"
    saved_bytes: int  # what the forward keeps for the backward
    grad_bytes: int  # the gradient shards the backward returns
    breakdown: dict  # bytes at the peak by kind
    forward: GraphLiveness | None = None
    backward: GraphLiveness | None = None

    def summary(self) -> str:
        parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in self.breakdown.items() if v)
        return f"{self.peak_bytes / 2**20:.1f} MiB at {self.peak_at} ({parts})"


def _storage(v):
    if not isinstance(v, torch.Tensor):
        return None
    try:
        return v.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - a tensor without storage (sparse, nested)
        return None


def _nbytes(v, hints: dict) -> int:
    """Bytes of ``v``'s storage (data-dependent sizes at their typical values: ``fxops.size_hints``)."""
    try:
        nbytes = v.untyped_storage().nbytes()
    except Exception:  # noqa: BLE001
        nbytes = v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0
    return hinted(nbytes, hints)


def _vals(n: torch.fx.Node) -> list:
    v = n.meta.get("val")
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    return [v] if isinstance(v, torch.Tensor) else []


_COPY_OPS = {"clone", "_unsafe_view", "view", "reshape", "contiguous", "split_with_sizes", "split", "getitem",
             "t", "permute", "transpose", "expand", "slice", "alias", "_to_copy", "convert_element_type",
             "copy_out"}  # copy_out: passes/overlap.py's copy of each parameter out of a gathered bucket


# Ops Inductor emits inside a generated kernel besides those torch tags element-wise or reductions:
# dtype casts, constants, indexing reads, softmax and the loss, which it decomposes into both.
_IN_KERNEL = {"_to_copy", "where", "full", "full_like", "zeros", "zeros_like", "ones", "ones_like", "scalar_tensor",
              "iota", "arange", "embedding", "gather", "index", "index_select", "_softmax", "_log_softmax",
              "_softmax_backward_data", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward",
              "native_layer_norm", "native_layer_norm_backward", "native_dropout", "native_dropout_backward"}
# Ops whose generated kernel writes a new buffer and computes its element-wise inputs inline:
# a concatenation (each input written into its slice of the output: the gradients' casts into
# a flat reduce bucket) and the functional scatters (the input cloned inside the kernel that
# writes the output: a scatter into ``zeros_like``).
_WRITES_NEW = {torch.ops.aten.cat.default, torch.ops.aten.index_put.default, torch.ops.aten.scatter.src,
               torch.ops.aten.scatter.value, torch.ops.aten.scatter_add.default}
_KERNEL_TAGS = tuple(t for t in (getattr(torch.Tag, "pointwise", None), getattr(torch.Tag, "reduction", None)) if t)


def in_kernel(n: torch.fx.Node) -> bool:
    """Whether Inductor computes ``n`` inside a generated (fusible) kernel."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    return op_name(n.target) in _IN_KERNEL or any(t in n.target.tags for t in _KERNEL_TAGS)


def gradient_in_kernel(n: torch.fx.Node) -> bool:
    """Whether the backward of forward op ``n`` runs inside Inductor's kernels, so that its
    gradients are values in registers rather than buffers: element-wise ops, reductions, casts,
    softmax and the loss; not an indexing read (an embedding), whose backward scatters into a new
    buffer."""
    return in_kernel(n) and op_name(n.target) not in ("embedding", "gather", "index", "index_select")


def _copies_gathered(n: torch.fx.Node, refs: dict, kind: dict) -> bool:
    """A parameter taken out of a gathered buffer (a copy or view of it): gathered too."""
    ins = [k for a in n.all_input_nodes for k in refs.get(a, [])]
    return bool(ins) and op_name(n.target) in _COPY_OPS and all(kind.get(k) == "gathered parameters" for k in ins)


def graph_liveness(gm: torch.fx.GraphModule, *, held: int = 0, count_inputs: bool = False,
                   preheld: frozenset = frozenset(), count_outputs: bool = True, fused: bool = True) -> GraphLiveness:
    """Walk ``gm`` in order. ``held``: bytes alive throughout (carried from an earlier graph);
    ``count_inputs``: whether the placeholders' buffers are this walk's to count (alive to the end);
    ``preheld``: names of placeholders the rank holds before the step (parameter shards, buffers,
    the batch, which the forward hands on to the backward), never counted; ``count_outputs``:
    whether the buffers this graph makes and returns are counted (False: the backward's gradient
    shards, which the cost model prices among the states the rank holds); ``fused``: whether
    values made and read only inside Inductor's kernels are left out (see the module docstring)."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    hints = size_hints(gm)
    (out_node,) = [n for n in nodes if n.op == "output"]
    outs = {a for a in out_node.all_input_nodes}
    # buffer key -> (bytes, last position it is read, kind); node -> buffer keys it refers to
    size: dict = {}
    last: dict = {}
    kind: dict = {}
    refs: dict = {}
    canon: dict = {}  # a storage that is another's under a second fake tensor -> that one
    end = len(nodes)
    for n in nodes:
        keys = []
        if (n.target is _WAIT or is_view(n.target)) and n.args and isinstance(n.args[0], torch.fx.Node):
            # The wait's result is the collective's buffer; a view's is its base's (also where a
            # pass made the view's fake value apart from its base's storage).
            refs[n] = list(refs.get(n.args[0], []))
            for v, k in zip(_vals(n), refs[n]):
                if _storage(v) is not None:
                    canon[_storage(v)] = k  # and so are views of the wait's result
            continue
        for v in _vals(n):
            k = _storage(v)
            if k is None:
                continue
            k = canon.get(k, k)
            keys.append(k)
            if k not in size:
                size[k] = _nbytes(v, hints)
                kind[k] = ("preheld" if n.name in preheld else "input") if n.op == "placeholder" else "other"
                last[k] = order[n]
        refs[n] = keys
        if n.op == "call_function" and (n.target in _GATHERS or _copies_gathered(n, refs, kind)):
            for k in keys:
                kind[k] = "gathered parameters"
    for n in nodes:
        for a in n.all_input_nodes:
            for k in refs.get(a, []):
                last[k] = max(last[k], order[n])
        if n.op == "call_function" and n.target in _COLLECTIVES:
            # The transport reads the inputs until the (last) wait, of the result or of each of
            # a coalesced collective's results.
            waits = [w for u in n.users for w in ([u] if u.target is _WAIT else u.users) if w.target is _WAIT]
            if waits:
                for a in n.all_input_nodes:
                    for k in refs.get(a, []):
                        last[k] = max(last[k], max(order[w] for w in waits))
    for a in outs:
        for k in refs.get(a, []):
            last[k] = end
    # A layer segment run as a call (passes/regions.py) returns its outputs together when it ends.
    seg_end = {n.meta["segment"]: order[n] for n in nodes if "segment" in n.meta}
    for n in nodes:
        if n.meta.get("segment_out"):
            for k in refs[n]:
                last[k] = max(last[k], seg_end[n.meta["segment"]])
    first = {}
    for n in nodes:
        for k in refs[n]:
            first.setdefault(k, order[n])
    returned = set() if count_outputs else {k for a in outs for k in refs.get(a, []) if kind[k] == "other"}
    maker: dict = {}  # buffer key -> the node that makes it
    for n in nodes:
        for k in refs[n]:
            maker.setdefault(k, n)
    if fused:
        local = _kernel_locals(nodes, refs, kind, outs, maker)
        # A kernel-local value is computed where it is read: what it is computed from is read
        # there too (the kernel that writes a loss's gradient reads the saved log-softmax).
        for n in reversed(nodes):
            mine = [k for k in refs[n] if k in local]
            if mine:
                for a in n.all_input_nodes:
                    for k in refs.get(a, []):
                        last[k] = max(last[k], *(last[m] for m in mine))
        returned |= local
    starts: dict = {}
    frees: dict = {}
    for k in size:
        if kind[k] == "preheld" or (kind[k] == "input" and not count_inputs) or k in returned:
            continue
        s = 0 if kind[k] == "input" else first[k]
        starts.setdefault(s, []).append(k)
        frees.setdefault(last[k] if last[k] < end else end + 1, []).append(k)
    live, peak, peak_i, curve = held, held, -1, []
    live_set: set = set()
    peak_set: set = set()
    for i, n in enumerate(nodes):
        for k in starts.get(i, []):
            live += size[k]
            live_set.add(k)
        if live > peak:
            peak, peak_i, peak_set = live, i, set(live_set)
        curve.append((n.name, live))
        for k in frees.get(i, []):
            live -= size[k]
            live_set.discard(k)
    kinds: dict = {"held": held}
    for k in peak_set:
        kinds[kind[k]] = kinds.get(kind[k], 0) + size[k]
    buffers = sorted(((size[k], maker[k].name) for k in peak_set), reverse=True)
    out_keys = {k for a in outs for k in refs.get(a, [])
                if kind[k] != "preheld" and not (kind[k] == "input" and not count_inputs) and k not in returned}
    out_kinds: dict = {}
    for k in out_keys:
        out_kinds[kind[k]] = out_kinds.get(kind[k], 0) + size[k]
    return GraphLiveness(peak, nodes[peak_i].name if peak_i >= 0 else "", kinds,
                         sum(size[k] for k in out_keys), curve, buffers, out_kinds)


def _kernel_locals(nodes: list, refs: dict, kind: dict, outs: set, maker: dict) -> set:
    """The buffers a fused program never allocates: made by an in-kernel op, read (through any
    view of them) only by in-kernel ops, and not returned."""
    readers: dict = {}
    for n in nodes:
        mine = set(refs.get(n, []))
        for a in n.all_input_nodes:
            for k in refs.get(a, []):
                if k not in mine:  # a view of k is k itself; its readers read k
                    readers.setdefault(k, []).append(n)
    kept = {k for a in outs for k in refs.get(a, [])}
    return {k for k, m in maker.items() if kind.get(k) == "other" and k not in kept and in_kernel(m)
            and not m.meta.get("segment_out")
            and all((in_kernel(r) or r.target in _WRITES_NEW) and r.meta.get("segment") == m.meta.get("segment")
                    for r in readers.get(k, []))}


def step_liveness(compiled, microbatches: int = 1, gradients: bool = True, fused: bool | None = None,
                  held: dict | None = None) -> Liveness:
    """The step's peak from its compiled graphs (``backend.CompiledStep``): the forward, then the
    backward, which starts with what the forward saved and frees each saved value at its last
    use (the runtime hands the saved values to the boxed graph, which owns them).
    ``gradients=False``: without the gradient shards the backward returns (and earlier
    microbatches' held ones), the part of the step the cost model prices apart from its states.
    ``fused``: walk the program Inductor generates (default: whether it compiled these graphs).
    ``held``: bytes alive through the whole step outside the graphs, by kind (``zero.StepWeights.held``:
    the parameters gathered once per step and their whole gradients)."""
    fused = compiled.inductor if fused is None else fused
    fw = graph_liveness(compiled.fw_graph, fused=fused)
    # The forward's inputs it saves for the backward (parameter shards, the batch) are the rank's
    # before the step: the backward receives them under the same placeholder names, and views
    # of them (a weight's transpose) under their own, holding no memory of their own either.
    fw_g = compiled.fw_graph.graph
    phs = set(fw_g.find_nodes(op="placeholder"))

    def base(n):
        while n.op == "call_function" and is_view(n.target) and isinstance(n.args[0], torch.fx.Node):
            n = n.args[0]
        return n

    saved = next(iter(fw_g.find_nodes(op="output"))).args[0]
    inputs = frozenset(n.name for n in phs) | {
        o.name for o in saved if isinstance(o, torch.fx.Node) and o not in phs and base(o) in phs}
    from autopar.passes.accumulate import ACCUMULATOR

    # The gradient buffers of a step gathered once (passes/accumulate.py) are in ``held``.
    inputs |= {n.name for n in compiled.bw_graph.graph.find_nodes(op="placeholder") if n.meta.get(ACCUMULATOR)}
    bw = graph_liveness(compiled.bw_graph, count_inputs=True, preheld=inputs, count_outputs=gradients, fused=fused)
    grads = bw.out_bytes
    carried = grads if microbatches > 1 and gradients else 0  # earlier microbatches' gradients, held
    held = {k: v for k, v in (held or {}).items() if v}
    outside = sum(held.values())
    f_peak, b_peak = fw.peak_bytes + carried + outside, bw.peak_bytes + carried + outside
    g = fw if f_peak >= b_peak else bw
    kinds = {("saved for backward" if k == "input" else k): v for k, v in g.peak_kinds.items() if k != "held"}
    if carried:
        kinds["accumulated gradients"] = carried
    kinds.update(held)
    return Liveness(max(f_peak, b_peak), f"{'forward' if g is fw else 'backward'}:{g.peak_node}", fw.out_bytes,
                    grads, {k: v for k, v in kinds.items() if v}, fw, bw)


def step_peak(pm, gradients: bool = True) -> Liveness:
    """The liveness peak of a ``ParallelModule``'s training step (non-pipelined plans);
    ``gradients``: as in ``step_liveness``."""
    from autopar.errors import AutoparError

    runner = getattr(pm, "_step_runner", None)
    if runner is None:
        raise AutoparError("the liveness peak is computed for plans without pipeline stages (pp=1)")
    p = pm.plan
    return step_liveness(runner.compiled, max(1, p.global_batch // (p.dp * p.mb)), gradients, held=once_held(pm))


def once_held(pm) -> dict:
    """What a step gathered once per step holds outside its graphs (``zero.StepWeights.held``);
    empty for other plans."""
    from autopar import zero

    if pm._once is None:
        return {}
    return zero.StepWeights(pm._named(*pm._runners()), pm._once).held()


def allocator_peaks(fn) -> tuple[float, float]:
    """How much memory one step allocates at its peak beyond what the process holds before it
    (parameters and optimizer state, no gradients): gradients, saved activations, workspaces and
    communication buffers, Inductor's generated code's buffers included. The allocator's peak: on
    a GPU ``max_memory_allocated``; on CPU the running sum of the profiler's allocation events
    (every tensor the step allocates and frees, through PyTorch's CPU allocator), which is what a
    GPU's allocator would count (the process's resident set adds glibc arenas, gloo's own
    buffers and thread stacks: 1.5-2x more on these runs, and not what the planner prices).

    Returns that peak and the same peak without what the process group's backend allocates
    inside a collective (gloo's staging copies, under ``gloo:*`` and ``c10d::*`` ops): NCCL
    allocates no such tensors from the caching allocator, and how long gloo holds them depends on its threads' timing (a
    prefetched gather's staging buffer, alive or not at the peak, moves it by a layer's weights).
    The collectives' outputs (``_c10d_functional``, FSDP2's own buffers) are counted either way."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        return peak, peak
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []  # (time, pointer, bytes (negative: freed), allocated inside the backend)

    def walk(e, inside: bool) -> None:
        inside = inside or e.name.startswith(("gloo:", "c10d::"))
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size, inside))
        for c in e.children:
            walk(c, inside)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, False)
    staged: set = set()
    live = peak = own = own_peak = 0
    for _, ptr, nbytes, inside in sorted(events, key=lambda x: x[0]):
        live += nbytes
        peak = max(peak, live)
        if nbytes > 0 and inside:
            staged.add(ptr)
        elif ptr in staged:  # a staging buffer freed
            staged.discard(ptr)
        else:
            own += nbytes
            own_peak = max(own_peak, own)
    return peak / 2**20, own_peak / 2**20
