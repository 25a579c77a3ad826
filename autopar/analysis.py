"""Analysis: turn captured graphs into a parallelism-independent model profile.

For each distinct block graph (see ``capture``):

- **Linears and their roles** (column, row, replicated) come from ``roles.find_roles`` run on
  the block's graph with its hidden-state inputs as the residual stream: the finder the executor
  runs on the step graph, so what is priced here is what it shards. Megatron's pairs are found on
  any model, with no names involved.
- **Heads.** A column output reshaped to ``(..., n, d)`` with ``n*d == out_features`` has ``n``
  heads; tensor parallelism of degree ``t`` needs ``t | n`` for every such ``n`` (query heads, KV
  heads) and ``t | out_features`` for the rest.
- **Regions.** The nodes from a row's columns to it, and the paired linears, are in the *TP region*:
  their FLOPs, bytes and saved activations divide by ``t``. The rest (norms, residual adds) is the
  *sequence region*: replicated under plain TP, divided by ``t`` with sequence parallelism.
- **Saved activations per AC mode** (bytes for one sequence of length ``s``):
  ``none`` is every storage autograd keeps (parameters excluded); ``full`` keeps only the block
  input; ``selective`` recomputes the attention core when it is quadratic in ``s`` (Korthikanti et
  al. 2022: ``34sbh`` instead of ``34sbh + 5as^2b`` for a GPT layer) and, when attention is a
  fused kernel (nothing quadratic to drop), keeps only matmul and attention outputs (op-level
  selective AC as in torchtitan) and recomputes the element-wise ops.

Outside the blocks (embedding, final norm, head, loss) ops are recorded by the capture's dispatch
mode; under TP the embedding's lookup writes its whole output on every rank, while after the head
every vocabulary-sized op (the logits, their cast, the cross-entropy) and what it saves divide by
the degree: the executor keeps the logits split and runs the loss on the shards.
"""

from __future__ import annotations

import functools
import hashlib
import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import sympy

from autopar.cut import BlockTrace, ModelTrace
from autopar.fxops import VIEW_OPS, node_flops, op_name, out_of_place, out_of_place_op, tensor_bytes
from autopar.grouped_mm import GROUPED_MM
from autopar.roles import find_roles

MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "grouped_mm", "grouped_mm_wgrad"}
ATTENTION_OPS = {
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "scaled_dot_product_attention", "_flash_attention_forward", "_efficient_attention_forward",
    "_scaled_dot_product_attention_math",
}
KIND_MATMUL, KIND_ATTN, KIND_OTHER = 0, 1, 2


@dataclass
class Linear:
    node: str
    weight: str  # parameter name relative to the block
    in_features: int
    out_features: int
    role: str = "replicated"  # column | row | replicated
    heads: int | None = None  # heads in the output (column) when reshaped to (n, d)
    partners: tuple[str, ...] = ()  # for a row linear: its column linears (weight names)
    transposed_storage: bool = True  # weight stored (out, in) as nn.Linear; False for Conv1D
    parts: int = 1  # a fused column's equal parts (q, k, v), split in interleaved parts
    group: tuple[str, ...] = ()  # routed experts' grouped linear: every expert's weight (``weight`` the first)
    # A row linear's partial sums are reduced at node ``reduce_at`` (``roles.Roles.reduce_at``), a
    # value of ``reduce_rows`` x tokens x its output features (routed experts reduced before their
    # combine: top_k; after it, like a dense row: 1).
    reduce_at: str = ""
    reduce_rows: float = 1.0
    in_rows: float = 1.0  # a grouped linear's input rows per token of the block (routed experts: top_k)
    stacked: bool = False  # the experts' weights in one 3-D parameter (``group`` names it once per expert)


@dataclass
class NodeCosts:
    """Per-node forward costs for one sequence (batch 1), as arrays."""

    names: list[str]
    flops: np.ndarray  # FLOPs
    act_bytes: np.ndarray  # activation bytes read + written (scale with tokens)
    weight_bytes: np.ndarray  # parameter bytes read (do not scale with tokens)
    kind: np.ndarray  # KIND_*
    tp: np.ndarray  # bool: in the TP region
    causal: np.ndarray  # bool: attention kernel with a causal mask
    recompute_selective: np.ndarray  # bool: recomputed under selective AC

    def experts(self) -> np.ndarray:
        """Where the nodes are routed experts' matmuls (``grouped_mm``: the experts' weights, each
        on its own rows)."""
        return np.array([n.startswith("grouped_mm") for n in self.names], dtype=bool)

    def subset(self, mask: np.ndarray) -> NodeCosts:
        """The nodes where ``mask`` is true."""
        idx = np.flatnonzero(mask)
        return NodeCosts([self.names[i] for i in idx], *(getattr(self, f)[idx] for f in (
            "flops", "act_bytes", "weight_bytes", "kind", "tp", "causal", "recompute_selective")))


