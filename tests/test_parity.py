"""Parity: the parallel model is the same model. Real processes over gloo, fp32, the DEFAULT
options (Inductor on), compared with one process: the loss and every gradient after one step
(gathered to full tensors, by original name), and the loss over three AdamW steps.

Cases are grouped per launch (process start and gloo set-up cost seconds; the Inductor cache is
shared by the ranks of a launch and across launches). ``make parity`` runs the whole model x
plan matrix and writes its table to bench/results/parity.md."""

import atexit
import os
import shutil
import tempfile

import pytest

from tests import dist_harness

GRAD_TOL = 5e-7  # relative to the largest gradient entry when that is above 1
LOSS_TOL = 2e-6  # first step: the same computation up to reduction order (relative above a loss of 1)
TRAJ_TOL = 2e-5  # later steps: AdamW divides by sqrt(v) and amplifies rounding on tiny gradients (likewise)
# Mixed precision (bf16 compute) against FSDP2 with the same policy: both round to bf16, at
# different points (Inductor fuses element-wise chains in fp32, eager rounds after each op). The
# first loss is the same computation: measured 7e-6 to 3e-5 apart. AdamW's first step moves every
# weight by the learning rate times its gradient's sign, so each small gradient whose sign the
# rounding flips moves 2e-2 the other way, and the later losses part further: HF Llama under
# FSDP 4 1e-5, 7e-5, 1.6e-3 over three steps (against fp32: 3.5e-5, 1.3e-3, 1.9e-3); DeiT under
# FSDP 4 at its second step 3.0e-3 from FSDP2's on transformers 4.57 (6.2e-3 and 3.2e-3 from
# fp32's) and 5.2e-3 on 5.24 (5.5e-3 and 3.6e-4 from fp32's).
MP_FIRST_TOL = 1e-3
MP_TOL = 1e-2

TP2_FSDP2_SP = {"tp": 2, "sp": 1, "dp": 2, "fsdp": 1, "pp": 1}
MODELS = ["llama-tiny", "gpt-tiny", "hf-llama", "hf-qwen2", "hf-mistral", "hf-gemma", "hf-gpt2", "hf-neox",
          "hf-phi3", "hf-opt", "hf-qwen2-moe", "hf-qwen3-moe", "hf-mixtral", "custom-llama", "hf-gptj", "hf-bloom",
          "hf-falcon", "hf-falcon-new", "hf-bigcode", "hf-deepseek-v2", "hf-roberta", "hf-modernbert", "hf-bart",
          "hf-mt5", "hf-deit", "hf-swin", "diffusers-dit", "hf-qwen3", "hf-olmo2", "hf-gemma2", "hf-gemma3", "hf-phi",
          "hf-stablelm", "hf-starcoder2", "hf-cohere", "hf-granite", "hf-gpt-oss", "custom-mixtral-3d",
          "hf:llama4_text", "hf:granitemoe", "hf:glm4_moe", "hf:olmoe"]  # by transformers' model type (tests/zoo.py)
