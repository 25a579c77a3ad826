"""Compute cost: a roofline per ATen node.

For a node with ``f`` FLOPs and ``m`` bytes moved, on a device of peak ``P`` FLOP/s and memory
bandwidth ``W``::

    t = max(f / (P * e_kind), m / (W * e_mem))

``e_kind`` is the achieved fraction of peak for matmuls or attention kernels, ``e_mem`` for
memory-bound ops; both come from the hardware profile (calibration sets them). Under Inductor,
element-wise chains fuse, so only ``fusion`` (a profile factor) of their bytes remain.

Scaling with the parallel configuration: a node's FLOPs and activation bytes grow with the
microbatch ``mb``; nodes in the TP region divide by the TP degree ``t``; nodes in the sequence
region divide by ``t`` only with sequence parallelism. Weight bytes divide by ``t`` in the TP
region. Causal attention kernels skip half of the score blocks. A profile's ``launch_us`` adds a
fixed cost per op; a profile's ``bandwidth_curve`` (measured by calibration) sets ``W`` by the bytes
an op moves (fused element-wise ops count ``fusion`` of one under Inductor). Backward costs ``2x`` the
forward for matmuls and memory-bound ops and ``2.5x`` for fused attention (FlashAttention-2's
backward recomputes the scores).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.analysis import KIND_ATTN, KIND_MATMUL, KIND_OTHER, NodeCosts
from autopar.cost_models.hardware import Hardware

BWD_FACTOR = {KIND_MATMUL: 2.0, KIND_ATTN: 2.5, KIND_OTHER: 2.0}


@dataclass(frozen=True)
class ComputeTimes:
    fwd: float
    bwd: float
    recompute_selective: float
    flops: float  # forward FLOPs executed (after sharding)


def memory_bandwidth(hw: Hardware, moved: np.ndarray) -> np.ndarray:
    """Achieved bytes/s of memory-bound ops moving ``moved`` bytes: the profile's measured curve,
    interpolated in log size (flat beyond its ends), or its flat bandwidth."""
    if hw.bandwidth_curve:
        sizes = np.log2([max(p[0], 1.0) for p in hw.bandwidth_curve])
        gbps = np.asarray([p[1] for p in hw.bandwidth_curve], dtype=np.float64)
        return np.interp(np.log2(np.maximum(moved, 1.0)), sizes, gbps) * 1e9 * hw.eff("memory")
    return np.full_like(np.asarray(moved, dtype=np.float64), hw.memory_bandwidth_gbps * 1e9 * hw.eff("memory"))


def node_times(
    costs: NodeCosts, hw: Hardware, *, mb: int, tp: int, sp: bool, bytes_scale: float = 1.0,
    compiled: bool = True, fp8: bool = False, seq_shard: int = 1, compute: str | None = None,
) -> ComputeTimes:
    """Roofline times of one microbatch of ``mb`` sequences through a node list."""
    if len(costs.names) == 0:
        return ComputeTimes(0.0, 0.0, 0.0, 0.0)
    rep_div = tp if sp else 1
    div = np.where(costs.tp, tp, rep_div).astype(np.float64) * seq_shard
    flops = costs.flops * mb / div
    act = costs.act_bytes * mb * bytes_scale / div
    if compiled:
        act = np.where(costs.kind == KIND_OTHER, act * hw.eff("fusion"), act)
    wbytes = costs.weight_bytes * bytes_scale / np.where(costs.tp, tp, 1)
    peak = hw.peak(compute) * 1e12
    mm_peak = peak * hw.eff("matmul") * (2.0 if fp8 else 1.0)
    rate = np.where(costs.kind == KIND_MATMUL, mm_peak, peak * hw.eff("attention"))
    eff_flops = np.where(costs.causal, flops * 0.5, flops)
    moved = act + wbytes
    bw = memory_bandwidth(hw, moved)
    t = np.maximum(eff_flops / rate, moved / bw)
    if hw.launch_us:
        # Eager runs every op; Inductor fuses the element-wise ones into few kernels.
        per_op = hw.launch_us * 1e-6
        t = t + (np.where(costs.kind == KIND_OTHER, per_op * hw.eff("fusion"), per_op) if compiled else per_op)
    bwd_f = np.select(
        [costs.kind == KIND_MATMUL, costs.kind == KIND_ATTN], [BWD_FACTOR[KIND_MATMUL], BWD_FACTOR[KIND_ATTN]],
        BWD_FACTOR[KIND_OTHER],
    )
    return ComputeTimes(
        fwd=float(t.sum()),
        bwd=float((t * bwd_f).sum()),
        recompute_selective=float(t[costs.recompute_selective].sum()),
        flops=float(flops.sum()),
    )
