"""The bad-input catalogue: one row per mistake a user makes, each answered by autopar's own
error type with a message that says what was wrong and what to do. On the CLI: one line on
stderr, exit status 2, no traceback; every file given is left as it was. In the API: the model
is left as it was."""

import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch

import autopar
from autopar import cli
from autopar.errors import AutoparError, PlanMismatchError, TraceError
from tests.dist_harness import batch, build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN = {"architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 256, "intermediate_size": 512,
        "max_position_embeddings": 131072, "model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "vocab_size": 1024,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
H100 = {"name": "x", "peak_tflops": 989, "memory_gb": 80, "memory_bandwidth_gbps": 3350, "gpus_per_node": 8,
        "intra_node_gbps": 450, "inter_node_gbps": 50}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")

    def put(name, text):
        p = d / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return str(p)

    plan = autopar.plan("llama-tiny", 2, hardware="cpu", precision="fp32", global_batch=8)
    good = json.loads(plan.to_json())
    f = {
        "cfg_not_json": put("a/config.json", '{"model_type": "llama",'),
        "cfg_typo": put("b/config.json", json.dumps({**QWEN, "num_hiden_layers": 4})),
        "cfg_type": put("c/config.json", json.dumps({**QWEN, "model_type": "qwen9"})),
        "cfg_none": put("d/config.json", json.dumps({"hidden_size": 4})),
        "cfg_ok": put("e/config.json", json.dumps(QWEN)),
        "cfg_no_hidden": put("f/config.json", json.dumps({k: v for k, v in QWEN.items() if k != "hidden_size"})),
        "cfg_no_heads": put("g/config.json", json.dumps({k: v for k, v in QWEN.items() if k != "num_attention_heads"})),
        "cfg_kv3": put("h/config.json", json.dumps({**QWEN, "num_key_value_heads": 3})),
        # its attention experts' gate reads each expert's token count (.tolist()) in a method of
        # their own, outside any block autopar runs in a form of its own
        "cfg_jetmoe": put("j/config.json", json.dumps({
            "model_type": "jetmoe", "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
            "vocab_size": 256, "max_position_embeddings": 4096})),
        "cfg_no_kv": put("i/config.json", json.dumps({**{k: v for k, v in QWEN.items() if k != "num_key_value_heads"},
                                                      "model_type": "llama", "_name_or_path": "org/llama-small"})),
        "hw_missing": put("hw1.json", json.dumps({k: v for k, v in H100.items() if k != "memory_gb"})),
        "hw_negative": put("hw2.json", json.dumps({**H100, "intra_node_gbps": -450})),
        "hw_text": put("hw3.json", json.dumps({**H100, "peak_tflops": "fast"})),
        "hw_corrupt": put("hw4.json", "{peak"),
        "plan_corrupt": put("p1.json", "{oops"),
        "plan_version": put("p2.json", json.dumps({**good, "version": 999})),
        "plan_fields": put("p3.json", json.dumps({k: v for k, v in good.items() if k != "layers"})),
        "ckpt_dir": os.path.dirname(put("ckpt/.metadata", "")),  # a checkpoint without its plan
        "factory": put("facmod_bad.py", "def raises():\n    raise RuntimeError('weights.bin not found')\n"
                                        "def not_a_module():\n    return {'layers': 2}\n"),
    }
    return f


# (id, argv with {file} placeholders, regex the one-line error must match)
CLI_CASES = [
    ("tp_not_dividing_heads", "explain llama3-8b --gpus 48 --pin tp=3", r"tp=3 does not divide .*heads \(32\).*valid TP degrees: 1, 2, 4, 8"),
    ("tp_not_dividing_kv_heads", "explain llama3-8b --gpus 64 --pin tp=16", r"tp=16 does not divide .*heads \(8\)"),
    ("unknown_model", "explain nosuch --gpus 8", r"unknown model 'nosuch'. Known presets: .*config.json"),
    ("unknown_hardware", "explain llama3-8b --gpus 8 --hardware tpu9", r"unknown hardware 'tpu9'. Known: "),
    ("gpus_zero", "explain llama3-8b --gpus 0", r"GPU count must be positive, got 0"),
    ("does_not_fit", "explain llama3-70b --gpus 2 --global-batch 2",
     r"no plan of llama3-70b fits .*closest.*needs [\d.]+ GiB per GPU \([\d.]+ GiB over\). What would fit: more GPUs \(try --gpus \d+\)"),
    ("plan_product_not_world", "estimate llama3-8b --gpus 64 --plan tp=8,pp=2,dp=2", r"tp\*pp\*dp = 8\*2\*2 = 32 but there are 64"),
    ("pins_contradict", "explain llama3-8b --gpus 8 --pin tp=2,tp=4", r"pin 'tp' is given twice with different values \(tp=2 and tp=4\)"),
    ("pins_repeated", "explain llama3-8b --gpus 8 --pin tp=2,tp=2", r"pin 'tp' is repeated; give each key once"),
    ("pin_unknown_key", "explain llama3-8b --gpus 8 --pin tensor=2", r"unknown pin 'tensor'; known: ac, cp, dp"),
    ("pin_bad_value", "explain llama3-8b --gpus 8 --pin ac=partial", r"ac='partial': choose one of none, selective, full"),
    ("pin_not_integer", "explain llama3-8b --gpus 8 --pin tp=two", r"pin tp='two' must be an integer"),
    ("pin_estimate_only", "explain llama3-8b --gpus 8 --pin once=reduce", r"once=reduce is priced by `autopar estimate` only"),
    ("pin_once_bad_value", "estimate llama3-8b --gpus 8 --plan fsdp=1,dp=8,once=always", r"once='always': choose microbatch"),
    ("pin_unit_estimate_only", "explain llama3-8b --gpus 8 --pin unit=tensor", r"unit=tensor is priced by `autopar estimate` only"),
    ("unit_bad_value", "estimate llama3-8b --gpus 8 --plan fsdp=1,dp=8,unit=param", r"unit='param': choose layer"),
    ("pin_cp_not_splitting_sequence", "explain llama3-8b --gpus 24 --seq-len 8192 --pin cp=3",
     r"splits each 8192-token sequence into 2 x cp = 6 chunks"),
    ("pin_ep_without_experts", "explain llama3-8b --gpus 8 --pin ep=2", r"ep=2: llama3-8b has no routed experts"),
    ("cp_product_not_world", "estimate llama3-8b --gpus 8 --plan dp=2,cp=2", r"tp\*pp\*dp\*cp = 1\*1\*2\*2 = 4 but there are 8"),
    ("cp_not_splitting_sequence", "estimate llama3-8b --gpus 24 --seq-len 8192 --global-batch 8 --plan dp=8,cp=3",
     r"splits each 8192-token sequence into 2 x cp = 6 chunks"),
    ("unit_without_fsdp", "estimate llama3-8b --gpus 8 --plan dp=8,unit=tensor", r"unit=tensor describes FSDP's collectives: add fsdp=1"),
    ("dp_overlap_with_fsdp", "estimate llama3-8b --gpus 8 --plan dp=8,fsdp=1,dp_overlap=0", r"dp_overlap describes the all-reduce of data parallelism without FSDP"),
    ("dp_overlap_bad_value", "estimate llama3-8b --gpus 8 --plan dp=8,dp_overlap=2", r"pin dp_overlap=2 is out of range \(0 or 1\)"),
    ("once_without_fsdp", "estimate llama3-8b --gpus 8 --plan dp=8,once=gather", r"once=gather describes FSDP's collectives: add fsdp=1"),
    ("pin_sp_without_tp", "explain llama3-8b --gpus 8 --pin sp=1,tp=1", r"sp=1 needs tp > 1"),
    ("pins_not_dividing_world", "explain llama3-8b --gpus 8 --pin tp=4,pp=4", r"product 16\) do not divide the 8 GPUs"),
    ("batch_not_divisible_by_dp", "estimate llama3-8b --gpus 8 --global-batch 10 --plan tp=1,pp=1,dp=8,mb=1",
     r"global batch 10 is not divisible by dp=8"),
    ("batch_not_divisible_by_mb", "estimate llama3-8b --gpus 8 --global-batch 24 --plan tp=1,pp=1,dp=8,mb=2",
     r"local batch 3 .* is not divisible by mb=2"),
    ("seq_not_divisible_under_sp", "estimate llama3-8b --gpus 8 --seq-len 1001 --plan tp=8,sp=1,pp=1,dp=1,mb=1",
     r"splits the 1001-token sequence over tp=8 ranks.*multiple of 8, or sp=0"),
    ("seq_len_zero", "explain llama3-8b --gpus 8 --seq-len 0", r"sequence length must be positive"),
    ("seq_len_one", "explain llama3-8b --gpus 8 --seq-len 1", r"--seq-len 1 is not a training sequence .*4,194,304 "
     r"sequences of 1.*at least 16"),
    ("memory_limit_negative", "explain llama3-8b --gpus 8 --memory-limit-gb -3", r"memory limit must be positive"),
    ("hardware_missing_field", "explain llama3-8b --gpus 8 --hardware {hw_missing}", r"lacks memory_gb; required: name, peak_tflops"),
    ("hardware_negative", "explain llama3-8b --gpus 8 --hardware {hw_negative}", r"intra_node_gbps must be a positive number, got -450"),
    ("hardware_not_a_number", "explain llama3-8b --gpus 8 --hardware {hw_text}", r"peak_tflops must be a positive number, got 'fast'"),
    ("hardware_corrupt", "explain llama3-8b --gpus 8 --hardware {hw_corrupt}", r"hw4.json is not valid JSON"),
    ("config_not_json", "explain {cfg_not_json} --gpus 8", r"config.json is not valid JSON \(line 1, column \d+"),
    ("config_misspelled_field", "explain {cfg_typo} --gpus 8", r"unknown field 'num_hiden_layers' .*did you mean 'num_hidden_layers'"),
    ("config_wrong_model_type", "explain {cfg_type} --gpus 8", r"model_type 'qwen9' is not a family transformers .* knows; did you mean"),
    ("config_without_model_type", "explain {cfg_none} --gpus 8", r"has no 'model_type'"),
    ("config_without_width", "explain {cfg_no_hidden} --gpus 8",
     r"has no 'hidden_size': without it transformers builds its default qwen2 shape \(hidden_size=\d+\), not this model"),
    ("config_without_heads", "explain {cfg_no_heads} --gpus 8", r"has no 'num_attention_heads'"),
    ("config_kv_heads_not_dividing", "explain {cfg_kv3} --gpus 8",
     r"4 attention heads are not divisible by 3 KV heads; num_key_value_heads must divide"),
    ("library_code_not_traceable", "explain {cfg_jetmoe} --gpus 8",
     r"modeling_jetmoe.py:\d+: .*That line is transformers' own code \(not yours\).*Nothing to change in your model"),
    ("seq_len_above_positions", "explain {cfg_ok} --gpus 8 --seq-len 200000", r"--seq-len 200000 is above .*131072 positions"),
    ("plan_corrupt", "show {plan_corrupt}", r"p1.json: plan is not valid JSON"),
    ("plan_other_version", "show {plan_version}", r"plan format version 999 is not supported"),
    ("plan_missing_fields", "show {plan_fields}", r"p3.json"),
    ("factory_raises", "explain facmod_bad:raises --gpus 8",
     r"construction of facmod_bad:raises at .*facmod_bad.py:2.*weights.bin not found.*without reading weights"),
    ("factory_not_a_module", "explain facmod_bad:not_a_module --gpus 8", r"returned a dict, not an nn.Module"),
    ("factory_missing", "explain facmod_bad:nosuch --gpus 8", r"cannot load factory 'facmod_bad:nosuch'"),
    ("top_negative", "explain llama3-8b --gpus 8 --top -1", r"--top is how many runners-up to show: 0 or more, got -1"),
    ("output_directory_missing", "explain llama-tiny --gpus 2 -o {plan_corrupt}.d/plan.json",
     r"cannot save to .*plan.json: directory .* does not exist; create it first"),
    ("show_a_model_config", "show {cfg_ok}", r"this is a model config, not a plan: plan it with 'autopar explain"),
    ("checkpoint_missing", "explain llama-tiny --gpus 2 --checkpoint {plan_corrupt}.d", r"no such directory"),
    ("checkpoint_without_plan", "explain llama-tiny --gpus 2 --checkpoint {ckpt_dir}",
     r"no autopar_plan.json there; checkpoints written with pm.save_checkpoint"),
]


@pytest.mark.parametrize("argv,msg", [pytest.param(a, m, id=i) for i, a, m in CLI_CASES])
def test_cli_bad_input(argv, msg, files, capsys, monkeypatch):
    monkeypatch.chdir(os.path.dirname(files["factory"]))
    before = {k: open(v).read() for k, v in files.items() if os.path.isfile(v)}
    rc = cli.main(argv.format(**files).split())
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopar: error: "), err
    assert re.search(msg, lines[0]), lines[0]
    assert before == {k: open(v).read() for k, v in files.items() if os.path.isfile(v)}, "an input file was changed"


def test_cli_debug_shows_the_traceback():
    r = subprocess.run([sys.executable, "-m", "autopar", "--debug", "explain", "nosuch", "--gpus", "8"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "Traceback" in r.stderr and "unknown model 'nosuch'" in r.stderr


def test_defaulted_config_fields_and_the_models_name_are_stated(files, capsys):
    assert cli.main(["explain", files["cfg_no_kv"], "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "autopar plan for hf:llama:org/llama-small on 8" in out  # the config's own name, not its directory
    assert "note: config.json has no 'num_key_value_heads': transformers' default 4 used" in out


def test_default_sequence_length_is_stated(files, capsys):
    assert cli.main(["explain", files["cfg_ok"], "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "global batch" in out and "x 4096 tokens" in out
    assert "note: sequence length 4096 (default: the config allows 131072; pass --seq-len" in out


# -- the Python API: autopar.compile and ParallelModule.step ---------------------------------
class _BatchNormBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
                                          for _ in range(2))
        self.bn = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.bn(h.transpose(1, 2)).transpose(1, 2))


@pytest.fixture(scope="module")
def compiled():
    ids, _ = batch(1)
    return autopar.compile(build("llama-tiny"), 1, example_inputs=(ids,), plan="mb=2", global_batch=8)


def _state(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _untouched(m, before):
    return all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def _hf_opt_layerdrop():
    import transformers as tf

    cfg = tf.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=8, vocab_size=256,
                       max_position_embeddings=64, word_embed_proj_dim=64, use_cache=False, layerdrop=0.2)
    return tf.OPTForCausalLM(cfg)


API_CASES = [
    ("not_a_module", lambda: ("llama-tiny", 1, {}), AutoparError, r"takes an nn.Module, got str"),
    ("world_without_process_group", lambda: (build("llama-tiny"), 4, {}), AutoparError, r"needs torch.distributed initialised"),
    ("mesh_not_a_mesh", lambda: (build("llama-tiny"), "8", {}), AutoparError, r"mesh must be a DeviceMesh or a world size"),
    ("float_example_inputs", lambda: (build("llama-tiny"), 1, {"example_inputs": (torch.randn(8, 32),)}), AutoparError,
     r"2-D integer tensor of token ids"),
    ("example_inputs_not_tuple", lambda: (build("llama-tiny"), 1, {"example_inputs": [batch(1)[0]]}), AutoparError,
     r"must be a tuple"),
    ("plan_for_another_model", lambda: (build("llama-small"), 1, {"example_inputs": (torch.randint(0, 1024, (8, 32)),),
                                                                   "plan": autopar.plan("llama-tiny", 1, hardware="cpu",
                                                                                        global_batch=8, precision="fp32")}),
     PlanMismatchError, r"made for model"),
    # OPT: the mask shortcut is passed on the export path; LayerDrop with probability 0 is exact
    # (tests/test_parity.py trains it); with a probability above 0 it is stochastic control flow.
    ("random_layer_skipping_hf_opt", lambda: (_hf_opt_layerdrop(), 1, {"example_inputs": (torch.randint(0, 256, (4, 16)),)}),
     TraceError, r"the training step of OPTForCausalLM at .*modeling_opt.py:\d+: .*torch.rand.*skips work when it is below 0.2 .*set that probability to 0 "
                 r"\(e.g. config.layerdrop=0\)"),
    # Routed experts that score with a sigmoid: the fixed-shape form would train another model.
    ("moe_routing_autopar_does_not_know", lambda: (_sigmoid_moe(), 1, {"example_inputs": (torch.randint(0, 32, (4, 8)),)}),
     AutoparError, r"mixture-of-experts block 1 \(SigmoidRouted\) does not compute what autopar's fixed-shape"),
    # Experts in 3-D parameters, as transformers 5 holds them, but without the num_experts that
    # says which dim holds the experts (transformers 5's own, and gpt-oss's, train: test_moe.py).
    ("moe_experts_as_3d_parameters", lambda: (_batched_experts(), 1, {"example_inputs": (torch.randint(0, 32, (4, 8)),)}),
     AutoparError, r"the experts 1 \(BatchedExperts\) hold every expert's weights in 3-D parameters \(transformers 5's "
                    r"experts interface, 'grouped_mm'\) without a num_experts"),
    # One embedding and one head: nothing repeats, so there is no layer to split or shard.
    ("no_repeated_layers", lambda: (torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)), 1,
                                    {"example_inputs": (torch.randint(0, 32, (4, 8)),)}),
     AutoparError, r"has no repeated blocks \(no two or more modules of one class with the same parameter shapes"),
    ("buffers_updated_in_forward", lambda: (_BatchNormBlocks(), 1, {"example_inputs": (torch.randint(0, 32, (4, 8)),)}),
     TraceError, r"updates the buffer\(s\) bn.num_batches_tracked, bn.running_mean, bn.running_var.*LayerNorm"),
    # Mixed precision: what FSDP2 accepts but autopar does not plan, said in words; nothing converted.
    ("mp_reduce_in_bf16", lambda: (build("llama-tiny"), 1, {"mp_policy": _mp(torch.bfloat16, None)}), AutoparError,
     r"computes in bfloat16 and reduces gradients in bfloat16, which is none of the precisions autopar runs: "
     r"fp32 .*reduce_dtype=torch.float32"),
    ("mp_fp16", lambda: (build("llama-tiny"), 1, {"mp_policy": _mp(torch.float16, torch.float32)}), AutoparError,
     r"fp16-mixed is priced but not run: fp16 needs dynamic loss scaling.*bf16-mixed"),
    ("mp_masters_not_fp32", lambda: (build("llama-tiny").to(torch.bfloat16), 1, {"mp_policy": "bf16-mixed"}),
     AutoparError, r"bf16-mixed keeps the parameters in float32, but the model's are bfloat16.*model.float\(\)"),
    ("mp_unknown_name", lambda: (build("llama-tiny"), 1, {"mp_policy": "bf8"}), AutoparError,
     r"precision 'bf8': choose one of fp32, bf16-mixed, bf16-true, fp16-mixed"),
    ("mp_wrong_type", lambda: (build("llama-tiny"), 1, {"mp_policy": torch.bfloat16}), AutoparError,
     r"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or a precision name"),
    ("plan_priced_for_another_precision", lambda: _planned_fp32("bf16-mixed"), PlanMismatchError,
     r"the plan was priced for fp32 \(fp32 throughout\) but this run trains bf16-mixed"),
]


def _planned_fp32(mp_policy):
    m = build("llama-tiny")
    plan = autopar.plan(m, 1, example_inputs=(batch(1)[0],), hardware="cpu", global_batch=8, precision="fp32")
    return m, 1, {"plan": plan, "mp_policy": mp_policy}


def _mp(param, reduce):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


class BatchedExperts(torch.nn.Module):
    """Four experts' weights in 3-D parameters, as transformers 5's ``use_experts_implementation``
    decorates an experts module (its ``_is_expert_parallel`` flag, the config's implementation)."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 32, 16))
        self.down_proj = torch.nn.Parameter(torch.randn(4, 16, 16))
        self.config = types.SimpleNamespace(_experts_implementation="grouped_mm")
        self._is_expert_parallel = False

    def forward(self, x):
        return x + (x @ self.gate_up_proj[0, :16].T) @ self.down_proj[0].T


def _batched_experts():
    return torch.nn.Sequential(torch.nn.Embedding(32, 16), BatchedExperts())


def _sigmoid_moe():
    from tests.test_moe import SigmoidRouted

    return torch.nn.Sequential(torch.nn.Embedding(32, 16), SigmoidRouted())


@pytest.mark.parametrize("make,exc,msg", [pytest.param(m, e, r, id=i) for i, m, e, r in API_CASES])
def test_compile_bad_input(make, exc, msg):
    model, mesh, kw = make()
    kw.setdefault("example_inputs", (batch(1)[0],))
    before = _state(model) if isinstance(model, torch.nn.Module) else None
    with pytest.raises(exc, match=msg):
        autopar.compile(model, mesh, **kw)
    if before is not None:
        assert _untouched(model, before), "the model was changed"


def test_planning_refuses_experts_held_as_3d_parameters():
    """``autopar.plan`` (and ``autopar explain`` on a transformers 5 MoE config) refuses the experts
    ``autopar.compile`` refuses, in the same words, rather than pricing what autopar cannot run."""
    with pytest.raises(AutoparError, match=r"hold every expert's weights in 3-D parameters.*without a num_experts"):
        autopar.plan(_batched_experts(), 8, example_inputs=(torch.randint(0, 32, (4, 8)),), hardware="cpu",
                     global_batch=8)


STEP_CASES = [
    ("float_ids", lambda ids, tgt: (ids.float(), tgt), r"step\(\) takes ids as integer token ids, got torch.float32"),
    ("bool_target", lambda ids, tgt: (ids, tgt.bool()), r"takes target as integer token ids, got torch.bool"),
    ("one_dimensional", lambda ids, tgt: (ids[0], tgt[0]), r"takes ids as a \(batch, seq\) tensor, got \(32,\)"),
    ("target_shape", lambda ids, tgt: (ids, tgt[:, :16]), r"target has shape \(8, 16\), ids \(8, 32\)"),
    ("wrong_device", lambda ids, tgt: (ids.to("meta"), tgt.to("meta")), r"ids on meta .* the model runs on cpu"),
    ("missing_target", lambda ids, tgt: (ids, None), r"needs target="),
    ("batch_not_divisible", lambda ids, tgt: (ids[:3], tgt[:3]), r"batch of 3 sequences cannot be split .* multiple of 2"),
    ("shape_changed_after_compile", lambda ids, tgt: (ids[:, :16], tgt[:, :16]), r"compiled for \(2, 32\); compile again"),
]


@pytest.mark.parametrize("bad,msg", [pytest.param(b, m, id=i) for i, b, m in STEP_CASES])
def test_step_bad_input(compiled, bad, msg):
    ids, tgt = batch(3)
    before = _state(compiled)
    with pytest.raises(AutoparError, match=msg):
        compiled.step(*bad(ids, tgt)) if bad(ids, tgt)[1] is not None else compiled.step(ids)
    assert _untouched(compiled, before)
    assert all(p.grad is None for p in compiled.parameters()), "a refused step left gradients behind"


def test_bad_meshes():
    """Meshes that disagree with the world or with the plan (a fake process group of 8)."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "mesh_errors.py")], capture_output=True,
                       text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    want = {
        "mesh_of_4_in_world_of_8": r"AutoparError: the mesh has 4 ranks but the process group has 8",
        "unknown_dim_names": r"AutoparError: mesh dimension\(s\) 'data', 'model' are not ones autopar places",
        "dp_beside_dp_shard": r"AutoparError: the mesh has 'dp' beside 'dp_shard'",
        "pin_contradicts_mesh": r"AutoparError: plan pins tp=2 but the mesh's 'tp' dimension has 4",
    }
    for name, msg in want.items():
        assert re.search(msg, got[name]), (name, got[name])
        assert got[name + "/untouched"], f"{name}: the model was changed"


@pytest.fixture(scope="module")
def compiled_images():
    from tests import zoo

    torch.manual_seed(0)
    xs, y = zoo.example("hf-deit", 1)
    return autopar.compile(build("hf-deit"), 1, example_inputs=xs, plan="mb=2", global_batch=8)


IMAGE_STEP_CASES = [
    ("integer_images", lambda x, y: (x.long(), y), r"takes inputs\[0\] as floating point, got torch.int64"),
    ("float_labels", lambda x, y: (x, y.float()), r"takes target as integers, got torch.float32"),
    ("labels_per_pixel", lambda x, y: (x, y[:, None].expand(8, 4)), r"takes target as a 1-D \(batch first\) tensor"),
    ("other_image_size", lambda x, y: (x[..., :16, :16], y), r"shape \(3, 16, 16\) per sample .* compiled for \(2, 3, 32, 32\)"),
    ("batches_differ", lambda x, y: (x, y[:4]), r"batches \[8, 4\]"),
]


@pytest.mark.parametrize("bad,msg", [pytest.param(b, m, id=i) for i, b, m in IMAGE_STEP_CASES])
def test_image_step_bad_input(compiled_images, bad, msg):
    """A model fed images: step() checks each input and the target against what was compiled."""
    from tests import zoo

    (x,), y = zoo.example("hf-deit", 3)
    before = _state(compiled_images)
    with pytest.raises(AutoparError, match=msg):
        compiled_images.step(*bad(x, y))
    assert _untouched(compiled_images, before)


def test_image_step_trains_the_same_model(compiled_images):
    """The same images through the compiled step and the one-process model: the same loss."""
    from autopar.capture import default_loss
    from tests import zoo

    torch.manual_seed(0)
    ref = build("hf-deit")
    xs, y = zoo.example("hf-deit", 4)
    assert float(compiled_images.step(xs, target=y)) == pytest.approx(float(default_loss(ref(*xs), y)), abs=1e-6)
    for p in compiled_images.parameters():
        p.grad = None


def test_own_loss_on_images_needs_its_target():
    """A loss of the user's own on a model not fed token ids: autopar cannot guess its target."""
    from tests import zoo

    xs, _ = zoo.example("hf-deit", 1)
    with pytest.raises(AutoparError, match=r"Pass example_target="):
        autopar.compile(build("hf-deit"), 1, example_inputs=xs, loss_fn=lambda out, y: (out.logits - y).square().mean())
