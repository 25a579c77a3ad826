"""Bad input to autopar.compile: a clear error and nothing changed."""

import copy
import json

import pytest
import torch

import autopar
from autopar.errors import AutoparError, PlanMismatchError
from tests.dist_harness import batch, build


def _params(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


@pytest.fixture(scope="module")
def model_and_plan(tmp_path_factory):
    m = build("llama-tiny")
    ids, _ = batch(1)
    p = autopar.plan(m, 1, example_inputs=(ids,), hardware="cpu", global_batch=8, pin="mb=2")
    path = tmp_path_factory.mktemp("plans") / "p.json"
    p.save(str(path))
    return m, p, str(path)


def test_world_without_process_group():
    m = build("llama-tiny")
    ids, _ = batch(1)
    with pytest.raises(AutoparError, match="needs torch.distributed initialised"):
        autopar.compile(m, 4, example_inputs=(ids,))


def test_plan_for_another_model(model_and_plan):
    _, p, _ = model_and_plan
    other = build("llama-small")
    ids = torch.randint(0, 1024, (8, 32))
    before = _params(other)
    with pytest.raises(PlanMismatchError, match="made for model"):
        autopar.compile(other, 1, example_inputs=(ids,), plan=p)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_plan_for_another_mesh(model_and_plan, tmp_path):
    m, p, _ = model_and_plan
    d = json.loads(p.to_json())
    d["world_size"] = 8
    path = tmp_path / "p8.json"
    path.write_text(json.dumps(d))
    ids, _ = batch(1)
    with pytest.raises(PlanMismatchError, match="for 8 GPUs"):
        autopar.compile(copy.deepcopy(m), 1, example_inputs=(ids,), plan=str(path))


def test_plan_json_that_does_not_parse(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{oops")
    ids, _ = batch(1)
    with pytest.raises(AutoparError, match="not valid JSON"):
        autopar.compile(build("llama-tiny"), 1, example_inputs=(ids,), plan=str(path))


@pytest.mark.parametrize("bad,msg", [
    ((torch.randn(8, 32),), "2-D integer tensor of token ids"),
    ((torch.randint(0, 256, (8,)),), "2-D integer tensor"),
    ([torch.randint(0, 256, (8, 32))], "must be a tuple"),
])
def test_bad_example_inputs(bad, msg):
    with pytest.raises(AutoparError, match=msg):
        autopar.compile(build("llama-tiny"), 1, example_inputs=bad)


def test_seq_len_differs_from_plan(model_and_plan):
    m, _, path = model_and_plan
    ids = torch.randint(0, 256, (8, 16))
    with pytest.raises(AutoparError):
        autopar.compile(copy.deepcopy(m), 1, example_inputs=(ids,), plan=path)


def test_step_batch_not_divisible(model_and_plan):
    m, _, path = model_and_plan
    ids, tgt = batch(1)
    pm = autopar.compile(copy.deepcopy(m), 1, example_inputs=(ids,), plan=path)
    with pytest.raises(AutoparError, match=r"batch of 3 sequences cannot be split over dp=1 ranks into microbatches of 2; use a multiple of 2"):
        pm.step(torch.randint(0, 256, (3, 32)), target=tgt[:3])
    with pytest.raises(AutoparError, match="needs target="):
        pm.step(ids)


def test_untraceable_model_names_the_line():
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            h = self.emb(x)
            if h.mean() > 0:  # data-dependent branch
                h = -h
            for l in self.layers:
                h = l(h)
            return h

    from autopar.errors import TraceError

    with pytest.raises(TraceError, match=r"test_compile_errors.py:\d+: if h.mean\(\) > 0"):
        autopar.compile(Bad(), 1, example_inputs=(torch.randint(0, 16, (2, 4)),))


def test_activation_checkpointing_saves_less():
    """The AC pass's tags reach the partitioner: full AC saves fewer bytes for backward than
    selective, and selective fewer than none (the forward graph's saved outputs, counted)."""
    ids, _ = batch(0, B=4)
    saved = {}
    for mode in ("none", "selective", "full"):
        pm = autopar.compile(build("llama-tiny"), 1, example_inputs=(ids,), plan=f"ac={mode},mb=4")
        fw = pm._step_runner.compiled.fw_graph
        (out,) = fw.graph.find_nodes(op="output")
        vals = [a.meta["val"] for a in out.args[0][1:] if isinstance(a.meta.get("val"), torch.Tensor)]
        params = {id(p) for p in pm.parameters()}
        saved[mode] = sum(v.numel() * v.element_size() for v in vals if v.dim() > 1 and id(v) not in params)
    assert saved["full"] < saved["selective"] < saved["none"], saved


def test_plan_given_as_pin_string():
    m = build("llama-tiny")
    ids, _ = batch(1)
    pm = autopar.compile(m, 1, example_inputs=(ids,), plan="ac=full,mb=2", global_batch=8)
    assert pm.plan.mb == 2 and {l.ac for l in pm.plan.layers} == {"full"}
    with pytest.raises(AutoparError, match="tp"):
        autopar.compile(build("llama-tiny"), 1, example_inputs=(ids,), plan="tp=2")
    with pytest.raises(AutoparError, match="cannot read plan"):
        autopar.compile(build("llama-tiny"), 1, example_inputs=(ids,), plan="no_such_plan.json")


def test_full_ac_keeps_only_each_layers_input():
    """Full AC recomputes the whole layer in backward, attention included (its kernel is tagged
    as seeded but draws nothing without dropout): inside the layers the forward saves one
    hidden-state tensor per layer (no attention output beside it), which is what the cost model
    prices for ``full``."""
    ids, _ = batch(0, B=4)
    pm = autopar.compile(build("llama-tiny"), 1, example_inputs=(ids,), plan="ac=full,mb=4")
    fw = pm._step_runner.compiled.fw_graph
    (out,) = fw.graph.find_nodes(op="output")
    per_layer: dict = {}
    for a in out.args[0][1:]:
        if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            layer = a.meta.get("custom", {}).get("layer")
            if layer is not None:
                per_layer.setdefault(layer, []).append(tuple(a.meta["val"].shape))
    hidden = (4, ids.shape[1], 64)  # llama-tiny: dim 64
    # Layer i's output is layer i+1's input; the last one's is kept (or not) by the final norm.
    assert set(range(len(pm.plan.layers) - 1)) <= set(per_layer), per_layer
    assert all(shapes == [hidden] for shapes in per_layer.values()), per_layer


def test_compile_tells_which_graph_it_compiles_and_how_long_it_took(model_and_plan, capsys, monkeypatch):
    """A user waits for Inductor: each graph is announced with its place in line and its size,
    and ``pm.explain()`` reports the compile's time and Inductor's share of it."""
    import re

    from autopar import backend

    monkeypatch.delenv("AUTOPAR_QUIET", raising=False)
    m, _, path = model_and_plan
    ids, tgt = batch(1)
    with monkeypatch.context() as mp:  # compiled here, not loaded as an earlier test compiled it
        mp.setattr(backend, "_load_stored", lambda key, vals: None)
        pm = autopar.compile(copy.deepcopy(m), 1, example_inputs=(ids,), plan=path)
    err = capsys.readouterr().err
    assert re.search(r"autopar: Inductor compiles the forward graph \(1/2, \d+ ops\)", err), err
    assert re.search(r"autopar: backward graph compiled in [\d.]+ s", err), err
    line = next(ln for ln in pm.explain().splitlines() if ln.startswith("autopar.compile took"))
    total, inductor = float(line.split()[2]), float(re.search(r"Inductor ([\d.]+) s", line).group(1))
    assert 0 < inductor <= total, line
    assert {"distribute", "ac", "partition", "regions", "inductor"} <= set(pm.info.timings), pm.info.timings
    # The same graphs again: loaded by autopar's digest of them, and said so.
    autopar.compile(copy.deepcopy(m), 1, example_inputs=(ids,), plan=path)
    err = capsys.readouterr().err
    assert re.search(r"autopar: backward graph loaded \(compiled before\) in [\d.]+ s", err), err


def test_disable_passes_names_what_can_be_turned_off():
    """Turning off a pass the step cannot run without (or a name that is no pass) is refused
    before anything is traced, with the names that can be turned off."""
    m = build("llama-tiny")
    before = _params(m)
    ids, _ = batch(1)
    for bad in (("distribute",), ("partition", "bucket"), "overlap_typo"):
        with pytest.raises(AutoparError, match=r"cannot be turned off; what can: ac, bucket, inductor, overlap, regions"):
            autopar.compile(m, 1, example_inputs=(ids,), disable_passes=bad)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_pass_runner_checks_what_each_pass_returns_and_names_the_failing_one():
    from autopar.passes import Pass, PassContext, StepGraphs, run_passes

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    G = torch.fx.GraphModule
    ctx = PassContext(None, None)
    same = Pass("same", G, G, lambda g, p, c: g)
    assert run_passes(gm, ctx, [same]) is gm and "same" in ctx.timings
    with pytest.raises(AutoparError, match=r"pass 'wrong' returned int, not a StepGraphs"):
        run_passes(gm, ctx, [same, Pass("wrong", G, StepGraphs, lambda g, p, c: 3)])
    with pytest.raises(AutoparError, match=r"pass 'boom' failed after same: ZeroDivisionError"):
        run_passes(gm, ctx, [same, Pass("boom", G, G, lambda g, p, c: 1 / 0)])
    with pytest.raises(AutoparError, match=r"pass 'late' takes a StepGraphs, got Linear \(after same\)"):
        run_passes(gm, ctx, [same, Pass("late", StepGraphs, StepGraphs, lambda g, p, c: g)])
    skipped = PassContext(None, None, disabled={"same"})
    assert run_passes(gm, skipped, [same]) is gm and skipped.notes == {"same": ["disabled by the user"]}


def test_compile_runs_the_collector_less_often_and_restores_it(model_and_plan, monkeypatch):
    """While autopar compiles, Python's cyclic collector runs every 50,000 allocations or more
    (``api.fewer_collections``); the caller's thresholds are back afterwards."""
    import gc

    from autopar import backend

    m, _, path = model_and_plan
    ids, _ = batch(1)
    seen = []
    real = backend.compile_graph

    def compile_graph(gm, inductor):
        seen.append(gc.get_threshold())
        return real(gm, inductor)

    monkeypatch.setattr(backend, "compile_graph", compile_graph)
    before = gc.get_threshold()
    autopar.compile(copy.deepcopy(m), 1, example_inputs=(ids,), plan=path)
    assert seen and all(t[0] >= 50_000 for t in seen), seen
    assert gc.get_threshold() == before
