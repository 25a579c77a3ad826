"""One capture: the planner's analysis reads the graph the executor runs."""

import numpy as np
import pytest
import torch

from autopar import analysis, capture, cut


def _profile_from(sg, m, batch, seq):
    return analysis.analyze(cut.for_analysis(sg, m, name="m", batch=batch, seq_len=seq, dtype=torch.float32))


def _same(a: analysis.ModelProfile, b: analysis.ModelProfile) -> None:
    assert len(a.blocks) == len(b.blocks) == 1
    x, y = a.blocks[0], b.blocks[0]
    assert x.costs.names == y.costs.names
    for f in ("flops", "act_bytes", "weight_bytes", "kind", "tp", "causal", "recompute_selective"):
        np.testing.assert_array_equal(getattr(x.costs, f), getattr(y.costs, f), err_msg=f)
    assert x.saved == y.saved and x.hidden_bytes == y.hidden_bytes
    assert (x.params_tp, x.params_rep, x.tp_divisors, x.heads, x.kv_heads) == (y.params_tp, y.params_rep, y.tp_divisors,
                                                                             y.heads, y.kv_heads)
    assert sorted((l.weight, l.role, l.partners) for l in x.linears) == sorted((l.weight, l.role, l.partners)
                                                                               for l in y.linears)
    for seg in ("pre", "post"):
        p, q = getattr(a, seg), getattr(b, seg)
        assert p.costs.names == q.costs.names
        np.testing.assert_array_equal(p.costs.flops, q.costs.flops)
        assert (p.params_vocab, p.params_rep, p.saved_vocab, p.saved_rep) == (q.params_vocab, q.params_rep,
                                                                              q.saved_vocab, q.saved_rep)


@pytest.mark.parametrize("kind", ["llama-tiny-4layers", "hf-gpt2", "hf-phi3", "custom-llama"])
def test_one_layer_priced_is_the_layer_that_runs(kind):
    """The planner traces one instance of the repeated layers (the others pass its output on);
    what it prices equals what it reads from the whole step graph the executor runs."""
    from tests import zoo

    torch.manual_seed(0)
    m = zoo.build(kind)
    ids = torch.randint(0, 200, (2, 16))
    whole = capture.trace_step(m, (ids,), target=torch.ones_like(ids))
    one = capture.trace_step(m, (ids,), target=torch.ones_like(ids), first_layers_only=True)
    layer_nodes = lambda sg: {n.meta.get("custom", {}).get("layer") for n in sg.gm.graph.nodes} - {None}
    assert layer_nodes(whole) == set(range(len(whole.layers))) and len(whole.layers) >= 2
    assert layer_nodes(one) == {0}
    assert len(one.gm.graph.nodes) < len(whole.gm.graph.nodes)
    a, b = _profile_from(whole, m, 2, 16), _profile_from(one, m, 2, 16)
    _same(a, b)
    assert a.blocks[0].saved["none"][0] > 0  # autograd's saved tensors were seen inside the layer
    assert any(l.role == "row" for l in a.blocks[0].linears)


