"""Step time and memory of a whole parallel configuration.

A configuration is a mesh ``pp x dp_replicate x dp_shard x tp`` (TP innermost, so it lands inside
a node), sequence parallelism, FSDP with a reshard policy, a microbatch size, a pipeline schedule
with ``v`` virtual stages, and an activation-checkpointing mode per layer.

Per microbatch, every layer on a pipeline rank costs (``LayerCoeffs``, one value per AC mode)::

    t_layer = fwd + bwd + recompute(ac) + tp_comm * (2 + [ac == full])
              + max(0, AG_fsdp - fwd) + max(0, [reshard] AG_fsdp + RS_fsdp - bwd - recompute(ac))

(TP collectives are exposed; FSDP collectives are prefetched behind the neighbouring layer's
compute and only the excess shows.) With context parallelism (``cp``, priced for published runs
only) a rank holds ``mb / cp`` sequences' worth of tokens, so compute, activations and TP messages
scale by it, and each layer adds its exposed K/V all-gathers and gradient reduce-scatters. Rank ``r`` with ``n_r`` layers then costs
``t_r = sum(t_layer) + [r == 0] t_embed + [r == last] t_head + p2p``. With ``M`` microbatches::

    no PP:            T = M * t_0
    GPipe / 1F1B:     T = (M - 1) * max_r t_r + sum_r t_r
    interleaved (v):  T = (M - 1) * max_r t_r + sum_r t_r / v + (v - 1)/v * max_r t_r

plus the optimizer step (memory-bound AdamW) and, without FSDP, the exposed gradient all-reduce.
The bubble is ``T - M * max_r t_r``; for a balanced pipeline it is ``(pp-1)/v`` of a microbatch.
Where a node's ranks share ``S`` compute slots (CPU processes on fewer cores than ranks), the
step is at least the node's total busy time over ``S`` (``shared_cores`` in the breakdown). Eager
runs with TP add the DTensor dispatch time the profile measured (``tp_eager_overhead``).

Memory of rank ``r`` (bytes)::

    states  = P_r * (master + grad + 2 AdamW moments, in the master dtype) / dp_shard
    working = unsharded compute-dtype params in flight (1 + prefetch layers with reshard, all of the stage without;
              without FSDP, under mixed precision, the step's compute-dtype copy of every weight)
    acts    = mb * sum_layers saved(ac) * inflight_r  +  one layer's backward working set
    inflight_r = 1 (no PP), M (GPipe), min(M, pp - r) (1F1B),
                 min(M v, (v-1) pp + 2 (pp-1-r) + 1) / v (interleaved, per layer)

plus the embedding/head activations (the fp32 logits of the loss on the last rank) and the
profile's reserve.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from dataclasses import dataclass, field

import numpy as np

from autopar.analysis import BlockProfile, ModelProfile
from autopar.cost_models.comm import Group, collective_time, collective_transfer, group_on_mesh
from autopar.cost_models.compute import node_times
from autopar.cost_models.hardware import Hardware
from autopar.errors import AutoparError
from autopar.plan import Precision
from autopar.plan import precision as precision_of

AC_MODES = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved_zb", "zbv")
# Schedules that run the weight gradients apart from the input gradients (the backward is split).
ZERO_BUBBLE = ("interleaved_zb", "zbv")
GiB = float(1 << 30)


@dataclass(frozen=True)
class Config:
    """The mesh-level choice of a plan (per-layer detail lives in ``Assignment``)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    dp_shard: int = 1  # FSDP shard degree (divides dp); dp // dp_shard replicas (HSDP)
    sp: bool = False
    fsdp: bool = False
    reshard: bool = True
    mb: int = 1
    schedule: str = "1f1b"
    v: int = 1
    # FSDP with several microbatches: "" gathers and reduces every microbatch (autopar's
    # executor); "reduce" reduces the gradients once per step, accumulating them unsharded
    # (torch.distributed.pipelining with FSDP2 in 2024, priced for published runs only); "gather"
    # also keeps the parameters gathered across the step's microbatches (ZeRO-1, Megatron-LM's
    # distributed optimizer, Llama 3's training): autopar runs it, gathering before the step's
    # first microbatch and reducing after its last, exposed.
    fsdp_once: str = ""
    # What one FSDP all-gather holds: "layer" (autopar's executor, FSDP2, torchtitan: a layer's
    # parameters in one collective) or "tensor" (DeepSpeed ZeRO-3 until mid-2021: one collective
    # per parameter tensor, each waited before the next is issued, so their latencies add up and
    # nothing hides them). Priced for published runs; the search never sets it.
    fsdp_unit: str = "layer"
    # Without FSDP: does the data-parallel gradient all-reduce overlap the last microbatch's
    # backward (True: autopar's bucketed all-reduces, PyTorch DDP) or run after it, exposed
    # (False: Megatron-LM's local DDP until 2023 and DeepSpeed's pipeline engine all-reduce once
    # the backward is done). Priced for published runs; the search never sets it.
    dp_overlap: bool = True
    # Context parallelism: each sequence split over ``cp`` ranks (between dp_shard and tp in the
    # mesh), attention gathering the keys and values of the whole sequence (ring attention with
    # all-gathered K/V, torchtitan's and torch's ``context_parallel``); FSDP shards the parameters
    # over dp_shard x cp and gradients are reduced over dp x cp (passes/cp.py).
    cp: int = 1
    # FSDP buckets (layers) gathered ahead of their use: with reshard, (1 + prefetch) layers'
    # gathered parameters are alive at once (passes/overlap.py; FSDP2's default is 1).
    prefetch: int = 1
    # Expert parallelism: a routed experts' block's experts split over ``ep`` consecutive
    # data-parallel ranks (``ep`` divides ``dp``), each token's rows sent to their experts' ranks
    # and back by all-to-alls (passes/ep.py).
    ep: int = 1
    # Whether those all-to-alls run under another microbatch's computation (DeepSeek-V3's
    # DualPipe pairs a forward chunk with a backward chunk, each one's all-to-alls hidden by the
    # other's matmuls), exposed only where they outlast the layer's compute; autopar's executor
    # runs them between the layer's computations, exposed. Priced for published runs; the search
    # never sets it.
    ep_overlap: bool = False
    # How a published MoE run sent its routed tokens (priced for it; the search never sets these:
    # autopar's executor sends each (token, expert) row to its expert's rank in the compute dtype).
    # ``ep_nodes``: node-limited routing, each token sent once to each of the at most ``ep_nodes``
    # nodes its experts are on and fanned out to them over the node's own links (DeepSeek-V3: 4);
    # ``ep_fp8``: the forward dispatch sent in FP8 (the combine and the backward's in the compute dtype).
    ep_nodes: int = 0
    ep_fp8: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def shard(self) -> int:
        """Ranks one parameter is sharded over: FSDP's dp_shard (times cp, folded into it)."""
        return self.dp_shard * self.cp if self.fsdp else 1

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

    def key(self) -> tuple:
        return (self.pp, self.dp, self.dp_shard, self.tp, int(self.sp), int(self.fsdp),
                int(self.reshard), self.mb, SCHEDULES.index(self.schedule), self.v, self.fsdp_once, self.fsdp_unit,
                int(self.dp_overlap), self.cp, self.prefetch, self.ep, int(self.ep_overlap), self.ep_nodes,
                int(self.ep_fp8))

    def short(self) -> str:
        s = f"tp={self.tp},pp={self.pp},dp={self.dp},sp={int(self.sp)},fsdp={int(self.fsdp)},mb={self.mb}"
        if self.fsdp and self.dp_shard != self.dp:
            s += f",dp_shard={self.dp_shard}"
        if self.fsdp and not self.reshard:
            s += ",reshard=0"
        if self.fsdp and self.fsdp_once:
            s += f",once={self.fsdp_once}"
        if self.fsdp and self.fsdp_unit != "layer":
            s += f",unit={self.fsdp_unit}"
        if not self.fsdp and self.dp > 1 and not self.dp_overlap:
            s += ",dp_overlap=0"
        if self.cp > 1:
            s += f",cp={self.cp}"
        if self.ep > 1:
            s += f",ep={self.ep}"
        if self.ep > 1 and self.ep_overlap:
            s += ",ep_overlap=1"
        if self.ep > 1 and self.ep_nodes:
            s += f",ep_nodes={self.ep_nodes}"
        if self.ep > 1 and self.ep_fp8:
            s += ",ep_fp8=1"
        if self.pp > 1:
            s += f",schedule={self.schedule}" + (f",v={self.v}" if self.v > 1 else "")
        return s


@dataclass(frozen=True)
class Assignment:
    """Layers and AC modes per pipeline rank: ``layers[r]`` layers, ``ac[r] = (none, sel, full)``."""

    layers: tuple[int, ...]
    ac: tuple[tuple[int, int, int], ...]

    def per_layer_ac(self) -> list[str]:
        out = []
        for (n0, n1, n2) in self.ac:
            # Within a rank, checkpoint the earliest layers fully (their activations live longest).
            out += ["full"] * n2 + ["selective"] * n1 + ["none"] * n0
        return out


