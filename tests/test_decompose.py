"""Inductor's decompositions applied node by node (``backend.decomposed``): each graph Inductor
compiles is, node for node (operation, shape, strides, dtype; layer subgraphs and constants
included), the graph a retrace of the whole graph through the same decompositions makes, for
each kind of plan (data parallel with mixed precision, TP with SP, pipeline stages, experts,
context parallelism) and model family (an image model's convolution among them). Run on a fake
process group (nothing runs), with default options (Inductor compiles each graph)."""

import pytest
import torch

from autopar import backend
from tests.scripts import graph_check

TP2_FSDP2_SP = {"tp": 2, "sp": 1, "dp": 2, "fsdp": 1, "pp": 1}
CASES = [
    ("hf-llama-5layers", 1, [{"mb": 8}]),
    ("hf-llama", 4, [{"dp": 4, "fsdp": 1, "pp": 1, "mp": "bf16-mixed"}, {**TP2_FSDP2_SP, "ac": "selective"}]),
    ("hf-llama-4layers", 4, [{"pp": 2, "dp": 2, "fsdp": 1, "tp": 1, "schedule": "zbv", "v": 2, "mb": 1}]),
    ("hf-mixtral", 4, [{"ep": 2, "tp": 2, "dp": 2, "fsdp": 1}]),
    ("hf-gpt2", 4, [{"cp": 2, "dp": 2, "fsdp": 1, "pp": 1}, TP2_FSDP2_SP]),
    ("hf-deit", 1, [{"mb": 8}]),  # a convolution, whose backward makes no input gradient
]


@pytest.mark.parametrize("kind,world,plans", CASES, ids=[c[0] + f"-w{c[1]}" for c in CASES])
def test_decomposed_graph_is_the_retrace(kind, world, plans):
    graph_check.run("AUTOPAR_DECOMPOSE", kind, world, plans)


def test_check_finds_a_graph_that_differs(monkeypatch):
    """The check fails where the node-by-node rewrite would differ from the retrace (here: an
    operation with a decomposition left as it is)."""
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        return torch.nn.functional.log_softmax(torch.addmm(w[0], x, w), dim=-1).sum()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 4), torch.randn(4, 4))
    vals = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    mode, table = detect_fake_mode(vals), select_decomp_table()
    assert any(backend._Decomposer(table).decomposes(n) for n in gm.graph.nodes)
    monkeypatch.setenv("AUTOPAR_DECOMPOSE", "check")
    with mode, torch._guards.tracing(torch._guards.TracingContext(mode)):
        out = backend.decomposed(gm, vals, table)  # the rewrite agrees with the retrace
        assert backend._described(out) != backend._described(gm)  # something was decomposed
        monkeypatch.setattr(backend._Decomposer, "decomposes", lambda self, n: False)
        with pytest.raises(AssertionError, match="differs from the retrace"):
            backend.decomposed(gm, vals, table)
