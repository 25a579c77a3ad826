"""Runtime: ``autopar.compile`` returns a ``ParallelModule`` that trains across the mesh.

``step(ids, target)`` runs forward and backward of one global batch: every rank passes the same
global batch; each data-parallel rank takes its slice, splits it into the plan's microbatches and
accumulates gradients (the loss of each microbatch scaled by 1/M, so the gradient is the gradient
of the mean loss, as in one process). The returned loss is the mean over microbatches and data
ranks, the same float on every rank.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from autopar import api, explain as explain_mod
from autopar.capture import default_loss
from autopar.errors import AutoparError, PlanMismatchError
from autopar.passes import PassContext, run_passes
from autopar.passes.ac import apply_ac
from autopar.passes.fsdp import apply_fsdp
from autopar.passes.inductor import apply_compile
from autopar.passes.pp import split_stages
from autopar.passes.tp import apply_tp
from autopar.plan import MESH_DIMS, Plan

log = logging.getLogger(__name__)


def init_distributed(backend: str | None = None) -> None:
    """Initialise the default process group from torchrun's or SLURM's environment."""
    if dist.is_initialized():
        return
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        env.setdefault("RANK", env["SLURM_PROCID"])
        env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
        env.setdefault("MASTER_ADDR", env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"))
        env.setdefault("MASTER_PORT", "29500")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend)


def _world(mesh: Any) -> tuple[int, str]:
    if hasattr(mesh, "device_type"):
        return mesh.size(), mesh.device_type
    if not isinstance(mesh, int):
        raise AutoparError(f"mesh must be a DeviceMesh or a world size, got {type(mesh).__name__}")
    dev = "cuda" if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return mesh, dev


def _resolve_plan(plan: Any, model: nn.Module, world: int, prof: "api.Profiled", *, example_inputs, hardware,
                  global_batch, memory_limit_gb, loss_fn, device: str) -> Plan:
    """A Plan from what the user passed ("auto", pins as a dict or ``"tp=2,sp=1"``, a Plan, or a
    JSON path), checked against this model's fingerprint and the world size."""
    is_pins = isinstance(plan, dict) or (isinstance(plan, str) and "=" in plan and not os.path.exists(plan))
    if not is_pins and (isinstance(plan, Plan) or (isinstance(plan, str) and plan != "auto")):
        p = plan if isinstance(plan, Plan) else Plan.load(plan)
        p.check(model_fingerprint=prof.profile.fingerprint, world_size=world)
        return p
    hw = hardware or ("cpu-gloo" if device == "cpu" else "h100")
    gb = global_batch or int(example_inputs[0].shape[0])
    pins = plan if is_pins else None
    return api.plan(model, world, example_inputs=example_inputs, hardware=hw, global_batch=gb, pin=pins,
                    memory_limit_gb=memory_limit_gb, precision=api.model_precision(model), loss_fn=loss_fn,
                    profiled=prof)