PLANS = {
    "fsdp4": {"dp": 4, "fsdp": 1, "pp": 1},
    "hsdp2x2": {"dp": 4, "fsdp": 1, "dp_shard": 2, "pp": 1},
    "ddp4": {"dp": 4, "fsdp": 0, "pp": 1},
    "tp4": {"tp": 4, "sp": 0, "pp": 1},
    "tp4_sp": {"tp": 4, "sp": 1, "pp": 1},
    "tp2_fsdp2_sp": TP2_FSDP2_SP,
    "ac_full_fsdp4": {"dp": 4, "fsdp": 1, "ac": "full", "pp": 1},
    "ac_selective_tp2_fsdp2_sp": {**TP2_FSDP2_SP, "ac": "selective"},
    # ZeRO-1: gathered once before the step's 2 microbatches, reduced once after them (zero.py);
    # HSDP: the reduce-scattered shard then all-reduced over the replicas.
    "hsdp2x2_once": {"dp": 4, "fsdp": 1, "dp_shard": 2, "pp": 1, "mb": 1, "once": "gather"},
    "auto": "auto",
    "auto_tp2": "tp=2",
}
PP4 = {
    "pp2_fsdp2": {"pp": 2, "dp": 2, "fsdp": 1, "tp": 1, "schedule": "1f1b", "mb": 1},
    "pp2_ddp2": {"pp": 2, "dp": 2, "fsdp": 0, "tp": 1, "schedule": "gpipe", "mb": 1},
    "pp2_tp2_sp": {"pp": 2, "tp": 2, "sp": 1, "dp": 1, "schedule": "1f1b", "mb": 2},
}
PP2 = {
    "pp2_gpipe": {"pp": 2, "schedule": "gpipe", "mb": 2, "dp": 1, "tp": 1},
    "pp2_1f1b": {"pp": 2, "schedule": "1f1b", "mb": 2, "dp": 1, "tp": 1},
    "pp2_interleaved_v2": {"pp": 2, "schedule": "interleaved", "v": 2, "mb": 2, "dp": 1, "tp": 1},
    "pp2_ac_selective": {"pp": 2, "schedule": "1f1b", "mb": 2, "dp": 1, "tp": 1, "ac": "selective"},
    # Zero-bubble: the backward split into input- and weight-gradient graphs, W run when the schedule says.
    "pp2_interleaved_zb": {"pp": 2, "schedule": "interleaved_zb", "v": 2, "mb": 2, "dp": 1, "tp": 1},
    "pp2_zbv": {"pp": 2, "schedule": "zbv", "v": 2, "mb": 2, "dp": 1, "tp": 1},
}


def case(model: str, plan_name: str, plan, **kw) -> dict:
    return {"name": f"{model}/{plan_name}", "model": model, "plan": plan, **kw}


# Qwen2-MoE trains under FSDP 4 with the HF plans (CI_PLANS_HF); Mixtral covers routed experts under TP there.
# Every family under TP 2 + SP on 2 processes (what differs by family is how its operators split
# over TP; FSDP x TP on 4 is the reference Llama's, HF Llama's and Mixtral's below, and every
# family's in ``make parity``), and the HF plans below: the ``matrix`` marker (``make
# test-matrix``, which CI runs after ``make test``), in launches that run side by side.
TP2_SP = {"tp": 2, "sp": 1, "pp": 1}
CI_MODELS = [case(m, "tp2_sp", TP2_SP, steps=2, user_loop=(m in ("hf-llama", "hf-deit"))) for m in MODELS
             if m not in ("hf-qwen2-moe", "llama-tiny")]  # the reference Llama's plans are in CI_PLANS
# Every plan on the reference Llama; on HF Llama the plans whose graphs differ most from the
# TP2xFSDP2+SP case above (``make parity`` runs every plan on every model).
CI_PLANS = [case("llama-tiny", n, p, clip=(n in ("ddp4", "tp4_sp", "tp2_fsdp2_sp")), user_loop=(n == "tp4_sp"))
            for n, p in PLANS.items() if n != "auto_tp2"]  # a pinned auto: gpt-tiny's in CI_PP4
