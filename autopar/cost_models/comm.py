"""Collective communication cost: alpha-beta on a two-level (NVLink inside a node, network
across nodes) topology, ring and tree algorithms, as NCCL chooses between them.

For a group of ``G = k * N`` ranks, ``k`` per node on ``N`` nodes, moving a buffer of ``n`` bytes
(the full, unsharded size: the output of all-gather, the input of reduce-scatter):

- ring all-gather / reduce-scatter::

      t = (G-1) * alpha + (k-1)/k * n / B_intra            (N == 1)
      t = (G-1) * alpha + (k-1)/k * n / B_intra + (N-1)/N * n / (r * B_inter)   (N > 1)

  every rank has its own NIC; ``r = max(1, k * fabric)`` of a node's ``k`` NICs carry the rings
  in parallel (``fabric`` is an efficiency: 1 when the library spreads rings over every rail).
- all-reduce = reduce-scatter + all-gather (ring), or a tree for small buffers:
  ``2 log2(G) * alpha + 2 n / B_slowest``; the cheaper of the two is taken.
- all-to-all: ``(G-1) * alpha + (G-1)/G * n / B_slowest``.
- point-to-point: ``alpha + n / B`` on the link between the two ranks.

``B`` are the profile's per-GPU per-direction bandwidths times its ``collective`` efficiency. A
calibrated profile may carry fitted ``(alpha_us, beta_gbps)`` per collective and group size
(``collectives["all_reduce"]["8"] = [alpha, beta]``); those replace the analytic formula.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from autopar.cost_models.hardware import Hardware

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


class Group(NamedTuple):
    """A process group's shape on the topology: ``size`` ranks, ``per_node`` of them per node
    (a tuple: it keys the search's collective-time memo, hashed and compared in C)."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return max(1, self.size // max(1, self.per_node))


def group_on_mesh(dims: list[int], index: int, gpus_per_node: int) -> Group:
    """The group along mesh dim ``index`` of a row-major mesh ``dims`` (innermost last)."""
    stride = math.prod(dims[index + 1:])
    size = dims[index]
    if stride >= gpus_per_node:
        per_node = 1
    else:
        per_node = max(1, min(size, gpus_per_node // stride))
    return Group(size, per_node)


def _fitted(hw: Hardware, kind: str, g: Group, nbytes: float) -> float | None:
    table = hw.collectives.get(kind)
    if not table:
        return None
    key = str(g.size) if str(g.size) in table else None
    if key is None:
        return None
    alpha_us, beta_gbps = table[key]
    return alpha_us * 1e-6 + nbytes / (beta_gbps * 1e9)


def collective_transfer(hw: Hardware, kind: str, nbytes: float, g: Group) -> float:
    """The part of a collective's time that grows with the message (copies and reductions: the
    work that occupies the processor), without the fixed latency (waiting for the peers)."""
    return max(0.0, collective_time(hw, kind, nbytes, g) - collective_time(hw, kind, 1.0, g))


def collective_time(hw: Hardware, kind: str, nbytes: float, g: Group) -> float:
    """Seconds for one collective of ``kind`` moving ``nbytes`` (full buffer) over group ``g``."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    fitted = _fitted(hw, kind, g, nbytes)
    if fitted is not None:
        return fitted
    eff = hw.eff("collective")
    b_intra = hw.intra_node_gbps * 1e9 * eff
    b_inter = hw.inter_node_gbps * 1e9 * eff
    a_intra, a_inter = hw.latency_us["intra"] * 1e-6, hw.latency_us["inter"] * 1e-6
    k, n_nodes, G = g.per_node, g.nodes, g.size
    alpha = a_inter if n_nodes > 1 else a_intra
    b_slow = b_inter if n_nodes > 1 else b_intra
    if kind == "send_recv":
        return alpha + nbytes / b_slow
    ring_bw = (k - 1) / k * nbytes / b_intra
    if n_nodes > 1:
        rails = max(1.0, k * hw.eff("fabric"))
        ring_bw += (n_nodes - 1) / n_nodes * nbytes / (rails * b_inter)
    ring = (G - 1) * alpha + ring_bw
    if kind in ("all_gather", "reduce_scatter"):
        return ring
    if kind == "all_reduce":
        tree = 2 * math.log2(G) * alpha + 2 * nbytes / b_slow
        return min(2 * ring, tree)
    if kind == "all_to_all":
        return (G - 1) * alpha + (G - 1) / G * nbytes / b_slow
    raise ValueError(f"unknown collective {kind!r}; known: {', '.join(KINDS)}")
