"""Runs of identical layers replayed once in the distribute pass, the other layers' joint nodes
copied from it (``passes/stamp.py``): the joint graph is the one a replay of every layer makes,
node for node (operations, inputs, annotations, shapes, strides, dtypes, aliasing), for every
kind of plan it takes; layers that are not the same computation are never copied; the copied
step trains as the single-process model does, compiled by Inductor."""

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.passes import stamp
from tests import zoo
from tests.scripts import graph_check

FSDP4 = {"dp": 4, "fsdp": 1, "pp": 1}
TP2_FSDP2_SP = {"tp": 2, "sp": 1, "dp": 2, "fsdp": 1, "pp": 1}


# (model, world, plans, the layers copied): data parallelism of every kind, TP with SP and
# selective AC, context parallelism, routed experts under TP, a model whose first layer is
# another kind (DeepSeek-V2's dense MLP), local and global attention layers (Gemma 3: five
# local, then a global one, which ends the run).
CASES = [
    ("hf-llama-5layers", 1, [{"mb": 8}], "layers 2-4 copied from layer 1's replay"),
    ("hf-llama-5layers", 4, [FSDP4, {**FSDP4, "ac": "full"}, {"dp": 4, "fsdp": 0, "pp": 1},
                             {"dp": 4, "fsdp": 1, "dp_shard": 2, "pp": 1, "mb": 1, "once": "gather"},
                             {**TP2_FSDP2_SP, "ac": "selective"}, {"tp": 4, "sp": 0, "pp": 1},
                             {"cp": 2, "tp": 2, "sp": 1}],
     "layers 2-4 copied from layer 1's replay"),
    ("hf-mixtral-5layers", 4, [TP2_FSDP2_SP], "layers 2-4 copied from layer 1's replay"),
    ("hf-deepseek-v2-5layers", 4, [FSDP4], "layers 3-4 copied from layer 2's replay"),
    ("hf-gemma3-8layers", 4, [TP2_FSDP2_SP], "layers 2-4 copied from layer 1's replay"),
    ("hf-gpt2-5layers", 4, [TP2_FSDP2_SP], "layers 2-4 copied from layer 1's replay"),
    # Local and global attention layers in turn (Gemma 2; gpt-oss, whose experts are 3-D
    # parameters with biases): blocks of two layers.
    ("hf-gemma2-8layers", 4, [TP2_FSDP2_SP, {**FSDP4, "ac": "full"}], "layers 4-7 copied from layers 2-3's replay"),
    ("hf-gpt-oss-8layers", 4, [TP2_FSDP2_SP], "layers 4-7 copied from layers 2-3's replay"),
]


@pytest.mark.parametrize("kind,world,plans,copied", CASES, ids=[c[0] + f"-w{c[1]}" for c in CASES])
def test_copied_layers_make_the_graph_every_layer_replayed_makes(kind, world, plans, copied):
    for o in graph_check.run("AUTOPAR_STAMP", kind, world, plans):
        assert o["copied"] == [copied], o


class _Block(nn.Module):
    def __init__(self, dim: int, scale: float = 1.0):
        super().__init__()
        self.norm, self.lin, self.scale = nn.LayerNorm(dim), nn.Linear(dim, dim), scale
        self.register_buffer("shift", torch.linspace(0, 1, dim))  # a buffer of each block's own

    def forward(self, x):
        return x + self.scale * torch.tanh(self.lin(self.norm(x)) + self.shift)


class _Stack(nn.Module):
    """Six blocks; ``odd``: block 3 scales by another constant (the same parameters, another
    computation); ``tied``: every block the same module (ALBERT's shared weights); ``every``:
    the head reads every block's output (as a model that returns all hidden states)."""

    def __init__(self, odd: bool = False, tied: bool = False, every: bool = False):
        super().__init__()
        dim = 16
        self.emb = nn.Embedding(64, dim)
        one = _Block(dim)
        self.blocks = nn.ModuleList([one if tied else _Block(dim, 0.5 if odd and i == 3 else 1.0) for i in range(6)])
        self.head, self.every = nn.Linear(dim, 64), every

    def forward(self, ids):
        x, outs = self.emb(ids), []
        for b in self.blocks:
            x = b(x)
            outs.append(x)
        return self.head(sum(outs) if self.every else x)


