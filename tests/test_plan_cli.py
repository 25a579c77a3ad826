"""Plan JSON round trip and checks; the CLI's output and errors."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar import api, capture, cli, explain, models
from autopar.errors import AutoparError, PlanMismatchError
from autopar.plan import Plan


@pytest.fixture(scope="module")
def tiny_plan():
    return api.plan("llama-tiny", 4, hardware="cpu", global_batch=8, precision="fp32", top_k=2)


def test_round_trip(tiny_plan, tmp_path):
    path = tmp_path / "p.json"
    tiny_plan.save(str(path))
    back = Plan.load(str(path))
    assert back == tiny_plan
    assert back.to_json() == tiny_plan.to_json()
    assert tiny_plan.diff(back) == []
    assert back.mesh_shape == (tiny_plan.pp, tiny_plan.dp // tiny_plan.dp_shard, tiny_plan.dp_shard, tiny_plan.cp, tiny_plan.tp)
    assert len(back.layers) == 4


def test_plan_checks(tiny_plan):
    with pytest.raises(PlanMismatchError, match="for 4 GPUs .* mesh has 8"):
        tiny_plan.check(world_size=8)
    with pytest.raises(PlanMismatchError, match="made for model llama-tiny"):
        tiny_plan.check(model_fingerprint="0" * 16)
    tiny_plan.check(model_fingerprint=tiny_plan.model_fingerprint, world_size=4)
    d = json.loads(tiny_plan.to_json())
    d["version"] = 99
    with pytest.raises(PlanMismatchError, match="version 99"):
        Plan.from_dict(d)
    with pytest.raises(AutoparError, match="not valid JSON"):
        Plan.from_json("{not json")


def test_diff_names_changes(tiny_plan):
    other = api.plan("llama-tiny", 4, hardware="cpu", global_batch=8, precision="fp32", pin="tp=2")
    lines = tiny_plan.diff(other)
    assert any(l.startswith("tp:") for l in lines) or tiny_plan.tp == 2
    # Another model is said first; runs of layers collapse; numbers are short.
    gpt = api.plan("gpt-tiny", 4, hardware="cpu", global_batch=8, precision="fp32", pin="ac=full")
    lines = tiny_plan.diff(gpt)
    assert lines[0].startswith("different models: llama-tiny -> gpt-tiny")
    assert not any("e-" in l or len(l) > 200 for l in lines), lines
    layer_lines = [l for l in lines if "(stage/chunk/AC)" in l]
    assert len(layer_lines) <= len({l.ac for l in tiny_plan.layers}) * 2


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True, text=True, timeout=300)


def test_explain_json_and_text():
    r = run_cli("explain", "llama3-8b", "--gpus", "64", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for k in ("plan", "step_time_s", "tokens_per_s_per_gpu", "mfu", "memory_gb_per_gpu", "breakdown"):
        assert k in d
    for k in ("tp", "pp", "dp", "sp", "fsdp", "mb", "ac", "schedule", "v", "layers"):
        assert k in d["plan"]
    p = d["plan"]
    assert p["tp"] * p["pp"] * p["dp"] == 64
    assert d["memory_gb_per_gpu"] <= 80.0
    assert sum(d["breakdown"].values()) == pytest.approx(d["step_time_s"])
    assert len(d["runners_up"]) == 3


def test_estimate_hand_written_plan():
    r = run_cli("estimate", "llama3-70b", "--gpus", "256", "--global-batch", "512", "--json",
                "--plan", "tp=8,pp=1,dp=32,sp=1,fsdp=1,mb=16,ac=full")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["plan"]["tp"], d["plan"]["dp"], d["plan"]["ac"], d["plan"]["mb"]) == (8, 32, "full", 16)
    assert d["tokens_per_s_per_gpu"] > 0 and 0 < d["mfu"] < 1


def test_version_and_text_output(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert "autopar 0.1.0" in capsys.readouterr().out
    assert cli.main(["explain", "llama-tiny", "--gpus", "2", "--hardware", "cpu", "--precision", "fp32",
                     "--global-batch", "4"]) == 0
    out = capsys.readouterr().out
    for section in ("mesh:", "layers", "step time breakdown", "memory per GPU", "collectives inserted"):
        assert section in out


def test_layers_of_another_shape_are_planned_and_numbered_modules_collapse():
    """DeepSeek's first layers are dense, the rest routed experts: every layer is in the plan (a
    stage and an AC mode each), and the TP table lists each expert projection once."""
    from autopar.explain import render
    from tests import zoo

    model = zoo.build("hf-deepseek-v2")  # 3 layers, the first dense, 4 routed experts
    p = api.plan(model, 4, example_inputs=(torch.zeros((4, 16), dtype=torch.long),), hardware="cpu",
                 precision="fp32", global_batch=4, pin="tp=2")
    assert [l.fqn for l in p.layers] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    text = render(p, width=200)
    assert "mlp.experts.0..3.gate_proj (4)" in text and "mlp.experts.1.gate_proj" not in text


def test_a_raised_default_batch_is_noted(capsys):
    assert cli.main(["explain", "llama3-8b", "--gpus", "100000", "--top", "0"]) == 0
    assert "note: global batch 12,500 sequences (102M tokens): the default 4M tokens raised" in capsys.readouterr().out


def test_explain_fits_the_terminal_and_runners_up_paste_back(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "72")
    assert cli.main(["explain", "llama3-8b", "--gpus", "64", "--top", "3"]) == 0
    out = capsys.readouterr().out
    # Every table within the width (prose is left whole for the terminal to wrap).
    assert all(len(line) <= 72 for line in out.splitlines() if line[:1] in "┏┃┡│└")
    runners = [line.split()[0] for line in out.split("runners-up")[1].splitlines()[1:] if line.startswith("  tp=")]
    assert len(runners) == 3
    for config in runners:  # whole, and accepted by --pin as it stands
        assert cli.main(["estimate", "llama3-8b", "--gpus", "64", "--plan", config, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["plan"]


def test_help_lists_hardware_and_pin_keys(capsys):
    for cmd, keys in (("explain", ("prefetch", "schedule")), ("estimate", ("cp", "once", "dp_overlap"))):
        with pytest.raises(SystemExit):
            cli.main([cmd, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "h100-sxm" in out and "a100-80gb" in out and all(f"{k}," in out or f"{k};" in out for k in keys)


def test_plan_json_is_deterministic_across_processes(tmp_path):
    """The same model, mesh and options give the same plan file byte for byte in two fresh
    processes (each traces the model itself: separate profile caches, a length no shipped profile has)."""
    outs = []
    for i in range(2):
        path = tmp_path / f"p{i}.json"
        env = dict(os.environ, AUTOPAR_CACHE_DIR=str(tmp_path / f"cache{i}"), PYTHONHASHSEED=str(i))
        r = subprocess.run([sys.executable, "-m", "autopar", "explain", "llama3-8b", "--gpus", "64", "--seq-len", "4096",
                            "-o", str(path)], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(path.read_bytes())
    assert outs[0] == outs[1]


def _same(a, b, where="profile"):
    """Field by field equality of two profiles (numpy arrays by value), naming the first difference."""
    import dataclasses

    import numpy as np

    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            if f.compare:
                _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_every_preset_ships_its_current_profile():
    """Each preset's profile at its default shapes ships with the package, made by this code and
    this torch (the key holds both): else `make profiles` was not rerun after a change."""
    from autopar import models

    stale = [n for n in models.PRESETS if api.preset_profile_key(n) not in api.shipped_profiles()]
    assert not stale, f"shipped profiles are stale or missing for {stale}: run `make profiles` and commit"


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_shipped_profile_is_what_a_trace_gives(name):
    from autopar import capture, models

    src = models.resolve(name)
    tr = capture.trace_model(src.build, batch=1, seq_len=src.seq_len, vocab_size=src.vocab_size, name=name)
    _same(api.analysis.analyze(tr), api.shipped_profiles()[api.preset_profile_key(name)])


def test_explaining_a_preset_on_a_fresh_machine_does_not_trace(tmp_path, monkeypatch, capsys):
    """With an empty profile cache, a preset is explained from its shipped profile: no trace, so
    Dynamo (about 1 s to import) is never loaded; the output is the one a trace gives."""
    code = ("import sys; from autopar import cli; rc = cli.main(['explain', 'llama3-8b', '--gpus', '64', '--json']); "
            "assert 'torch._dynamo' not in sys.modules, 'the model was traced'; sys.exit(rc)")
    env = dict(os.environ, AUTOPAR_CACHE_DIR=str(tmp_path / "fresh"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "traced"))
    monkeypatch.setattr(api, "shipped_profiles", dict)
    assert cli.main(["explain", "llama3-8b", "--gpus", "64", "--json"]) == 0
    assert os.listdir(tmp_path / "traced" / "profiles")  # this one did trace
    shipped, traced = json.loads(r.stdout), json.loads(capsys.readouterr().out)
    shipped.pop("planning_s", None), traced.pop("planning_s", None)
    assert shipped == traced


def test_explain_graph_lists_the_executed_collectives():
    r = run_cli("explain", "llama3-8b", "--gpus", "64", "--pin", "tp=8,sp=1,pp=1,ac=none", "--graph")
    assert r.returncode == 0, r.stderr[-2000:]
    text = r.stdout[r.stdout.index("collectives in the compiled step graphs"):]
    rows = [l for l in text.splitlines() if "│ tp " in l]
    fwd = [l for l in rows if "forward" in l]
    # Two layers under SP: 2 column-input gathers and 2 row reduce-scatters per layer, the
    # embedding's reduce-scatter, the head's input gather; the logits are never gathered (loss
    # parallelism: three per-token all-reduces).
    assert sum("all_gather" in l for l in fwd) == 5 and sum("reduce_scatter" in l for l in fwd) == 5
    assert sum("all_reduce" in l for l in fwd) == 3
    assert all(l.split("│")[-2].strip() for l in fwd), "each forward collective names the node it came from"


def test_explain_against_a_checkpoint(tmp_path):
    """A checkpoint saved on 4 GPUs (its plan beside it), planned again for 2: explain names both
    plans and what changed (here the GPU count), in text and in JSON."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    r = run_cli("explain", "llama-tiny", "--gpus", "4", "--hardware", "cpu", "--precision", "fp32",
                "--global-batch", "8", "-o", str(ckpt / "autopar_plan.json"))
    assert r.returncode == 0, r.stderr
    r = run_cli("explain", "llama-tiny", "--gpus", "2", "--hardware", "cpu", "--precision", "fp32",
                "--global-batch", "8", "--checkpoint", str(ckpt))
    assert r.returncode == 0, r.stderr
    assert "on 4 GPUs" in r.stdout and "on 2 GPUs" in r.stdout and "world_size: 4 -> 2" in r.stdout
    assert "pm.load_checkpoint" in r.stdout
    r = run_cli("explain", "llama-tiny", "--gpus", "2", "--hardware", "cpu", "--precision", "fp32",
                "--global-batch", "8", "--checkpoint", str(ckpt), "--json")
    d = json.loads(r.stdout)["checkpoint"]
    assert d["saved_world_size"] == 4 and "world_size: 4 -> 2" in d["changes"]