@dataclass
class BlockProfile:
    cls_name: str
    fqns: list[str]
    linears: list[Linear]
    costs: NodeCosts
    params_tp: int  # parameter elements sharded by TP
    params_rep: int  # parameter elements replicated under TP (norm weights, row biases)
    param_shapes: dict[str, tuple[int, ...]]
    # Saved activation bytes for one sequence, per AC mode: (tp-region bytes, sequence-region bytes)
    saved: dict[str, tuple[float, float]]
    hidden_bytes: float  # the block's input activation for one sequence
    tp_divisors: dict[str, int]  # quantity -> count that a TP degree must divide
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    quadratic_attention: bool
    # One entry per column/row pair group: (module whose input is gathered once for all its
    # column linears, or None when each column linear gathers its own input; columns; row).
    tp_groups: list = field(default_factory=list)
    # The features of each input TP gathers per layer (``roles.Roles.gathered``: the normed hidden
    # states, or a compressed latent), () where not recorded (then one hidden-wide input per gather).
    gather_features: tuple = ()

    @functools.cached_property
    def gathers(self) -> int:
        """Input gathers per layer under TP: one per group with a common module, else per column."""
        return sum(1 if g[0] is not None else len(g[1]) for g in self.tp_groups)

    @functools.cached_property
    def rows(self) -> float:
        """Partial sums reduced per layer under TP, in tokens x hidden messages: one per reduce
        point of the groups' row linears (rows whose sums meet before the residual, as a shared
        and the routed experts', reduce once)."""
        grouped = {g[2] for g in self.tp_groups}
        ends = {l.reduce_at or l.node: l.reduce_rows for l in self.linears
                if l.role == "row" and l.weight.rsplit(".", 1)[0] in grouped}
        return sum(ends.values())

    @functools.cached_property
    def experts(self) -> tuple[int, float] | None:
        """Routed experts: (experts, rows per token: top_k) of the block's grouped linears, or None."""
        lin = next((l for l in self.linears if l.group), None)
        return (len(lin.group), lin.in_rows) if lin is not None else None

    @functools.cached_property
    def experts_biased(self) -> bool:
        """Whether the routed experts' linears have biases (under EP each row's expert index travels with it):
        ``bias`` beside each expert's ``weight``, or a 3-D weight's ``<name>_bias`` (gpt-oss)."""
        return any(b in self.param_shapes for l in self.linears for w in l.group
                   for b in (w.removesuffix("weight") + "bias", w + "_bias"))

    @functools.cached_property
    def experts_stacked(self) -> bool:
        """Whether the routed experts' weights are 3-D parameters (every expert's in one)."""
        return any(l.stacked for l in self.linears)

    @functools.cached_property
    def expert_params(self) -> int:
        """Elements of the routed experts' linear weights (every expert's)."""
        return sum(math.prod(self.param_shapes[w]) for l in self.linears for w in dict.fromkeys(l.group))

    @functools.cached_property
    def tp_linears(self) -> int:
        """Linears sharded by TP (column and row)."""
        return sum(l.role in ("column", "row") for l in self.linears)

    @property
    def sequence_modules(self) -> list[str]:
        """Modules with 1-D parameters that are not linears (norms): sequence-parallel under SP."""
        linear_mods = {w.rsplit(".", 1)[0] for l in self.linears for w in (l.group or (l.weight,))}
        return sorted({n.rsplit(".", 1)[0] for n, shp in self.param_shapes.items() if len(shp) == 1} - linear_mods)

    @property
    def count(self) -> int:
        return len(self.fqns)

    @property
    def params(self) -> int:
        return self.params_tp + self.params_rep

    def fwd_flops(self) -> float:
        return float(self.costs.flops.sum())
    # What the min-cut partitioner saves (autopar's executor, and torch.compile's AOTAutograd):
    # ac -> (TP-split bytes, replicated bytes, whole bytes) per sequence, as ``saved`` plus the
    # saved row-linear outputs, whole under TP and SP (before their reduction); {} when not traced.
    saved_partitioned: dict = field(default_factory=dict)