def _runs(model) -> list:
    from autopar import capture

    ids = torch.randint(0, 64, (2, 8))
    sg = capture.trace_step(model, (ids,), target=ids, name="stack")
    return [(r.first, r.template, r.copies) for r in stamp.find_runs(sg.gm, sg.n_params)]


def test_only_layers_that_are_the_same_computation_are_copied():
    torch.manual_seed(0)
    assert _runs(_Stack()) == [(0, 1, [2, 3, 4, 5])]
    # block 3 differs: the run stops before it (blocks 4 and 5 alike, after another kind: too few)
    assert _runs(_Stack(odd=True)) == [(0, 1, [2])]
    assert _runs(_Stack(tied=True)) == []  # one weight's gradient sums over every block
    assert _runs(_Stack(every=True)) == []  # what a block makes is read after the next one


def _trains_as_eager(model: nn.Module, ids: torch.Tensor) -> list:
    """``model`` compiled with default options (and the stamped joint checked against the full
    replay): its first step's loss and gradients as the eager model's. The distribute notes."""
    import copy

    from autopar.capture import default_loss

    ref = copy.deepcopy(model)
    pm = autopar.compile(model, 1, example_inputs=(ids,), example_target=ids, plan={"mb": ids.shape[0]})
    loss = pm.step(ids, target=ids)
    ref_loss = default_loss(ref(ids), ids)
    ref_loss.backward()
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    grads = {n: p.grad for n, p in pm.named_parameters() if p.grad is not None}
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert grads.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    return pm.info.notes.get("distribute")


def test_copied_blocks_with_buffers_and_a_frozen_layer(monkeypatch):
    """Blocks with buffers of their own, copied (the joint checked against the full replay);
    a block whose weights do not train ends the run before it; both train as the eager model does."""
    monkeypatch.setenv("AUTOPAR_STAMP", "check")
    monkeypatch.setenv("AUTOPAR_QUIET", "1")
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (4, 8))
    assert _trains_as_eager(_Stack(), ids) == ["layers 2-5 copied from layer 1's replay"]
    model = _Stack()
    model.blocks[4].requires_grad_(False)
    assert _trains_as_eager(model, ids) == ["layers 2-3 copied from layer 1's replay"]


def test_copied_layers_train_as_the_single_process_model(monkeypatch):
    """Default options (Inductor): HF Llama, 5 layers, one process: losses and every gradient as
    the model's own eager step, and the layers were copied."""
    monkeypatch.setenv("AUTOPAR_QUIET", "1")
    torch.manual_seed(0)
    model = zoo.build("hf-llama-5layers")
    ref = zoo.build("hf-llama-5layers")
    ref.load_state_dict(model.state_dict())
    (ids,), tgt = zoo.example("hf-llama", 0, B=4, S=16)
    pm = autopar.compile(model, 1, example_inputs=(ids,), example_target=tgt, plan={"mb": 4})
    assert pm.info.notes["distribute"] == ["layers 2-4 copied from layer 1's replay"]
    loss = pm.step(ids, target=tgt)
    from autopar.capture import default_loss

    ref_loss = default_loss(ref(ids), tgt)
    ref_loss.backward()
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    grads = {n: p.grad for n, p in pm.named_parameters() if p.grad is not None}
    assert len(grads) == len(list(ref.parameters()))
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_size_arithmetic_is_no_write_but_a_call_on_a_tensor_may_be():
    """``fxops.mutates``: a non-ATen call reading only sizes (expert parallelism's sum of split
    sizes) leaves the graph functional, so no second trace; one reading a tensor may write it."""
    import operator

    from autopar.fxops import mutates

    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4)
    n = g.call_function(torch.ops.aten.sym_size.int, (x, 0))
    n.meta["val"] = 4
    total = g.call_function(operator.add, (n, n))
    total.meta["val"] = 8
    g.output(total)
    assert not mutates(torch.fx.GraphModule({}, g))
    g.call_function(print, (x,)).meta["val"] = None
    assert mutates(torch.fx.GraphModule({}, g))