def test_compile_traces_the_step_once(monkeypatch):
    """autopar.compile traces the training step once: the planner analyses that graph and the
    executor runs it (a plan that runs the whole batch at once)."""
    import autopar
    from tests import zoo

    calls = []
    real = capture.trace_step
    monkeypatch.setattr(capture, "trace_step", lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.setattr(capture, "trace_model", lambda *a, **k: pytest.fail("the planner traced the model again"))
    torch.manual_seed(0)
    m = zoo.build("llama-tiny")
    ids = torch.randint(0, 200, (2, 16))
    with torch.no_grad():
        ref = capture.default_loss(m(ids), ids)
    pm = autopar.compile(m, 1, example_inputs=(ids,))
    assert len(calls) == 1 and not calls[0].get("first_layers_only")
    loss = pm.step(ids, target=ids)
    assert float(loss) == pytest.approx(float(ref), abs=1e-6)


@pytest.mark.parametrize("kind", ["hf-llama", "gpt-tiny"])
def test_step_traced_as_mixed_precision_runs(kind):
    """Under mixed precision the step is traced on bf16 parameters (FSDP2's forward): the matmuls
    and attention compute in bf16, the model's own fp32 upcasts stay (HF RMSNorm), the loss is
    fp32, and ``output_dtype`` casts the model's outputs (an HF ModelOutput's fields too)."""
    from autopar.passes.distribute import output_values
    from tests import zoo

    m = zoo.build(kind)
    ids = torch.randint(0, 200, (2, 16))
    sg = capture.trace_step(m, (ids,), target=torch.ones_like(ids), param_dtype=torch.bfloat16)
    mm = [n for n in sg.gm.graph.nodes if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    assert mm and all(n.meta["val"].dtype == torch.bfloat16 for n in mm)
    assert [v.dtype for v in output_values(sg)] == [torch.float32]
    if kind == "hf-llama":  # RMSNorm computes its variance in fp32
        assert any(n.target == torch.ops.aten.pow.Tensor_Scalar and n.meta["val"].dtype == torch.float32
                   for n in sg.gm.graph.nodes)
    fwd = capture.trace_step(m, (ids,), param_dtype=torch.bfloat16)
    assert [v.dtype for v in output_values(fwd)] == [torch.bfloat16]
    cast = capture.trace_step(m, (ids,), param_dtype=torch.bfloat16, output_dtype=torch.float32)
    assert [v.dtype for v in output_values(cast)] == [torch.float32]
    assert all(p.dtype == torch.float32 for p in m.parameters())  # the module is not converted


def test_output_dtype_casts_every_output_form():
    import collections

    Out = collections.namedtuple("Out", "logits aux")
    x, ids = torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.long)
    got = capture._cast_outputs(Out(x, ids), torch.float32)
    assert isinstance(got, Out) and got.logits.dtype == torch.float32 and got.aux.dtype == torch.long
    assert [t.dtype for t in capture._cast_outputs([x, ids], torch.float32)] == [torch.float32, torch.long]
    assert capture._cast_outputs({"logits": x}, torch.float32)["logits"].dtype == torch.float32


@pytest.mark.parametrize("kind,want", [
    ("hf-llama", ["model.layers.0", "model.layers.1"]),
    # The first layer has no attention norm: only the MLPs repeat exactly; the layers hold them.
    ("hf-modernbert", ["model.layers.0", "model.layers.1"]),
    # Two kinds, encoder's then decoder's, in the order they run (names would sort the decoder first).
    ("hf-bart", [f"model.model.{s}.layers.{i}" for s in ("encoder", "decoder") for i in (0, 1)]),
    # T5's blocks differ (the first holds the position bias; the decoder's cross-attention): found
    # from their feed-forward sublayers, which repeat exactly.
    ("hf-mt5", [f"model.{s}.block.{i}" for s in ("encoder", "decoder") for i in (0, 1)]),
    # Stages of different widths: each stage's blocks a kind.
    ("hf-swin", [f"swin.encoder.layers.{s}.blocks.{i}" for s in (0, 1) for i in (0, 1)]),
])
def test_layers_of_every_kind_in_model_order(kind, want):
    from tests import zoo

    assert capture.find_layers(zoo.build(kind)) == want


def test_a_key_value_cache_built_in_training_is_the_same_step():
    """HF models as they ship (``use_cache`` on) start each layer's key/value cache as an empty
    tensor that ``torch.cat`` skips: the captured step reads no such operand (DTensor would shard
    it along the heads), and compiled with Inductor (GPT-J: views of the cached keys) it gives
    the model's own loss."""
    import autopar
    from tests import zoo

    torch.manual_seed(0)
    m = zoo.build("hf-gptj")
    assert m.config.use_cache
    ids = torch.randint(0, 200, (2, 16))
    sg = capture.trace_step(m, (ids,), target=ids)
    cats = [n for n in sg.gm.graph.nodes if n.target == torch.ops.aten.cat.default]
    assert not any(a.meta["val"].dim() == 1 and a.meta["val"].numel() == 0 for n in cats for a in n.args[0])
    with torch.no_grad():
        ref = float(capture.default_loss(m(ids), ids))
    pm = autopar.compile(m, 1, example_inputs=(ids,), example_target=ids)
    assert float(pm.step(ids, target=ids)) == pytest.approx(ref, abs=1e-5)


def test_unaliased_writes_run_out_of_place_and_writes_through_views_stay():
    """The joint graph is made functional without a second trace where a write only changes what
    later readers see (``fxops.out_of_place``): the rewritten graph computes the same values. A
    write through a view (its base read afterwards) is left for functionalisation."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.fxops import out_of_place

    def fresh(x, y):
        z = torch.zeros(4, 3) + x  # made in the graph, no view of it
        before = z * 2  # reads the old value
        z.add_(y)
        z.mul_(3)  # a second write on the same tensor
        return before, z + 1

    def through_view(x, y):
        z = torch.zeros(4, 3) + x
        z[:2].add_(y[:2])  # writes the base through a slice
        return z * 2

    x, y = torch.randn(4, 3), torch.randn(4, 3)

    def mutable(gm):
        return [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target._schema.is_mutable]

    gm = make_fx(fresh, tracing_mode="fake")(x, y)
    assert mutable(gm), "the traced graph should hold the writes"
    out_of_place(gm)
    assert not mutable(gm)
    for got, want in zip(gm(x, y), fresh(x, y)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    gm = make_fx(through_view, tracing_mode="fake")(x, y)
    out_of_place(gm)
    assert mutable(gm) == [torch.ops.aten.add_.Tensor]
    torch.testing.assert_close(gm(x, y), through_view(x, y), rtol=0, atol=0)


def _attention_calls(gm) -> list[tuple[bool, bool]]:
    """(causal, has a mask) of each attention kernel in a traced graph."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and "scaled_dot_product" in str(n.target) and "backward" not in str(n.target):
            causal = bool(n.kwargs.get("is_causal", False)) or any(a is True for a in n.args[3:6])
            out.append((causal, n.kwargs.get("attn_mask") is not None))
    return out


@pytest.mark.parametrize("kind", ["hf-llama", "hf-mixtral"])
def test_a_causal_lm_runs_causal_attention_without_a_mask(kind):
    """transformers builds an explicit (s x s) mask whenever it is traced (a packed-sequence mask
    from the position ids; every mask on the export path, which routed experts take): the step
    would run masked attention, which a GPU cannot run as causal flash attention. Position ids the
    model makes itself count up, so the step calls causal attention with no mask; position ids the
    caller passes may restart (packed sequences), so their mask stays."""
    from tests import zoo

    m = zoo.build(kind)
    ids = torch.randint(0, 200, (2, 16))
    sg = capture.trace_step(m, (ids,), target=ids)
    assert _attention_calls(sg.gm) == [(True, False)] * len(sg.layers)

    class Packed(torch.nn.Module):  # the caller's own positions, through a wrapper of its own
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids, pos):
            return self.inner(input_ids=ids, position_ids=pos, use_cache=False).logits

    pos = torch.arange(16).repeat(2, 1)
    sg = capture.trace_step(Packed(m), (ids, pos), target=ids)
    assert _attention_calls(sg.gm) == [(False, True)] * len(sg.layers)