@dataclass
class OuterProfile:
    """Embedding (pre) or head + loss (post): node costs and saved bytes, vocab-parallel split."""

    costs: NodeCosts
    params_vocab: int
    params_rep: int
    saved_vocab: float
    saved_rep: float
    # Per op, per sequence: (vocabulary-sized, other) bytes of its outputs' and its inputs'
    # gradients, which its backward holds at once beside the saved tensors. Distinct pairs only.
    # ``grad_ws``: the ops whose gradients Inductor's program makes as buffers (the head's
    # matmul: its logits' gradient in the compute dtype, which the loss's fused backward writes);
    # ``grad_ws_eager``: every op, as the eager graphs run (the loss's softmax: two logits-sized
    # fp32 tensors).
    # ``grad_out``: those ops' output gradients alone (the logits' gradient, which the loss's fused
    # backward writes while the loss's saved tensors are still alive).
    grad_ws: list[tuple[float, float]] = field(default_factory=list)
    grad_ws_eager: list[tuple[float, float]] = field(default_factory=list)
    grad_out: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class ModelProfile:
    name: str
    fingerprint: str
    seq_len: int
    dtype_bytes: int
    hidden: int
    vocab: int
    blocks: list[BlockProfile]
    pre: OuterProfile
    post: OuterProfile
    block_container: str
    n_params: int
    tied: list[tuple[str, str]] = field(default_factory=list)
    module_types: dict[str, str] = field(default_factory=dict)
    outside_params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    outside_segments: dict[str, str] = field(default_factory=dict)  # module -> "pre" | "post"
    # Every repeated layer in the order the model runs them (an encoder's before a decoder's,
    # which sorting their names would not give); empty in profiles made before it was recorded.
    layers: tuple[str, ...] = ()
    _layer_seq: list | None = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def n_layers(self) -> int:
        return sum(b.count for b in self.blocks)

    @property
    def tied_outside(self) -> tuple[int, int]:
        """Elements of the weights tied across the model's two ends (a head sharing the input
        embedding): (vocabulary-sized, other). Counted once in ``pre``; under PP the last stage
        holds a copy."""
        vocab = rep = 0
        for a, _ in self.tied:
            shape = self.outside_params.get(a)
            if shape is None:  # weights shared inside the repeated blocks stay on their stage
                continue
            if self.vocab in shape:
                vocab += math.prod(shape)
            else:
                rep += math.prod(shape)
        return vocab, rep

    def layer_sequence(self) -> list[BlockProfile]:
        """Block profiles in model order (one entry per layer)."""
        if self._layer_seq is None:
            kind = {f: b for b in self.blocks for f in b.fqns}
            self._layer_seq = [kind[f] for f in self.layer_fqns()]
        return self._layer_seq

    def layer_fqns(self) -> list[str]:
        """The repeated layers' module paths in model order."""
        return list(self.layers) or sorted((f for b in self.blocks for f in b.fqns), key=fqn_index)

    def tp_divisors(self) -> dict[str, int]:
        """What a TP degree must divide, of every distinct block (named by its first layer
        where there are several: Swin's stages have the same weights with other head counts)."""
        out: dict[str, int] = {}
        for b in self.blocks:
            for k, v in b.tp_divisors.items():
                out[f"{b.fqns[0]}.{k}" if len(self.blocks) > 1 and b.fqns else k] = v
        return out

    def max_tp_check(self, tp: int) -> list[str]:
        """Reasons why ``tp`` is not a valid TP degree (empty when it is)."""
        return [f"{k} ({v})" for k, v in self.tp_divisors().items() if v % tp]

    def model_flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward, no recompute): 3x the forward, with full
        (non-causal) attention as in the usual MFU convention."""
        fwd = sum(b.fwd_flops() * b.count for b in self.blocks)
        fwd += self.pre.costs.flops.sum() + self.post.costs.flops.sum()
        return 3.0 * fwd / self.seq_len

    def flops_expr(self) -> sympy.Expr:
        """Forward FLOPs of the model as a polynomial in batch ``b`` (the sequence is fixed)."""
        import sympy

        b = sympy.Symbol("b", positive=True)
        fwd = sum(b_.fwd_flops() * b_.count for b_ in self.blocks)
        fwd += float(self.pre.costs.flops.sum() + self.post.costs.flops.sum())
        return sympy.Integer(int(fwd)) * b


def fqn_index(fqn: str) -> tuple:
    """A natural sort key for module paths: layers.2 before layers.10, block_2 before block_10."""
    import re

    return tuple(tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p)) for p in fqn.split("."))


def layer_index(param_name: str, layers: list[str]) -> int | None:
    """The index of the repeated layer (a module path in ``layers``) that holds ``param_name``."""
    return next((i for i, f in enumerate(layers) if param_name.startswith(f + ".")), None)


def _strip_views(node: torch.fx.Node) -> torch.fx.Node:
    """What ``node`` views: through view ops and the pieces of one (``unbind``'s of a 3-D expert
    weight, one per expert)."""
    while node.op == "call_function" and node.args and (
            op_name(node.target) in VIEW_OPS or (node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node)
                                                 and op_name(node.args[0].target) in VIEW_OPS)):
        a = node.args[0]
        if not isinstance(a, torch.fx.Node):
            break
        node = a
    return node


def _leading_feature_dim(v: torch.Tensor, features: int) -> int | None:
    """``n`` when ``v`` views ``features`` as trailing dims ``(n, d, ...)`` (more than one), else None."""
    if v.dim() < 2 or v.shape[-1] == features:
        return None
    size = 1
    for d in range(v.dim() - 1, -1, -1):
        size *= int(v.shape[d])
        if size == features:
            return int(v.shape[d]) if d < v.dim() - 1 else None
        if size > features:
            return None
    return None


def _val(n) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _node_costs(gm: torch.fx.GraphModule, param_nodes: set[str]) -> dict[str, tuple]:
    """name -> (flops, act_bytes, weight_bytes, kind, causal) for every compute node."""
    out = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = op_name(n.target)
        if name in VIEW_OPS or name == "getitem":
            continue
        outv = n.meta.get("val")
        flops = node_flops(n)
        in_nodes = [a for a in n.all_input_nodes]
        w_bytes = sum(tensor_bytes(_val(a)) for a in in_nodes if _strip_views(a).name in param_nodes)
        a_bytes = sum(tensor_bytes(_val(a)) for a in in_nodes if _strip_views(a).name not in param_nodes)
        a_bytes = a_bytes + sum(tensor_bytes(o) for o in torch.utils._pytree.tree_leaves(outv))
        kind = KIND_OTHER
        causal = False
        if name in ATTENTION_OPS:
            kind = KIND_ATTN
            q, k = _val(n.args[0]), _val(n.args[1])
            if flops == 0 and q is not None:  # CPU flash kernel is not in flop_registry
                bq, hq, sq, dq = q.shape
                flops = 2 * bq * hq * sq * k.shape[-2] * (dq + _val(n.args[2]).shape[-1])
            causal = bool(n.kwargs.get("is_causal", False)) or any(a is True for a in n.args[3:6])
        elif name in MATMUL_OPS:
            kind = KIND_MATMUL
        out[n.name] = (flops, a_bytes, w_bytes, kind, causal)
    return out


def _block_linears(bt: BlockTrace, found, tokens: int) -> tuple[dict[str, Linear], dict[str, str], set[str]]:
    """The block's linears (by node name) as the role finder found them, each column's bias, and
    the nodes inside a TP region (between a column group and its row linear). ``tokens``: the
    rows of the block's input."""
    linears: dict[str, Linear] = {}
    bias_of: dict[str, str] = {}
    weight_of = {gl.node: bt.param_names[gl.weight] for gl in found.linears}
    for gl in found.linears:
        wname = weight_of[gl.node]
        shape = bt.param_shapes[wname]
        in_f, out_f = int(shape[gl.in_dim]), int(shape[gl.out_dim])
        lin = linears[gl.node.name] = Linear(gl.node.name, wname, in_f, out_f)
        if gl.grouped:
            lin.stacked = gl.stacked
            lin.group = (wname,) * int(shape[0]) if gl.stacked else tuple(bt.param_names[i] for i in gl.group)
            rows = _val(gl.node.args[0])
            if rows is not None and tokens:
                lin.in_rows = float(rows.shape[0]) / tokens
        if gl.node in found.reduce_at:
            end = found.reduce_at[gl.node]
            lin.reduce_at = end.name
            val = _val(end)
            if val is not None and tokens:
                lin.reduce_rows = float(val.numel()) / (tokens * out_f)
        # nn.Linear stores its weight (out, in) and transposes it; HF Conv1D stores (in, out);
        # 3-D expert weights (experts, out, in), or (experts, in, out) as gpt-oss stores them.
        lin.transposed_storage = tuple(shape[-2:]) == (out_f, in_f)
        if gl.role in ("column", "row"):
            lin.role = gl.role
        lin.parts = gl.parts if gl.role == "column" else 1
        if gl.bias is not None:
            bias_of[lin.node] = bt.param_names[gl.bias]
    tp_nodes: set[str] = set()
    for row, cols in found.columns_of.items():
        linears[row.name].partners = tuple(sorted(weight_of[c] for c in cols))
        tp_nodes |= {x.name for x in found.region[row] if x.op != "placeholder"} | {row.name}
        tp_nodes |= {c.name for c in cols}
    return linears, bias_of, tp_nodes