# GPT-NeoX's parallel attention and MLP output biases get one gradient computation: under DDP it
# is all-reduced once and waited twice (passes/bucket.py: one_wait_each), and with two
# microbatches both parameters' gradients must accumulate separately (runtime._unshared).
CI_PLANS_HF = [case("hf-llama", n, PLANS[n]) for n in ("fsdp4", "ac_full_fsdp4")] + [
    case("hf-qwen2-moe", "fsdp4", PLANS["fsdp4"]), case("hf-neox", "ddp4_mb1", {**PLANS["ddp4"], "mb": 1}),
    # Routed experts under TP with selective AC (backend.compile_graph: no second rematerialisation).
    case("hf-mixtral", "ac_selective_tp2_fsdp2_sp", PLANS["ac_selective_tp2_fsdp2_sp"]),
    # Beyond decoders: encoders with a tied masked-LM head (ModernBERT: stacked q, k, v; local and
    # global attention layers) and encoder-decoders, beside their TP 2 x FSDP 2 + SP cases above
    # (the planner's own choice: ModernBERT's and mT5's); images in, class labels out (DeiT: a
    # patch-embedding convolution, class tokens, a 10-way head); latents, timesteps and class
    # labels in, the noise MSE out (diffusers' DiT, adaptive layer norm).
    *[case(m, "auto", "auto") for m in ("hf-modernbert", "hf-mt5", "hf-deit", "diffusers-dit")],
    # Latent attention under CP x TP + SP: the replicated latent projection runs on each rank's
    # tokens, flattened and unflattened with the sequence split over both cp and tp.
    case("hf-deepseek-v2", "cp2_tp2_sp", {"cp": 2, "tp": 2, "sp": 1}),
    # Experts held as 3-D parameters with biases (gpt-oss), FSDP-sharded along the experts and
    # TP-split along their features; attention sinks. As transformers 5 holds them, under EP x TP
    # (the fused gate/up's rows split along their features between the grouped calls).
    case("hf-gpt-oss", "tp2_fsdp2_sp", TP2_FSDP2_SP),
    case("custom-mixtral-3d", "ep2_tp2_fsdp2", {"ep": 2, "tp": 2, "dp": 2, "fsdp": 1})]
# The same families cut into two pipeline stages (two kinds of layers for the encoder-decoders;
# Swin's stages of different widths, shifted windows), on 2 processes: the stages' graphs are
# what differs by family (data parallelism over the stages is the reference Llama's, CI_PP4).
PP2_GPIPE = {"pp": 2, "dp": 1, "tp": 1, "schedule": "gpipe", "mb": 2}
CI_PP2_HF = [case(m, "pp2_gpipe", PP2_GPIPE) for m in ("hf-roberta", "hf-modernbert", "hf-bart", "hf-mt5", "hf-deit",
                                                        "hf-swin", "diffusers-dit")]
CI_PP4 = [case("llama-tiny", n, p, clip=True) for n, p in PP4.items()] + [
    case("hf-llama", "pp2_ddp2", PP4["pp2_ddp2"]),
    # A head tied to the embedding across stages: FSDP-sharded copies; TP-sharded copies (fused Conv1D).
    case("hf-gpt2", "pp2_fsdp2", PP4["pp2_fsdp2"], clip=True),
    case("hf-gpt2", "pp2_tp2_sp", PP4["pp2_tp2_sp"], clip=True),
    # ... gathered once per step (ZeRO-1): each stage's copy reduced to its shard, then summed.
    case("hf-gpt2", "pp2_fsdp2_once", {**PP4["pp2_fsdp2"], "once": "gather"}, clip=True),
    case("gpt-tiny", "auto_pp2", "pp=2,tp=1"),  # the planner's own choice for a tied model, PP pinned
    # A zero-bubble pipeline on a Llama written as torchtitan writes it (complex rotary embeddings):
    # the deferred weight gradients accumulate outside autograd.
    case("titan-llama", "pp2_dp2_zbv", {"pp": 2, "dp": 2, "tp": 1, "mb": 1, "schedule": "zbv", "v": 2}),
]
CI_PP2 = [case("llama-tiny-4layers", n, p) for n, p in PP2.items()] + [
    # 3 layers over 2 stages (the planner splits them 2 + 1), the head tied to the embedding.
    case("gpt-tiny-3layers", "pp2_1f1b_uneven", "pp=2,tp=1,dp=1,schedule=1f1b"),
    # Zero bubble with LayerNorm: its backward makes the input and the weight gradients in one op,
    # whose items the weight-gradient graph receives (not the tuple).
    case("hf-gpt2-4layers", "pp2_zbv", PP2["pp2_zbv"]),
]


