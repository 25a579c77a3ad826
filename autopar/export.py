"""A plan written as the configuration of the framework a user would otherwise run it with.

``autopar export PLAN --to torchtitan`` writes the ``[parallelism]``, ``[training]`` and
``[activation_checkpoint]`` tables of a torchtitan job TOML; ``--to megatron`` the parallelism,
batch and recompute arguments of Megatron-LM's ``pretrain_gpt.py``. The layout (mesh degrees,
schedule, microbatch, FSDP resharding, AC) is the plan's. What the other framework cannot express
is said in a comment line where it is close (a per-layer AC mix becomes the mode covering every
layer that recomputes) and refused with an ``AutoparError`` where it is not (a schedule the
framework does not have, TP without SP in torchtitan), never silently changed.
"""

from __future__ import annotations

from collections import Counter

from autopar.errors import AutoparError
from autopar.plan import SCHEDULE_NAMES, Plan, precision

TARGETS = ("torchtitan", "megatron")


def export(plan: Plan, target: str) -> str:
    if target not in TARGETS:
        raise AutoparError(f"export target {target!r} is not known: use one of {', '.join(TARGETS)}")
    stacks = sorted({layer.fqn.rpartition(".")[0] for layer in plan.layers})
    if len(stacks) > 1:  # an encoder-decoder, a vision model in stages
        raise AutoparError(f"{plan.model_name}'s layers are in {len(stacks)} stacks ({', '.join(stacks[:4])}): "
                           f"{target}'s trainers run one stack of decoder layers; run this plan with "
                           "autopar.compile(model, mesh, plan=...)")
    return _torchtitan(plan) if target == "torchtitan" else _megatron(plan)


def _ac(plan: Plan) -> tuple[str, list[str]]:
    """One AC mode for frameworks that take one: the strongest any layer uses; a comment when
    the plan mixes modes."""
    counts = Counter(l.ac for l in plan.layers)
    mode = next((m for m in ("full", "selective") if counts[m]), "none")
    notes = []
    if len(counts) > 1:
        mix = ", ".join(f"{m} on {n} layers" for m, n in sorted(counts.items()))
        notes.append(f"autopar's plan mixes AC modes per layer ({mix}); {mode} is applied to every layer here")
    return mode, notes


def _precision_notes(plan: Plan, target: str, float8_how: str) -> list[str]:
    """What the other framework runs differently from the plan's precision."""
    prec = precision(plan.precision)
    notes = []
    if prec.param != "float32":
        notes.append(f"{target} keeps fp32 master weights; this plan ({prec.name}) was priced without them")
    if prec.float8 and float8_how:
        notes.append(f"the plan was priced with float8 linears: {float8_how}")
    return notes


def _torchtitan(plan: Plan) -> str:
    if plan.tp > 1 and not plan.sp:
        raise AutoparError("torchtitan's tensor parallelism always shards the sequence (SP): this plan has "
                           "tp > 1 with sp=0; pin sp=1 and plan again to export it")
    if plan.pp > 1 and plan.schedule not in SCHEDULE_NAMES:
        raise AutoparError(f"torchtitan has no pipeline schedule {plan.schedule!r}")
    mode, notes = _ac(plan)
    notes += _precision_notes(plan, "torchtitan", "add \"float8\" to [model] converters (torchao)")
    replicate = plan.dp // plan.dp_shard if plan.fsdp else plan.dp
    shard = plan.dp_shard if plan.fsdp else 1
    if plan.fsdp and plan.fsdp_once:
        notes.append("torchtitan's FSDP gathers and reduces the parameters per microbatch; the plan gathers them once "
                     "per step and reduces their gradients once (ZeRO-1), priced with one step's whole parameters "
                     "and gradients held")
    lines = [f"# autopar plan for {plan.model_name} on {plan.world_size} x {plan.hardware}: "
             f"{plan.as_config_string()}"]
    lines += [f"# note: {n}" for n in notes]
    lines += [
        "", "[training]",
        # Per data-parallel rank: a pipeline splits it into microbatches; without one, torchtitan
        # accumulates global / (local x data parallel) steps of it.
        f"local_batch_size = {plan.mb * plan.n_microbatches if plan.pp > 1 else plan.mb}",
        f"global_batch_size = {plan.global_batch}",
        f"seq_len = {plan.seq_len}",
        f'mixed_precision_param = "{precision(plan.precision).compute}"',
        f'mixed_precision_reduce = "{precision(plan.precision).reduce}"',
        "", "[parallelism]",
        f"data_parallel_replicate_degree = {replicate}",
        f"data_parallel_shard_degree = {shard}",
        *([f'fsdp_reshard_after_forward = "{"always" if plan.reshard_after_forward else "never"}"'] if plan.fsdp else []),
        f"tensor_parallel_degree = {plan.tp}",
        f"context_parallel_degree = {plan.cp}",
        *([f"expert_parallel_degree = {plan.ep}"] if plan.ep > 1 else []),
        f"pipeline_parallel_degree = {plan.pp}",
    ]
    if plan.pp > 1:
        lines += [f'pipeline_parallel_schedule = "{SCHEDULE_NAMES[plan.schedule]}"',
                  f"pipeline_parallel_microbatch_size = {plan.mb}",
                  f"pipeline_parallel_layers_per_stage = {_layers_per_stage(plan)}"]
    lines += ["", "[activation_checkpoint]", f'mode = "{mode}"']
    if mode == "selective":
        lines.append('selective_ac_option = "op"')
    return "\n".join(lines) + "\n"


