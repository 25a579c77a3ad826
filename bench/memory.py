"""One training step's peak memory and time: autopar against torch FSDP2 on the same model, in
the same processes, in one run.

The model is what an FSDP user would try: HF ``LlamaForCausalLM`` with hidden 1024, FFN 4096,
16 heads, vocabulary 512, fp32 (64 MiB a layer), at two depths. The alternative is what they
would otherwise write: ``fully_shard`` on every decoder block and on the root (FSDP2, eager,
``reshard_after_forward=True``), with DTensor TP (``ColwiseParallel``/``RowwiseParallel`` on the
projections) inside it for the TP x FSDP configuration. autopar gets the same model with the
same plan pinned (FSDP resharding after forward, one microbatch per rank, as FSDP2 runs it).

Per rank and side, after a warm-up step and with the gradients cleared: the step's peak above
what the process held before it, two ways (``PLATFORM.md``): the allocator's (the profiler's
allocation events, what a GPU's ``max_memory_allocated`` counts; the median of three steps, with
and without gloo's staging copies: ``autopar.memory.allocator_peaks``) and the resident set's
(``VmHWM`` after ``clear_refs``, with glibc told to map large blocks so freed memory leaves);
the step time (median of alternating steps); and the first step's loss on both sides (the same
model). Also the executed graphs' liveness peak (``memory.step_peak``). And the allocator's peak of
both sides again in one process on PyTorch's fake process group (rank 0 of the same world;
collectives allocate their outputs and move nothing): no transport threads, so the same number
every step. On gloo, when gloo's thread lets go of a finished collective's buffers moves autopar's
allocator peak (its collectives run asynchronously; FSDP2's wait in line) by up to a layer's
weights from step to step.

``python -m bench.memory [--layers 8,16] [--only fsdp] [--mp bf16-mixed] [--model vit|bart|gpt-oss]`` writes
bench/results/memory.{json,md} (``memory_bf16_mixed.*`` with ``--mp``: both sides under FSDP2's
``MixedPrecisionPolicy`` for that precision; ``memory_vit.*`` with ``--model vit``: a ViT of the
same width fed 224-pixel images, the input path of issue 28; ``memory_bart.*`` with ``--model
bart``: an encoder-decoder, both stacks' layers gathered where used on both sides; ``memory_gpt-oss.*``
with ``--model gpt-oss``: experts held as 3-D parameters, FSDP2 running transformers' own loop
over the experts hit, autopar its routed form; ``--only ep2_fsdp2``: autopar under expert
parallelism, each rank running its own experts, against the same FSDP2; ``ep2_fsdp4``: the same
over 4 processes, the experts split over twice the ep ranks).
Targets (issue 22): autopar / FSDP2 <= 1.0 at both depths, growth with depth no steeper.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from autopar import launch
from autopar.memory import allocator_peaks
from bench.common import worst_rank, write

HIDDEN, FFN, HEADS, VOCAB = 1024, 4096, 16, 512
BATCH, SEQ = 4, 256  # global: each data-parallel rank runs its share in one microbatch
CONFIGS = {
    "fsdp": (2, {"dp": 2, "fsdp": 1, "reshard": 1, "tp": 1, "pp": 1, "ac": "none"}),
    "tp2_fsdp2": (4, {"tp": 2, "sp": 0, "dp": 2, "fsdp": 1, "reshard": 1, "pp": 1, "ac": "none"}),
    # mixtures of experts only (``--model gpt-oss --only ep2_fsdp2``): each rank runs its own
    # experts (its FSDP shard of the 3-D weights) on the rows routed to them
    "ep2_fsdp2": (2, {"dp": 2, "fsdp": 1, "reshard": 1, "tp": 1, "pp": 1, "ac": "none", "ep": 2}),
    # ... split over twice the ep ranks: each rank gathers the other piece of its own experts
    "ep2_fsdp4": (4, {"dp": 4, "fsdp": 1, "reshard": 1, "tp": 1, "pp": 1, "ac": "none", "ep": 2}),
}
BY_DEFAULT = ("fsdp", "tp2_fsdp2")


IMAGE, PATCH, CLASSES = 224, 16, 1000  # --model vit: 197 tokens an image, an ImageNet head


def build(layers: int, model: str = "llama") -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if model == "vit":
        cfg = tf.ViTConfig(image_size=IMAGE, patch_size=PATCH, hidden_size=HIDDEN, intermediate_size=FFN,
                           num_hidden_layers=layers, num_attention_heads=HEADS, num_labels=CLASSES,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
        return tf.ViTForImageClassification(cfg)
    if model == "gpt-oss":  # experts held as 3-D parameters (8, top 2, biased), attention sinks, alternating windows
        cfg = tf.GptOssConfig(hidden_size=HIDDEN, intermediate_size=FFN // 4, num_hidden_layers=layers,
                              num_attention_heads=HEADS, num_key_value_heads=HEADS // 4, head_dim=HIDDEN // HEADS,
                              num_local_experts=8, num_experts_per_tok=2, vocab_size=VOCAB, sliding_window=SEQ // 2,
                              max_position_embeddings=SEQ, rope_scaling=None, use_cache=False,
                              layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                              attn_implementation="eager")
        return tf.GptOssForCausalLM(cfg)
    if model == "bart":  # an encoder-decoder of the same width: half the layers in each stack
        from autopar.models import SameIds

        cfg = tf.BartConfig(d_model=HIDDEN, encoder_layers=layers // 2, decoder_layers=layers - layers // 2,
                            encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                            decoder_ffn_dim=FFN, vocab_size=VOCAB, max_position_embeddings=SEQ, dropout=0.0,
                            attention_dropout=0.0, activation_dropout=0.0, use_cache=False, attn_implementation="sdpa")
        return SameIds(tf.BartForConditionalGeneration(cfg))
    cfg = tf.LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB,
                         max_position_embeddings=SEQ, use_cache=False, attn_implementation="sdpa")
    return tf.LlamaForCausalLM(cfg)


def resident_peak_mib(fn) -> float:
    """The resident set's peak during ``fn()`` above the resident set before it (Linux)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts from the current resident set

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    before = status("VmRSS:")
    fn()
    return (status("VmHWM:") - before) / 2**20