def compile(
    model: nn.Module, mesh: Any, *, example_inputs: tuple, loss_fn: Callable | None = None,
    plan: Any = "auto", hardware: Any = None, global_batch: int | None = None,
    memory_limit_gb: float | None = None, compile: bool = True, disable_passes: tuple = (),
    tune: bool = False, tune_top: int = 4, tune_steps: int = 2, tune_db: str | None = None,
) -> "ParallelModule":
    """Plan (or take a plan) and apply it: returns a module that trains across ``mesh``.

    ``tune=True`` measures the planner's top ``tune_top`` plans for ``tune_steps`` real steps on
    copies of the model and applies the fastest one that fits (measurements cached in SQLite at
    ``tune_db``); ``pm.tuning`` then holds predicted and measured times side by side.
    """
    world, device = _world(mesh)
    if dist.is_initialized() and world != dist.get_world_size():
        raise AutoparError(f"the mesh has {world} ranks but the process group has {dist.get_world_size()}; "
                           "pass a mesh over the whole world")
    if not dist.is_initialized() and world != 1:
        raise AutoparError(f"a world of {world} needs torch.distributed initialised (torchrun, or autopar.runtime.init_distributed())")
    if not isinstance(example_inputs, tuple) or not example_inputs or not isinstance(example_inputs[0], torch.Tensor):
        raise AutoparError("example_inputs must be a tuple whose first item is a (batch, seq) tensor of token ids")
    ids = example_inputs[0]
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise AutoparError(f"example_inputs[0] must be a 2-D integer tensor of token ids (batch, seq); got {ids.dtype} {tuple(ids.shape)}")
    # Traced once: for planning, for checking a given plan's fingerprint, and for tuning.
    prof = api.profile_model(model, example_inputs=example_inputs, precision=api.model_precision(model),
                             loss_fn=loss_fn)
    tuning = None
    if tune:
        import copy

        from autopar import tune as tune_mod

        hw = hardware or ("cpu-gloo" if device == "cpu" else "h100")
        cands = api.plan_candidates(model, world, k=tune_top, example_inputs=example_inputs, hardware=hw,
                                    global_batch=global_batch or int(ids.shape[0]), memory_limit_gb=memory_limit_gb,
                                    pin=plan if isinstance(plan, dict) else None, loss_fn=loss_fn,
                                    profiled=prof)
        db = tune_mod.MeasurementDB(tune_db) if (not dist.is_initialized() or dist.get_rank() == 0) else None
        tuning = tune_mod.tune_plans(lambda: copy.deepcopy(model), cands, example_inputs,
                                     hardware=api.load_hardware(hw).name, db=db, steps=tune_steps, loss_fn=loss_fn,
                                     compile=compile, memory_limit_gb=memory_limit_gb)
        plan = tuning[0]["plan"]
    p = _resolve_plan(plan, model, world, prof, example_inputs=example_inputs, hardware=hardware,
                      global_batch=global_batch, memory_limit_gb=memory_limit_gb, loss_fn=loss_fn, device=device)
    if p.seq_len != ids.shape[1]:
        raise PlanMismatchError(f"the plan is for sequences of {p.seq_len} tokens, the example inputs have {ids.shape[1]}")
    dmesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dmesh = init_device_mesh(device, p.mesh_shape, mesh_dim_names=MESH_DIMS)
    ctx = PassContext(dmesh, p, compile=compile, disabled=set(disable_passes))
    if device == "cuda":
        model.to(torch.device("cuda", torch.cuda.current_device()))
    passes = [("tp", apply_tp), ("ac", apply_ac), ("compile", apply_compile), ("fsdp", apply_fsdp)]
    if p.pp == 1:
        pm = ParallelModule([run_passes(model, ctx, passes)], p, dmesh, loss_fn or default_loss, ctx)
        pm.tuning = tuning
        return pm
    stages = split_stages(model, p, dmesh.get_local_rank("pp"))
    for idx, _ in stages:
        ctx.record("pp", f"stage {idx} of {p.pp * p.v} on pp rank {dmesh.get_local_rank('pp')}")
    modules = [run_passes(m, ctx, passes) for _, m in stages]
    pm = ParallelModule(modules, p, dmesh, loss_fn or default_loss, ctx)
    pm._stage_ids = [idx for idx, _ in stages]
    pm.tuning = tuning
    return pm


