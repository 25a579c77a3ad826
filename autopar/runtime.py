"""Runtime: the ``ParallelModule`` that ``autopar.compile`` returns, and process-group set-up.

The module shares the user's submodules, so its parameters keep their original names (tied
parameters once, as in the original); each parameter is a DTensor on the mesh dims the plan uses
(its TP split and data-parallel shard), which a plain ``torch.optim`` optimizer, ``state_dict``
and ``torch.distributed.checkpoint`` take as they are. Its forward and ``step`` run the compiled
graphs (``backend.CompiledStep``) through one ``autograd.Function``: the forward graph on the
local tensors, the backward graph when autograd asks for gradients, which arrive as DTensors
with the parameters' placements, already reduced and averaged over data parallelism.

``step(inputs, target)`` runs forward and backward of one global batch: every rank passes the same
global batch; each data-parallel rank takes its slice, splits it into the plan's microbatches
and accumulates gradients (each microbatch's loss scaled by 1/M, so the gradient is that of the
mean loss, as in one process). ``pm(x)`` takes this rank's data-parallel slice, like DDP or FSDP.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from autopar import explain as explain_mod
from autopar import zero
from autopar.errors import AutoparError
from autopar.plan import Plan

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


def rank_device() -> torch.device:
    """This rank's device for tensors that go through ``torch.distributed``: its GPU when the
    process group is NCCL (which reduces GPU tensors only), else the CPU."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class FailureWatch:
    """Bounded failure across ranks. An exception on one rank inside ``compile`` or ``step()`` is
    posted to the process group's store (first failure wins) and written into every other rank's
    wake key; every rank has a thread blocked reading its own wake key (its own store connection,
    no polling), so the message arrives in the same call that wakes it.
    A rank that learns of the failure while it is inside a guarded call is, by construction,
    waiting for the failed rank in a collective that will never complete (gloo and NCCL cannot
    interrupt it from Python), so it prints the failing rank's error and exits (status 1), as
    torchrun's elastic agent would. A rank that learns of it between calls raises the failing
    rank's error at its next call. Rank 0 serves the store: once a failure is known, it does not
    exit (whether it stops here or its caller ends on the raised error) before every other rank
    has read the message (each acknowledges it), or ``LINGER_S`` has passed.
    At exit (or when the process group changes) a rank wakes only its own thread and joins it:
    a thread still inside a store call while the interpreter finalizes aborts the process."""

    KEY = "autopar/failure"
    GRACE_S = 5.0  # how long a rank inside a guarded call may take to raise the same error itself
    LINGER_S = 15.0  # how long rank 0 keeps the store up for the others to read a failure
    _instance: FailureWatch | None = None

    def __init__(self):
        import atexit
        import threading

        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.group = dist.group.WORLD
        self.store = dist.distributed_c10d._get_default_store().clone()
        # a second connection, made now: waking the thread at exit must not connect anew, which
        # blocks for the store's whole timeout when rank 0 (its server) has already ended
        self.waker = self.store.clone()
        self.depth = 0
        self.failure: str | None = None
        self.woken = False  # the thread has read its wake key (and returns by itself)
        self.thread = threading.Thread(target=self._watch, daemon=True, name="autopar-failure-watch")
        self.thread.start()
        atexit.register(self.stop)

    def _wake_key(self, rank: int) -> str:
        return f"{self.KEY}/wake/{rank}"

    @classmethod
    def get(cls) -> FailureWatch | None:
        """The process's watch for the current process group, started on first use (None without
        a real multi-rank group)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return None
        if cls._instance is not None and cls._instance.group is not dist.group.WORLD:
            cls._instance.stop()  # the group it watched is gone
            cls._instance = None
        if cls._instance is None:
            try:
                cls._instance = cls()
            except (RuntimeError, AttributeError, NotImplementedError) as e:  # a store that cannot clone (fake PG)
                log.info("failure watch not started: %s", e)
                return None
        return cls._instance

    @classmethod
    def stop_current(cls) -> None:
        """Stop this process's watch (before ``destroy_process_group``, after a barrier, so that
        no rank's thread is left waiting on a store that goes away)."""
        if cls._instance is not None:
            cls._instance.stop()
            cls._instance = None

    def stop(self) -> None:
        """Wake this rank's watch thread (only its own) and wait for it to return; on rank 0,
        after a failure, first let the others read it."""
        self._linger()
        if not self.thread.is_alive():
            return
        if not self.woken:
            try:  # the other connection: the thread's own is blocked in its read
                self.waker.set(self._wake_key(self.rank), "stop")
            except Exception as e:  # noqa: BLE001 - the store is gone: the thread's read has failed too
                log.info("failure watch: %s", e)
        self.thread.join(timeout=self.GRACE_S + 1)

    def _linger(self) -> None:
        """Rank 0 after a failure: wait (bounded) until every rank that did not post it has read it."""
        if self.rank != 0 or not self.failure:
            return
        deadline = time.monotonic() + self.LINGER_S
        try:
            while self.waker.add(self.KEY + "/seen", 0) < self.world - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception as e:  # noqa: BLE001 - nothing more to wait for
            log.info("failure watch: %s", e)

    def _stop_if_waiting(self, msg: str) -> None:
        """The failure is known: a rank still inside a guarded call after the grace period exits."""
        import sys

        deadline = time.monotonic() + self.GRACE_S
        while self.depth and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.depth:
            print(f"autopar: {msg}\nautopar: rank {self.rank} stops: it was waiting for that rank in a "
                  "collective that cannot complete", file=sys.stderr, flush=True)
            self._linger()
            os._exit(1)

    def _watch(self) -> None:
        import datetime

        key = self._wake_key(self.rank)
        self.store.set_timeout(datetime.timedelta(hours=1))
        while True:
            try:
                msg = self.store.get(key).decode()  # blocks until the key is set
            except Exception as e:  # noqa: BLE001 - a read timeout: read again; the store gone: stop
                if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                    continue
                return
            self.woken = True
            if msg == "stop":
                return
            self.failure = msg
            try:
                self.store.add(self.KEY + "/seen", 1)
            except Exception as e:  # noqa: BLE001 - rank 0 has ended: the message is read all the same
                log.info("failure watch: %s", e)
            # An error every rank meets alike (a bad pin, a plan for another mesh) is raised on
            # each of them within moments: a rank that leaves its guarded call in the grace
            # period raises its own; one still inside is waiting in a collective, and stops.
            self._stop_if_waiting(msg)
            return

    def post(self, where: str, exc: BaseException) -> str:
        """Tell every rank; returns the first failure posted (this one, or an earlier one)."""
        import datetime

        msg = f"rank {self.rank} failed in {where}: {type(exc).__name__}: {' '.join(str(exc).split())[:2000]}"
        store = dist.distributed_c10d._get_default_store()  # the watch's own connection is blocked in its read
        try:
            if store.add(self.KEY + "/count", 1) == 1:
                self.failure = msg
                others = [r for r in range(self.world) if r != self.rank]
                store.multi_set([self._wake_key(r) for r in others], [msg] * len(others))
                return msg
            store.wait([self._wake_key(self.rank)], datetime.timedelta(seconds=10))
            return store.get(self._wake_key(self.rank)).decode()
        except Exception as e:  # noqa: BLE001 - the store itself is gone: nothing to tell
            log.info("could not post the failure: %s", e)
        return msg

    def __enter__(self):
        if self.failure:
            raise AutoparError(f"{self.failure}; this rank cannot continue: fix that and start again")
        self.depth += 1
        return self

    def __exit__(self, typ, exc, tb):
        self.depth -= 1
        return False