# A fused projection's parts: split off, then each viewed as its heads.
_PARTS = ("split", "split_with_sizes", "chunk", "getitem")


def _find_heads(linears: dict[str, Linear], nodes: dict) -> None:
    """Set each column linear's head count (in place): its output viewed as (..., n, d...) with
    n*prod(d...) == out_features has n heads (or groups of heads, as Falcon's (kv groups, q per
    group + 2, head dim)), which TP divides."""
    for lin, l in linears.items():
        if l.role != "column":
            continue
        frontier, depth = [lin], 0
        while frontier and l.heads is None and depth < 6:
            nxt = []
            for x in frontier:
                for un in nodes[x].users:
                    if un.op != "call_function" or op_name(un.target) not in (*VIEW_OPS, *_PARTS):
                        continue
                    v = _val(un)
                    n = _leading_feature_dim(v, l.out_features) if isinstance(v, torch.Tensor) else None
                    if n is not None and n == l.parts > 1:  # stacked parts: (q k v, heads, head dim)
                        n = _leading_feature_dim(v, l.out_features // l.parts)
                    elif n is None and l.parts > 1 and isinstance(v, torch.Tensor):  # one part, split off
                        n = _leading_feature_dim(v, l.out_features // l.parts)
                    if n is not None:
                        l.heads = n
                        break
                    nxt.append(un.name)
            frontier, depth = nxt, depth + 1


def _saved_by_ac_mode(bt: BlockTrace, nodes: dict, batch: int, hidden_ph: set, hidden_bytes: float, tp_nodes: set,
                      linears: dict[str, Linear], keep_ops: set, quadratic) -> dict[str, tuple[float, float]]:
    """Bytes per sample the block saves for its backward under each AC mode, as (inside TP
    regions, replicated); ``quadratic``: the test for a (.., s, s) score tensor where attention
    is explicit (selective AC then recomputes exactly those), None where it is one fused op
    (selective AC keeps the matmul and attention outputs)."""

    def producer_kept(name: str) -> bool:
        node = nodes[name]
        if node.op == "call_function" and op_name(node.target) == "getitem":
            node = node.args[0]
        return node.name in keep_ops

    none_tp = none_rep = sel_tp = sel_rep = 0.0
    for name in bt.saved_nodes:
        node = nodes[name]
        if node.op == "placeholder" and name not in hidden_ph:
            continue  # parameters and constant inputs (rotary tables, masks)
        v = _val(node)
        nbytes = v.untyped_storage().nbytes() / batch if v is not None else 0
        if v is not None and any(
            u.op == "call_function" and op_name(u.target) in ("bernoulli", "bernoulli_") for u in node.users
        ):
            nbytes = v.numel() / batch  # dropout mask: bool (1 byte) in the accelerator kernel
        in_tp = name in tp_nodes or (node.op == "call_function" and op_name(node.target) == "getitem" and node.args[0].name in tp_nodes)
        if name in hidden_ph:
            continue  # counted once below, in every mode
        if in_tp:
            none_tp += nbytes
        else:
            none_rep += nbytes
        if quadratic is not None:
            keep = not quadratic(v)
        else:
            keep = producer_kept(name)
        if keep:
            if in_tp:
                sel_tp += nbytes
            else:
                sel_rep += nbytes
    if quadratic is None:
        # Outputs of kept ops that autograd itself did not save are kept by the SAC policy too.
        for n in keep_ops:
            if n in bt.saved_nodes or linears.get(n, Linear("", "", 0, 0)).role == "row":
                continue
            v = _val(nodes[n])
            if v is None:
                continue
            vb = v.untyped_storage().nbytes() / batch if v is not None else 0
            if n in tp_nodes:
                sel_tp += vb
            else:
                sel_rep += vb
    return {
        "none": (none_tp, none_rep + hidden_bytes),
        "selective": (min(sel_tp, none_tp), min(sel_rep, none_rep) + hidden_bytes),
        "full": (0.0, hidden_bytes),
    }


def _tp_groups(linears: dict[str, Linear]) -> list[tuple[str | None, list[str], str]]:
    """Each row linear's TP group: (the module holding exactly that group, or None; its column
    modules; its row module)."""
    tp_groups = []
    for l in linears.values():
        if l.role != "row":
            continue
        cols = [p.rsplit(".", 1)[0] for p in l.partners]
        row = l.weight.rsplit(".", 1)[0]
        parts = [m.split(".") for m in cols + [row]]
        common = []
        for level in zip(*parts):
            if len(set(level)) != 1:
                break
            common.append(level[0])
        lca = ".".join(common)
        # The common parent must be a proper submodule that contains only this group.
        tp_groups.append((lca if lca and lca not in cols + [row] else None, cols, row))
    # Two groups sharing one parent (attention and MLP in one module) cannot gather once each.
    parents = [g[0] for g in tp_groups if g[0] is not None]
    tp_groups = [(g[0] if parents.count(g[0]) == 1 else None, g[1], g[2]) for g in tp_groups]
    return tp_groups


def analyze_block(bt: BlockTrace, seq_len: int, batch: int) -> BlockProfile:
    """The planner's profile of one distinct block: its linears and their TP roles (the one role
    finder's, only priced here), heads, per-node costs per sample, what it saves for the backward
    under each AC mode, its TP groups and how many of its parameters TP shards."""
    gm = bt.gm
    nodes = {n.name: n for n in gm.graph.nodes}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    n_params = len(bt.param_names)
    param_of = {placeholders[i].name: bt.param_names[i] for i in range(n_params)}
    tensor_ph = placeholders[n_params:]
    hidden_ph = {tensor_ph[i].name for i in bt.hidden_input_idx if i < len(tensor_ph)}

    # The roles (column, row, replicated) from the one role finder, the executor's; here only priced.
    found = find_roles(gm, {placeholders[i]: i for i in range(n_params)},
                       [n for n in tensor_ph if n.name in hidden_ph])
    # The block's tokens: rows of its first hidden input (a decoder block's own hidden states, not
    # the encoder's output it attends to), in argument order.
    first = next((tensor_ph[i] for i in bt.hidden_input_idx if i < len(tensor_ph)), None)
    first_val = _val(first) if first is not None else None
    tokens = math.prod(first_val.shape[:-1]) if first_val is not None else 0
    linears, bias_of, tp_nodes = _block_linears(bt, found, tokens)
    _find_heads(linears, nodes)

    tp_div: dict[str, int] = {}
    for l in linears.values():
        if l.role == "column":
            key = f"{l.weight} heads" if l.heads else f"{l.weight} out_features"
            tp_div[key] = l.heads or l.out_features
    heads = kv_heads = head_dim = None
    col_heads = [l for l in linears.values() if l.role == "column" and l.heads]
    if col_heads:
        heads = max(l.heads for l in col_heads)
        kv_heads = min(l.heads for l in col_heads)
        head_dim = col_heads[0].out_features // col_heads[0].parts // col_heads[0].heads
    else:  # no per-head projection found (a fused one): the keys' shape at the attention kernel
        keys = [n.args[1].meta["val"] for n in gm.graph.nodes if n.op == "call_function" and op_name(n.target) in ATTENTION_OPS]
        if keys and keys[0].dim() == 4:
            kv_heads, head_dim = int(keys[0].shape[1]), int(keys[0].shape[3])

    # Node costs and regions.
    pnames = set(param_of)
    raw = _node_costs(gm, pnames)
    names = list(raw)
    costs = NodeCosts(
        names=names,
        flops=np.array([raw[n][0] for n in names], dtype=np.float64) / batch,
        act_bytes=np.array([raw[n][1] for n in names], dtype=np.float64) / batch,
        weight_bytes=np.array([raw[n][2] for n in names], dtype=np.float64),
        kind=np.array([raw[n][3] for n in names], dtype=np.int8),
        tp=np.array([n in tp_nodes for n in names], dtype=bool),
        causal=np.array([raw[n][4] for n in names], dtype=bool),
        recompute_selective=np.zeros(len(names), dtype=bool),
    )

    def quadratic(v: torch.Tensor | None) -> bool:
        return v is not None and sum(1 for d in v.shape if d == seq_len) >= 2

    # Explicit attention: a matmul that is not a linear and produces an (.., s, s) score tensor.
    quad_attn = any(
        raw[n][3] == KIND_MATMUL and n not in linears and quadratic(_val(nodes[n])) for n in names
    )
    keep_ops = set(linears) | {n for n in names if raw[n][3] == KIND_ATTN}
    for i, n in enumerate(names):
        if quad_attn:
            costs.recompute_selective[i] = quadratic(_val(nodes[n])) or any(
                quadratic(_val(a)) for a in nodes[n].all_input_nodes
            )
        else:
            costs.recompute_selective[i] = n not in keep_ops

    hidden_bytes = sum(tensor_bytes(_val(nodes[h])) for h in hidden_ph) / batch
    saved = _saved_by_ac_mode(bt, nodes, batch, hidden_ph, hidden_bytes, tp_nodes, linears, keep_ops,
                              quadratic if quad_attn else None)
    tp_groups = _tp_groups(linears)
    tp_weights = set()
    for l in linears.values():
        if l.role in ("column", "row"):
            tp_weights.update(l.group or (l.weight,))
            if l.role == "column" and l.node in bias_of:
                tp_weights.add(bias_of[l.node])
    params_tp = sum(math.prod(bt.param_shapes[w]) for w in tp_weights)
    params_all = sum(math.prod(s) for s in bt.param_shapes.values())
    return BlockProfile(
        cls_name=bt.cls_name, fqns=bt.fqns, linears=list(linears.values()), costs=costs,
        params_tp=params_tp, params_rep=params_all - params_tp, param_shapes=bt.param_shapes,
        saved=saved, hidden_bytes=hidden_bytes, tp_divisors=tp_div, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, quadratic_attention=quad_attn, tp_groups=tp_groups,
        gather_features=tuple(sorted(int(_val(root).shape[-1]) for root in found.gathered())),
        saved_partitioned=partitioned_saved(bt, batch, tp_nodes, hidden_bytes,
                                            {r.name for r in found.columns_of}),
    )


def partitioned_saved(bt: BlockTrace, batch: int, tp_nodes: set[str], hidden_bytes: float,
                      row_nodes: set[str] = frozenset()) -> dict:
    """What the executor saves for the block's backward, per AC mode. Without AC: the block's
    joint forward and backward traced on its fake tensors and split by the min-cut partitioner
    (the executor's ``backend.partition``); saved values that are a parameter (or a view of one)
    are not activations and are left out (FSDP regathers them; without FSDP they are resident
    anyway); the block's input counts as ``hidden_bytes``. Selective AC: the same, with the
    forward tagged by the AC pass's own policy (``passes.ac.recompute_policy``); full AC the
    input. Returns {} when the block cannot be traced this way (the eager ``saved`` is used then)."""
    try:
        j, n_outs = _block_joint(bt)
        none = _partition_saved(_graph_copy(j), n_outs, batch, tp_nodes, hidden_bytes, row_nodes)
        sel = _partition_saved(_graph_copy(j), n_outs, batch, tp_nodes, hidden_bytes, row_nodes, ac="selective")
    except Exception as e:  # noqa: BLE001 - a block this recipe cannot trace: the eager estimate stands
        import logging

        logging.getLogger(__name__).info("partitioned saved activations of %s not traced: %s", bt.cls_name, e)
        return {}
    return {"none": none, "selective": sel, "full": (0.0, hidden_bytes, 0.0)}


def _graph_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm``'s graph (each node's meta a copy of the dict: tags set on it stay there)."""
    g = torch.fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, g)


def _block_joint(bt: BlockTrace) -> tuple[torch.fx.GraphModule, int]:
    """The block's joint forward and backward, traced on its fake tensors, and its outputs' count.
    A grouped matmul of routed experts is traced with its first expert's weight alone: what it
    saves is its rows and their offsets (its weights are parameters, not activations), whatever
    the experts' number, and DeepSeek-V3's 768 expert weights would otherwise make the joint 3,500
    nodes for the partitioner to cut."""
    import torch.fx.traceback as fx_traceback
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = bt.gm
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    n_params = len(bt.param_names)
    vals = [ph.meta["val"] for ph in phs]
    wrt = set(range(n_params)) | {n_params + i for i in bt.hidden_input_idx}
    (out,) = gm.graph.find_nodes(op="output")
    outs = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    float_outs = [a.meta["val"] for a in outs if isinstance(a, torch.fx.Node) and a.meta["val"].is_floating_point()]

    def joint(primals, tangents):
        ins = [p.detach().requires_grad_(i in wrt and p.is_floating_point()) for i, p in enumerate(primals)]
        env = dict(zip(phs, ins))
        res = None
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                res = torch.fx.node.map_arg(n.args[0], env.__getitem__)
                break
            if n.op == "get_attr":
                env[n] = getattr(gm, n.target)
                continue
            target = out_of_place_op(n.target)
            args = torch.fx.node.map_arg(n.args, env.__getitem__)
            if target is GROUPED_MM:
                args = (args[0], args[1][:1], *args[2:])
            with fx_traceback.annotate({"source": n.name}):
                env[n] = target(*args, **torch.fx.node.map_arg(n.kwargs, env.__getitem__))
            if target is not n.target and isinstance(n.args[0], torch.fx.Node):
                env[n.args[0]] = env[n]  # later readers of the mutated tensor read the new value
        res = list(res) if isinstance(res, (list, tuple)) else [res]
        diff = [r for r in res if isinstance(r, torch.Tensor) and r.requires_grad]
        grads = torch.autograd.grad(diff, [ins[i] for i in sorted(wrt)], tangents[:len(diff)], allow_unused=True)
        return [*res, *[g for g in grads if g is not None]]

    with detect_fake_mode(vals):
        tangents = [torch.empty(v.shape, dtype=v.dtype) for v in float_outs]
        with fx_traceback.preserve_node_meta():
            j = make_fx(joint, tracing_mode="real")(vals, tangents)
    # A backward formula's in-place op on a value it made (clamp's mask, ``logical_and_``: gpt-oss's
    # experts) as its out-of-place form, as the executor's functional joint has it: the partitioner
    # keeps every mutation in the forward.
    out_of_place(j, restrides=False)
    j.graph.eliminate_dead_code()  # the unused experts' weights' detach
    j.recompile()
    return j, len(outs)


def _partition_saved(j: torch.fx.GraphModule, n_outs: int, batch: int, tp_nodes: set[str], hidden_bytes: float,
                     row_nodes: set[str] = frozenset(), ac: str = "none"):
    """Saved bytes of a block's joint ``j`` split as the executor splits it, under ``ac``."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    if ac != "none":
        from autopar.passes.ac import forward_nodes, recompute_policy

        for n in forward_nodes(j):
            policy = recompute_policy(n, ac)
            # The block's outputs are the forward's outputs here (made once, not recomputed).
            if policy is not None and not any(u.op == "output" for u in n.users):
                n.meta.update(recompute=policy, ac_graph_id=1)
    fw, _ = min_cut_rematerialization_partition(j, None, num_fwd_outputs=n_outs)
    (fo,) = fw.graph.find_nodes(op="output")
    params = {ph.meta["val"].untyped_storage()._cdata for ph in fw.graph.find_nodes(op="placeholder")}
    # A row linear's output is whole under TP (partial sums, before their reduction) and under SP
    # (the whole sequence, before the reduce-scatter). Selective AC saves every matmul's output,
    # this one as it is, whole; without AC the partitioner saves its reduced value instead.
    rows = {n.meta["val"].untyped_storage()._cdata for n in fw.graph.nodes
            if ac != "none" and n.meta.get("custom", {}).get("source", "") in row_nodes
            and isinstance(n.meta.get("val"), torch.Tensor)}
    seen: dict = {}
    for a in fo.args[0][n_outs:]:
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        if not isinstance(v, torch.Tensor) or a.op == "placeholder":
            continue
        key = v.untyped_storage()._cdata
        if key not in params:  # a parameter (a view of one) is not an activation
            src = a.meta.get("custom", {}).get("source", "")
            seen[key] = (v.untyped_storage().nbytes(), "whole" if key in rows else "tp" if src in tp_nodes else "rep")
    by = {k: sum(b for b, c in seen.values() if c == k) / batch for k in ("tp", "rep", "whole")}
    return by["tp"], by["rep"] + hidden_bytes, by["whole"]


def _outer(trace: ModelTrace, segment: str, vocab: int, batch: int) -> OuterProfile:
    recs = [r for r in trace.ops if r.segment == segment and r.name not in VIEW_OPS]
    # Under TP the embedding writes its whole output on every rank (only its table is split);
    # after the head every vocabulary-sized op runs on the logits' shards (loss parallelism).
    vocab_op = [any(vocab in s for s in r.out_shapes + r.in_shapes) and (segment == "post" or r.name in MATMUL_OPS)
                for r in recs]
    costs = NodeCosts(
        names=[r.name for r in recs],
        flops=np.array([r.flops for r in recs], dtype=np.float64) / batch,
        act_bytes=np.array([r.bytes for r in recs], dtype=np.float64) / batch,
        weight_bytes=np.zeros(len(recs)),
        kind=np.array([KIND_MATMUL if r.name in MATMUL_OPS else KIND_OTHER for r in recs], dtype=np.int8),
        tp=np.array(vocab_op, dtype=bool),
        causal=np.zeros(len(recs), dtype=bool),
        recompute_selective=np.zeros(len(recs), dtype=bool),
    )
    pv = pr = 0
    for name, (shape, owner) in trace.params.items():
        if owner != "outside":
            continue
        seg = "pre" if _is_before_blocks(name, trace) else "post"
        if seg != segment:
            continue
        if vocab in shape:
            pv += math.prod(shape)
        else:
            pr += math.prod(shape)
    # Saved for backward: vocabulary-sized tensors (the logits, the loss's softmax) live on their shards.
    sv = sum(s.bytes for s in trace.saved if s.segment == segment and vocab in s.shape) / batch
    sr = sum(s.bytes for s in trace.saved if s.segment == segment and vocab not in s.shape) / batch
    ws, ws_eager, outs = set(), set(), set()
    for r in recs:
        split, out = [0.0, 0.0], [0.0, 0.0]
        for i, (shape, nbytes) in enumerate(zip(r.out_shapes + r.in_shapes, r.out_bytes + r.in_bytes)):
            split[vocab not in shape] += nbytes / batch
            if i < len(r.out_shapes):
                out[vocab not in shape] += nbytes / batch
        ws_eager.add(tuple(split))
        if not r.fused_grad:
            ws.add(tuple(split))
            outs.add(tuple(out))
    return OuterProfile(costs, pv, pr, sv, sr, sorted(ws), sorted(ws_eager), sorted(outs))


def _is_before_blocks(pname: str, trace: ModelTrace) -> bool:
    """Parameters registered before the block container in module order belong to 'pre'."""
    order = list(trace.params)
    first_block = next((i for i, (n, (_, o)) in enumerate(trace.params.items()) if o != "outside"), len(order))
    return order.index(pname) < first_block


def analyze(trace: ModelTrace) -> ModelProfile:
    vocab = int(trace.extras["vocab_size"])
    blocks = [analyze_block(b, trace.seq_len, trace.batch) for b in trace.blocks]
    # -1 where the head is kept whole (no loss parallelism): no dimension is vocabulary-split.
    split_vocab = vocab if trace.extras.get("vocab_split", True) else -1
    pre = _outer(trace, "pre", split_vocab, trace.batch)
    post = _outer(trace, "post", split_vocab, trace.batch)
    hidden = 0
    if blocks:
        hidden = int(round(blocks[0].hidden_bytes / (trace.seq_len * torch.tensor([], dtype=trace.dtype).element_size())))
    fp = hashlib.sha256(trace.fingerprint_src.encode()).hexdigest()[:16]
    n_params = sum(math.prod(s) for s, _ in trace.params.values())
    return ModelProfile(
        name=trace.name, fingerprint=fp, seq_len=trace.seq_len,
        dtype_bytes=torch.tensor([], dtype=trace.dtype).element_size(), hidden=hidden, vocab=vocab,
        blocks=blocks, pre=pre, post=post, block_container=trace.block_container, layers=trace.layers,
        n_params=n_params, tied=trace.tied, module_types=trace.module_types,
        outside_params={n: shape for n, (shape, owner) in trace.params.items() if owner == "outside"},
        outside_segments={n.rsplit(".", 1)[0]: ("pre" if _is_before_blocks(n, trace) else "post")
                          for n, (_, owner) in trace.params.items() if owner == "outside"},
    )
