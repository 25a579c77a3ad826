"""``autopar export``: a plan as torchtitan's job TOML and as Megatron-LM's arguments, each
checked field by field against the plan's layout."""

import re

import pytest
import tomllib

from autopar import api, cli
from autopar.export import export

PLANS = {
    "fsdp_tp_sp": "tp=2,pp=1,dp=32,sp=1,fsdp=1,mb=1,ac=selective",
    "hsdp": "tp=1,pp=1,dp=64,dp_shard=16,sp=0,fsdp=1,mb=1,ac=none",
    "pp_interleaved_full": "tp=2,pp=4,dp=8,sp=1,fsdp=0,mb=1,ac=full,schedule=interleaved,v=2",
    "pp_zbv": "tp=1,pp=4,dp=16,sp=0,fsdp=1,mb=1,ac=none,schedule=zbv,v=2",
    # ZeRO-1 (gathered once per step): Megatron-LM's distributed optimizer
    "pp_zero1": "tp=1,pp=4,dp=16,sp=0,fsdp=1,mb=1,ac=none,schedule=1f1b,once=gather",
}


@pytest.fixture(scope="module")
def plans():
    return {k: api.estimate_plan("llama3-8b", 64, v)[0] for k, v in PLANS.items()}


def _megatron_args(text: str) -> dict:
    args = {}
    for line in text.splitlines():
        if line.startswith("--"):
            key, *val = line.rstrip(" \\").split(maxsplit=1)
            args[key] = val[0] if val else True
    return args


@pytest.mark.parametrize("name", ["fsdp_tp_sp", "hsdp", "pp_interleaved_full", "pp_zbv"])
def test_torchtitan_layout_is_the_plans(plans, name):
    p = plans[name]
    cfg = tomllib.loads(export(p, "torchtitan"))
    par, tr = cfg["parallelism"], cfg["training"]
    degrees = (par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] * par["tensor_parallel_degree"]
               * par["pipeline_parallel_degree"] * par["context_parallel_degree"])
    assert degrees == p.world_size
    assert par["tensor_parallel_degree"] == p.tp and par["pipeline_parallel_degree"] == p.pp
    assert par["data_parallel_shard_degree"] == (p.dp_shard if p.fsdp else 1)
    assert par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] == p.dp
    if p.fsdp:
        assert par["fsdp_reshard_after_forward"] == ("always" if p.reshard_after_forward else "never")
    # torchtitan's accumulation: global / (local x data parallel) steps; a pipeline splits the local batch.
    accumulation = tr["global_batch_size"] // (tr["local_batch_size"] * p.dp)
    assert tr["global_batch_size"] == p.global_batch and tr["seq_len"] == p.seq_len
    if p.pp > 1:
        assert accumulation == 1 and par["pipeline_parallel_microbatch_size"] == p.mb
        assert tr["local_batch_size"] // p.mb == p.n_microbatches
        assert par["pipeline_parallel_schedule"] == {"interleaved": "Interleaved1F1B", "zbv": "ZBVZeroBubble"}[p.schedule]
        assert par["pipeline_parallel_layers_per_stage"] * p.pp * p.v == len(p.layers)
    else:
        assert tr["local_batch_size"] == p.mb and accumulation == p.n_microbatches
    modes = {l.ac for l in p.layers}
    assert cfg["activation_checkpoint"]["mode"] == ("full" if "full" in modes else "selective" if "selective" in modes
                                                    else "none")


@pytest.mark.parametrize("name", ["fsdp_tp_sp", "pp_interleaved_full", "pp_zero1"])
def test_megatron_layout_is_the_plans(plans, name):
    p = plans[name]
    a = _megatron_args(export(p, "megatron"))
    tp, pp, cp = (int(a[k]) for k in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                      "--context-parallel-size"))
    assert (tp, pp) == (p.tp, p.pp) and p.world_size // (tp * pp * cp) == p.dp
    assert int(a["--micro-batch-size"]) == p.mb and int(a["--global-batch-size"]) == p.global_batch
    assert int(a["--num-layers"]) == len(p.layers) and ("--sequence-parallel" in a) == p.sp
    assert ("--use-torch-fsdp2" in a) == (p.fsdp and not p.fsdp_once)
    assert ("--use-distributed-optimizer" in a) == (p.fsdp_once == "gather")
    if p.schedule == "interleaved" and p.pp > 1:
        assert int(a["--num-layers-per-virtual-pipeline-stage"]) * p.pp * p.v == len(p.layers)
    if all(l.ac == "full" for l in p.layers):
        assert a["--recompute-granularity"] == "full" and a["--recompute-method"] == "block"
        assert int(a["--recompute-num-layers"]) * p.pp * p.v == len(p.layers)
    elif any(l.ac == "selective" for l in p.layers):
        assert a["--recompute-granularity"] == "selective"