class ParallelModule:
    """The parallel model. A plain optimizer over ``parameters()`` trains it.

    ``modules`` holds one module, or under pipeline parallelism this rank's stage modules (one per
    virtual stage); their parameters keep the original names.
    """

    def __init__(self, modules: list[nn.Module], plan: Plan, mesh, loss_fn: Callable, ctx: PassContext):
        self.modules, self.plan, self.mesh, self.loss_fn, self._ctx = modules, plan, mesh, loss_fn, ctx
        self.module = modules[0]
        self._stage_ids: list[int] = []
        self._schedules: dict[int, Any] = {}
        self._pending_loss = None  # the last step's loss all-reduce, until the next step
        if mesh is not None:
            self._dp_rank = mesh.get_local_rank("dp_replicate") * plan.dp_shard + mesh.get_local_rank("dp_shard")
            self._dp_group = mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group() if plan.dp > 1 else None
        else:
            self._dp_rank, self._dp_group = 0, None

    # -- nn.Module-like surface --------------------------------------------------------------
    def parameters(self):
        for m in self.modules:
            yield from m.parameters()

    def named_parameters(self):
        for m in self.modules:
            yield from m.named_parameters()

    def state_dict(self):
        """Sharded state (DTensors under TP/FSDP), keyed by the original parameter names; under
        pipeline parallelism, the entries of this rank's stages."""
        out = {}
        for m in self.modules:
            out.update(m.state_dict())
        return out

    def load_state_dict(self, sd, strict: bool = True):
        if len(self.modules) == 1:
            return self.module.load_state_dict(sd, strict=strict)
        for m in self.modules:
            mine = {k: v for k, v in sd.items() if k in m.state_dict()}
            m.load_state_dict(mine, strict=False)
        return None

    def train(self, mode: bool = True):
        for m in self.modules:
            m.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def __call__(self, *args, **kwargs):
        if self.plan.pp > 1:
            raise AutoparError(
                "a forward-only call is not available under a pipeline plan (the model is split "
                f"over {self.plan.pp} ranks); use step() for training, or a plan with pp=1"
            )
        return self.module(*args, **kwargs)

    def explain(self, graph: bool = False) -> str:
        text = explain_mod.render(self.plan)
        if getattr(self, "tuning", None):
            text += explain_mod.render_tuning(self.tuning)
        if graph:
            lines = ["", "passes applied (what each inserted):"]
            for name, items in self._ctx.provenance.items():
                lines += [f"  [{name}] {x}" for x in items]
            text += "\n".join(lines) + "\n"
        return text

    # -- training ----------------------------------------------------------------------------
    def step(self, ids: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of one global batch; returns the mean loss (same on every rank).

        With several ranks the loss is an asynchronous all-reduce, complete when read; one never
        read is waited for at the next step (read the last one on every rank before tearing the
        process group down, or torch warns that it was never waited for)."""
        if hasattr(self._pending_loss, "wait"):  # an asynchronous collective's result
            self._pending_loss.wait()
        plan = self.plan
        B = ids.shape[0]
        if B % (plan.dp * plan.mb):
            raise AutoparError(
                f"a batch of {B} sequences cannot be split over dp={plan.dp} ranks into microbatches "
                f"of {plan.mb}; use a multiple of {plan.dp * plan.mb}"
            )
        if target is None:
            raise AutoparError("step() needs target= (the labels for the loss)")
        local = B // plan.dp
        sl = slice(self._dp_rank * local, (self._dp_rank + 1) * local)
        ids_l, tgt_l = ids[sl], target[sl]
        M = local // plan.mb
        if plan.pp > 1:
            loss = self._pipeline_step(ids_l, tgt_l, M)
        else:
            total = torch.zeros((), dtype=torch.float32, device=ids.device)
            for i in range(M):
                mb = slice(i * plan.mb, (i + 1) * plan.mb)
                loss = self.loss_fn(self.module(ids_l[mb]), tgt_l[mb])
                (loss / M).backward()
                total += loss.detach().float()
            loss = total / M
        if plan.dp > 1:
            if not plan.fsdp:
                self._allreduce_grads()
            # A functional collective: waited on only when the loss is read, so it overlaps with
            # whatever the training loop does next (the optimizer step).
            loss = funcol.all_reduce(loss / plan.dp, "sum", self._dp_group)
        self._pending_loss = loss
        return loss

    def _schedule(self, M: int):
        """The pipelining schedule for M microbatches (built once per M)."""
        if M not in self._schedules:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

            plan = self.plan
            if M < plan.pp or (plan.schedule == "interleaved" and M % plan.pp):
                raise AutoparError(f"{M} microbatches do not fit the {plan.schedule} schedule over {plan.pp} stages")
            device = next(self.modules[0].parameters()).device
            group = self.mesh["pp"].get_group()
            stages = [PipelineStage(m, idx, plan.pp * plan.v, device, group=group)
                      for idx, m in zip(self._stage_ids, self.modules)]

            def loss_fn(out, tgt):
                return self.loss_fn(out, tgt)

            if plan.schedule == "interleaved":
                sched = ScheduleInterleaved1F1B(stages, n_microbatches=M, loss_fn=loss_fn)
            else:
                cls = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
                sched = cls(stages[0], n_microbatches=M, loss_fn=loss_fn)
            self._schedules[M] = sched
        return self._schedules[M]

    def _pipeline_step(self, ids: torch.Tensor, target: torch.Tensor, M: int) -> torch.Tensor:
        plan = self.plan
        sched = self._schedule(M)
        n_stages = plan.pp * plan.v
        args = (ids,) if 0 in self._stage_ids else ()
        losses: list = []
        kwargs = {"target": target, "losses": losses} if n_stages - 1 in self._stage_ids else {}
        sched.step(*args, **kwargs)
        loss = torch.stack([l.detach().float() for l in losses]).mean() if losses else torch.zeros((), device=ids.device)
        return funcol.all_reduce(loss, "sum", self.mesh["pp"].get_group())  # only the last stage contributes

    def _allreduce_grads(self) -> None:
        """Replicated data parallelism: average gradients over the data-parallel ranks, bucketed."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        locs = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        for dtype in sorted({g.dtype for g in locs}, key=str):
            group = [g for g in locs if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in group])
            dist.all_reduce(flat, group=self._dp_group)
            flat /= self.plan.dp
            off = 0
            for g in group:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over every shard (TP, FSDP) of every parameter.

        Sum of squares per gradient: a shard's local sum, all-reduced over the mesh dims it is
        sharded on (one all-reduce per group of gradients sharing mesh and dims); pending partial
        sums (``Partial`` placements) are reduced first; replicated gradients count once.
        """
        from torch.distributed.tensor import DTensor, Partial, Replicate

        params = [p for p in self.parameters() if p.grad is not None]
        sums: dict[tuple, list] = {}
        for p in params:
            g = p.grad
            if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
                g = g.redistribute(g.device_mesh, [Replicate() if isinstance(pl, Partial) else pl for pl in g.placements])
                p.grad = g
            if isinstance(g, DTensor):
                dims = tuple(i for i, pl in enumerate(g.placements) if not (pl.is_replicate() or pl.is_partial()))  # Shard, _StridedShard
                key = (id(g.device_mesh), dims)
                entry = sums.setdefault(key, [g.device_mesh, dims, 0.0])
                entry[2] = entry[2] + g.to_local().float().pow(2).sum()
            else:
                entry = sums.setdefault(("plain",), [None, (), 0.0])
                entry[2] = entry[2] + g.float().pow(2).sum()
        total = torch.zeros((), dtype=torch.float32)
        for mesh, dims, sq in sums.values():
            sq = torch.as_tensor(sq, dtype=torch.float32)
            for d in dims:
                dist.all_reduce(sq, group=mesh.get_group(d))
            total = total + sq.cpu()
        if self.plan.pp > 1:  # each pipeline rank holds other parameters
            total = total.to(next(self.modules[0].parameters()).device)
            dist.all_reduce(total, group=self.mesh["pp"].get_group())
            total = total.cpu()
        norm = total.sqrt()
        coef = float((max_norm / (norm + 1e-6)).clamp(max=1.0))
        for p in params:
            g = p.grad
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
        return norm
