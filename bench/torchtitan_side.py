"""torchtitan's own Llama 3 and its own ``parallelize_llama``, on a CPU gloo mesh: the
alternative a user of autopar would otherwise run. Installed by ``make bench-deps`` (the pinned
packages of ``bench/torchtitan_deps.txt``, without their dependencies: torchtitan 0.3.0 would
otherwise pull a different torch, datasets, wandb and tensorboard).

On CPU, torchtitan needs four things that this module does and nothing else: its expert-parallel
Triton kernels module is replaced by one whose functions raise (a dense Llama never calls them;
triton is not installable without CUDA), ``torchtitan.trainer`` (imported only for an isinstance
check, and pulling the data loaders) by an empty ``Trainer``, its device type set to "cpu", and its
FSDP modules told to reduce by sum and divide afterwards, since gloo has no PREMUL_SUM. The model is
built from torchtitan's own configuration classes with SDPA causal attention (its language-model
presets choose FlexAttention, which needs a GPU), at the shapes of autopar's ``llama-small``
preset, with its fused QKV projection and complex RoPE.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch

KERNELS = ["copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
           "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
           "reduce_topk_slots_kernel", "topk_scores_grad_kernel"]
DIM, HEADS, KV_HEADS, LAYERS, HIDDEN, VOCAB, SEQ = 256, 8, 4, 8, 688, 1024, 256


def _cpu_shims() -> None:
    def _needs_triton(*a, **k):
        raise RuntimeError("torchtitan's expert-parallel Triton kernels are not available on CPU")

    kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")
    for name in KERNELS:
        setattr(kernels, name, _needs_triton)
    trainer = types.ModuleType("torchtitan.trainer")
    trainer.Trainer = type("Trainer", (), {"Config": type("Config", (), {})})
    sys.modules.setdefault(kernels.__name__, kernels)
    sys.modules.setdefault(trainer.__name__, trainer)
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as utils

    utils.device_type = parallel_dims.device_type = "cpu"


def available() -> str | None:
    """None when torchtitan imports here, else why not (with what to run)."""
    try:
        _cpu_shims()
        import torchtitan.models.llama3  # noqa: F401
    except ImportError as e:
        return f"torchtitan is not installed ({e}); run `make bench-deps` first"
    return None


def _parallelism(tp: int, sp: bool, dp_shard: int):
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(tensor_parallel_degree=tp, enable_sequence_parallel=sp, data_parallel_shard_degree=dp_shard,
                             spmd_backend="partial_dtensor")


def build_llama3(tp: int = 1, sp: bool = False, dp_shard: int = 1, seed: int = 0) -> torch.nn.Module:
    """torchtitan's Llama3Model at llama-small's shapes, initialised by its own ``init_states``."""
    cfg = llama3_config(tp, sp, dp_shard)
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model


def llama3_config(tp: int = 1, sp: bool = False, dp_shard: int = 1):
    """torchtitan's configuration of that model (what its pipeline split reads)."""
    _cpu_shims()
    import torchtitan.models.llama3 as L
    from torchtitan.models.common.attention import ScaledDotProductAttention

    layers = L._build_llama3_layers(
        fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=HIDDEN,
        rope=L.ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=10000.0), attn_backend="flex")
    for layer in layers:  # causal SDPA in place of the language-model default (FlexAttention)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = L.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB, layers=layers,
        tok_embeddings=L.Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=L._EMBEDDING_INIT),
        norm=L.RMSNorm.Config(normalized_shape=DIM, param_init=L._NORM_INIT),
        lm_head=L.Linear.Config(in_features=DIM, out_features=VOCAB, param_init=L._output_linear_init(DIM)))
    cfg.update_from_config(config=types.SimpleNamespace(parallelism=_parallelism(tp, sp, dp_shard)))
    return cfg