def test_progress_bar_only_on_a_terminal_and_long_searches(monkeypatch):
    """The search's progress bar stays off when stderr is not a terminal or the search is short
    (rich is then never imported by it), and shows, then stops, when both hold."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    with cli._Progress(after_s=0.0) as prog:
        prog.update(10, 100)
    assert prog.bar is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with cli._Progress(after_s=3600.0) as prog:
        prog.update(10, 100)
    assert prog.bar is None
    with cli._Progress(after_s=0.0) as prog:
        prog.update(10, 100)
        prog.update(20, 100)
        assert prog.bar is not None and prog.bar.tasks[0].completed == 20
    assert prog.bar.live.is_started is False


def test_estimate_of_a_plan_that_does_not_fit_says_so_and_exits_1():
    import contextlib
    import io

    from autopar import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["estimate", "llama3-70b", "--gpus", "8", "--plan", "tp=8,pp=1,dp=1"])
    assert rc == 1
    assert "DOES NOT FIT:" in out.getvalue() and "GiB over" in out.getvalue()
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["estimate", "llama3-8b", "--gpus", "64", "--plan", "tp=1,pp=1,dp=64,fsdp=1"]) == 0


def test_arguments_are_checked_before_the_model_loads():
    """A mistaken argument is answered before torch is imported (within a second, not after a trace)."""
    code = ("import sys; from autopar import cli; rc = cli.main(sys.argv[1:]); "
            "print('torch' in sys.modules); sys.exit(rc)")
    for argv in (["explain", "llama3-8b", "--gpus", "-8"], ["explain", "llama3-8b", "--gpus", "8", "--hardware", "h1000"],
                 ["explain", "llama3-8b", "--gpus", "8", "-o", "/nonexistent/dir/plan.json"]):
        r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stdout.strip() == "False", (argv, r.stdout, r.stderr)


def test_a_config_seen_before_is_planned_without_importing_transformers(tmp_path):
    """What transformers makes of a config file is cached: the second plan of it imports no
    transformers (seconds of start-up), and plans the same."""
    cfg = tmp_path / "m" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "vocab_size": 1024, "max_position_embeddings": 2048}))
    env = {**os.environ, "AUTOPAR_CACHE_DIR": str(tmp_path / "cache")}
    code = ("import sys, json; from autopar import cli; rc = cli.main(['explain', sys.argv[1], '--gpus', '8', '--json']); "
            "print('TRANSFORMERS', 'transformers' in sys.modules, file=sys.stderr); sys.exit(rc)")
    runs = [subprocess.run([sys.executable, "-c", code, str(cfg)], capture_output=True, text=True, env=env,
                           timeout=300) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-2000:]
    assert "TRANSFORMERS True" in runs[0].stderr and "TRANSFORMERS False" in runs[1].stderr
    assert json.loads(runs[0].stdout)["plan"] == json.loads(runs[1].stdout)["plan"]


def test_an_image_classifier_config_is_planned_on_its_images(tmp_path, monkeypatch):
    """A ViT config.json: traced on images of its size (a forward on fake tensors), its sequence
    the patches and class token its layers see, its classes the head's outputs; a sequence length
    is refused (it is the patches), and a config that is neither a language model nor an image
    classifier is refused with the way to plan it."""
    import transformers

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    cfg = transformers.ViTConfig(image_size=64, patch_size=8, hidden_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, intermediate_size=512, num_labels=100)
    path = tmp_path / "vit" / "config.json"
    cfg.save_pretrained(path.parent)
    p = api.plan(str(path), 8, hardware="h100", global_batch=256)
    assert p.seq_len == (64 // 8) ** 2 + 1 and len(p.layers) == 4
    with pytest.raises(AutoparError, match="its sequence is the patches its layers see"):
        api.plan(str(path), 8, hardware="h100", seq_len=128)
    # Swin's constructor reads values it computes (drop-path rates by linspace(...).item()): built
    # on the meta device and made fake; both stages' blocks are layers.
    swin = tmp_path / "swin" / "config.json"
    transformers.SwinConfig(image_size=64, patch_size=4, embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4,
                            num_labels=10).save_pretrained(swin.parent)
    p = api.plan(str(swin), 8, hardware="h100", global_batch=64)
    assert [layer.fqn for layer in p.layers] == [f"swin.encoder.layers.{s}.blocks.{i}" for s in (0, 1) for i in (0, 1)]
    other = tmp_path / "clip" / "config.json"
    transformers.CLIPVisionConfig().save_pretrained(other.parent)
    with pytest.raises(AutoparError, match=r"neither a language model's \(causal, masked or encoder-decoder\) nor"):
        api.plan(str(other), 8, hardware="h100")


def test_encoder_and_encoder_decoder_configs_are_planned(tmp_path, monkeypatch):
    """A masked-LM encoder's config is built with its masked-LM head (ModernBERT, initialised by
    a truncated normal: skipped on fake tensors), an encoder-decoder's as the model fed the same
    ids in both stacks: its encoder and decoder layers are both planned, in the order they run
    (the decoder's names sort first)."""
    import transformers

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    small = dict(vocab_size=1000, num_attention_heads=4, max_position_embeddings=256)
    configs = {
        "t5": transformers.T5Config(d_model=256, d_kv=64, d_ff=1024, num_layers=3, num_decoder_layers=2, num_heads=4,
                                    vocab_size=1000),
        "bart": transformers.BartConfig(d_model=256, encoder_layers=3, decoder_layers=2, encoder_attention_heads=4,
                                        decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024,
                                        vocab_size=1000, max_position_embeddings=256),
        "modernbert": transformers.ModernBertConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                                    pad_token_id=0, bos_token_id=1, eos_token_id=2, sep_token_id=2,
                                                    cls_token_id=1, **small),
    }
    built = {"t5": "T5ForConditionalGeneration", "bart": "BartForConditionalGeneration",
             "modernbert": "ModernBertForMaskedLM"}
    for name, cfg in configs.items():
        cfg.save_pretrained(tmp_path / name)
        path = str(tmp_path / name / "config.json")
        with FakeTensorMode(), capture.no_init():
            m = models.resolve(path).build()
        inner = m.model if isinstance(m, models.SameIds) else m
        assert type(inner).__name__ == built[name] and isinstance(m, models.SameIds) == (name != "modernbert")
        p = api.plan(path, 8, hardware="h100", global_batch=64, seq_len=128)
        fqns = [layer.fqn for layer in p.layers]
        if name == "modernbert":
            assert fqns == [f"model.layers.{i}" for i in range(3)]
        else:
            assert [f.split(".")[-3] for f in fqns] == ["encoder"] * 3 + ["decoder"] * 2, fqns
            text = explain.render(dataclasses.replace(p, layers=tuple(dataclasses.replace(x, stage=0, chunk=0)
                                                                      for x in p.layers)), width=200)
            assert "encoder.block.0 .. 2 │ 3" in text.replace("layers.", "block.") and \
                "decoder.block.0 .. 1 │ 2" in text.replace("layers.", "block."), text  # one row per stack