def check(per_rank: list[dict], plan) -> None:
    for r in per_rank:
        assert "error" not in r, f"{r['name']}: {r['error']}\n{r.get('tb', '')}"
    r = per_rank[0]
    want = {} if plan == "auto" else (dict(kv.split("=") for kv in plan.split(",")) if isinstance(plan, str) else plan)
    got = dict(kv.split("=") for kv in r["plan"].split(","))
    for k, v in want.items():
        if k != "dp_shard":
            assert got.get(k) == str(int(v) if isinstance(v, bool) else v), (r["name"], k, got)
    assert r["is_module"], "autopar.compile must return an nn.Module"
    assert all(x["full_state_dict_exact"] for x in per_rank), "full_state_dict() differs from the original weights"
    names = set().union(*(x["param_names"] for x in per_rank))  # under PP each rank holds its stages'
    assert len(names) == r["n_ref_params"], f"{r['name']}: parameters {len(names)} of {r['n_ref_params']}"
    for x in per_rank:
        assert x["grad_max_diff"] < GRAD_TOL * max(1.0, x["grad_scale"]), \
            f"{x['name']}: {x['worst_param']} differs by {x['grad_max_diff']}"
        if "user_loop" in x:
            u = x["user_loop"]
            assert u["grad_max_diff"] < GRAD_TOL * max(1.0, u["grad_scale"]), f"{x['name']} pm(x): {u['worst_param']}"
        # fp32 rounding is relative: like the gradients', the tolerances scale with a loss above 1
        # (mT5's untrained logits give a loss of 23)
        assert x["losses"][0] == pytest.approx(x["ref_losses"][0], abs=LOSS_TOL * max(1.0, abs(x["ref_losses"][0])))
        for a, b in zip(x["losses"][1:], x["ref_losses"][1:]):
            assert a == pytest.approx(b, abs=TRAJ_TOL * max(1.0, abs(b))), (x["name"], x["losses"], x["ref_losses"])
        if "clip_norm_diff" in x:
            assert x["clip_norm_diff"] < 1e-5
    assert len({tuple(x["losses"]) for x in per_rank}) == 1, "every rank reports the same loss"


def _by_name(world, cases):
    res = dist_harness.run(world, cases)
    return {c["name"]: [per_rank[i] for per_rank in res] for i, c in enumerate(cases)}


# The matrix in two launches of about equal work, side by side on the two xdist workers.
# Mixed precision (bf16 compute and gathers, fp32 masters and reductions) in the three shapes of
# parallelism, compared with FSDP2 under the same policy on the same processes (``check_mixed``).
CI_MIXED = [case(m, f"{n}_bf16", p, mp="bf16-mixed") for m in ("hf-llama", "gpt-tiny")
            for n, p in (("fsdp4", PLANS["fsdp4"]), ("tp2_fsdp2_sp", TP2_FSDP2_SP), ("pp2_fsdp2", PP4["pp2_fsdp2"]))
            if (m, n) != ("gpt-tiny", "fsdp4")] + [
    case("hf-llama", "ddp4_bf16", PLANS["ddp4"], mp="bf16-mixed"),  # cast, no gather; fp32 all-reduce
    # ZeRO-1 with TP + SP: bf16 gathered once, gradients accumulated in fp32 and reduced once.
    case("hf-llama", "tp2_fsdp2_sp_once_bf16", {**TP2_FSDP2_SP, "mb": 1, "once": "gather"}, mp="bf16-mixed"),
    case("hf-deit", "fsdp4_bf16", PLANS["fsdp4"], mp="bf16-mixed")]  # images cast to bf16 as FSDP2 casts them
