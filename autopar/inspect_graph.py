"""``autopar explain --graph``: the rewritten graph of the first layer, with provenance.

The plan's TP and AC passes are applied to the model built on fake tensors, over a fake process
group of the plan's size (nothing is allocated, no GPU needed); one forward and backward runs
under a dispatch mode that records every ATen op of the first layer in order. Each collective is
marked with the pass and the module style that inserted it. FSDP's collectives are issued by
runtime hooks around each layer and are listed from the plan.
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.module_tracker import ModuleTracker

from autopar.capture import VIEW_OPS, default_loss, op_name, tensor_bytes
from autopar.plan import MESH_DIMS, Plan

COLLECTIVE_NS = "_c10d_functional"


def rewritten_graph(build, plan: Plan, *, max_ops: int = 400) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.passes import PassContext, run_passes
    from autopar.passes.ac import apply_ac
    from autopar.passes.pp import split_stages
    from autopar.passes.tp import apply_tp

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    mesh = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=MESH_DIMS)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision, torch.float32)
    prev = torch.get_default_dtype()
    with FakeTensorMode(allow_non_fake_inputs=True) as fm:
        torch.set_default_dtype(dtype)
        try:
            model = build()
        finally:
            torch.set_default_dtype(prev)
    if plan.pp > 1:
        model = split_stages(model, plan, 0)[0][1]
    ctx = PassContext(mesh, plan, compile=False)
    run_passes(model, ctx, [("tp", apply_tp), ("ac", apply_ac)])
    first = plan.layers[0].fqn
    styles = {line.split(":")[0]: (name, line) for name, lines in ctx.provenance.items() for line in lines}
    rows: list[str] = []
    tracker = ModuleTracker()

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inside = [p for p in tracker.parents if f".{first}" in p or p.endswith(first)]
            if not inside or len(rows) >= max_ops:
                return out
            name = op_name(func)
            if name in VIEW_OPS or name.startswith("wait") or getattr(func, "namespace", "") == "prim":
                return out
            where = max(inside, key=len).split(".", 1)[-1]
            phase = "bwd" if tracker.is_bw else "fwd"
            shapes = [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)][:1]
            line = f"  {phase} {name}{shapes[0] if shapes else ''}"
            if getattr(func, "namespace", "") == COLLECTIVE_NS:
                mod = max((m for m in styles if where.startswith(m)), key=len, default=None)
                src = f"{styles[mod][0]} pass: {styles[mod][1]}" if mod else "tp pass"
                line = f"  {phase} {name}(local {tensor_bytes(args[0]) / 2**20:.1f} MiB)   # inserted by {src}"
            rows.append(line)
            return out

    with fm:
        vocab = next((p.shape[0] for n, p in model.named_parameters() if p.dim() == 2), 256)
        ids = torch.randint(0, max(2, min(vocab, 256)), (plan.mb, plan.seq_len))
        with tracker, Recorder():
            out = model(ids)
            if plan.pp == 1:
                default_loss(out, torch.randint(0, 2, (plan.mb, plan.seq_len))).backward()
    buf = io.StringIO()
    buf.write(f"rewritten graph of {first} (one microbatch of {plan.mb} x {plan.seq_len}, "
              f"{'forward and backward' if plan.pp == 1 else 'forward'}; tp={plan.tp}, sp={int(plan.sp)}, "
              f"ac={plan.layers[0].ac}):\n")
    buf.write("\n".join(rows) + "\n")
    buf.write("passes applied:\n")
    for name, lines in ctx.provenance.items():
        for l in lines:
            if l.startswith(first + ".") or l.startswith(first + ":") or not l.startswith(plan.layers[0].fqn.rsplit(".", 1)[0]):
                buf.write(f"  [{name}] {l}\n")
    if plan.fsdp and plan.dp > 1:
        buf.write(f"  [fsdp] {first}: fully_shard over dp_shard={plan.dp_shard} (all-gather before forward"
                  f"{' and backward' if plan.reshard_after_forward else ''}, reduce-scatter after backward)\n")
    return buf.getvalue()