def test_a_tensor_filled_slice_by_slice_is_traced_as_its_data_flow():
    """A tensor made empty and filled part by part (``x[..., :a].copy_(p)``, as transformers 5's
    latent attention assembles its keys) is rewritten as ``slice_scatter`` calls: no write into a
    view is left, each part's producer feeds the result, and the values are the same. A tensor
    read before it is filled is left as it is."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.fxops import out_of_place

    def assemble(p, q):
        out = p.new_empty(*p.shape[:-1], 8)
        out[..., :6].copy_(p)
        out[:, :, 6:].copy_(q.expand(-1, 3, -1).to(out.dtype))  # a broadcast source of another dtype
        return out * 2

    def read_first(p, q):
        out = p.new_zeros(*p.shape[:-1], 8)
        s = out.sum()
        out[..., :6].copy_(p)
        return out + s

    p, q = torch.randn(2, 3, 6), torch.randn(2, 1, 2, dtype=torch.float64)
    gm = make_fx(assemble, tracing_mode="fake")(p, q)
    out_of_place(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.copy_.default not in targets and targets.count(torch.ops.aten.slice_scatter.default) == 2
    assert torch.equal(gm(p, q), assemble(p, q))
    gm = make_fx(read_first, tracing_mode="fake")(p, q)
    out_of_place(gm)
    assert torch.ops.aten.copy_.default in [n.target for n in gm.graph.nodes]
    assert torch.equal(gm(p, q), read_first(p, q))


def test_models_built_after_planning_are_initialised_as_their_library_does():
    """Planning builds the model with ``torch.nn.init`` made no-ops (``capture.no_init``). A
    library first imported meanwhile that keeps the initialisers it found (transformers 5's
    ``initialization``, through which its models initialise) gets the real ones back: an HF
    model built later in the same process has HF's initial weights (normal, std 0.02), its 3-D
    experts (``torch.empty``) included, not its constructors' values or uninitialised memory.
    In a fresh process, where transformers has not initialised a model yet."""
    import os
    import subprocess
    import sys

    code = """if True:
        import torch, autopar
        from tests import zoo
        ids = torch.zeros((2, 16), dtype=torch.long)
        autopar.plan(lambda: zoo.build("hf-llama"), 2, pin="tp=1,dp=2", example_inputs=(ids,), global_batch=2)
        torch.manual_seed(0)
        m = zoo.build("custom-mixtral-3d")
        stds = {n: float(p.detach().std()) for n, p in m.named_parameters() if p.dim() >= 2}
        bad = {n: s for n, s in stds.items() if not 0.015 < s < 0.025}
        print("BAD", bad if bad else "none")
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": root, "AUTOPAR_QUIET": "1"}, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "BAD none" in r.stdout, r.stdout[-3000:]