def fsdp2_model(model: torch.nn.Module, world: int, tp: int, mp_policy=None) -> torch.nn.Module:
    """What a user writes by hand: DTensor TP on the projections (if tp > 1), then fully_shard
    per decoder block and on the root (with ``mp_policy`` when given)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from autopar.capture import find_layers

    dp = world // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    blocks = [model.get_submodule(n) for n in find_layers(model)]
    if tp > 1:
        plan = {f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
        plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel(),
                     "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel()})
        for layer in blocks:
            parallelize_module(layer, mesh["tp"], plan)
    kw = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for layer in blocks:
        fully_shard(layer, mesh=mesh["dp"], **kw)
    fully_shard(model, mesh=mesh["dp"], **kw)
    return model


def _side_by_side(ids, tgt, pm, ref, dp_rank: int, dp: int):
    """The two sides' step functions: autopar's ``step`` of the global batch (token ids or
    images), FSDP2's forward and backward of this data-parallel rank's share."""
    from autopar.capture import default_loss

    sl = slice(dp_rank * (BATCH // dp), (dp_rank + 1) * (BATCH // dp))

    def fsdp2_step():
        loss = default_loss(ref(ids[sl]), tgt[sl])
        loss.backward()
        return loss

    return {"autopar": (lambda: pm.step(ids, target=tgt), pm), "fsdp2": (fsdp2_step, ref)}


def _clear(sides) -> None:
    for _, mod in sides.values():
        for p in mod.parameters():
            p.grad = None
    gc.collect()


def alternate_steps(sides: dict, steps: int) -> tuple[dict, dict]:
    """A warm-up step, then ``steps`` timed steps of each side in turn (gradients cleared, every
    rank in step before and after): each side's first loss and its step times."""
    losses, times = {}, {k: [] for k in sides}
    for i in range(1 + steps):
        for side, (fn, _) in sides.items():
            _clear(sides)
            dist.barrier()
            t0 = time.perf_counter()
            loss = fn()
            dist.barrier()
            if i == 0:
                losses[side] = float(loss.detach())
            else:
                times[side].append(time.perf_counter() - t0)
    return losses, times