# Context parallelism: HF Llama's 128-token sequences split over 2 or 4 ranks (attention over the
# gathered keys and values of grouped-query heads, head-tail balanced queries), with FSDP over
# dp_shard x cp and with TP + SP on a (cp, tp) mesh; GPT's explicit attention (learned positions,
# a tied head) and Qwen2's biased projections under cp 2 x FSDP 2; and under PP 2 x cp 2.
CP = {"cp2_fsdp2": {"cp": 2, "dp": 2, "fsdp": 1}, "cp4": {"cp": 4}, "cp2_tp2_sp": {"cp": 2, "tp": 2, "sp": 1}}
CI_CP = [case("hf-llama", n, p, seq=128) for n, p in CP.items()] + [
    case(m, "cp2_fsdp2", CP["cp2_fsdp2"]) for m in ("gpt-tiny", "hf-qwen2")] + [
    # Pipeline stages that send each cp rank's own tokens to the next (cp.sent, cp.received).
    case("hf-llama", "pp2_cp2", {"pp": 2, "cp": 2, "dp": 1, "tp": 1, "schedule": "1f1b", "mb": 2}, seq=128),
    # Selective AC keeps the swapped queries and outputs (a collective's result, never run again).
    case("hf-llama", "cp2_fsdp2_ac_sel", {**CP["cp2_fsdp2"], "ac": "selective"}, seq=128)]
# Expert parallelism: each rank runs its share of the experts on the rows all ranks route to
# them (all-to-alls sized by the routing). Mixtral's experts sharded over exactly the ep ranks
# (each rank receives only its own experts' weights), in fp32 (also through the user's own loop,
# ``pm(x)``) and in bf16 against FSDP2; Qwen3-MoE over an HSDP shard group of ep ranks with a full
# recompute (the routing run again); pipeline stages whose data-parallel ranks split the experts:
# Mixtral under DDP (every expert whole on every rank) with 1F1B, DeepSeek-V2 (a gate module
# routes, shared experts) under zbv (the weight-gradient graph takes the routed sizes from the
# input-gradient one).
EP4_FSDP4 = {"ep": 4, "dp": 4, "fsdp": 1}
CI_EP = [case("hf-mixtral", "ep4_fsdp4", EP4_FSDP4, user_loop=True), case("hf-mixtral", "ep4_fsdp4_bf16", EP4_FSDP4, mp="bf16-mixed"),
         # gathered once per step: each rank's own experts' weights received once before the 2
         # microbatches, their gradients sent back once after them (zero.py)
         case("hf-mixtral", "ep4_fsdp4_once", {**EP4_FSDP4, "mb": 1, "once": "gather"}),
         case("hf-qwen3-moe", "ep2_hsdp2x2_ac_full", {"ep": 2, "dp": 4, "dp_shard": 2, "fsdp": 1, "ac": "full"}),
         # experts FSDP-sharded over twice the ep ranks (torchtitan's dp_shard_mod_ep): each owner
         # receives its ep group's shards, then gathers the rest from its place in the other ep
         # group; per layer in the graph, and once per step
         case("hf-mixtral", "ep2_fsdp4", {"ep": 2, "dp": 4, "fsdp": 1}),
         case("hf-qwen3-moe", "ep2_fsdp4_once", {"ep": 2, "dp": 4, "fsdp": 1, "mb": 1, "once": "gather"}),
         # Qwen3-MoE as transformers 5 holds it (3-D experts): split along the experts over exactly
         # the ep ranks (each rank's shard its own experts'), and over twice as many (each rank
         # gathers the other piece of its own experts, the rows sent in owner order), per layer in
         # the graph and once per step
         case("hf:qwen3_moe", "ep4_fsdp4", EP4_FSDP4),
         case("hf:qwen3_moe", "ep2_fsdp4", {"ep": 2, "dp": 4, "fsdp": 1}),
         case("hf:qwen3_moe", "ep2_fsdp4_once", {"ep": 2, "dp": 4, "fsdp": 1, "mb": 1, "once": "gather"}),
         case("hf-mixtral", "pp2_ep2_ddp2", {"pp": 2, "ep": 2, "dp": 2, "fsdp": 0, "tp": 1, "schedule": "1f1b", "mb": 1}),
         case("hf-deepseek-v2-4layers", "pp2_ep2_zbv",
              {"pp": 2, "ep": 2, "dp": 2, "fsdp": 1, "tp": 1, "schedule": "zbv", "v": 2, "mb": 1}),
         # experts in 3-D parameters with biases: each row's expert index sent with the row
         case("hf-gpt-oss", "pp2_ep2_fsdp2", {"pp": 2, "ep": 2, "dp": 2, "fsdp": 1, "tp": 1, "schedule": "1f1b", "mb": 1})]