def _flat_keys(state: dict) -> list[str]:
    """The keys ``torch.distributed.checkpoint`` stores a nested state dict under."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return list(flatten_state_dict(state)[0])


def _through_full(t, placements):
    """``t`` (a DTensor) redistributed to ``placements`` through its full value, sliced locally."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t.full_tensor(), t.device_mesh, placements, src_data_rank=None)


def _dcp_view(state):
    """``state`` as torch.distributed.checkpoint can store it. A fused projection's shard under
    TP (``_StridedShard``: each rank holds its heads of q, k and v) is not one contiguous chunk
    of the global tensor, which is all a checkpoint's metadata can describe, so such DTensors
    (parameters and their optimizer moments) appear replicated on those mesh dims. Returns the
    view and the (original, stand-in) pairs, for copying a loaded stand-in back."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    pairs = []

    def walk(x):
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, DTensor) and any(isinstance(p, _StridedShard) for p in x.placements):
            tmp = _through_full(x, [Replicate() if isinstance(p, _StridedShard) else p for p in x.placements])
            pairs.append((x, tmp))
            return tmp
        return x

    return walk(state), pairs


def shutdown() -> None:
    """End a run cleanly on every rank: stop the failure watch, wait for every rank, destroy the
    process group (a plain ``destroy_process_group`` also works; this one leaves no rank's
    watch waiting on the store that rank 0 takes down)."""
    FailureWatch.stop_current()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def guarded(where: str):
    """``with guarded("step()"):``: failures inside are posted to every rank (see FailureWatch)."""
    import contextlib

    watch = FailureWatch.get()

    @contextlib.contextmanager
    def cm():
        if watch is None:
            yield
            return
        with watch:
            try:
                yield
            except Exception as e:
                first = watch.failure or watch.post(where, e)
                if isinstance(e, AutoparError):
                    raise  # this rank's own error about the user's input, whatever the others met
                if not first.startswith(f"rank {watch.rank} "):
                    raise AutoparError(f"{first}; rank {watch.rank} stopped with it ({type(e).__name__})") from e
                raise

    return cm()


class _RunGraphs(torch.autograd.Function):
    """Forward: the compiled forward graph on local tensors. Backward: the compiled backward
    graph; parameter gradients come back as DTensors placed like their parameters."""

    @staticmethod
    def forward(ctx, runner: StepRunner, *args):
        local = [a._local_tensor if hasattr(a, "_local_tensor") else a for a in args]
        ctx.once = once = runner.once
        if once is not None:  # parameters gathered once per step (zero.py): read whole
            local[:runner.n_params] = [once.whole[n] for n in runner.param_names]
        t0 = time.perf_counter()
        outs = runner.compiled.fw(local)
        runner.busy_s += time.perf_counter() - t0
        n = runner.compiled.n_outputs
        ctx.runner = runner
        # The partitioner's order: the forward returns the saved tensors, then the sizes it saved
        # (data-dependent ones, as expert parallelism's routed row counts); the backward takes
        # the sizes first.
        ctx.saved = [o for o in outs[n:] if not isinstance(o, torch.Tensor)] + [
            o for o in outs[n:] if isinstance(o, torch.Tensor)]
        ctx.metas = [(a.device_mesh, a.placements, a.shape, a.stride()) if hasattr(a, "_local_tensor") else None
                     for a in args]
        result = tuple(outs[:n])
        if runner.compiled.bw_weight is not None:
            ctx.params = args[:runner.n_params]  # the weight-gradient part accumulates into them
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in result]
        ctx.mark_non_differentiable(*[o for i, o in enumerate(result) if i not in runner.grad_outputs])
        return result

    @staticmethod
    def backward(ctx, *grads):
        runner = ctx.runner
        tangents = [grads[i] if grads[i] is not None else torch.zeros(shape, dtype=dtype, device=device)
                    for i, (shape, dtype, device) in enumerate(ctx.out_meta) if i in runner.grad_outputs]
        c = runner.compiled
        # The only references to the saved values are in ``args``, which the boxed graph empties:
        # each is freed at its last use in the backward.
        accs = ctx.once.accumulators(runner) if ctx.once is not None and c.bw_weight is None else []
        args = _as_expected(ctx.saved + tangents + accs, c.bw_strides)
        ctx.saved = None
        result: list = [None] * (1 + runner.n_args)
        t0 = time.perf_counter()
        if c.bw_weight is not None:
            # Zero-bubble: input gradients now; the weight gradients when the schedule says (W).
            out = list(c.bw_input(args))
            runner.busy_s += time.perf_counter() - t0
            k = c.n_input_grads
            out[:k] = _unshared(out[:k])
            n_w = len(runner.grad_index) - k
            for i, g in zip(runner.grad_index[n_w:], out[:k]):
                result[1 + i] = g
            runner.pending.append(_WeightGrads(runner, ctx.params, ctx.metas, out[k:], ctx.once))
            return tuple(result)
        out = c.bw(args)
        runner.busy_s += time.perf_counter() - t0
        out = _unshared(list(out) if isinstance(out, (list, tuple)) else [out])
        for i, g in zip(runner.grad_index, out):
            if ctx.once is None or i >= runner.n_params:  # else added into the step's buffer in the graph
                result[1 + i] = _placed(g, ctx.metas[i])
        if ctx.once is not None:
            ctx.once.queue_reduce()
        return tuple(result)


def _unshared(grads: list) -> list:
    """Gradients that share memory made separate. Two parameters whose gradients are one
    computation (GPT-NeoX's parallel attention and MLP output biases) get one tensor from the
    compiled graph; autograd would then take that tensor as both parameters' ``.grad`` and the
    next microbatch's accumulation would add into it twice."""
    seen: set[int] = set()
    out = []
    for g in grads:
        if isinstance(g, torch.Tensor) and g.numel():
            if g.data_ptr() in seen:
                g = g.clone()
            seen.add(g.data_ptr())
        out.append(g)
    return out


def _placed(g, meta):
    """A local gradient as a DTensor placed like its parameter (``meta``), or as is."""
    if meta is None or g is None:
        return g
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = meta
    return DTensor.from_local(g, mesh, placements, run_check=False, shape=shape, stride=stride)


class _WeightGrads:
    """One microbatch's deferred weight-gradient part (zero-bubble schedules' W action):
    runs the compiled W graph on what the input-gradient part carried and accumulates the
    gradients into the parameters, as autograd would have."""

    def __init__(self, runner: StepRunner, params, metas, carried, once):
        self.runner, self.params, self.metas, self.carried, self.once = runner, params, metas, carried, once

    def __call__(self) -> None:
        c = self.runner.compiled
        t0 = time.perf_counter()
        accs = self.once.accumulators(self.runner) if self.once is not None else []
        args = _as_expected(self.carried + accs, c.bw_weight_strides)
        self.carried = None
        # A backward computation and its accumulation, outside autograd (the eager graph,
        # compile=False, would otherwise record them and refuse the in-place add).
        with torch.no_grad():
            out = c.bw_weight(args)
            self.runner.busy_s += time.perf_counter() - t0
            if self.once is not None:  # the graph added the gradients into the step's buffers
                return
            out = _unshared(list(out) if isinstance(out, (list, tuple)) else [out])
            for i, g in zip(self.runner.grad_index, out):
                p = self.params[i]
                if p.grad is None:
                    p.grad = _placed(g.clone(memory_format=torch.contiguous_format), self.metas[i])
                else:
                    getattr(p.grad, "_local_tensor", p.grad).add_(g)


def _as_expected(values: list, strides: list) -> list:
    """The compiled backward was built for the strides the trace gave the saved values; the
    compiled forward may lay some out differently: copy those into the expected layout."""
    out = []
    for v, st in zip(values, strides):
        if isinstance(v, torch.Tensor) and st is not None and v.stride() != st:
            v = torch.empty_strided(v.shape, st, dtype=v.dtype, device=v.device).copy_(v)
        out.append(v)
    return out


class StepRunner:
    """One compiled step graph: the loss (``step``), the logits (``forward``), or a pipeline
    stage's outputs. ``grad_index``: the argument positions that receive gradients;
    ``grad_outputs``: the output positions gradients come back to."""

    def __init__(self, compiled, param_names: list[str], n_args: int, grad_index: list[int], grad_outputs: list[int],
                 input_shapes: list, accumulate: list[int] | None = None):
        self.compiled, self.param_names, self.n_params, self.n_args = compiled, param_names, len(param_names), n_args
        self.once = None  # this step's parameters gathered once (zero.StepWeights), under fsdp_once
        # fsdp_once: the backward outputs (positions in grad_index) it adds into the step's buffers
        # instead of returning them (passes/accumulate.py), in the order it takes the buffers
        self.accumulate = accumulate or []
        self.grad_index, self.grad_outputs, self.input_shapes = grad_index, set(grad_outputs), input_shapes
        self.pending: list[_WeightGrads] = []  # zero-bubble: weight gradients not yet run
        self.busy_s = 0.0  # time inside the compiled graphs (the bench's measured bubble)

    def take_weight_grads(self) -> _WeightGrads:
        """The pipeline schedule's ``dw_builder``: the W part of the backward just run."""
        return self.pending.pop()

    def __call__(self, params: list, buffers: list, inputs: list):
        return _RunGraphs.apply(self, *params, *buffers, *inputs)


class _StageModule(nn.Module):
    """A pipeline stage as the schedule sees it: the stage graph's runner over the parallel
    module's parameters (registered there, not here)."""

    def __init__(self, pm: ParallelModule, sg, runner: StepRunner):
        super().__init__()
        object.__setattr__(self, "_pm", pm)
        self._sg, self._runner = sg, runner
        # (shape, dtype, carries a gradient): activations sent between stages do; the model's own
        # inputs, which travel along with them (token ids, images), do not.
        # The shapes are the compiled graph's (under CP each rank's part of the sequence).
        phs = sg.placeholders()[sg.n_params + len(sg.buffer_names):]
        self.input_meta = [(shape, ph.meta["val"].dtype, ph.meta["val"].is_floating_point() and i < sg.n_received)
                           for i, (ph, shape) in enumerate(zip(phs, runner.input_shapes))]
        from autopar.passes.distribute import output_values

        fw = runner.compiled.fw_graph
        sent = next(iter(fw.graph.find_nodes(op="output"))).args[0][:len(output_values(sg))]
        self.output_meta = [(tuple(o.meta["val"].shape), v.dtype, i in runner.grad_outputs)
                            for i, (v, o) in enumerate(zip(output_values(sg), sent))]

    def forward(self, *inputs):
        pm = self._pm
        params = [pm.get_parameter(n) for n in self._sg.param_names]
        buffers = [pm.get_buffer(n) for n in self._sg.buffer_names]
        outs = self._runner(params, buffers, list(inputs))
        return outs if len(outs) > 1 else outs[0]


@dataclass
class CompileInfo:
    """What ``autopar.compile`` did, for ``explain`` and the runtime: the compiled graphs'
    collectives (records by graph set: "step", "forward", "stage N", "tied gradients"), the passes'
    notes and times, the step's example inputs and its parameter and buffer order, the forward
    output's type (set when the user's own loop first calls the model), the pipeline's tied
    parameters (name, group of the holders, counted in the norm here) and the whole time taken."""

    param_names: list[str]
    inputs: list = field(default_factory=list)
    buffers: list = field(default_factory=list)
    output_type: Any = None
    collectives: dict[str, list[dict]] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    tied: list = field(default_factory=list)
    compile_s: float | None = None
    # By graph set, the graphs this rank compiled (the ranks with the same graphs share them out)
    compiled_here: dict[str, list[str]] = field(default_factory=dict)


def _kind(t: torch.Tensor) -> str:
    return "float" if t.is_floating_point() else "int" if t.dtype not in (torch.bool, torch.complex64,
                                                                           torch.complex128) else str(t.dtype)


class ParallelModule(nn.Module):
    """The parallel model: an ``nn.Module`` whose parameters (original names) are the local
    shards of this rank, as DTensors. A plain optimizer over ``parameters()`` trains it."""

    def __init__(self, model: nn.Module, plan: Plan, mesh, *, step_runner: StepRunner | None,
                 forward_factory: Callable[[tuple], StepRunner] | None, loss_fn: Callable, info: CompileInfo,
                 stages: dict | None = None, once: zero.Once | None = None):
        super().__init__()
        # Share the user's submodules and parameter/buffer dicts: names stay the original ones.
        self._modules = model._modules
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set  # state_dict keys as the original's
        object.__setattr__(self, "_model_type", type(model))
        self.plan, self.mesh, self.loss_fn = plan, mesh, loss_fn
        self._step_runner = step_runner
        self._forward_factory = forward_factory
        self._forward_runners: dict = {}
        self._stages = stages or {}  # pipeline stage index -> (StepGraph, StepRunner), this rank's
        self._schedules: dict = {}
        self.info = info
        self._buffer_list = info.buffers
        self._tied = info.tied
        self._once = once  # FSDP once per step: how the parameters are gathered (zero.Once)
        if once is not None:
            info.collectives["once per step"] = zero.StepWeights(self._named(*self._runners()), once).records()
        if mesh is not None and plan.dp > 1:
            self._dp_rank = mesh.get_local_rank("dp_replicate") * plan.dp_shard + mesh.get_local_rank("dp_shard")
            self._dp_group = mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()
        else:
            self._dp_rank, self._dp_group = 0, None

    # -- forward (the user's own loop) ----------------------------------------------------
    def forward(self, *inputs):
        with guarded("forward"):
            return self._forward(*inputs)

    def _forward(self, *inputs):
        if self.plan.pp > 1:
            raise AutoparError(
                "a forward-only call is not available under a pipeline plan (the model is split "
                f"over {self.plan.pp} ranks); use step() for training, or a plan with pp=1"
            )
        shapes = tuple(tuple(x.shape) for x in inputs)
        runner = self._forward_runners.get(shapes)
        if runner is None:
            if self._forward_factory is None:
                raise AutoparError("this ParallelModule was built for step() only")
            runner = self._forward_runners[shapes] = self._forward_factory(inputs)
        if self._once is not None:  # gathered for this call, reduced when its backward ends
            runner.once = zero.StepWeights(self._named(runner), self._once, auto=torch.is_grad_enabled()).gather()
        try:
            (logits,) = runner(self._live_params(), self._buffer_list, list(inputs))
        finally:
            runner.once = None
        out_type = self.info.output_type
        if out_type is not None:
            try:
                return out_type(logits=logits)
            except TypeError:
                return logits
        return logits

    def _live_params(self) -> list:
        """The step graph's parameters as registered now (the optimizer updates them in place)."""
        return [self.get_parameter(name) for name in self.info.param_names]

    def _runners(self) -> list[StepRunner]:
        """This rank's step graphs' runners: the step's, or its pipeline stages'."""
        return [self._step_runner] if self._step_runner is not None else [r for _, r in self._stages.values()]

    def _named(self, *runners: StepRunner) -> dict:
        return {n: self.get_parameter(n) for r in runners for n in r.param_names}

    def _once_per_step(self, *runners: StepRunner):
        """Under ``fsdp_once``: the parameters of ``runners`` gathered for the step's microbatches
        and their gradients reduced after them (``zero.once_per_step``)."""
        if self._once is None:
            return contextlib.nullcontext()
        return zero.once_per_step(runners, self._named(*runners), self._once)

    def explain(self, graph: bool = False) -> str:
        text = explain_mod.render(self.plan) + explain_mod.render_compile_time(self.info)
        if getattr(self, "tuning", None):
            text += explain_mod.render_tuning(self.tuning)
        if graph:
            text += explain_mod.render_executed(self.info)
        return text

    # -- training ----------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor | tuple, target: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of one global batch; returns the mean loss (same on every rank).
        ``inputs``: the model's input (token ids, images) or a tuple of its inputs, batch first, as
        at compile; ``target``: what the loss compares the output with (labels), batch first.

        The loss all-reduce is waited for inside (a stream wait on GPUs, not a host sync), so
        a failure on another rank surfaces here. An exception on any rank stops every rank (see
        ``FailureWatch``)."""
        with guarded("step()"):
            return self._step(inputs if isinstance(inputs, tuple) else (inputs,), target)

    def _compute_device(self) -> torch.device:
        """Where this rank computes: its GPU on a CUDA mesh, else where its parameters are."""
        if self.mesh is not None and self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return next((getattr(p, "_local_tensor", p).device for p in self.parameters()), torch.device("cpu"))

    def _check_inputs(self, inputs: tuple, target) -> None:
        """``inputs`` and ``target`` against the microbatch the step was compiled for: the same
        number of tensors, each of the same kind (integer or floating point) and per-sample shape."""
        if target is None:
            raise AutoparError("step() needs target= (the labels for the loss)")
        *want, want_tgt = self.info.inputs
        tokens = len(want) == 1 and want[0].dim() == 2 and not want[0].is_floating_point()
        if len(inputs) != len(want):
            raise AutoparError(f"step() got {len(inputs)} input(s), the step was compiled for {len(want)}")
        named = [("ids" if tokens else f"inputs[{i}]", x, w) for i, (x, w) in enumerate(zip(inputs, want))]
        for what, t, w in named + [("target", target, want_tgt)]:
            if not isinstance(t, torch.Tensor) or t.dim() != w.dim():
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                axes = "(batch, seq)" if tokens else f"{w.dim()}-D (batch first)"
                raise AutoparError(f"step() takes {what} as a {axes} tensor, got {shape}")
            if _kind(t) != _kind(w):
                kind = {"int": "integer token ids" if tokens else "integers", "float": "floating point"}[_kind(w)]
                fix = "; pass a LongTensor" if _kind(w) == "int" else ""
                raise AutoparError(f"step() takes {what} as {kind}, got {t.dtype}{fix}")
        if tokens and want_tgt.shape == want[0].shape and target.shape != inputs[0].shape:  # next-token labels
            raise AutoparError(f"target has shape {tuple(target.shape)}, ids {tuple(inputs[0].shape)}: they must match")
        if any(t.shape[0] != inputs[0].shape[0] for t in (*inputs, target)):
            raise AutoparError(f"step() got inputs and target of batches {[t.shape[0] for t in (*inputs, target)]}: "
                               "every one is batch first, over the same batch")
        dev = self._compute_device().type
        if any(t.device.type != dev for t in (*inputs, target)):
            raise AutoparError(f"step() got {named[0][0]} on {inputs[0].device} and target on {target.device}, but the "
                               f"model runs on {dev}: move the batch there first")

    def _step(self, inputs: tuple, target: torch.Tensor | None) -> torch.Tensor:
        plan = self.plan
        self._check_inputs(inputs, target)
        B = inputs[0].shape[0]
        if B % (plan.dp * plan.mb):
            raise AutoparError(
                f"a batch of {B} sequences cannot be split over dp={plan.dp} ranks into microbatches "
                f"of {plan.mb}; use a multiple of {plan.dp * plan.mb}"
            )
        for t, w in zip((*inputs, target), self.info.inputs):
            if (plan.mb, *t.shape[1:]) != tuple(w.shape):
                raise AutoparError(
                    f"step() got a batch of shape {tuple(t.shape[1:])} per sample in microbatches of {plan.mb}, but the "
                    f"step was compiled for {tuple(w.shape)}; compile again for the new shape"
                )
        local = B // plan.dp
        sl = slice(self._dp_rank * local, (self._dp_rank + 1) * local)
        xs_l, tgt_l = [x[sl] for x in inputs], target[sl]
        M = local // plan.mb
        if self.plan.pp > 1:
            loss = self._pipeline_step(xs_l, tgt_l, M)
        else:
            params = self._live_params()
            total = torch.zeros((), dtype=torch.float32, device=tgt_l.device)
            with self._once_per_step(*self._runners()):
                for i in range(M):
                    mb = slice(i * plan.mb, (i + 1) * plan.mb)
                    (loss,) = self._step_runner(params, self._buffer_list, [*(x[mb] for x in xs_l), tgt_l[mb]])
                    (loss / M).backward()
                    total += loss.detach().float()
            loss = total / M
        if plan.dp > 1:
            loss = funcol.all_reduce(loss / plan.dp, "sum", self._dp_group)
        return funcol.wait_tensor(loss) if isinstance(loss, funcol.AsyncCollectiveTensor) else loss

    def _schedule(self, M: int):
        """The pipelining schedule for M microbatches (built once per M)."""
        if M not in self._schedules:
            from torch.distributed import pipelining as pl

            plan = self.plan
            from autopar.cost_models.step import ZERO_BUBBLE

            zero_bubble = plan.schedule in ZERO_BUBBLE
            if M < plan.pp or (plan.schedule in ("interleaved", "interleaved_zb") and M % plan.pp):
                raise AutoparError(f"{M} microbatches do not fit the {plan.schedule} schedule over {plan.pp} stages; "
                                   f"use a global batch of a multiple of {plan.pp * plan.mb * plan.dp} sequences")
            group = self.mesh["pp"].get_group()
            stages = []
            dev = self._compute_device()
            for idx, (sg, runner) in sorted(self._stages.items()):
                mod = _StageModule(self, sg, runner)
                ins = tuple(torch.zeros(shape, dtype=dt, device=dev, requires_grad=grad)
                            for shape, dt, grad in mod.input_meta)
                outs = tuple(torch.zeros(shape, dtype=dt, device=dev, requires_grad=grad)
                             for shape, dt, grad in mod.output_meta)
                stages.append(pl.PipelineStage(mod, idx, plan.pp * plan.v, dev,
                                               input_args=ins, output_args=outs if len(outs) > 1 else outs[0],
                                               group=group, dw_builder=runner.take_weight_grads if zero_bubble else None))

            def loss_fn(out, tgt):  # each microbatch's loss scaled by 1/M: the mean's gradient
                return self.loss_fn(out, tgt) / M

            multi = {"interleaved": pl.ScheduleInterleaved1F1B, "interleaved_zb": pl.ScheduleInterleavedZeroBubble,
                     "zbv": pl.ScheduleZBVZeroBubble}
            if plan.schedule in multi:
                sched = multi[plan.schedule](stages, n_microbatches=M, loss_fn=loss_fn, scale_grads=False)
            else:
                cls = pl.ScheduleGPipe if plan.schedule == "gpipe" else pl.Schedule1F1B
                sched = cls(stages[0], n_microbatches=M, loss_fn=loss_fn, scale_grads=False)
            self._schedules[M] = sched
        return self._schedules[M]

    def _pipeline_step(self, inputs: list, target: torch.Tensor, M: int) -> torch.Tensor:
        n_stages = self.plan.pp * self.plan.v
        sched = self._schedule(M)
        args = tuple(inputs) if 0 in self._stages else ()
        losses: list = []
        kwargs = {"target": target, "losses": losses} if n_stages - 1 in self._stages else {}
        with self._once_per_step(*self._runners()):
            sched.step(*args, **kwargs)
        for name, group, _ in self._tied:  # each copy got the gradient of its own stage's uses
            g = self.get_parameter(name).grad
            dist.all_reduce(getattr(g, "_local_tensor", g), group=group)
        loss = torch.stack([l.detach().float() for l in losses]).sum() if losses else torch.zeros((), device=target.device)
        return funcol.all_reduce(loss, "sum", self.mesh["pp"].get_group())  # only the last stage contributes

    # -- checkpoints ---------------------------------------------------------------------------
    PLAN_FILE = "autopar_plan.json"

    def save_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Save the weights (and the optimizer's state) with ``torch.distributed.checkpoint``
        under the original parameter names, and the plan beside them (``autopar_plan.json``, what
        ``autopar explain --checkpoint`` compares a new plan with). A collective: every rank."""
        import torch.distributed.checkpoint as dcp

        dcp.save(_dcp_view(self._checkpoint_state(optimizer))[0], checkpoint_id=path)
        if not dist.is_initialized() or dist.get_rank() == 0:
            self.plan.save(os.path.join(path, self.PLAN_FILE))

    def load_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | None = None):
        """Load a checkpoint written by ``save_checkpoint`` (or by ``dcp.save`` of
        ``{"model": pm.state_dict(), "optim": get_optimizer_state_dict(pm, opt)}``) under any
        plan and GPU count: each rank reads the pieces its shards need. Returns the plan it was
        saved under (None when the checkpoint has none). A collective: every rank."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if not os.path.isdir(path):
            raise AutoparError(f"no checkpoint at {path}: give the directory save_checkpoint wrote")
        # An optimizer that has not stepped gets its state (the entries the load fills) from
        # torch only where no parameter holds a gradient; otherwise its moments would silently
        # stay unloaded. The gradients are set aside for that and put back.
        held = []
        if optimizer is not None and not optimizer.state:
            held = [(q, q.grad) for g in optimizer.param_groups for q in g["params"] if q.grad is not None]
        for q, _ in held:
            q.grad = None
        try:
            state = self._checkpoint_state(optimizer)
        finally:
            for q, grad in held:
                q.grad = grad
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        missing = [k for k in _flat_keys(state) if k not in meta]
        if missing:
            what = "the optimizer's state" if all(k.startswith("optim.") for k in missing) else "these weights"
            raise AutoparError(f"the checkpoint at {path} lacks {what} ({len(missing)} entries, e.g. {missing[0]}); "
                               "it was saved from another model, or without the optimizer")
        view, strided = _dcp_view(state)
        dcp.load(view, checkpoint_id=path)
        with torch.no_grad():
            for orig, tmp in strided:  # back to each rank's interleaved pieces
                orig.copy_(_through_full(tmp, orig.placements))
        self.load_state_dict(state["model"])
        if optimizer is not None:
            set_optimizer_state_dict(self, optimizer, optim_state_dict=state["optim"])
        plan_file = os.path.join(path, self.PLAN_FILE)
        return Plan.load(plan_file) if os.path.exists(plan_file) else None

    def _checkpoint_state(self, optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = {"model": self.state_dict()}
        if optimizer is not None:
            state["optim"] = get_optimizer_state_dict(self, optimizer)
        return state

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """Plain full tensors under the original names, on every rank (a collective: call it on
        all ranks). The original single-device model takes it with ``load_state_dict`` (so a
        HuggingFace model can be ``save_pretrained`` after training); tied parameters appear
        under each of their names, as in the original's ``state_dict``. Under PP each stage's
        parameters are gathered from the ranks that hold them."""
        from torch.distributed.tensor import DTensor

        out = {}
        for k, v in self.state_dict(keep_vars=False).items():
            out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
        if self.plan.pp > 1:  # every rank holds some stages: share what each has over the pp group
            group = self.mesh["pp"].get_group()
            parts: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, out, group=group)
            out = {}
            for part in parts:
                out.update(part)
        return out

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over every shard (TP, FSDP) of every parameter.

        Sum of squares per gradient: a shard's local sum, all-reduced over the mesh dims it is
        sharded on (one all-reduce per group of gradients sharing mesh and dims); pending partial
        sums (``Partial`` placements) are reduced first; replicated gradients count once.
        """
        from torch.distributed.tensor import DTensor, Replicate

        params = [p for p in self.parameters() if p.grad is not None]
        copies = {id(self.get_parameter(name)) for name, _, counted in self._tied if not counted}
        sums: dict[tuple, list] = {}
        for p in params:
            if id(p) in copies:  # another rank's copy of the same weight counts it
                continue
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                g = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
                p.grad = g
            if isinstance(g, DTensor):
                dims = tuple(i for i, pl in enumerate(g.placements) if not (pl.is_replicate() or pl.is_partial()))
                entry = sums.setdefault((id(g.device_mesh), dims), [g.device_mesh, dims, 0.0])
                entry[2] = entry[2] + g.to_local().float().pow(2).sum()
            else:
                entry = sums.setdefault(("plain",), [None, (), 0.0])
                entry[2] = entry[2] + g.float().pow(2).sum()
        total = torch.zeros((), dtype=torch.float32, device=self._compute_device())  # NCCL reduces GPU tensors
        for mesh, dims, sq in sums.values():
            sq = torch.as_tensor(sq, dtype=torch.float32, device=total.device)
            for d in dims:
                dist.all_reduce(sq, group=mesh.get_group(d))
            total = total + sq
        if self.plan.pp > 1:  # each pipeline rank holds other parameters
            dist.all_reduce(total, group=self.mesh["pp"].get_group())
        norm = total.sqrt()
        coef = float((max_norm / (norm + 1e-6)).clamp(max=1.0))
        for p in params:
            g = p.grad
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
        return norm