@dataclass(frozen=True)
class CostContext:
    model: ModelProfile
    hw: Hardware
    global_batch: int  # sequences per step
    precision: str = "bf16-mixed"  # a name in plan.PRECISIONS
    compiled: bool = True
    async_tp: bool = False
    fp8: bool = False
    memory_limit_gb: float | None = None
    # Which activations the backward finds saved: "partitioned", what the min-cut partitioner
    # keeps (autopar's executor; torch.compile'd blocks), or "autograd", what eager autograd
    # keeps (Megatron-LM, DeepSpeed, eager FSDP2; Korthikanti et al.'s closed forms).
    activations: str = "partitioned"
    # The head and the loss compiled with the rest of the step, so that the loss's backward is one
    # fused kernel (autopar's executor: one graph); False where they run eagerly beside compiled
    # blocks (the published runs: torchtitan compiles each block, its loss ran eagerly).
    fused_loss: bool = True
    # Expert parallelism: the busiest ep rank's routed rows over the mean (1: routing spread
    # evenly). Its expert matmuls and the all-to-alls' messages scale by it; the rest waits.
    ep_imbalance: float = 1.0

    @property
    def limit_bytes(self) -> float:
        gb = self.memory_limit_gb if self.memory_limit_gb is not None else self.hw.memory_gb
        return gb * GiB

    @functools.cached_property
    def act_bytes(self) -> int:
        """Bytes of an activation, and of a parameter as the step reads (gathers) it."""
        return self.prec.bytes("compute")

    @functools.cached_property
    def reduce_bytes(self) -> int:
        """Bytes of a gradient element as data parallelism reduces it."""
        return self.prec.bytes("reduce")

    @functools.cached_property
    def prec(self) -> Precision:
        return precision_of(self.precision)

    @functools.cached_property
    def float8(self) -> bool:
        """Linears' matmuls in float8: the precision's, or a published run's (``fp8``)."""
        return self.fp8 or self.prec.float8

    @functools.cached_property
    def bytes_scale(self) -> float:
        return self.act_bytes / self.model.dtype_bytes


@dataclass(frozen=True)
class LayerCoeffs:
    """Per-layer, per-microbatch costs on one rank, one entry per AC mode."""

    time: dict  # ac -> seconds
    act: dict  # ac -> saved bytes (for mb sequences)
    static: float  # parameter/gradient/optimizer bytes per layer
    working_param: float  # unsharded bytes of one layer's parameters (FSDP)
    parts: dict  # named components for the breakdown (ac -> {name: seconds})
    hidden_comm: dict = field(default_factory=dict)  # ac -> comm seconds overlapped with compute
    fsdp_param: float = -1.0  # bytes FSDP gathers per layer (-1: working_param; less under EP)
    copy: float = 0.0  # the compute-dtype copy of the layer's weights the step makes without FSDP


@dataclass
class Estimate:
    config: Config
    assignment: Assignment
    step_time_s: float
    breakdown: dict  # seconds per component (sums to step_time_s)
    memory_bytes: list[float]  # per pipeline rank
    memory_breakdown: dict  # bytes per component on the peak rank
    tokens_per_s_per_gpu: float
    mfu: float
    collectives: list[dict] = field(default_factory=list)
    activation_bytes: list[float] = field(default_factory=list)  # per pipeline rank, at its peak

    @property
    def peak_memory_gb(self) -> float:
        return max(self.memory_bytes) / GiB

    def fits(self, limit_bytes: float) -> bool:
        return max(self.memory_bytes) <= limit_bytes