# EP x TP: each rank runs the TP shards of its own experts on the rows its ep group routes to them
# (Mixtral; DeepSeek-V2 with SP, its latent attention replicated; gpt-oss, its expert biases
# replicated over tp and each rank adding its feature shard; module experts with biases, split
# with their columns).
CI_EP_TP = [case("hf-mixtral", "ep2_tp2_fsdp2", {"ep": 2, "tp": 2, "dp": 2, "fsdp": 1}),
            case("hf-deepseek-v2", "ep2_tp2_fsdp2_sp", {"ep": 2, "tp": 2, "dp": 2, "fsdp": 1, "sp": 1}),
            case("hf-gpt-oss", "ep2_tp2_fsdp2", {"ep": 2, "tp": 2, "dp": 2, "fsdp": 1}),
            case("hf:qwen3_moe", "ep2_tp2_fsdp2", {"ep": 2, "tp": 2, "dp": 2, "fsdp": 1}),
            case("custom-qwen2-moe-biased", "ep2_tp2_fsdp2_sp", {"ep": 2, "tp": 2, "dp": 2, "fsdp": 1, "sp": 1}),
            # experts looped over by the block's own routing (Ernie 4.5: a bias-corrected top-k, frozen)
            case("hf:ernie4_5_moe-3layers", "ep2_tp2_fsdp2", {"ep": 2, "tp": 2, "dp": 2, "fsdp": 1}),
            # DeepSeek-V3 as transformers writes it: latent attention, sigmoid scores with a
            # bias-corrected top-k within the best expert groups, a shared expert, 3-D experts, a
            # dense first layer (GLM-4.5's MoE routes the same way: its TP 2 + SP case above)
            case("hf:deepseek_v3-3layers", "ep2_tp2_fsdp2_sp", {"ep": 2, "tp": 2, "dp": 2, "fsdp": 1, "sp": 1})]
LAUNCHES = {"models_a": (2, CI_MODELS[0::2]), "models_b": (2, CI_MODELS[1::2]), "models_hf": (4, CI_PLANS_HF),
            "models_pp": (2, CI_PP2_HF), "plans": (4, CI_PLANS), "pp4": (4, CI_PP4), "pp2": (2, CI_PP2),
            "mixed": (4, CI_MIXED), "cp": (4, CI_CP), "ep": (4, CI_EP),
            "ep_tp": (4, CI_EP_TP)}
MATRIX = {"models_a", "models_b", "models_hf", "models_pp"}
# Checkpoints across plans (tests/test_checkpoint.py), on graphs a launch compiles anyway: after
# its steps the saver saves the model and the optimizer; a later case of the same launch, after
# its own steps, loads them (launch, saver, loader). FSDP 4 to TP 4 + SP; the sequence split over
# cp (parameters sharded over dp_shard x cp) to TP + SP; a head tied to the embedding across
# stages, FSDP to TP (GPT-2's fused Conv1D q, k, v); in mixed precision (the fp32 masters) from
# one stage to two and back, and GPT's fused QKV under TP to two stages.
CKPT = [("plans", "llama-tiny/fsdp4", "llama-tiny/tp4_sp"), ("cp", "hf-llama/cp2_fsdp2", "hf-llama/cp2_tp2_sp"),
        ("pp4", "hf-gpt2/pp2_fsdp2", "hf-gpt2/pp2_tp2_sp"), ("mixed", "hf-llama/fsdp4_bf16", "hf-llama/pp2_fsdp2_bf16"),
        ("mixed", "hf-llama/pp2_fsdp2_bf16", "hf-llama/ddp4_bf16"),
        ("mixed", "gpt-tiny/tp2_fsdp2_sp_bf16", "gpt-tiny/pp2_fsdp2_bf16")]