def _layers_per_stage(plan: Plan) -> int:
    per = Counter(plan.stage_index(l.stage, l.chunk) for l in plan.layers)
    sizes = set(per.values())
    if len(sizes) != 1:
        raise AutoparError(f"the plan's pipeline stages hold {sorted(per.values())} layers: torchtitan and "
                           "Megatron-LM split the layers evenly; pin a pp that divides the layer count")
    return sizes.pop()


def _megatron(plan: Plan) -> str:
    if plan.pp > 1 and plan.schedule not in ("1f1b", "interleaved"):
        raise AutoparError(f"Megatron-LM runs 1F1B and interleaved 1F1B pipelines, not {plan.schedule!r}: "
                           "pin schedule=1f1b or schedule=interleaved and plan again to export it")
    if plan.fsdp and plan.dp_shard != plan.dp:
        raise AutoparError("Megatron-LM's FSDP shards over the whole data-parallel group: this plan is HSDP "
                           f"({plan.dp // plan.dp_shard} x {plan.dp_shard}); pin dp_shard={plan.dp} to export it")
    mode, notes = _ac(plan)
    args = [f"--tensor-model-parallel-size {plan.tp}", f"--pipeline-model-parallel-size {plan.pp}",
            f"--context-parallel-size {plan.cp}", f"--micro-batch-size {plan.mb}",
            f"--global-batch-size {plan.global_batch}", f"--seq-length {plan.seq_len}"]
    prec = precision(plan.precision)
    if prec.compute != "float32":  # fp32 is Megatron-LM's default; --bf16/--fp16 keep fp32 master weights
        args.append({"bfloat16": "--bf16", "float16": "--fp16"}[prec.compute])
    if prec.float8:
        args.append("--fp8-format hybrid")  # Transformer Engine's float8 linears
    notes += _precision_notes(plan, "Megatron-LM", "")
    if plan.sp:
        args.append("--sequence-parallel")
    args.append(f"--num-layers {len(plan.layers)}")
    if plan.pp > 1 and plan.schedule == "interleaved":
        args.append(f"--num-layers-per-virtual-pipeline-stage {_layers_per_stage(plan)}")
    elif plan.pp > 1:
        _layers_per_stage(plan)  # an even split, or an error
    if plan.ep > 1:
        args.append(f"--expert-model-parallel-size {plan.ep}")
    if plan.fsdp and plan.fsdp_once:  # ZeRO-1: whole weights, gradients reduce-scattered once per step
        args.append("--use-distributed-optimizer")
    elif plan.fsdp:
        args.append("--use-torch-fsdp2")
        if not plan.reshard_after_forward:
            notes.append("Megatron-LM's torch FSDP2 reshards after forward; the plan keeps the gathered weights")
    if mode == "full" and not any(l.ac == "selective" for l in plan.layers):
        # The block method recomputes the first N layers of each (virtual) stage: the plan's count.
        n_full = sum(l.ac == "full" for l in plan.layers) // (plan.pp * plan.v)
        args += ["--recompute-granularity full", "--recompute-method block", f"--recompute-num-layers {n_full}"]
        notes = [n for n in notes if "mixes AC" not in n]
        notes.append(f"full AC on {n_full} layers of each stage (Megatron-LM recomputes the first ones)")
    elif mode != "none":
        args += (["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
                 if mode == "full" else ["--recompute-granularity selective"])
    head = [f"# autopar plan for {plan.model_name} on {plan.world_size} x {plan.hardware}: {plan.as_config_string()}",
            f"# data parallel {plan.dp} = {plan.world_size} GPUs / (tp {plan.tp} x pp {plan.pp} x cp {plan.cp})"]
    head += [f"# note: {n}" for n in notes]
    return "\n".join(head) + "\n" + " \\\n".join(args) + "\n"