class StageModel:
    """All the coefficients of one ``Config``; prices ``Assignment``s by arithmetic."""

    def __init__(self, ctx: CostContext, cfg: Config, cache: dict | None = None):
        self.ctx, self.cfg = ctx, cfg
        self._cache = cache if cache is not None else {}
        self._affine: dict = {}  # (first, last, in-flight on the first) -> (t0, m0)
        self._layer_memory: list[float] | None = None
        self._params: dict = {}
        self._balanced: tuple[int, ...] | None = None
        m, hw = ctx.model, ctx.hw
        if m.n_layers < cfg.pp * cfg.v:
            raise AutoparError(f"pp*v = {cfg.pp * cfg.v} exceeds the model's {m.n_layers} layers")
        local = ctx.global_batch // cfg.dp
        self.M = local // cfg.mb
        # The mesh pp x dp_replicate x (dp_shard x cp) x tp: FSDP shards over dp_shard and cp together.
        mesh = [cfg.pp, cfg.dp_replicate, cfg.dp_shard * cfg.cp, cfg.tp]
        gpn = hw.gpus_per_node
        self.g_pp = group_on_mesh(mesh, 0, gpn)
        self.g_rep = group_on_mesh(mesh, 1, gpn)
        self.g_shard = group_on_mesh(mesh, 2, gpn)
        self.g_tp = group_on_mesh(mesh, 3, gpn)
        self.g_cp = group_on_mesh([cfg.pp, cfg.dp, cfg.cp, cfg.tp], 2, gpn)
        self.g_ep = ep_group(cfg, gpn)
        # The ranks of dp_shard with this rank's place in its ep group: an owned expert's FSDP shards
        # beyond the ep ranks (``ep_owned`` with dp_shard a multiple of ep).
        self.g_ep_shard = (group_on_mesh([cfg.pp, cfg.dp_replicate, cfg.dp_shard // cfg.ep, cfg.ep, cfg.cp * cfg.tp], 2, gpn)
                           if cfg.ep > 1 and cfg.dp_shard % cfg.ep == 0 else Group(1, 1))
        self.g_dp = Group(cfg.dp * cfg.cp,
                          self.g_shard.per_node * (self.g_rep.per_node if self.g_shard.nodes == 1 else 1))
        # Per microbatch a rank holds mb sequences' 1/cp share of the tokens (and of the attention:
        # its queries against every key), so everything that scales with tokens scales by this.
        self.tokens = cfg.mb / cfg.cp
        self.block = {id(b): self._layer_cached(b) for b in m.blocks}
        self.layers = m.layer_sequence()
        self.coeffs = self.block[id(self.layers[0])] if len(m.blocks) == 1 else self._average()
        # The rank that runs the last stage (the head and the loss): V-shaped zbv puts it on rank 0.
        self.post_rank = 0 if cfg.schedule == "zbv" else cfg.pp - 1
        self._outer()

    def _ep_group(self, why: str) -> Group:
        """The group an expert-parallel collective (``ep_layer_collectives``) runs over."""
        if why == EP_WEIGHTS_SHARDS:
            return self.g_ep_shard
        if why == EP_NODES:  # one rank a node: the token's copy sent to each node
            return Group(self.g_ep.nodes, 1)
        if why == EP_IN_NODE:
            return Group(self.g_ep.per_node, self.g_ep.per_node)
        return self.g_ep

    def _ct(self, kind: str, nbytes: float, g: Group) -> float:
        """``collective_time`` on this context's hardware, shared by the search's configurations."""
        return self._memo(collective_time, kind, nbytes, g)

    def _cx(self, kind: str, nbytes: float, g: Group) -> float:
        """``collective_transfer`` likewise."""
        return self._memo(collective_transfer, kind, nbytes, g)

    def _memo(self, fn, kind: str, nbytes: float, g: Group) -> float:
        key = (fn, kind, nbytes, g)
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = fn(self.ctx.hw, kind, nbytes, g)
        return got

    # -- per layer ---------------------------------------------------------------------------
    def _layer_cached(self, b: BlockProfile) -> LayerCoeffs:
        """``_layer`` shared by the configurations of a search that differ only in pp, schedule
        and v (a layer's coefficients depend on none of them)."""
        cfg = self.cfg
        key = ("layer", id(b), cfg.tp, cfg.mb, cfg.sp, cfg.fsdp, cfg.dp_shard, cfg.dp_replicate, cfg.reshard,
               cfg.fsdp_once, cfg.fsdp_unit, self.M, cfg.cp, cfg.ep, cfg.ep_overlap)
        if key not in self._cache:
            self._cache[key] = self._layer(b)
        return self._cache[key]

    def _layer(self, b: BlockProfile) -> LayerCoeffs:
        ctx, cfg = self.ctx, self.cfg
        tp, mb, sp = cfg.tp, self.tokens, cfg.sp
        costs = self._ep_costs(b) if cfg.ep > 1 and b.experts else b.costs
        ct = self._times(costs, mb, tp, sp, ctx.float8)
        if cfg.ep > 1 and b.experts and ctx.ep_imbalance != 1.0:
            ct = self._imbalanced(costs, ct, mb, tp, sp)
        rec = {"none": 0.0, "selective": ct.recompute_selective, "full": ct.fwd}
        saved = getattr(b, "saved_partitioned", None) if ctx.activations == "partitioned" else None
        saved = saved or b.saved
        # Under SP without AC autopar's executor keeps each column group's gathered (whole-sequence)
        # input for the backward (the partitioner does not recompute a collective); under AC it
        # keeps the sequence shard and gathers it again in the backward, as Megatron-LM does.
        sp_gathered = 0.0
        if sp and tp > 1 and ctx.activations == "partitioned":
            sp_gathered = (sum(gathered_features(b, ctx.model.hidden)) * mb * ctx.model.seq_len * ctx.act_bytes
                           * (1 - 1 / tp))
        tp_fwd = tp_bwd = regather = 0.0
        for kind, nbytes, n_fwd, n_bwd, _ in tp_layer_collectives(b, cfg, ctx):
            t = self._ct(kind, nbytes, self.g_tp)
            tp_fwd += n_fwd * t
            tp_bwd += n_bwd * t
            if sp and kind == "all_gather":
                regather += n_fwd * t
        cp_fwd = cp_bwd = 0.0
        for kind, nbytes, n_fwd, n_bwd, _ in cp_layer_collectives(b, cfg, ctx):
            t = self._ct(kind, nbytes, self.g_cp)
            cp_fwd += n_fwd * t
            cp_bwd += n_bwd * t
        if ctx.async_tp:  # overlapped with the neighbouring matmuls (torchtitan's async TP)
            tp_fwd, tp_bwd, regather = tp_fwd * 0.3, tp_bwd * 0.3, regather * 0.3
        # Expert parallelism: the routed rows' all-to-alls (in the forward, again in a full
        # recompute, reversed in the backward) and, where each rank reads only its own experts,
        # their weights' all-to-all in place of the experts' FSDP gathers and reductions.
        ep_fwd = ep_bwd = ep_rows = 0.0
        for kind, nbytes, n_fwd, n_bwd, why in ep_layer_collectives(b, cfg, ctx):
            t = self._ct(kind, nbytes, self._ep_group(why))
            ep_fwd += n_fwd * t
            ep_bwd += n_bwd * t
            ep_rows += n_fwd * t if why not in (EP_WEIGHTS, EP_WEIGHTS_SHARDS) else 0.0
        p_local = b.params_tp / tp + b.params_rep
        own = b.expert_params / tp if ep_owned(cfg) else 0.0
        ag, rs, busy = self._fsdp_collectives(p_local - own, cfg.reshard)
        # Under SP the sequence region's ops (norms; residual adds are counted too) run on DTensors.
        eager = self._eager_tp_overhead(b.tp_linears, int(np.count_nonzero(~b.costs.tp)))
        time, parts, act, hidden = {}, {}, {}, {}
        seq_div = tp if sp else 1
        # One collective per parameter tensor: each gather beyond a layer's first adds the ring's
        # latency, in the forward and (resharded) again in the backward.
        per_tensor = 0.0
        if cfg.fsdp_unit == "tensor" and cfg.shard > 1:
            gathers = 2 if cfg.reshard and cfg.fsdp_once != "gather" else 1
            per_tensor = (len(b.param_shapes) - 1) * gathers * self._ct("all_gather", 1.0, self.g_shard)
            if cfg.fsdp_once == "gather":  # gathered once per step, spread over its microbatches
                per_tensor /= self.M
        for ac in AC_MODES:
            comm_tp = tp_bwd + tp_fwd * (2 if ac == "full" else 1) + (regather if ac == "selective" else 0.0)
            fsdp = self._fsdp_exposed(ag, rs, ct.fwd, ct.bwd + rec[ac], cfg.reshard) + per_tensor
            ep = ep_bwd + ep_fwd + (ep_rows if ac == "full" else 0.0)
            if cfg.ep_overlap:  # under the other chunk's computation: what outlasts it shows
                ep = max(0.0, ep - (ct.fwd + ct.bwd + rec[ac]))
            parts[ac] = {
                "compute": ct.fwd + ct.bwd, "recompute": rec[ac], "tp_comm": comm_tp,
                "cp_comm": cp_bwd + cp_fwd * (2 if ac == "full" else 1),
                "ep_comm": ep,
                "fsdp_comm": fsdp,
                # A full recompute runs the forward third of the DTensor dispatches again.
                "tp_eager_overhead": eager * (4 / 3 if ac == "full" else 1.0),
            }
            time[ac] = sum(parts[ac].values())
            hidden[ac] = max(0.0, busy - parts[ac]["fsdp_comm"])
            act[ac] = mb * ctx.bytes_scale * _split_saved(saved[ac], tp, seq_div)
            if sp_gathered and ac == "none":
                act[ac] += sp_gathered
        # Gathered for the layer: its own experts' weights, not every expert's.
        working = (p_local - own + own / cfg.ep) * ctx.act_bytes
        return LayerCoeffs(time, act, self._state_bytes(p_local), working, parts, hidden, copy=self._copy_bytes(p_local),
                           fsdp_param=(p_local - own) * ctx.act_bytes)

    def _fsdp_exposed(self, ag: float, rs: float, fwd: float, bwd: float, reshard: bool) -> float:
        """FSDP seconds per microbatch that the compute (``fwd``, ``bwd``) does not hide: the
        gather before the forward, the gather again (``reshard``) and the reduce before the
        backward. With ``fsdp_once`` what happens once per step is spread over the M microbatches."""
        once, M = self.cfg.fsdp_once, self.M
        if self.cfg.fsdp_unit == "tensor":
            # Each tensor's gather is waited for on the compute stream before the next is issued
            # (DeepSpeed ZeRO-3 of 2021): no compute hides a gather; the reduce-scatter overlaps.
            gathers = ag + (ag if reshard else 0.0)
            exposed_rs = max(0.0, rs - bwd)
            return gathers / (M if once == "gather" else 1) + exposed_rs / (M if once else 1)
        exposed_fwd = max(0.0, ag - fwd)
        if not once:
            return exposed_fwd + max(0.0, (ag if reshard else 0.0) + rs - bwd)
        exposed_rs = max(0.0, rs - bwd) / M
        if once == "gather":
            # autopar's executor (ZeRO-1): every gather before the step's first microbatch and
            # every reduction after its last, none hidden by compute.
            return (ag + rs) / M
        return exposed_fwd + max(0.0, (ag if reshard else 0.0) - bwd) + exposed_rs

    def _fsdp_collectives(self, p_local: float, reshard: bool) -> tuple[float, float, float]:
        """FSDP per layer: all-gather and reduce-scatter seconds (HSDP adds the replica all-reduce
        to the latter), and the processor time of all of them per microbatch (``collective_transfer``;
        with ``fsdp_once="gather"`` they run once per step)."""
        cfg, ctx = self.cfg, self.ctx
        if cfg.shard <= 1:
            return 0.0, 0.0, 0.0
        reshard = reshard and cfg.fsdp_once != "gather"
        ag_bytes, rs_bytes = p_local * ctx.act_bytes, p_local * ctx.reduce_bytes
        ag = self._ct("all_gather", ag_bytes, self.g_shard)
        rs = self._ct("reduce_scatter", rs_bytes, self.g_shard)
        busy = (self._cx("all_gather", ag_bytes, self.g_shard) * (2 if reshard else 1)
                + self._cx("reduce_scatter", rs_bytes, self.g_shard))
        if cfg.dp_replicate > 1:
            rs += self._ct("all_reduce", rs_bytes / cfg.shard, self.g_rep)
            busy += self._cx("all_reduce", rs_bytes / cfg.shard, self.g_rep)
        if cfg.fsdp_once == "gather":
            busy /= self.M
        return ag, rs, busy

    def _eager_tp_overhead(self, linears: int, sequence_ops: int) -> float:
        """Seconds of DTensor dispatch per microbatch (forward and backward) in an eager run."""
        cfg, hw = self.cfg, self.ctx.hw
        if self.ctx.compiled or cfg.tp == 1:
            return 0.0
        return (linears * hw.tp_linear_us + (sequence_ops * hw.sp_op_us if cfg.sp else 0.0)) * 1e-6

    def _times(self, costs, mb: float, tp: int, sp: bool, fp8: bool):
        key = (id(costs), mb, tp, sp, fp8)
        if key not in self._cache:
            ctx = self.ctx
            self._cache[key] = node_times(costs, ctx.hw, mb=mb, tp=tp, sp=sp, bytes_scale=ctx.bytes_scale,
                                          compiled=ctx.compiled, fp8=fp8, compute=ctx.prec.compute)
        return self._cache[key]

    def _ep_costs(self, b: BlockProfile):
        """The block's costs on one ep rank: its expert matmuls read its own experts' weights,
        1/ep of the block's (each rank runs its experts on the rows routed to them)."""
        key = ("ep_costs", id(b), self.cfg.ep)
        if key not in self._cache:
            w = np.where(b.costs.experts(), b.costs.weight_bytes / self.cfg.ep, b.costs.weight_bytes)
            self._cache[key] = dataclasses.replace(b.costs, weight_bytes=w)
        return self._cache[key]

    def _imbalanced(self, costs, ct, mb: float, tp: int, sp: bool):
        """``ct`` with the expert matmuls of ``costs`` (a block's ``grouped_mm`` nodes) on the
        busiest ep rank: ``ctx.ep_imbalance`` times their even share."""
        key = ("experts", id(costs))
        if key not in self._cache:
            self._cache[key] = costs.subset(costs.experts())
        ex = self._times(self._cache[key], mb, tp, sp, self.ctx.float8)
        more = self.ctx.ep_imbalance - 1.0
        return dataclasses.replace(ct, fwd=ct.fwd + more * ex.fwd, bwd=ct.bwd + more * ex.bwd,
                                   recompute_selective=ct.recompute_selective + more * ex.recompute_selective)

    def _average(self) -> LayerCoeffs:
        """The layers' mean coefficients, shared by the configurations whose layer coefficients are the same."""
        key = ("average", *(id(self.block[id(b)]) for b in self.ctx.model.blocks))
        if key not in self._cache:
            self._cache[key] = self._average_of([self.block[id(b)] for b in self.layers])
        return self._cache[key]

    @staticmethod
    def _average_of(cs: list) -> LayerCoeffs:
        # The layers share few distinct coefficient objects (one per kind): each weighted by its count.
        n = len(cs)
        counts = collections.Counter(map(id, cs))
        cs = list({id(c): c for c in cs}.values())
        avg = lambda get: sum(get(c) * counts[id(c)] for c in cs) / n  # noqa: E731
        return LayerCoeffs(
            time={a: avg(lambda c: c.time[a]) for a in AC_MODES},
            act={a: avg(lambda c: c.act[a]) for a in AC_MODES},
            static=avg(lambda c: c.static),
            working_param=max(c.working_param for c in cs),
            parts={a: {k: avg(lambda c: c.parts[a][k]) for k in cs[0].parts[a]} for a in AC_MODES},
            hidden_comm={a: avg(lambda c: c.hidden_comm[a]) for a in AC_MODES},
            fsdp_param=max(c.fsdp_param if c.fsdp_param >= 0 else c.working_param for c in cs),
            copy=avg(lambda c: c.copy),
        )

    def _state_bytes(self, p_local: float) -> float:
        """Held between steps: parameter, gradient, AdamW's exp_avg and exp_avg_sq (sharded by FSDP)."""
        return p_local * 4 * self.ctx.prec.bytes("param") / self.cfg.shard

    def _copy_bytes(self, p_local: float) -> float:
        """Without FSDP, under mixed precision, the step casts each weight to the compute dtype
        once and the backward reads that copy: held through the step (not between steps)."""
        prec = self.ctx.prec
        return p_local * prec.bytes("compute") if prec.compute != prec.param and not self.cfg.fsdp else 0.0

    # -- embedding / head ---------------------------------------------------------------------
    def _outer(self):
        ctx, cfg, hw, m = self.ctx, self.cfg, self.ctx.hw, self.ctx.model
        tp, mb = cfg.tp, self.tokens
        tied_vocab, tied_rep = m.tied_outside if self.post_rank else (0, 0)  # a copy on another rank
        # Shared by the configurations of a search that differ only in pp (beyond where the tied
        # copy is), schedule, v and reshard.
        key = ("outer", tp, mb, cfg.sp, cfg.fsdp, cfg.dp_shard, cfg.dp_replicate, cfg.fsdp_once, self.M,
               bool(self.post_rank), cfg.cp)
        if key not in self._cache:
            self._cache[key] = {name: self._outer_segment(name, prof, tied_vocab, tied_rep)
                                for name, prof in (("pre", m.pre), ("post", m.post))}
        self.outer = self._cache[key]
        hid = mb * m.seq_len * m.hidden * ctx.act_bytes / (tp if cfg.sp else 1)
        self.p2p = self.pp_runtime = 0.0
        # The tied weight's two gradient copies (first and last stage) summed once per step, over
        # a group of two ranks as far apart as the pipeline's ends (Megatron's embedding group).
        self.tied_grad_bytes = (tied_vocab / tp + tied_rep) * ctx.prec.bytes("param") / cfg.shard
        self.tied_ar = 0.0
        if self.tied_grad_bytes:
            g_ends = group_on_mesh([2, cfg.dp_replicate, cfg.dp_shard * cfg.cp, cfg.tp], 0, hw.gpus_per_node)
            self.tied_ar = self._ct("all_reduce", self.tied_grad_bytes, g_ends)
        if cfg.pp > 1:
            self.p2p = 2 * self._ct("send_recv", hid, self.g_pp) * cfg.v
            # The schedule's own time per microbatch and stage chunk (forward and backward actions).
            self.pp_runtime = hw.pp_microbatch_us * 1e-6 * cfg.v

    def _outer_segment(self, name: str, prof, tied_vocab: float, tied_rep: float) -> dict:
        ctx, cfg = self.ctx, self.cfg
        tp, mb = cfg.tp, self.tokens
        ct = self._times(prof.costs, mb, tp, cfg.sp, False)
        p_local = prof.params_vocab / tp + prof.params_rep
        if name == "post":  # the last stage's copy of a head tied to the embedding
            p_local += tied_vocab / tp + tied_rep
        ag, rs, busy = self._fsdp_collectives(p_local, True)  # the embedding and head reshard
        fsdp = self._fsdp_exposed(ag, rs, ct.fwd, ct.bwd, True)
        tp_t = sum((nf + nb) * self._ct(kind, nbytes, self.g_tp)
                   for kind, nbytes, nf, nb, _ in tp_outer_collectives(name, cfg, ctx))
        # The backward's gradients of one op's outputs and inputs (the vocabulary part on its shards).
        def largest(pairs) -> float:
            return mb * ctx.bytes_scale * max((v / tp + r for v, r in pairs), default=0.0)

        fused = ctx.compiled and ctx.fused_loss
        grad_ws = largest(prof.grad_ws if fused else prof.grad_ws_eager)
        # Compiled, the loss's backward is one fused kernel: it writes the logits' gradient while
        # the loss's saved tensors are alive; eager, its ops' gradients are ``grad_ws`` beside them.
        logits = largest(prof.grad_out)  # the head's output (its gradient, compiled) in the compute dtype
        grad_out = logits if fused else grad_ws
        eager = self._eager_tp_overhead(1, 0)  # the vocabulary-parallel embedding or head
        return {
            "time": ct.fwd + ct.bwd + tp_t + fsdp + eager,
            "parts": {"compute": ct.fwd + ct.bwd, "tp_comm": tp_t, "fsdp_comm": fsdp, "tp_eager_overhead": eager},
            "static": self._state_bytes(p_local),
            "copy": self._copy_bytes(p_local),
            "working": p_local * ctx.act_bytes,
            "hidden_comm": max(0.0, busy - fsdp),
            "act_vocab": mb * ctx.bytes_scale * prof.saved_vocab / tp,
            "act_rep": mb * ctx.bytes_scale * prof.saved_rep,
            "grad_ws": grad_ws,
            "grad_out": grad_out,
            "logits": logits,
            "flops": ct.flops,
        }

    # -- per rank -----------------------------------------------------------------------------
    def inflight(self, r: int) -> float:
        """Microbatches whose activations rank ``r`` holds at its peak (per layer)."""
        cfg, M = self.cfg, self.M
        if cfg.pp == 1:
            return 1.0
        if cfg.schedule == "gpipe":
            return float(M)
        if cfg.schedule == "1f1b" or cfg.v == 1:
            return float(min(M, cfg.pp - r))
        # interleaved, interleaved_zb and zbv: the warm-up of the interleaved schedule (zero-bubble
        # schedules keep the activations a deferred weight gradient reads until W runs).
        chunks = min(M * cfg.v, (cfg.v - 1) * cfg.pp + 2 * (cfg.pp - 1 - r) + 1)
        return chunks / cfg.v

    def rank_time(self, r: int, ac: tuple[int, int, int]) -> float:
        c = self.coeffs
        t = sum(n * c.time[a] for n, a in zip(ac, AC_MODES))
        if r == 0:
            t += self.outer["pre"]["time"]
        if r == self.post_rank:
            t += self.outer["post"]["time"]
        return t + self.p2p + self.pp_runtime

    def rank_affine(self, r: int) -> tuple[float, list[float], float, list[float]]:
        """``rank_time`` and total ``rank_memory`` of rank ``r`` as affine functions of its
        (none, selective, full) layer counts: ``(t0, tc, m0, mc)``, from as few evaluations as
        their form allows (the search asks for every rank of every configuration). Time is
        linear in the counts; a layer's memory is the same on every rank but for its activations,
        which scale with the microbatches the rank holds in flight; with no layers, a rank's time
        and memory depend only on whether it runs the first and the last stage (and, on the
        first, the embedding's in-flight activations)."""
        first, last, inflight = r == 0, r == self.post_rank, self.inflight(r)
        key = (first, last, inflight if first else None)
        if key not in self._affine:
            self._affine[key] = (self.rank_time(r, (0, 0, 0)), sum(self.rank_memory(r, (0, 0, 0), bound=True).values()))
        t0, m0 = self._affine[key]
        act = [self.coeffs.act[a] for a in AC_MODES]
        if self._layer_memory is None:  # a layer's memory less its activations, from this rank
            self._layer_memory = [sum(self.rank_memory(r, e, bound=True).values()) - m0 - inflight * act[i]
                                  for i, e in enumerate(((1, 0, 0), (0, 1, 0), (0, 0, 1)))]
        mc = [base + inflight * x for base, x in zip(self._layer_memory, act)]
        return t0, [self.coeffs.time[a] for a in AC_MODES], m0, mc

    def rank_memory(self, r: int, ac: tuple[int, int, int], bound: bool = False) -> dict:
        """Rank ``r``'s memory at its peak with ``ac`` = its (none, selective, full) layer counts.

        The step's peak is in its backward, with every layer's saved activations alive (``act``),
        the gathered parameters (``working``) and, on top, the largest of these moments (the
        compiled program's: the loss's and the head's gradients are made in fused kernels,
        ``memory.py``): the loss's forward and backward, beside the loss's saved vocabulary-sized
        tensors; the head's backward and its gradients' reduction, those tensors freed; a layer's backward
        start, with what it recomputes; a layer's backward end, its own activations freed and its
        gradients copied into the flat bucket of their reduction, in the reduce dtype; the
        embedding's backward and reduction. ``bound``: the layer moments over every AC mode, not
        only those in ``ac`` (``rank_affine``'s constant, which must not depend on the counts)."""
        cfg, c, ctx = self.cfg, self.coeffs, self.ctx
        n = sum(ac)
        inflight = self.inflight(r)
        act = inflight * sum(k * c.act[a] for k, a in zip(ac, AC_MODES))
        static = n * c.static
        working = n * c.copy
        keep = cfg.reshard and cfg.fsdp_once != "gather"
        if cfg.shard > 1:
            working += ((1 + cfg.prefetch) * c.working_param) if keep else n * c.working_param
            if cfg.fsdp_once:  # unsharded fp32 gradients accumulated across the microbatches
                working += n * c.working_param / ctx.act_bytes * ctx.reduce_bytes

        def flat(param_bytes: float) -> float:
            """The flat reduce buffer of a bucket of ``param_bytes`` (compute dtype); under
            ``fsdp_once="gather"`` each gradient's cast to the reduce dtype before it is added into
            the step's buffer (passes/accumulate.py); none where the gradients accumulate unsharded
            and are reduced in place (fsdp_once="reduce") or are not reduced."""
            if cfg.dp == 1 or cfg.fsdp_once == "reduce":
                return 0.0
            if cfg.fsdp_once == "gather" and ctx.reduce_bytes == ctx.act_bytes:
                return 0.0
            return param_bytes / ctx.act_bytes * ctx.reduce_bytes

        # A layer's weight gradients (compute dtype) and their flat reduce buffer: of the parameters
        # FSDP reduces, beside owned experts' gradients stacked (compute dtype) for the all-to-all
        # that sends them back; gathered once per step, of every parameter (each gradient cast
        # before it is added into the step's buffer).
        if c.fsdp_param >= 0 and cfg.fsdp_once != "gather":
            grads = c.working_param + flat(c.fsdp_param) + (c.working_param - c.fsdp_param)
        else:
            grads = c.working_param + flat(c.working_param)
        modes = [a for k, a in zip(ac, AC_MODES) if k or bound] or ["none"]
        moments = [max(c.act["none"] - c.act[a], grads - c.act[a]) for a in modes]
        post_inflight = float(self.M) if (cfg.pp > 1 and cfg.schedule == "gpipe") else 1.0
        outer_act = 0.0
        for name, on in (("pre", r == 0), ("post", r == self.post_rank)):
            if not on:
                continue
            o = self.outer[name]
            static += o["static"]
            working += o["copy"]
            if name == "post":
                outer_act += o["act_rep"] * post_inflight
                loss = o["act_vocab"] * post_inflight + o["grad_out"]
                if cfg.tp > 1:  # loss parallelism (DTensor's) also writes an fp32 logits-sized target mask
                    loss += o["logits"] / ctx.act_bytes * 4
                moments += [loss, o["grad_ws"] + flat(o["working"])]
            else:
                outer_act += (o["act_vocab"] + o["act_rep"]) * inflight
                moments.append(o["grad_ws"] + flat(o["working"]))
            if cfg.shard > 1:
                if keep:  # gathered at use and freed: one of the working set
                    working = max(working, o["working"])
                else:
                    # The head's gathered weight is kept for its backward; not resharded, the
                    # embedding's is still freed after its forward (its backward reads no weight),
                    # far from the backward's peak, unless gathered for the whole step.
                    kept = name == "post" or cfg.fsdp_once == "gather"
                    grads = ctx.reduce_bytes / ctx.act_bytes if cfg.fsdp_once else 0.0  # accumulated whole
                    working += o["working"] * (kept + grads)
        return {
            "parameters+grads+optimizer": static,
            "unsharded_params": working,
            "activations": act + outer_act + max(moments),
            "reserve": ctx.hw.reserve_gb * GiB,
        }

    # -- whole step ---------------------------------------------------------------------------
    def step_time(self, rank_times: list[float]) -> float:
        return max(self.critical_path(rank_times), self.node_throughput_bound(rank_times))

    def critical_path(self, rank_times: list[float]) -> float:
        """The step when every rank computes on its own device: pipeline, optimizer, DP comm."""
        cfg, M = self.cfg, self.M
        if cfg.pp == 1:
            pipe = M * rank_times[0]
        else:
            mx = max(rank_times)
            bubble = sum(rank_times) / cfg.v + (cfg.v - 1) / cfg.v * mx - mx
            pipe = M * mx + bubble * self.zero_bubble_factor()
        return pipe + self.optimizer_time() + self.dp_exposed() + self.tied_ar

    def zero_bubble_factor(self) -> float:
        """The share of the 1F1B-style bubble left when the schedule runs the weight gradients (W)
        apart from the input gradients (B) and fills the bubble with them (Qi et al. 2023):
        ``(F + B - W) / (F + B + W)`` for interleaved zero bubble (ZB-H1 per chunk) and
        ``max(0, F + B - 2W) / (F + B + W)`` for the V schedule (ZB-H2-like at 1F1B memory), with
        W a third of the layer's compute (the weight-gradient matmuls of its linears: forward,
        input-gradient and weight-gradient matmuls cost the same) and the rest (communication,
        runtime) not movable. 1 for other schedules."""
        sched = self.cfg.schedule
        if sched not in ZERO_BUBBLE:
            return 1.0
        parts = self.coeffs.parts["none"]
        total = sum(parts.values())
        w = parts.get("compute", 0.0) / 3 / total if total > 0 else 0.0
        return (1 - 2 * w) if sched == "interleaved_zb" else max(0.0, 1 - 3 * w)

    def node_throughput_bound(self, rank_times: list[float]) -> float:
        """When a node's ranks share fewer compute slots than there are ranks (CPU processes on
        fewer cores), the step lasts at least the node's total busy time over its slots: ranks
        idle in a pipeline bubble leave their share to the others. 0 with a device per rank."""
        hw = self.ctx.hw
        on_node = min(self.cfg.world, hw.gpus_per_node)
        if not hw.compute_slots or hw.compute_slots >= on_node:
            return 0.0
        # Overlapped communication still occupies the shared cores (gloo reduces and copies on them).
        busy = [self.M * (t + self.rank_hidden_comm(r)) + self.optimizer_time() + self.dp_busy()
                for r, t in enumerate(rank_times)]
        return on_node * (sum(busy) / len(busy)) / hw.compute_slots  # the node's ranks spread over the stages

    def rank_hidden_comm(self, r: int) -> float:
        """Communication overlapped with compute on rank ``r`` per microbatch (balanced layers, no AC)."""
        t = self.balanced_layers()[r] * self.coeffs.hidden_comm["none"]
        if r == 0:
            t += self.outer["pre"]["hidden_comm"]
        if r == self.post_rank:
            t += self.outer["post"]["hidden_comm"]
        return t

    def optimizer_time(self) -> float:
        ranks = [self.rank_params(r) for r in range(self.cfg.pp)] if self.cfg.pp > 1 else [self.rank_params(0)]
        p = max(ranks)
        # AdamW reads param, grad, two states and writes param and two states: 7 master-dtype values.
        moved = p / self.cfg.shard * 7 * self.ctx.prec.bytes("param")
        return moved / (self.ctx.hw.memory_bandwidth_gbps * 1e9 * self.ctx.hw.eff("memory"))

    def rank_params(self, r: int) -> float:
        """Local parameter elements of rank ``r`` under a balanced split."""
        if r not in self._params:
            self._params[r] = self._rank_params(r)
        return self._params[r]

    def _rank_params(self, r: int) -> float:
        m, cfg = self.ctx.model, self.cfg
        n = self.balanced_layers()[r]
        p = n * (m.blocks[0].params_tp / cfg.tp + m.blocks[0].params_rep) if m.blocks else 0
        if r == 0:
            p += m.pre.params_vocab / cfg.tp + m.pre.params_rep
        if r == self.post_rank:
            tied_vocab, tied_rep = m.tied_outside if self.post_rank else (0, 0)
            p += (m.post.params_vocab + tied_vocab) / cfg.tp + m.post.params_rep + tied_rep
        return p

    def balanced_layers(self) -> tuple[int, ...]:
        if self._balanced is None:
            L, pp = self.ctx.model.n_layers, self.cfg.pp
            self._balanced = tuple(L // pp + (1 if r < L % pp else 0) for r in range(pp))
        return self._balanced

    def dp_exposed(self) -> float:
        cfg = self.cfg
        if cfg.dp * cfg.cp == 1 or cfg.fsdp:
            return 0.0
        p = max(self.rank_params(r) for r in range(cfg.pp))
        ar = self._ct("all_reduce", p * self.ctx.reduce_bytes, self.g_dp)
        if not cfg.dp_overlap:
            return ar
        window = self.coeffs.parts["none"]["compute"] * 2 / 3 * max(1, self.balanced_layers()[0])
        return max(0.0, ar - window) + self._ct("all_reduce", min(p * self.ctx.reduce_bytes, 25e6), self.g_dp)

    def dp_busy(self) -> float:
        """Processor time of the data-parallel gradient all-reduce (without FSDP): its exposed
        part, or its transfer work where that is larger (overlapped, it still runs on the cores)."""
        cfg = self.cfg
        if cfg.dp * cfg.cp == 1 or cfg.fsdp:
            return 0.0
        p = max(self.rank_params(r) for r in range(cfg.pp))
        return max(self.dp_exposed(), self._cx("all_reduce", p * self.ctx.reduce_bytes, self.g_dp))

    def evaluate(self, a: Assignment) -> Estimate:
        cfg, ctx, m = self.cfg, self.ctx, self.ctx.model
        times = [self.rank_time(r, a.ac[r]) for r in range(cfg.pp)]
        T = self.step_time(times)
        mems = [self.rank_memory(r, a.ac[r]) for r in range(cfg.pp)]
        totals = [sum(x.values()) for x in mems]
        peak_r = max(range(cfg.pp), key=lambda r: totals[r])
        # Breakdown from the bottleneck rank, scaled by the microbatch count.
        b = max(range(cfg.pp), key=lambda r: times[r])
        parts = dict.fromkeys(self.coeffs.parts["none"], 0.0)
        for n, ac in zip(a.ac[b], AC_MODES):
            for k, v in self.coeffs.parts[ac].items():
                parts[k] += n * v
        for name, on in (("pre", b == 0), ("post", b == self.post_rank)):
            if on:
                for k, v in self.outer[name]["parts"].items():
                    parts[k] += v
        breakdown = {k: v * self.M for k, v in parts.items()}
        breakdown["pp_p2p"] = self.p2p * self.M
        breakdown["pp_runtime"] = self.pp_runtime * self.M
        crit = self.critical_path(times)
        breakdown["bubble"] = crit - self.optimizer_time() - self.dp_exposed() - self.tied_ar - times[b] * self.M
        breakdown["shared_cores"] = T - crit
        breakdown["optimizer"] = self.optimizer_time()
        breakdown["dp_comm"] = self.dp_exposed()
        breakdown["pp_tied_grads"] = self.tied_ar
        tokens = ctx.global_batch * m.seq_len
        tps = tokens / T / cfg.world
        mfu = m.model_flops_per_token() * tokens / (T * cfg.world * ctx.hw.peak_tflops * 1e12)
        return Estimate(
            config=cfg, assignment=a, step_time_s=T, breakdown=breakdown, memory_bytes=totals,
            memory_breakdown=mems[peak_r], tokens_per_s_per_gpu=tps, mfu=mfu,
            collectives=self.collectives(a), activation_bytes=[x["activations"] for x in mems],
        )

    def collectives(self, a: Assignment) -> list[dict]:
        """The collectives one step issues on the busiest rank: kind, group, bytes, count."""
        cfg, ctx, m, M = self.cfg, self.ctx, self.ctx.model, self.M
        out = []
        n = max(a.layers)
        n_full = max(x[2] for x in a.ac)
        if cfg.tp > 1 and m.blocks:
            for kind, nbytes, nf, nb, why in tp_layer_collectives(m.blocks[0], cfg, ctx):
                count = (nf * (n + n_full) + nb * n) * M
                if count:
                    out.append({"kind": kind, "group": "tp", "group_size": cfg.tp, "bytes": nbytes,
                                "count": count, "why": why})
            for name in ("pre", "post"):
                for kind, nbytes, nf, nb, why in tp_outer_collectives(name, cfg, ctx):
                    if nf + nb:
                        out.append({"kind": kind, "group": "tp", "group_size": cfg.tp, "bytes": nbytes,
                                    "count": (nf + nb) * M, "why": why})
        if cfg.cp > 1 and m.blocks:
            for kind, nbytes, nf, nb, why in cp_layer_collectives(m.blocks[0], cfg, ctx):
                count = (nf * (n + n_full) + nb * n) * M
                if count:
                    out.append({"kind": kind, "group": "cp", "group_size": cfg.cp, "bytes": nbytes, "count": count,
                                "why": why})
        moe = next((b for b in m.blocks if b.experts), None)
        if cfg.ep > 1 and moe is not None:
            share = sum(1 for x in self.layers if x.experts) / len(self.layers)  # the layers with experts
            for kind, nbytes, nf, nb, why in ep_layer_collectives(moe, cfg, ctx):
                size = self._ep_group(why).size
                if size == 1:  # node-limited routing inside one node: no network part
                    continue
                again = 0 if why in (EP_WEIGHTS, EP_WEIGHTS_SHARDS) else n_full  # a full recompute routes the rows again
                name = {EP_WEIGHTS_SHARDS: "dp_shard / ep", EP_NODES: "ep, one rank a node",
                        EP_IN_NODE: "ep within a node"}.get(why, "ep")
                out.append({"kind": kind, "group": name, "group_size": size, "bytes": nbytes,
                            "count": round((nf * (n + again) + nb * n) * share * M), "why": why})
        shard_group = "dp_shard" if cfg.cp == 1 else "dp_shard x cp"
        if cfg.shard > 1:
            p = self.coeffs.fsdp_param if self.coeffs.fsdp_param >= 0 else self.coeffs.working_param
            per = 1 if cfg.fsdp_once == "gather" else M
            ag_count = n * per * (2 if cfg.reshard and cfg.fsdp_once != "gather" else 1)
            if cfg.fsdp_unit == "tensor" and m.blocks:
                k = len(m.blocks[0].param_shapes)
                out.append({"kind": "all_gather", "group": shard_group, "group_size": cfg.shard,
                            "bytes": p / k, "count": ag_count * k,
                            "why": "FSDP parameter unshard per tensor (mean size)"})
            else:
                out.append({"kind": "all_gather", "group": shard_group, "group_size": cfg.shard,
                            "bytes": p, "count": ag_count, "why": "FSDP parameter unshard per layer"})
            out.append({"kind": "reduce_scatter", "group": shard_group, "group_size": cfg.shard,
                        "bytes": p / ctx.act_bytes * ctx.reduce_bytes, "count": n * (1 if cfg.fsdp_once else M),
                        "why": "FSDP gradient reduce per layer"})
            if cfg.dp_replicate > 1:
                out.append({"kind": "all_reduce", "group": "dp_replicate", "group_size": cfg.dp_replicate,
                            "bytes": p / ctx.act_bytes * ctx.reduce_bytes / cfg.shard,
                            "count": n * (1 if cfg.fsdp_once else M),
                            "why": "HSDP gradient all-reduce across replicas"})
        elif cfg.dp * cfg.cp > 1:
            p = max(self.rank_params(r) for r in range(cfg.pp))
            out.append({"kind": "all_reduce", "group": "dp" if cfg.cp == 1 else "dp x cp", "group_size": cfg.dp * cfg.cp,
                        "bytes": p * ctx.reduce_bytes,
                        "count": 1, "why": "data-parallel gradient all-reduce (bucketed)"})
        if cfg.pp > 1:
            hid = self.tokens * m.seq_len * m.hidden * ctx.act_bytes / (cfg.tp if cfg.sp else 1)
            out.append({"kind": "send_recv", "group": "pp", "group_size": cfg.pp, "bytes": hid,
                        "count": 2 * M * cfg.v, "why": "pipeline activations and gradients"})
            if self.tied_grad_bytes:
                out.append({"kind": "all_reduce", "group": "pp ends", "group_size": 2, "bytes": self.tied_grad_bytes,
                            "count": 1, "why": "gradients of the weight tied across the first and last stage"})
        return out


def _split_saved(saved: tuple, tp: int, seq_div: int) -> float:
    """One rank's share of a layer's saved bytes ``(TP-split, replicated[, whole])``: the TP-split
    part on its shard, the replicated part on its sequence shard under SP, the whole part (a row
    linear's output, which selective AC saves before its reduction, whole, and after it, on the
    sequence shard under SP) twice."""
    return saved[0] / tp + saved[1] / seq_div + (saved[2] * (1 + 1 / seq_div) if len(saved) > 2 else 0.0)


def tp_layer_collectives(b: BlockProfile, cfg: Config, ctx: CostContext) -> list[tuple]:
    """What the TP pass inserts per layer and microbatch: (kind, bytes, forward count, backward
    count, why). Each input the layer's columns read is gathered once, at its own width (the
    normed hidden states; a compressed latent); each row reduces once at the hidden width. Without
    SP: all-reduce forward at rows, backward at gathers. With SP: all-gather/reduce-scatter in
    place of each, mirrored in backward."""
    if cfg.tp == 1 or not b.rows:
        return []
    token = cfg.mb / cfg.cp * ctx.model.seq_len * ctx.act_bytes
    msg, r = token * ctx.model.hidden, b.rows
    out: dict = {}  # (kind, bytes) -> [forward count, backward count]

    def add(kind: str, nbytes: float, fwd: float, bwd: float) -> None:
        counts = out.setdefault((kind, nbytes), [0, 0])
        counts[0] += fwd
        counts[1] += bwd

    if not cfg.sp:  # Megatron: the row outputs all-reduced (fwd), each gathered input's gradient (bwd)
        add("all_reduce", msg, r, 0)
        for width in gathered_features(b, ctx.model.hidden):
            add("all_reduce", token * width, 0, 1)
    else:  # each all-reduce as a reduce-scatter and an all-gather, mirrored in the backward
        add("reduce_scatter", msg, r, 0)
        add("all_gather", msg, 0, r)
        for width in gathered_features(b, ctx.model.hidden):
            add("all_gather", token * width, 1, 0)
            add("reduce_scatter", token * width, 0, 1)
    why = {"all_reduce": "TP row outputs (fwd), column inputs' gradients (bwd)",
           "all_gather": "SP: column inputs (fwd), row outputs' gradients (bwd)",
           "reduce_scatter": "SP: row outputs (fwd), column inputs' gradients (bwd)"}
    return [(kind, nbytes, f, bw, why[kind]) for (kind, nbytes), (f, bw) in out.items()]


def gathered_features(b: BlockProfile, hidden: int) -> tuple[int, ...]:
    """The features of each input TP gathers per layer: as the analysis recorded them, else one
    hidden-wide input per gather."""
    return b.gather_features or (hidden,) * b.gathers


def cp_layer_collectives(b: BlockProfile, cfg: Config, ctx: CostContext) -> list[tuple]:
    """What context parallelism moves per layer and microbatch (kind, bytes, forward count,
    backward count, why): the keys and values of the whole sequence gathered before attention
    (in the forward, and again in the backward, which frees them in between), and their
    gradients reduce-scattered back to the ranks that own those tokens. Under TP each rank
    gathers its own key/value heads."""
    if cfg.cp == 1:
        return []
    kv_local = b.kv_heads // cfg.tp if b.kv_heads >= cfg.tp else b.kv_heads
    msg = cfg.mb * ctx.model.seq_len * 2 * kv_local * b.head_dim * ctx.act_bytes
    # Causal balance: each rank swaps half its queries (and back, their outputs) with the mirror
    # rank, so every rank computes chunks 2r and 2cp-1-2r of 2cp (passes/cp.py); the backward
    # swaps the outputs' and the queries' gradients.
    heads_local = (b.heads or b.kv_heads) // cfg.tp if (b.heads or b.kv_heads) >= cfg.tp else (b.heads or b.kv_heads)
    half = cfg.mb * ctx.model.seq_len / (2 * cfg.cp) * heads_local * b.head_dim * ctx.act_bytes
    return [("all_gather", msg, 1, 1, "CP: keys and values of the whole sequence (attention), again in backward"),
            ("reduce_scatter", msg, 0, 1, "CP: key and value gradients to their tokens' ranks"),
            ("send_recv", half, 2, 2, "CP: half the queries and their outputs swapped with the mirror rank")]


EP_ROWS = "EP: routed rows to their experts' ranks and back (fwd), their gradients (bwd)"
EP_NODES = ("EP: each token once to each node its experts are on and back (fwd), the gradients (bwd): "
            "node-limited routing")
EP_IN_NODE = "EP: the tokens fanned out to their experts' ranks inside the node and back, and their gradients"
EP_WEIGHTS = "EP: experts' weight shards to their experts' ranks (fwd), again after reshard, gradients back (bwd)"
EP_WEIGHTS_SHARDS = ("EP: the owners' shards of their experts' weights gathered over dp_shard / ep (fwd), again after "
                     "reshard, their gradients reduced (bwd)")


def ep_group(cfg: Config, gpus_per_node: int) -> Group:
    """The ep group: ``ep`` consecutive data-parallel ranks (passes/ep.py), cp x tp ranks apart."""
    return group_on_mesh([cfg.pp, cfg.dp // cfg.ep, cfg.ep, cfg.cp * cfg.tp], 2, gpus_per_node)


def ep_owned(cfg) -> bool:
    """Whether each ep rank reads only its own experts' weights: FSDP shards them over the ep
    ranks or a multiple of them (``passes/ep.py``: ``owned_weights``: the ep ranks' shards of its
    experts sent to each owner, then, over ``dp_shard / ep`` ranks, the rest gathered, as
    torchtitan shards experts over ``dp_shard_mod_ep``). Experts held as 3-D parameters are split
    along the experts: over exactly the ep ranks each rank's shard is its experts' weights, with
    no exchange, and beyond them a piece of them, the rest gathered over the ``dp_shard / ep``
    ranks holding it (``ep.assembled_stacked``). Else every expert is gathered as FSDP gathers.
    ``cfg``: a ``Config`` or a ``Plan`` (the same fields)."""
    return cfg.ep > 1 and cfg.fsdp and cfg.dp_shard % cfg.ep == 0 and cfg.cp == 1


def ep_layer_collectives(b: BlockProfile, cfg: Config, ctx: CostContext) -> list[tuple]:
    """What expert parallelism moves per layer and microbatch (kind, bytes each rank sends,
    forward count, backward count, why): the experts' row counts, each token's ``top_k`` rows to
    their experts' ranks and the experts' outputs back (the busiest rank's: ``ctx.ep_imbalance``
    times the even share), biased experts' row indices (one integer a row), and, where each rank
    receives its own experts' weights (``ep_owned``, experts as modules: 3-D experts' are the
    rank's own shard already), their shards."""
    if cfg.ep == 1 or not b.experts:
        return []
    n_experts, top_k = b.experts
    m = ctx.model
    n_tokens = cfg.mb / cfg.cp * m.seq_len * ctx.ep_imbalance
    n_rows = n_tokens * top_k
    out = [("all_to_all", 8.0 * n_experts, 1, 0, "EP: each expert's routed row count")]
    row = m.hidden * ctx.act_bytes
    if not (cfg.ep_nodes or cfg.ep_fp8):
        out.append(("all_to_all", n_rows * row, 2, 2, EP_ROWS))
    else:  # a published run's dispatch (``Config.ep_nodes``, ``ep_fp8``)
        sent = m.hidden * (1.0 if cfg.ep_fp8 else ctx.act_bytes)  # FP8's per-tile scales: under 1%
        if cfg.ep_nodes:
            copies = n_tokens * min(cfg.ep_nodes, top_k, ep_group(cfg, ctx.hw.gpus_per_node).nodes)
            out += [("all_to_all", copies * sent, 1, 0, EP_NODES), ("all_to_all", copies * row, 1, 2, EP_NODES),
                    ("all_to_all", n_rows * sent, 1, 0, EP_IN_NODE), ("all_to_all", n_rows * row, 1, 2, EP_IN_NODE)]
        else:
            out += [("all_to_all", n_rows * sent, 1, 0, EP_ROWS), ("all_to_all", n_rows * row, 1, 2, EP_ROWS)]
    if b.experts_biased:  # each row's expert index travels with it (its bias, passes/ep.py)
        out.append(("all_to_all", 8.0 * n_rows, 1, 0, "EP: routed rows' expert indices (biases)"))
    if ep_owned(cfg):
        n = sum(1 for l in b.linears if l.group)
        whole = b.expert_params / n / cfg.tp / cfg.ep  # one linear's experts of one rank, whole
        k = cfg.dp_shard // cfg.ep  # the ranks its experts' FSDP shards are spread over beyond ep
        # Read in the forward (again in the backward after a reshard), the gradients sent back;
        # once per step (zero.py), the weights there and the gradients back once.
        once = cfg.fsdp_once == "gather"
        per = 1 / (ctx.global_batch // cfg.dp // cfg.mb) if once else 1
        again = 1 if cfg.reshard and not once else 0
        if not b.experts_stacked:  # one all-to-all per grouped linear (gate, up, down): 3-D experts need none
            out += [("all_to_all", whole / k * ctx.act_bytes, n * per, n * again, EP_WEIGHTS),
                    ("all_to_all", whole / k * ctx.reduce_bytes, 0, n * per, EP_WEIGHTS)]
        if k > 1:
            out += [("all_gather", whole * ctx.act_bytes, n * per, n * again, EP_WEIGHTS_SHARDS),
                    ("reduce_scatter", whole * ctx.reduce_bytes, 0, n * per, EP_WEIGHTS_SHARDS)]
    return out


def tp_outer_collectives(segment: str, cfg: Config, ctx: CostContext) -> list[tuple]:
    """TP collectives of the vocabulary-parallel embedding ("pre") and head ("post")."""
    if cfg.tp == 1:
        return []
    m = ctx.model
    msg = cfg.mb / cfg.cp * m.seq_len * m.hidden * ctx.act_bytes
    if segment == "pre":  # an image or latent model has no token table: its input layer is replicated
        if not cfg.sp:
            return [("all_reduce", msg, 1, 0, "vocab-parallel embedding output")] if m.pre.params_vocab else []
        # The residual stream splits at the first block: the embedding's partial sums are
        # reduce-scattered into it (or a replicated input layer's output split), its gradient gathered.
        out = [("reduce_scatter", msg, 1, 0, "SP: vocab-parallel embedding output")] if m.pre.params_vocab else []
        return out + [("all_gather", msg, 0, 1, "SP: residual stream gradient at the first block")]
    if not (m.post.params_vocab or m.tied_outside[0]):  # a head kept whole (not under a cross-entropy)
        return [("all_gather", msg, 1, 0, "SP: head input")] if cfg.sp else []
    # Loss parallelism: the logits stay split; three all-reduces of one fp32 value per token
    # (row max, sum of exponentials, the target's logit).
    per_token = cfg.mb / cfg.cp * m.seq_len * 4
    out = [("all_reduce", per_token, 3, 0, "loss-parallel cross-entropy: max, sum of exponentials, target logit")]
    if cfg.sp:
        out += [("all_gather", msg, 1, 0, "SP: head input"), ("reduce_scatter", msg, 0, 1, "SP: head input gradient")]
    else:
        out.append(("all_reduce", msg, 0, 1, "vocab-parallel head: input gradient"))
    return out


def uniform_assignment(sm: StageModel, ac: str) -> Assignment:
    layers = sm.balanced_layers()
    idx = AC_MODES.index(ac)
    return Assignment(tuple(layers), tuple(tuple(n if i == idx else 0 for i in range(3)) for n in layers))


def estimate(ctx: CostContext, cfg: Config, assignment: Assignment | None = None, ac: str = "none") -> Estimate:
    """Price one configuration (a hand-written plan): uniform layers and one AC mode by default."""
    validate_config(ctx, cfg)
    sm = StageModel(ctx, cfg)
    return sm.evaluate(assignment or uniform_assignment(sm, ac))


def validate_config(ctx: CostContext, cfg: Config, *, priced_only: bool = False) -> None:
    """Refuse a configuration that cannot be priced. ``priced_only`` (``autopar estimate`` of a
    published run): a 1F1B or GPipe pipeline with fewer microbatches than stages is priced (its
    bubble is the larger share: Megatron-LM ran such runs), though autopar does not run one."""
    m = ctx.model
    if cfg.dp_shard < 1 or cfg.dp % cfg.dp_shard:
        raise AutoparError(f"dp_shard ({cfg.dp_shard}) must divide dp ({cfg.dp})")
    bad = m.max_tp_check(cfg.tp) if cfg.tp > 1 else []
    if bad:
        raise AutoparError(
            f"tp={cfg.tp} does not divide {', '.join(bad)} of {m.name}; choose a tp that divides "
            f"them (valid: {', '.join(str(t) for t in valid_tp_degrees(m))})"
        )
    if ctx.global_batch % cfg.dp:
        raise AutoparError(f"global batch {ctx.global_batch} is not divisible by dp={cfg.dp}")
    local = ctx.global_batch // cfg.dp
    if local % cfg.mb:
        raise AutoparError(f"local batch {local} (global {ctx.global_batch} / dp {cfg.dp}) is not divisible by mb={cfg.mb}")
    M = local // cfg.mb
    if cfg.pp > 1 and M < cfg.pp and not (priced_only and cfg.schedule in ("1f1b", "gpipe")):
        raise AutoparError(f"{M} microbatches cannot fill {cfg.pp} pipeline stages; use a smaller mb or pp")
    if cfg.schedule in ("interleaved", "interleaved_zb") and cfg.pp > 1 and (cfg.v < 2 or M % cfg.pp):
        raise AutoparError(f"{cfg.schedule} needs v >= 2 and microbatches ({M}) divisible by pp ({cfg.pp})")
    if cfg.schedule == "zbv" and cfg.pp > 1 and cfg.v != 2:
        raise AutoparError("the zbv schedule runs exactly two stages per rank (V-shaped): v=2")
    if cfg.pp * cfg.v > m.n_layers:
        raise AutoparError(f"pp*v = {cfg.pp * cfg.v} exceeds the {m.n_layers} layers of {m.name}")
    if cfg.sp and cfg.tp == 1:
        raise AutoparError("sequence parallelism needs tp > 1")
    validate_cp(m, cfg.cp)
    validate_ep(m, cfg.ep, cfg.dp)
    if cfg.sp and m.seq_len % cfg.tp:
        raise AutoparError(f"sequence parallelism splits the {m.seq_len}-token sequence over tp={cfg.tp} ranks, which does "
                           f"not divide it; use a sequence length that is a multiple of {cfg.tp}, or sp=0")


def validate_cp(m: ModelProfile, cp: int) -> None:
    """Refuse a context-parallel degree the model's sequences or attention cannot take."""
    if cp == 1:
        return
    if m.seq_len % (2 * cp):
        raise AutoparError(f"context parallelism splits each {m.seq_len}-token sequence into 2 x cp = {2 * cp} "
                           "chunks (two per rank, balancing causal attention); use a sequence length that "
                           f"is a multiple of {2 * cp}, or a smaller cp")
    missing = [b.cls_name for b in m.blocks if not (b.kv_heads and b.head_dim)]
    if missing:
        raise AutoparError(f"cp={cp}: the analysis found no attention heads in {', '.join(sorted(set(missing)))} "
                           f"of {m.name}, so what context parallelism gathers cannot be priced; use cp=1")


def validate_ep(m: ModelProfile, ep: int, dp: int | None = None) -> None:
    """Refuse an expert-parallel degree the model's experts or the data-parallel ranks cannot take."""
    if ep == 1:
        return
    counts = {b.experts[0] for b in m.blocks if b.experts}
    if not counts:
        raise AutoparError(f"ep={ep}: {m.name} has no routed experts (a mixture-of-experts block whose experts "
                           "are linears, or 3-D weights applied to the tokens routed to each), so there is nothing "
                           "to split over ep ranks; use ep=1")
    bad = sorted(e for e in counts if e % ep)
    if bad:
        raise AutoparError(f"ep={ep} does not divide the {bad[0]} experts of {m.name}'s blocks; choose an ep that "
                           f"divides {math.gcd(*counts)}")
    if dp is not None and dp % ep:
        raise AutoparError(f"ep={ep} ranks are carved out of the data-parallel ones, and dp={dp} is not a multiple of "
                           f"{ep}; choose an ep that divides dp")


def valid_tp_degrees(m: ModelProfile, limit: int = 512) -> list[int]:
    """TP degrees (up to ``limit``) that divide every head count and sharded dimension."""
    return [t for t in range(1, limit + 1) if not m.max_tp_check(t)]


@functools.lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))