CKPT_DIRS: dict = {}  # saver's case name -> its checkpoint directory, once its launch ran
_results: dict = {}


def _launch(name: str) -> dict:
    """Run one launch once (its cases in turn on its processes) and keep the results by case."""
    if name not in _results:
        world, cases = LAUNCHES[name]
        pairs = [(s, d) for launch, s, d in CKPT if launch == name]
        if pairs:
            root = tempfile.mkdtemp(prefix=f"autopar-ckpt-{name}-")
            atexit.register(shutil.rmtree, root, True)
            dirs = {s: os.path.join(root, s.replace("/", "_")) for s, _ in pairs}
            loads = {d: dirs[s] for s, d in pairs}
            cases = [dict(c) for c in cases]
            for c in cases:
                if c["name"] in dirs:
                    c["save_ckpt"] = dirs[c["name"]]
                if c["name"] in loads:
                    c["load_ckpt"] = loads[c["name"]]
            CKPT_DIRS.update(dirs)
        _results[name] = _by_name(world, cases)
    return _results[name]


# Each xdist group runs on one worker, so each launch runs once; two launches at a time.
GROUP = {"models_a": "parity-a", "models_b": "parity-b", "plans": "parity-b", "pp4": "parity-c", "pp2": "parity-c",
         "mixed": "parity-a", "cp": "parity-d", "models_hf": "parity-e", "models_pp": "parity-f", "ep": "parity-g",
         "ep_tp": "parity-h"}


@pytest.mark.slow
@pytest.mark.parametrize("launch,c", [
    pytest.param(name, c, id=f"{name}:{c['name']}",
                 marks=[pytest.mark.xdist_group(GROUP[name])] + ([pytest.mark.matrix] if name in MATRIX else []))
    for name, (_, cases) in LAUNCHES.items() for c in cases])
def test_parity(launch, c):
    (check_mixed if c.get("mp") else check)(_launch(launch)[c["name"]], c["plan"])


SHARED = [("plans", n) for n in ("llama-tiny/fsdp4", "llama-tiny/tp4", "llama-tiny/tp2_fsdp2_sp", "llama-tiny/ac_full_fsdp4")] + [
    ("ep", "hf-mixtral/ep4_fsdp4"), ("ep", "hf-qwen3-moe/ep2_hsdp2x2_ac_full"), ("ep_tp", "hf-mixtral/ep2_tp2_fsdp2"),
    ("ep_tp", "hf-deepseek-v2/ep2_tp2_fsdp2_sp")] + [
    ("cp", n) for n in ("hf-llama/cp4", "hf-llama/cp2_tp2_sp", "gpt-tiny/cp2_fsdp2")]


@pytest.mark.slow
@pytest.mark.parametrize("launch,name", [pytest.param(launch, n, id=f"{launch}:{n}", marks=pytest.mark.xdist_group(GROUP[launch]))
                                         for launch, n in SHARED])
def test_ranks_with_the_same_graphs_load_the_passes_one_ran(launch, name):
    """``passes/shared.py``: under FSDP 4, TP 4, TP 2 x FSDP 2 + SP, FSDP 4 with full AC (whose
    graphs call operators the AC pass defines as it runs) and expert parallelism (each rank its
    own experts: which ones is read at run time; with TP, and with a full recompute) and context
    parallelism (each rank its own query rows and swap partner, read at run time; with TP, and
    with FSDP) every rank makes the same graphs, so ranks 1-3 load the graphs rank 0's passes made
    (or an earlier run's) instead of running the passes (the parity of those cases is the test
    that they are the right graphs)."""
    for r in _launch(launch)[name][1:]:
        assert "passes (loaded)" in r["timings"] and "distribute" not in r["timings"], (r["name"], r["timings"])


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP["ep"])
@pytest.mark.parametrize("name", ["hf-mixtral/ep2_fsdp4", "hf-qwen3-moe/ep2_fsdp4_once", "hf:qwen3_moe/ep2_fsdp4",
                                  "hf:qwen3_moe/ep2_fsdp4_once"])
