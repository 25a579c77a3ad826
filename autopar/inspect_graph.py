"""``autopar explain --graph``: the graphs the executor builds for a plan, with provenance.

The plan is applied by the real executor (the same passes as ``autopar.compile``) on a fake
process group of the plan's size, in this one process: the model is built with its layer count
cut to two and storage left uninitialised (only shapes matter), and Inductor is skipped (the
graphs shown are the ones it would compile). Every collective of the forward and backward graphs
is listed with its kind, group size, bytes and the pass and node it came from.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from autopar.plan import Plan


def rewritten_graph(build, plan: Plan, *, layers: int = 2) -> str:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autopar
    from autopar import explain
    from autopar.errors import AutoparError

    if plan.pp > 1:
        raise AutoparError("explain --graph shows non-pipelined plans; pin pp=1 to see one stage's graphs")
    if dist.is_initialized():
        raise AutoparError("explain --graph runs on its own fake process group: call it outside a distributed job")
    with torch.device("meta"):
        model = build()
    cfg = getattr(model, "config", None)
    if dataclasses.is_dataclass(cfg) and hasattr(cfg, "n_layers") and cfg.n_layers > layers:
        with torch.device("meta"):
            model = type(model)(dataclasses.replace(cfg, n_layers=layers))
    model = model.to_empty(device="cpu")
    dp = plan.dp
    ids = torch.zeros((dp * plan.mb, plan.seq_len), dtype=torch.long)
    pins = {"tp": plan.tp, "dp": plan.dp, "pp": 1, "sp": int(plan.sp), "fsdp": int(plan.fsdp), "mb": plan.mb,
            "dp_shard": plan.dp_shard, "ac": plan.layers[0].ac}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        pm = autopar.compile(model, plan.world_size, example_inputs=(ids,), plan=pins, compile=False,
                             hardware="h100")
        return (f"graphs of {plan.model_name} with {layers} layers under {pm.plan.as_config_string()} "
                f"on a fake process group of {plan.world_size}\n" + explain.render_executed(pm.info))
    finally:
        dist.destroy_process_group()
