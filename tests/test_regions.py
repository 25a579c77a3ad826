"""Each repeated layer compiled once (``passes/regions.py``, on by default): the graphs Inductor
compiles call one subgraph per distinct layer segment, and train exactly as the flat graphs do."""

import copy

import torch

import autopar
from autopar.capture import default_loss
from autopar.passes.regions import _labels, _layer_dependent, wrap_layers
from tests import zoo
from tests.dist_harness import batch


def _step(pm, ids, tgt):
    loss = pm.step(ids, target=tgt)
    return float(loss), {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}


def test_layers_are_calls_of_one_subgraph_and_train_as_the_model_does():
    torch.manual_seed(0)
    ref = zoo.build("hf-llama", num_hidden_layers=4)
    ids, tgt = batch(1)
    pm = autopar.compile(copy.deepcopy(ref), 1, example_inputs=(ids,), plan="mb=8", global_batch=8)
    n_layers = ref.config.num_hidden_layers
    notes = pm.info.notes["regions"]
    assert f"fw: {n_layers} layer segments as calls of 1 compiled subgraphs" in notes, notes
    # The backward: the bottom layer (its gradient goes to the embedding) differs from the others
    # and, occurring once, stays inline.
    assert f"bw: {n_layers - 1} layer segments as calls of 1 compiled subgraphs" in notes, notes
    fw = pm._step_runner.compiled.fw_graph  # the flat graph: what memory.py walks
    assert not any(n.target is torch.ops.higher_order.invoke_subgraph for n in fw.graph.nodes)
    # No weight read transposed and transposed back (autograd's matrix-product gradients): the
    # distribute pass reads the weight itself, two nodes a product fewer for every later pass.
    t = torch.ops.aten.t.default
    for gm in (fw, pm._step_runner.compiled.bw_graph):
        twice = [n.name for n in gm.graph.nodes if n.target is t and getattr(n.args[0], "target", None) is t]
        assert not twice, twice
    assert {n.meta["segment"] for n in fw.graph.nodes if "segment" in n.meta} == set(range(n_layers))

    loss, grads = _step(pm, ids, tgt)
    want = default_loss(ref(ids), tgt)
    want.backward()
    assert abs(loss - float(want)) <= 1e-5 * abs(float(want))
    ref_grads = dict(ref.named_parameters())
    assert set(grads) == {n for n, p in ref.named_parameters()}
    for name, g in grads.items():
        r = ref_grads[name].grad
        assert torch.allclose(g, r, rtol=1e-4, atol=1e-6 * float(r.abs().max())), name


def test_a_layer_that_reads_itself_through_the_outer_graph_is_cut_there():
    """A segment must not read a value the outer graph made from it (there a collective sits
    between two halves of a layer): the layer is cut there into two segments."""
    g = torch.fx.Graph()
    xs = [g.placeholder(f"w{i}") for i in range(2)]
    h = g.placeholder("h")
    for i, w in enumerate(xs):  # matrix products: an element-wise op only the outer graph reads stays outside
        a = g.call_function(torch.ops.aten.mm.default, (h, w))
        a.meta["custom"] = {"layer": i}
        out = g.call_function(torch.ops.aten.neg.default, (a,))  # outside the layer: no annotation
        out.meta["custom"] = {"module": "between"}
        b = g.call_function(torch.ops.aten.mm.default, (out, w))
        b.meta["custom"] = {"layer": i}
        h = b
    g.output((h,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    for n in gm.graph.nodes:
        n.meta["val"] = torch.empty(2, 2)
    new, kinds, calls, _ = wrap_layers(gm, _labels(gm, set()), _layer_dependent(gm, 2, set()))
    assert (kinds, calls) == (1, 4)  # each layer cut in two there: four calls of one product
    x = [torch.randn(2, 2) for _ in range(3)]
    assert torch.equal(new(*x)[0], gm(*x)[0])
    # The same operations in another precision share no subgraph: one kind per precision.
    for n in gm.graph.nodes:
        if n.meta.get("custom", {}).get("layer") == 1:
            n.meta["val"] = torch.empty(2, 2, dtype=torch.float64)
    assert wrap_layers(gm, _labels(gm, set()), _layer_dependent(gm, 2, set()))[1:3] == (2, 4)


def test_inductor_failing_on_the_layer_calls_compiles_the_layers_inline(monkeypatch):
    """Where Inductor cannot compile a graph's layer calls (a bug of its own: torch 2.11 on a GPU
    refused one), the same graph with every layer inline is compiled instead, said in the notes,
    and the step is the model's."""
    from autopar import backend

    real = backend.compile_graph

    def refuse_calls(gm, inductor):
        if any(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes):
            raise RuntimeError("Failed to run autotuning code block: name 'workspace_0' is not defined")
        return real(gm, inductor)

    monkeypatch.setattr(backend, "compile_graph", refuse_calls)
    torch.manual_seed(0)
    ref = zoo.build("hf-llama", num_hidden_layers=3)
    ids, tgt = batch(1)
    pm = autopar.compile(copy.deepcopy(ref), 1, example_inputs=(ids,), plan="mb=8", global_batch=8)
    notes = pm.info.notes["regions"]
    assert any(line.startswith("forward: compiled with every layer inline, Inductor failed") for line in notes), notes
    assert not any("segment" in n.meta for n in pm._step_runner.compiled.fw_graph.graph.nodes)
    loss, grads = _step(pm, ids, tgt)
    want = default_loss(ref(ids), tgt)
    want.backward()
    assert abs(loss - float(want)) <= 1e-5 * abs(float(want))
    for name, p in ref.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-6 * float(p.grad.abs().max())), name


def test_what_a_layer_hands_out_as_a_view_is_read_where_it_lies():
    """A layer whose outputs Inductor would return as views (a transposed input; a copy of the
    second half of a split, which Inductor turns into a view at an offset into the call's own
    buffer) computes under regions what the flat graph computes: those views are made outside
    the call, from what it returns."""
    import torch.fx.traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar import backend

    def step(w0, w1, h):
        outs = []
        for i, w in enumerate((w0, w1)):
            with fx_traceback.annotate({"layer": i}):
                h = torch.mm(h, w).tanh()
                s = h.sum(0, keepdim=True).view(-1)
                outs += [s.split(s.shape[0] // 2)[1].clone(), w.t()]
        with fx_traceback.annotate({"module": "head"}):  # read by the outer graph's own kernels
            return [h, *(o * 2 for o in outs)]

    args = [torch.randn(16, 16), torch.randn(16, 16), torch.randn(8, 16)]
    with fx_traceback.preserve_node_meta():
        gm = make_fx(step, tracing_mode="fake")(*args)
    out = wrap_layers(gm, _labels(gm, set()), _layer_dependent(gm, 2, set()))
    assert out is not None and out[2] == 2, "both layers are calls of one subgraph"
    wrapped = out[0]
    sub = next(m for name, m in wrapped.named_children() if name.startswith("_layer_segment"))
    returned = next(n for n in sub.graph.nodes if n.op == "output").args[0]
    assert not any(n.op == "placeholder" or torch.ops.aten.clone.default == n.target for n in returned), \
        "no input and no copy of a view handed out by the call"
    want = step(*args)
    got = backend.compile_graph(wrapped, inductor=True)(list(args))
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.allclose(g, w, atol=1e-5), f"output {i}"