def test_experts_sharded_beyond_the_ep_ranks_are_gathered_by_their_owners_only(name):
    """FSDP over 4 ranks, ep 2: each owner receives its ep group's shards of its experts (an
    all-to-all over 2 ranks; 3-D experts' shards are whole experts, already on the rank's shard
    group) and gathers the rest over the 2 ranks at its place in the other ep group (in the
    graph, or once before the step with the gradients reduced over them after it), not every
    expert over all 4 (the parity of these cases is the test that the pieces land in place)."""
    moved = {(k, g, p) for k, g, p, _ in _launch("ep")[name][0]["collectives"]}
    assert ("all_gather_into_tensor", 2, "ep") in moved, moved
    if name.endswith("once"):
        assert ("reduce_scatter_tensor", 2, "ep") in moved, moved


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP["plans"])
@pytest.mark.parametrize("name", ["llama-tiny/fsdp4", "llama-tiny/tp2_fsdp2_sp"])
def test_ranks_with_the_same_graphs_compile_them_side_by_side(name):
    """``backend.compile_step``: the four ranks' graphs are the same, so rank 0 compiles the
    forward, rank 1 the backward, and each loads the other from Inductor's cache."""
    got = [r["compiled_here"]["step"] for r in _launch("plans")[name]]
    assert got == [["fw"], ["bw"], [], []], got


def check_mixed(per_rank: list[dict], plan) -> None:
    """Mixed precision ran as FSDP2 runs it: the parameters and their gradients stay fp32, the
    data-parallel gathers move bf16 and the gradient reductions fp32, every matrix product of the
    forward's layers takes bf16 (bf16 really ran), and the loss trajectory is FSDP2's
    within MP_FIRST_TOL at the first step and MP_TOL after. (Not that the first loss is nearer FSDP2's than fp32's: Inductor keeps some
    bf16 intermediates in fp32 inside its fused kernels, which puts the compiled loss 1e-5 to 1e-4
    from eager bf16's, as far as bf16 is from fp32 on these models, on either side: HF Llama under
    TP 2 + SP, batch 16, every layer inline, landed nearer fp32.)"""
    for r in per_rank:
        assert "error" not in r, f"{r['name']}: {r['error']}\n{r.get('tb', '')}"
    r = per_rank[0]
    assert all(x["full_state_dict_exact"] for x in per_rank)
    for x in per_rank:
        d = x["dtypes"]
        assert d["params"] == d["grads"] == ["torch.float32"], d
        assert d["all_gather"] in ([], ["bfloat16"]) and d["reduce_scatter"] in ([], ["float32"]), d
        assert d["all_reduce"] in ([], ["float32"]), d
    sharded = plan.get("fsdp", 0) and plan.get("dp", 1) > 1
    assert any(x["dtypes"]["all_gather" if sharded else "all_reduce"] for x in per_rank), "no data-parallel collective"
    assert all(x["dtypes"]["matmul"] == ["torch.bfloat16"] for x in per_rank), [x["dtypes"] for x in per_rank]
    got, fsdp2 = r["losses"], r["fsdp2_losses"]
    assert got[0] == pytest.approx(fsdp2[0], abs=MP_FIRST_TOL), (r["name"], got, fsdp2)
    assert got[1:] == pytest.approx(fsdp2[1:], abs=MP_TOL), (r["name"], got, fsdp2)
    assert len({tuple(x["losses"]) for x in per_rank}) == 1, "every rank reports the same loss"


def test_world1_auto():
    r = dist_harness.run_case(1, {"name": "auto1", "model": "hf-llama", "plan": "auto", "user_loop": True})
    check([r], "auto")