def test_what_megatron_cannot_run_is_refused(plans, tmp_path, capsys):
    for name, msg in (("pp_zbv", "Megatron-LM runs 1F1B and interleaved 1F1B pipelines, not 'zbv'"),
                      ("hsdp", "this plan is HSDP \\(4 x 16\\); pin dp_shard=64")):
        f = tmp_path / f"{name}.json"
        plans[name].save(str(f))
        assert cli.main(["export", str(f), "--to", "megatron"]) == 2
        assert re.search(msg, capsys.readouterr().err)


def test_export_writes_a_file(plans, tmp_path, capsys):
    f, out = tmp_path / "plan.json", tmp_path / "job.toml"
    plans["fsdp_tp_sp"].save(str(f))
    assert cli.main(["export", str(f), "--to", "torchtitan", "-o", str(out)]) == 0
    assert "written to" in capsys.readouterr().out
    assert tomllib.loads(out.read_text())["parallelism"]["tensor_parallel_degree"] == 2


@pytest.mark.parametrize("name", ["fsdp_tp_sp", "pp_interleaved_full", "pp_zbv"])
def test_plot_follows_the_schedule_and_the_predicted_memory(plans, name, tmp_path, capsys):
    from autopar import plot

    p = plans[name]
    tl = plot.timeline(p)
    assert len(tl) == p.pp
    shown = plot.shown_microbatches(p)
    for row in tl:  # every stage of the rank: a forward and its backward for every microbatch shown
        kinds = [k for k, *_ in row]
        assert kinds.count("F") == shown * p.v
        assert kinds.count("B") + kinds.count("I") == shown * p.v
        assert all(s < e for *_, s, e in row) and all(a[4] <= b[3] for a, b in zip(row, row[1:]))
    curves = plot.memory_curves(p, tl)
    pr = p.predicted
    per_rank = pr.get("memory_gb_per_stage") or [pr["memory_gb_per_gpu"]]
    # Each rank's highest point is its predicted peak (less the reserve, drawn as the limit's margin).
    for r, curve in enumerate(curves):
        assert max(y for _, y in curve) == pytest.approx(per_rank[r] - pr["memory_breakdown_gb"]["reserve"], rel=1e-6)
    f = tmp_path / "plan.json"
    p.save(str(f))
    assert cli.main(["show", str(f), "--plot", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("prec,titan,megatron", [
    ("bf16-mixed", ("bfloat16", "float32"), {"--bf16"}), ("fp32", ("float32", "float32"), set()),
    ("bf16-true", ("bfloat16", "bfloat16"), {"--bf16"}), ("float8", ("bfloat16", "float32"), {"--bf16", "--fp8-format"})])
def test_precision_exported_as_each_framework_names_it(prec, titan, megatron):
    """The plan's precision in the other framework's terms: torchtitan's mixed_precision_param and
    _reduce, Megatron-LM's --bf16 (fp32 masters) and float8 flag; what they run otherwise is a note."""
    p = api.estimate_plan("llama3-8b", 64, PLANS["fsdp_tp_sp"], precision=prec)[0]
    text = export(p, "torchtitan")
    tr = tomllib.loads(text)["training"]
    assert (tr["mixed_precision_param"], tr["mixed_precision_reduce"]) == titan
    assert ("keeps fp32 master weights" in text) == (prec == "bf16-true")
    assert ("float8" in text.split("[training]")[0]) == (prec == "float8")
    m = export(p, "megatron")
    assert {k for k in _megatron_args(m) if k in ("--bf16", "--fp16", "--fp8-format")} == megatron
    assert ("keeps fp32 master weights" in m) == (prec == "bf16-true")


def test_a_plan_of_several_stacks_is_not_exported(plans):
    """An encoder-decoder's plan (encoder and decoder layers) is refused: torchtitan and Megatron-LM
    train one stack of decoder layers."""
    import dataclasses

    from autopar.errors import AutoparError

    p = plans["hsdp"]
    layers = tuple(dataclasses.replace(x, fqn=x.fqn.replace("layers.", "encoder.layers.", 1) if i < 16 else
                                       x.fqn.replace("layers.", "decoder.layers.", 1)) for i, x in enumerate(p.layers))
    p2 = dataclasses.replace(p, layers=layers)
    for target in ("torchtitan", "megatron"):
        with pytest.raises(AutoparError, match="layers are in 2 stacks .*one stack of decoder layers"):
            export(p2, target)
    assert export(p, "torchtitan")  # one stack: exported
