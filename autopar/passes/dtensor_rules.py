"""Sharding rules DTensor lacks on PyTorch 2.13, registered once on import, and one redistribution
it traces into thousands of nodes.

``_scaled_dot_product_flash_attention_for_cpu`` (what ``scaled_dot_product_attention`` runs on CPU)
has no strategy, so DTensor would propagate through its decomposition: correct, but it expands the
strategy space of a dozen ops and takes minutes. The rule is the one DTensor has for the CUDA flash
kernel: all replicated, or heads sharded (dim 1 of ``(batch, heads, seq, head_dim)``), or batch
sharded; an attention mask follows the heads or batch dim when it has one, else is replicated.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import (
    expand_to_full_mesh_op_strategy,
    register_op_strategy,
)
from torch.distributed.tensor.placement_types import _StridedShard

_aten = torch.ops.aten


def _mask_placement(op_schema, dim: int) -> list:
    mask = op_schema.kwargs_schema.get("attn_mask")
    if mask is None or not hasattr(mask, "strategies"):
        return []
    shape = mask.strategies[0].output_spec.tensor_meta.shape
    return [Shard(dim) if len(shape) == 4 and shape[dim] > 1 else Replicate()]


def _attention_strategy(op_schema, n_out: int, n_in: int):
    rows = [[Replicate()] * (n_out + n_in + len(_mask_placement(op_schema, 1)))]
    for dim in (1, 0):  # heads, batch
        rows.append([Shard(dim)] * (n_out + n_in) + _mask_placement(op_schema, dim))
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, rows, input_index=n_out)


@register_op_strategy(_aten._scaled_dot_product_flash_attention_for_cpu.default,
                      schema_info=RuntimeSchemaInfo(3, static_kwargkey=["scale"]))
def _cpu_flash_forward(op_schema):
    return _attention_strategy(op_schema, n_out=2, n_in=3)


@register_op_strategy(_aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                      schema_info=RuntimeSchemaInfo(6, static_kwargkey=["scale"]))
def _cpu_flash_backward(op_schema):
    return _attention_strategy(op_schema, n_out=3, n_in=6)


def _outside_tracing(fn):
    """``fn`` (index arithmetic on plain ints) run with the fake and proxy modes off: inside
    ``make_fx`` its small ``arange``s and ``tolist``s would be traced, each ``tolist`` an unbacked
    symbol, which made one matmul's sharding propagation on a (cp, tp) mesh take minutes."""
    from torch.utils._python_dispatch import _disable_current_modes

    @functools.wraps(fn)
    def wrapper(self, curr_local_size, num_chunks, rank, *args, **kwargs):
        if not all(isinstance(v, int) for v in (curr_local_size, num_chunks, rank)):
            return fn(self, curr_local_size, num_chunks, rank, *args, **kwargs)
        with _disable_current_modes():
            return fn(self, curr_local_size, num_chunks, rank, *args, **kwargs)

    return wrapper


# The sequence split of context parallelism flattens (batch, sequence) into one dim before every
# linear: an interleaved ``_StridedShard``, whose shard sizes DTensor computes with tensors.
_StridedShard.local_shard_size_and_offset = _outside_tracing(_StridedShard.local_shard_size_and_offset)


def _gathered_in_order(fn):
    """``_StridedShard``'s gather to whole, as one all-gather and a reorder of views where the
    split is even. A ``_StridedShard(dim, sf)`` over ``n`` ranks holds, on rank ``i``, chunk ``i``
    of each of ``sf`` pieces of ``dim``; gathered, ``dim`` reads ``(n, sf, c)`` and the whole tensor
    is ``(sf, n, c)``: a transpose. DTensor reorders by index tensors it computes inside the trace
    (an ``arange`` cut into ``sf x n`` chunks, concatenated, argsorted), hundreds to thousands of
    graph nodes per gather where heads or windows fold into one dim (T5's and DeepSeek-V2's
    attention, Swin's windows), which the trace, the partitioner and Inductor then carry. Uneven
    splits keep DTensor's way."""
    from autopar.passes.coords import all_gather

    @functools.wraps(fn)
    def wrapper(self, local_tensor, mesh, mesh_dim, current_logical_shape):
        n = mesh.size(mesh_dim=mesh_dim)
        d, size = self.dim, current_logical_shape[self.dim]
        sf = self._split_factor_int()
        if not all(isinstance(v, int) for v in (n, size, sf, local_tensor.size(d))) or size % (sf * n) \
                or local_tensor.size(d) * n != size:
            return fn(self, local_tensor, mesh, mesh_dim, current_logical_shape)
        gathered = all_gather(local_tensor, d, mesh, mesh_dim)
        shape = list(gathered.shape)
        split = shape[:d] + [n, sf, size // (sf * n)] + shape[d + 1:]
        return gathered.view(split).transpose(d, d + 1).reshape(shape)

    return wrapper


def _wrap_to_replicate() -> None:
    """Only over the method as 2.13 has it (its arguments by these names); elsewhere DTensor's own."""
    import inspect

    fn = vars(_StridedShard).get("_to_replicate_tensor")
    if fn is not None and list(inspect.signature(fn).parameters) == [
            "self", "local_tensor", "mesh", "mesh_dim", "current_logical_shape"]:
        _StridedShard._to_replicate_tensor = _gathered_in_order(fn)


_wrap_to_replicate()
