"""The grouped matmul routed experts run as: each expert's weight applied to its own rows only.

``torch.ops.autopar.grouped_mm(x, weights, offs)``: ``x`` holds the tokens sorted by expert,
``offs`` the end of each expert's rows (cumulative counts, fixed shape ``(E,)``), ``weights``
the ``E`` experts' weights as ``nn.Linear`` keeps them (``(out, in)``, one tensor each, so each
expert's parameter, or its data-parallel gather, is read where it lives: no stacked copy is
made in the graph or saved for the backward). Rows of expert ``e``: ``x[rows] @ weights[e].T``.
The shapes are fixed (all ``tokens x top_k`` rows), the values decide which rows go where, so
the routed form is one static graph that spends the experts' active FLOPs. Its backward is the
same operator on the weights' transposes (input gradient) and ``grouped_mm_wgrad`` (each
expert's weight gradient from its rows).

On a GPU in bfloat16 the work runs as ``torch._grouped_mm`` (one kernel); elsewhere (CPU, fp32,
or where that kernel refuses the inputs, said once) as one ``mm`` per expert over its rows.
FLOPs are registered with torch's flop counter (2 per multiply-add of the rows that run), so the
cost model prices what runs.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula


def _bounds(offs: torch.Tensor) -> list[int]:
    return [0, *offs.tolist()]


_KERNEL = {"usable": True}


def _one_kernel(*tensors: torch.Tensor) -> bool:
    return _KERNEL["usable"] and all(t.is_cuda and t.dtype == torch.bfloat16 for t in tensors)


def _kernel_failed(e: Exception) -> None:
    """``torch._grouped_mm`` refused these inputs (a GPU before Hopper, unaligned shapes): the
    per-expert matmuls compute the same from now on, said once."""
    import logging

    _KERNEL["usable"] = False
    logging.getLogger(__name__).warning("torch._grouped_mm failed (%s); routed experts run one matmul per expert", e)


def stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    """The experts' matrices as one ``(E, out, in)`` tensor: a view where they already are evenly
    spaced slices of one storage (``unbind`` of a 3-D expert weight, or its transposes), else a
    stacked copy (experts as modules of their own)."""
    w0 = weights[0]
    if len(weights) > 1 and all(w.untyped_storage().data_ptr() == w0.untyped_storage().data_ptr()
                                and w.shape == w0.shape and w.stride() == w0.stride() for w in weights):
        step = weights[1].storage_offset() - w0.storage_offset()
        if step > 0 and all(w.storage_offset() == w0.storage_offset() + e * step for e, w in enumerate(weights)):
            return w0.as_strided((len(weights), *w0.shape), (step, *w0.stride()), w0.storage_offset())
    return torch.stack(weights)


@torch.library.custom_op("autopar::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, weights: list[torch.Tensor], offs: torch.Tensor) -> torch.Tensor:
    if _one_kernel(x, *weights):
        try:
            return torch._grouped_mm(x, stacked(weights).transpose(-2, -1), offs=offs.to(torch.int32))
        except RuntimeError as e:
            _kernel_failed(e)
    out = x.new_zeros(x.shape[0], weights[0].shape[0])
    b = _bounds(offs)
    for e, w in enumerate(weights):
        if b[e + 1] > b[e]:
            torch.mm(x[b[e]:b[e + 1]], w.t(), out=out[b[e]:b[e + 1]])
    return out


@grouped_mm.register_fake
def _(x, weights, offs):
    return x.new_empty(x.shape[0], weights[0].shape[0])


@torch.library.custom_op("autopar::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(grad: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Each of the ``n`` experts' weight gradient ``grad[rows].T @ x[rows]`` (``(out, in)``)."""
    if _one_kernel(grad, x):
        try:
            return list(torch._grouped_mm(grad.t(), x, offs=offs.to(torch.int32)).unbind(0))
        except RuntimeError as e:
            _kernel_failed(e)
    b = _bounds(offs)
    return [grad[b[e]:b[e + 1]].t() @ x[b[e]:b[e + 1]] for e in range(n)]


@grouped_mm_wgrad.register_fake
def _(grad, x, offs, n):
    return [grad.new_empty(grad.shape[1], x.shape[1]) for _ in range(n)]


def _setup(ctx, inputs, output):
    x, weights, offs = inputs
    ctx.save_for_backward(x, offs, *weights)


def _backward(ctx, grad):
    x, offs, *weights = ctx.saved_tensors
    dx = grouped_mm(grad, [w.t() for w in weights], offs) if ctx.needs_input_grad[0] else None
    dw = grouped_mm_wgrad(grad, x, offs, len(weights)) if ctx.needs_input_grad[1] else None
    return dx, dw, None


grouped_mm.register_autograd(_backward, setup_context=_setup)


GROUPED_MM = torch.ops.autopar.grouped_mm.default


@register_flop_formula(torch.ops.autopar.grouped_mm)
def _grouped_mm_flops(x_shape, w_shapes, offs_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * w_shapes[0][0]


@register_flop_formula(torch.ops.autopar.grouped_mm_wgrad)
def _grouped_mm_wgrad_flops(grad_shape, x_shape, offs_shape, n, *args, out_shape=None, **kwargs) -> int:
    return 2 * grad_shape[0] * grad_shape[1] * x_shape[1]