def parallelize(model: torch.nn.Module, pins: dict, world: int, compile: bool) -> torch.nn.Module:
    """torchtitan's ``parallelize_llama`` for the TP/SP/FSDP/HSDP/AC of autopar plan pins
    (``{"tp": 2, "sp": 1, "dp": 2, "fsdp": 1, "ac": "full"}``), as its trainer calls it. ``model``
    must come from ``build_llama3`` with the same tp and sp (its sharding config)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3 import parallelize_llama

    if pins.get("pp", 1) > 1:
        raise ValueError("the torchtitan side runs plans without PP")
    tp = pins.get("tp", 1)
    dp = world // tp
    dp_shard = pins.get("dp_shard", dp) if pins.get("fsdp") else 1
    dims = ParallelDims(dp_replicate=dp // dp_shard, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1,
                        world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    ac = {"full": FullAC.Config(), "selective": SelectiveAC.Config(), "none": None}[pins.get("ac", "none")]
    model = parallelize_llama(
        model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32"),
        parallelism=_parallelism(tp, bool(pins.get("sp")), dp_shard),
        compile_config=CompileConfig(enable=compile, components=["model"]), ac_config=ac, dump_folder="")
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.set_force_sum_reduction_for_comms(True)
    return model


def pipeline(model: torch.nn.Module, pins: dict, world: int, compile: bool, batch: int, loss_fn):
    """torchtitan's ``pipeline_llm`` for a PP x FSDP (or PP x DDP) plan's pins, as its trainer calls
    it: the model cut into ``pins["pp"]`` stages, each parallelised (and compiled block by block) by
    ``parallelize_llama``, under its 1F1B schedule with the plan's microbatch size. Returns a
    function ``(ids, target) -> loss`` that runs one step of the whole batch on this rank (the
    loss: the mean of its microbatches' on a last-stage rank, 0 on the others); its
    ``parameters()`` are this rank's stages'."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import parallelize_llama

    pp = pins["pp"]
    dp = world // pp
    dp_shard = dp if pins.get("fsdp") else 1
    local = batch // dp
    mb = pins.get("mb", max(local // pp, 1))  # the microbatch's sequences, as autopar's pin says
    dims = ParallelDims(dp_replicate=dp // dp_shard, dp_shard=dp_shard, cp=1, tp=1, pp=pp, ep=1,
                        world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    parallelism = ParallelismConfig(data_parallel_shard_degree=dp_shard, pipeline_parallel_degree=pp,
                                    pipeline_parallel_schedule="1F1B", pipeline_parallel_microbatch_size=mb,
                                    spmd_backend="partial_dtensor")
    schedule, parts, first, last = pipeline_llm(
        model, parallel_dims=dims,
        training=TrainingConfig(local_batch_size=local, mixed_precision_param="float32", mixed_precision_reduce="float32"),
        parallelism=parallelism, compile_config=CompileConfig(enable=compile, components=["model"]), ac_config=None,
        dump_folder="", device=torch.device("cpu"), model_config=llama3_config(1, False, dp_shard),
        parallelize_fn=parallelize_llama, loss_fn=lambda pred, labels: (loss_fn(pred, labels), None))
    for part in parts:
        for mod in part.modules():
            if isinstance(mod, FSDPModule):
                mod.set_force_sum_reduction_for_comms(True)
    dp_rank = dist.get_rank() % dp  # the mesh is (pp, dp): a stage's data-parallel ranks are consecutive

    def step(ids, target):
        sl = slice(dp_rank * local, (dp_rank + 1) * local)
        losses = []
        if first:
            schedule.step(ids[sl], target=target[sl] if last else None, losses=losses)
        else:
            schedule.step(target=target[sl] if last else None, losses=losses)
        return torch.stack(losses).mean().detach() if losses else torch.zeros(())

    step.parameters = lambda: [p for part in parts for p in part.parameters()]
    return step


def train_step(model, plan, ids, target, dp_rank: int, loss_fn) -> torch.Tensor:
    """One step the torchtitan way: this rank's share of the batch, vocabulary-parallel loss under TP."""
    from torch.distributed.tensor.parallel import loss_parallel

    local = ids.shape[0] // plan.dp
    sl = slice(dp_rank * local, (dp_rank + 1) * local)
    with loss_parallel() if plan.tp > 1 else contextlib.nullcontext():
        loss = loss_fn(model(ids[sl]), target[sl])
        loss.backward()
    loss = loss.detach()
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