def test_a_diffusion_transformer_config_is_planned_on_its_latents(tmp_path, monkeypatch):
    """A diffusers config.json (``_class_name``; DiT's published one names the legacy
    ``Transformer2DModel``, which diffusers maps to ``DiTTransformer2DModel`` by its norm): planned
    on latents of its sample size with the inputs its forward takes (timestep, class labels; SD3's
    text conditioning and pooled projection), on the noise's mean squared error; its sequence is
    its latent patches (a length is refused), a config without a latents' shape is refused."""
    diffusers = pytest.importorskip("diffusers")
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    dit = {"_class_name": "Transformer2DModel", "norm_type": "ada_norm_zero", "attention_head_dim": 32,
           "num_attention_heads": 4, "in_channels": 4, "out_channels": 8, "num_layers": 3, "sample_size": 16,
           "patch_size": 2, "num_embeds_ada_norm": 1000, "norm_elementwise_affine": False, "activation_fn": "gelu-approximate"}
    (tmp_path / "dit").mkdir()
    (tmp_path / "dit" / "config.json").write_text(json.dumps(dit))
    sd3 = diffusers.SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=32,
                                          num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=128,
                                          pooled_projection_dim=64, out_channels=4, pos_embed_max_size=16)
    sd3.save_config(tmp_path / "sd3")
    for name, inputs in (("dit", "hidden_states, timestep, class_labels"),
                         ("sd3", "hidden_states, encoder_hidden_states, pooled_projections, timestep")):
        path = str(tmp_path / name / "config.json")
        src = models.resolve(path)
        assert src.loss_fn is capture.noise_mse and src.notes[0].startswith(f"planned on {inputs} ")
        p = api.plan(path, 8, hardware="h100", global_batch=64)
        assert p.seq_len == (16 // 2) ** 2 and len(p.layers) == 3, (name, p.seq_len, [l.fqn for l in p.layers])
        with pytest.raises(AutoparError, match="latents of 4x16x16: its sequence is the patches"):
            api.plan(path, 8, hardware="h100", seq_len=128)
    (tmp_path / "flux").mkdir()
    (tmp_path / "flux" / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel", "num_layers": 1}))
    with pytest.raises(AutoparError, match="gives no latents' shape"):
        api.plan(str(tmp_path / "flux" / "config.json"), 8, hardware="h100")