def measure_sides(sides: dict, steps: int, out: dict, gloo: bool = False) -> dict:
    """Each side's step time (``<side>_s``: the median of ``alternate_steps``) and allocator peak
    (``<side>_alloc_mib``, gloo's staging copies left out; with ``gloo`` also ``<side>_alloc_gloo_mib``
    with them) into ``out``; returns the sides' first losses. The median of three peaks: when
    gloo's threads let go of a finished collective's buffers moves autopar's peak (its
    collectives run asynchronously) by up to 100 MiB from step to step."""
    losses, times = alternate_steps(sides, steps)
    for side, (fn, _) in sides.items():
        peaks = []
        for _ in range(3):
            _clear(sides)
            peaks.append(allocator_peaks(fn))
        with_gloo, own = (statistics.median(p) for p in zip(*peaks))
        out[f"{side}_alloc_mib"] = own
        if gloo:
            out[f"{side}_alloc_gloo_mib"] = with_gloo
        out[f"{side}_s"] = statistics.median(times[side])
    return losses


def _setup(world: int, name: str, layers: int, compile: bool, mp: str, model: str):
    """autopar's compiled model and FSDP2's, of the same weights, and the batch."""
    import autopar

    _, pins = CONFIGS[name]
    tp = pins.get("tp", 1)
    dp = world // tp
    base = build(layers, model)
    g = torch.Generator().manual_seed(0)
    if model == "vit":
        ids, tgt = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)
    else:
        ids, tgt = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
    t0 = time.perf_counter()
    policy = None
    if mp:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from autopar.plan import precision

        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, precision(mp).compute),
                                      reduce_dtype=getattr(torch, precision(mp).reduce))
    pm = autopar.compile(copy.deepcopy(base), world, example_inputs=(ids,), plan={**pins, "mb": BATCH // dp},
                         global_batch=BATCH, compile=compile, mp_policy=policy)
    setup = time.perf_counter() - t0
    ref = fsdp2_model(copy.deepcopy(base), world, tp, policy)
    return ids, tgt, pm, ref, dp, setup


def _fake(_rank: int, _world: int, _port: int, name: str, layers: int, compile: bool, mp: str, model: str) -> dict:
    """The allocator's peak of both sides on the fake process group (rank 0 of the world)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autopar
    from autopar import memory

    world = CONFIGS[name][0]
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    ids, tgt, pm, ref, dp, _ = _setup(world, name, layers, compile, mp, model)
    sides = _side_by_side(ids, tgt, pm, ref, pm._dp_rank, dp)
    out = {}
    for side, (fn, _) in sides.items():
        for _ in range(2):  # warm-up, then the measured step
            _clear(sides)
            peak = memory.allocator_peaks(fn)[0]
        out[f"{side}_fake_mib"] = peak
    out["liveness_fake_mib"] = memory.step_peak(pm).peak_bytes / 2**20
    autopar.shutdown()
    return out


def _run(name, layers, steps, compile, mp, model) -> dict:
    """One rank's measurements on gloo (``launch.run`` made the process group and ends it)."""
    world = dist.get_world_size()
    from autopar import memory

    ids, tgt, pm, ref, dp, setup = _setup(world, name, layers, compile, mp, model)
    sides = _side_by_side(ids, tgt, pm, ref, pm._dp_rank, dp)
    out = {"name": name, "layers": layers, "plan": pm.plan.as_config_string(), "autopar_setup_s": setup}
    losses = measure_sides(sides, steps, out, gloo=True)
    for side, (fn, _) in sides.items():
        _clear(sides)
        out[f"{side}_rss_mib"] = resident_peak_mib(fn)
    # FSDP2's loss is this rank's share: the mean over data-parallel ranks is the global mean.
    ref_loss = torch.tensor(losses["fsdp2"])
    dist.all_reduce(ref_loss)
    out["loss_diff"] = abs(losses["autopar"] - float(ref_loss) / world)
    out["liveness_mib"] = memory.step_peak(pm).peak_bytes / 2**20
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="8,16")
    ap.add_argument("--only", default="", help="configurations (default: " + ",".join(BY_DEFAULT) + "): "
                    + ",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--mp", default="", help="a mixed precision for both sides (e.g. bf16-mixed; default: fp32)")
    ap.add_argument("--model", default="llama", choices=("llama", "vit", "bart", "gpt-oss"),
                    help="vit: HF ViT of the same width, 224-pixel images in 16-pixel patches, 1,000 classes; "
                         "bart: HF BART of the same width, the layers half encoder and half decoder; "
                         "gpt-oss: HF gpt-oss of the same width, 8 experts (FFN/4 each, top 2) in 3-D parameters")
    args = ap.parse_args(argv)
    # Freed large blocks go back to the system, so the resident peak is the step's (PLATFORM.md).
    os.environ.update(MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="0")
    import tempfile

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="autopar-inductor-"))
    os.environ.setdefault("AUTOPAR_CACHE_DIR", tempfile.mkdtemp(prefix="autopar-cache-"))  # a first run's setup
    rows = []
    for name in [n for n in CONFIGS if n in (args.only.split(",") if args.only else BY_DEFAULT)]:
        for layers in map(int, args.layers.split(",")):
            world = CONFIGS[name][0]
            per = launch.run(world, "gloo", _run, name, layers, args.steps, not args.no_compile, args.mp, args.model)
            fake = launch.spawn(1, _fake, name, layers, not args.no_compile, args.mp, args.model)
            if fake.failures or not fake.results[0]:
                print(fake.failures[0].message if fake.failures else f"fake group: no result {fake.exitcodes}",
                      file=sys.stderr)
                return 1
            fake = fake.results[0][0]
            row = worst_rank(per)
            row.update(fake)
            row["fake_ratio"] = row["autopar_fake_mib"] / row["fsdp2_fake_mib"]
            row["alloc_ratio"] = row["autopar_alloc_mib"] / row["fsdp2_alloc_mib"]
            row["alloc_gloo_ratio"] = row["autopar_alloc_gloo_mib"] / row["fsdp2_alloc_gloo_mib"]
            row["rss_ratio"] = row["autopar_rss_mib"] / row["fsdp2_rss_mib"]
            row["time_ratio"] = row["autopar_s"] / row["fsdp2_s"]
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            rows.append(row)
    vit = args.model == "vit"
    described = {"vit": f"HF ViT hidden {HIDDEN}, FFN {FFN}, {HEADS} heads, {IMAGE} px / {PATCH} px patches, "
                        f"{CLASSES} classes",
                 "bart": f"HF BART d_model {HIDDEN}, FFN {FFN}, {HEADS} heads, vocab {VOCAB}, the layers half "
                         "encoder and half decoder, the same ids into both",
                 "llama": f"HF Llama hidden {HIDDEN}, FFN {FFN}, {HEADS} heads, vocab {VOCAB}",
                 "gpt-oss": f"HF gpt-oss hidden {HIDDEN}, 8 experts of FFN {FFN // 4} (top 2) in 3-D parameters, "
                            f"{HEADS} heads, vocab {VOCAB}, eager attention with sinks"}
    summary = {"model": described[args.model] + ", fp32 parameters",
               "precision": args.mp or "fp32",
               "batch": f"{BATCH} x {(IMAGE // PATCH) ** 2 + 1 if vit else SEQ} tokens global, one microbatch per rank",
               "compiled": not args.no_compile,
               "alternative": "FSDP2 fully_shard per block + root, eager (DTensor TP inside for tp2_fsdp2)",
               "max alloc ratio": f"{max(r['alloc_ratio'] for r in rows):.3f} (target <= 1.0)",
               "max fake-group alloc ratio": f"{max(r['fake_ratio'] for r in rows):.3f} (target <= 1.0)",
               "max resident ratio": f"{max(r['rss_ratio'] for r in rows):.3f} (target <= 1.0)"}
    partial = bool(args.only) or args.layers != "8,16"
    stem = "memory" + ("" if args.model == "llama" else f"_{args.model}") + (f"_{args.mp.replace('-', '_')}" if args.mp else "")
    write(stem + "_partial" if partial else stem, rows, summary,
          ["name", "layers", "plan", "autopar_fake_mib", "fsdp2_fake_mib", "fake_ratio", "liveness_fake_mib",
           "autopar_alloc_mib", "fsdp2_alloc_mib", "alloc_ratio", "autopar_alloc_gloo_mib",
           "fsdp2_alloc_gloo_mib", "alloc_gloo_ratio", "autopar_rss_mib",
           "fsdp2_rss_mib", "rss_ratio", "liveness_mib", "autopar_s", "fsdp2_s", "time_ratio", "loss_diff",
           "autopar_setup_s"],
          "One step's peak memory: autopar vs FSDP2 (fully_shard per block), CPU gloo")
    return 0


if __name__ == "__main__":
    sys.exit(main())
