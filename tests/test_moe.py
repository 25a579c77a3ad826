"""Mixture-of-experts blocks that route tokens with ``nonzero`` (transformers' Mixtral, Qwen2-MoE):
traced in a fixed-shape form that computes the same thing, priced at their active FLOPs, checked on
the model's own weights before training, and refused where routing differs (parity runs in
tests/test_parity.py)."""

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar import api, traceable
from autopar.analysis import KIND_MATMUL
from autopar.cost_models.step import (
    EP_WEIGHTS,
    EP_WEIGHTS_SHARDS,
    Config,
    StageModel,
    uniform_assignment,
)
from autopar.errors import AutoparError, TraceError
from tests import zoo


def _qwen2_moe(top_k: int) -> nn.Module:
    import transformers as tf

    cfg = tf.Qwen2MoeConfig(vocab_size=256, max_position_embeddings=64, use_cache=False, hidden_size=64,
                            intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                            moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                            num_experts_per_tok=top_k, norm_topk_prob=False)
    cfg._attn_implementation = "sdpa"
    return zoo.module_experts(tf.Qwen2MoeForCausalLM(cfg))  # experts as modules on transformers 5 too


def _matmul_flops(model: nn.Module) -> float:
    prof = api.profile_model(model, seq_len=32).profile
    b = prof.blocks[-1]  # the routed-expert layers (DeepSeek's first layers are dense: a block kind of their own)
    return float(b.costs.flops[b.costs.kind == KIND_MATMUL].sum())


def test_experts_priced_at_active_flops_and_all_parameters():
    torch.manual_seed(0)
    two, four = _qwen2_moe(2), _qwen2_moe(4)
    # Two more experts per token: 3 matmuls of 64 x 32 each, forward (2 FLOPs per MAC), 32 tokens.
    per_expert = 2 * 3 * 64 * 32 * 32
    assert _matmul_flops(four) - _matmul_flops(two) == pytest.approx(2 * per_expert, rel=1e-6)
    prof = api.profile_model(two, seq_len=32).profile
    assert prof.n_params == sum(p.numel() for p in two.parameters())


@pytest.mark.parametrize("kind", ["hf-qwen2-moe", "hf-qwen3-moe", "hf-mixtral"])
def test_fixed_shape_form_matches_the_block(kind):
    torch.manual_seed(0)
    model = zoo.build(kind)
    blocks = traceable.check_routed_experts(model)
    assert len(blocks) == 2 and all(b.top_k == 2 and b.n_experts == 4 for b in blocks)
    x = torch.randn(2, 16, 64, requires_grad=True)
    m = blocks[0].module
    own, _ = m(x)
    mine, _ = traceable.routed_experts_forward(blocks[0], x)
    torch.testing.assert_close(mine, own, rtol=1e-6, atol=1e-7)
    g_own = torch.autograd.grad(own.square().sum(), [x, m.gate.weight])
    g_mine = torch.autograd.grad(mine.square().sum(), [x, m.gate.weight])
    for a, b in zip(g_mine, g_own):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_gate_module_routing_is_run_as_it_is():
    """DeepSeek-V2's block routes with a gate module of its own (softmax top-k, scaled, no
    renormalisation) and sorts tokens by expert in a data-dependent loop; the fixed-shape form runs
    that gate as it is and returns the block's output alone, as the block does."""
    torch.manual_seed(0)
    model = zoo.build("hf-deepseek-v2")
    blocks = traceable.check_routed_experts(model)
    assert len(blocks) == 2 and all(b.gate_module and b.top_k == 2 and b.n_experts == 4 for b in blocks)
    m = blocks[0].module
    m.gate.routed_scaling_factor = 1.5  # the gate's own scaling is kept, whatever it is
    x = torch.randn(2, 16, 64, requires_grad=True)
    own, mine = m(x), traceable.routed_experts_forward(blocks[0], x)
    torch.testing.assert_close(mine, own, rtol=1e-6, atol=1e-7)
    g_own = torch.autograd.grad(own.square().sum(), [x, m.gate.weight])
    g_mine = torch.autograd.grad(mine.square().sum(), [x, m.gate.weight])
    for a, b in zip(g_mine, g_own):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # Planned (its data-dependent loop would stop a trace) and priced at the active share: two
    # more experts per token are 3 matmuls of 64 x 32 more each, forward, 32 tokens.
    four = zoo.build("hf-deepseek-v2", num_experts_per_tok=4)
    assert _matmul_flops(four) - _matmul_flops(model) == pytest.approx(2 * 2 * 3 * 64 * 32 * 32, rel=1e-6)
    prof = api.profile_model(model, seq_len=32).profile
    assert prof.n_params == sum(p.numel() for p in model.parameters())


class SigmoidRouted(nn.Module):
    """Looks like a routed-experts block, but scores experts with a sigmoid (as DeepSeek-V3 does)."""

    def __init__(self, dim=16, n=4, k=2):
        super().__init__()
        self.top_k = k
        self.gate = nn.Linear(dim, n, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))

    def forward(self, x):
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        logits = self.gate(flat)
        w, sel = torch.topk(torch.sigmoid(logits), self.top_k, dim=-1)
        dense = torch.zeros_like(logits).scatter(1, sel, w)
        out = sum(e(flat) * dense[:, i:i + 1] for i, e in enumerate(self.experts))
        return out.reshape(b, s, h), logits


def test_other_routing_is_refused_not_trained():
    model = nn.Sequential(SigmoidRouted())
    with pytest.raises(AutoparError, match=r"mixture-of-experts block 0 \(SigmoidRouted\) does not compute"):
        traceable.check_routed_experts(model)


@pytest.mark.parametrize("kind", ["hf-mixtral", "custom-mixtral-3d"])
def test_router_jitter_is_refused_with_the_setting(kind):
    """Experts as modules or in 3-D parameters (transformers 5's form, whose block multiplies its
    input by the noise before its router): each rank would draw its own noise."""
    with pytest.raises(TraceError, match="router_jitter_noise=0"):
        api.profile_model(zoo.build(kind, router_jitter_noise=0.1), seq_len=32)


def test_narrower_value_heads_priced_as_the_fused_kernel():
    """Multi-head latent attention (DeepSeek) has value heads narrower than its query/key heads;
    where this CPU would take the unfused path (an explicit mask), the planner's trace calls the
    fused kernel with the values padded in and the output sliced back: same values and shape."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 16, 12), torch.randn(1, 4, 16, 12)
    v = torch.randn(1, 4, 16, 8)
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    got = traceable._fused_attention(q, k, v, mask)
    assert got is not None and got.shape == (1, 4, 16, 8)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_grouped_mm_applies_each_expert_to_its_rows_only():
    """``grouped_mm``: rows of expert e times its weight, an expert with no rows skipped; its
    gradients are the per-expert matmuls' (no row reaches another expert's weight), and it
    compiles with Inductor to the same values."""
    from autopar.grouped_mm import grouped_mm

    torch.manual_seed(0)
    counts = [3, 0, 5, 2]
    x = torch.randn(sum(counts), 6, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(4, 6, dtype=torch.float64, requires_grad=True) for _ in counts]
    offs = torch.tensor(counts).cumsum(0)
    bounds = [0, *offs.tolist()]
    want = torch.cat([x[bounds[e]:bounds[e + 1]] @ w.t() for e, w in enumerate(ws)])
    got = grouped_mm(x, ws, offs)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, [x, *ws], g), torch.autograd.grad(want, [x, *ws], g)):
        torch.testing.assert_close(a, b)
    compiled = torch.compile(lambda x, ws, offs: grouped_mm(x, ws, offs).relu())
    torch.testing.assert_close(compiled(x, ws, offs), want.relu())


def _step_graph(model: nn.Module):
    from autopar import capture

    ids = torch.randint(0, 100, (2, 16))
    return capture.trace_step(model, (ids,), target=ids)


def test_experts_run_on_their_tokens_only_one_grouped_linear_each():
    """The traced step applies each expert linear as one grouped matmul over tokens x top_k rows
    (not every expert on every token), and the one role finder gives each grouped linear one TP
    role for every expert's weight: gate and up projections split by output features, the down
    projection by input features, the tokens gathered once before they are sorted by expert."""
    from autopar import roles
    from autopar.grouped_mm import GROUPED_MM
    from autopar.passes.tp import placement_str, tp_rules

    torch.manual_seed(0)
    model = _qwen2_moe(2)
    sg = _step_graph(model)
    grouped = list(sg.gm.graph.find_nodes(op="call_function", target=GROUPED_MM))
    assert len(grouped) == 3 * 2  # three linears per expert, two layers
    assert all(n.meta["val"].shape[0] == 2 * 16 * 2 for n in grouped)  # tokens x top_k rows
    phs = sg.placeholders()
    expert_params = {phs[i] for i, name in enumerate(sg.param_names) if ".experts." in name}
    assert not [n for n in sg.gm.graph.nodes if n.op == "call_function" and n.target in (
        torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and any(a in expert_params for a in n.all_input_nodes)]
    found = roles.step_roles(sg)
    by_name = {sg.param_names[lin.weight].rsplit(".", 2)[-2]: lin for lin in found.linears if lin.group}
    assert {k: v.role for k, v in by_name.items()} == {"gate_proj": "column", "up_proj": "column", "down_proj": "row"}
    assert all(len(lin.group) == 4 for lin in by_name.values())
    # The shared and the routed experts' partial sums meet before the residual stream and are
    # reduced once there, over the tokens: priced per layer as attention's reduce and that one.
    rows = {sg.param_names[lin.weight]: lin.node for lin in found.linears if lin.role == "row"}
    ends = {name.split(".mlp.")[-1].removeprefix("block.").split(".")[0]: found.reduce_at[n]  # zoo.FirstOutput's
            for name, n in rows.items() if ".mlp." in name}
    assert set(ends) == {"shared_expert", "experts"} and len({ends["shared_expert"], ends["experts"]}) == 1
    prof = api.profile_model(model, seq_len=16).profile
    assert [b.rows for b in prof.blocks] == [1 + 1]
    rules = tp_rules(sg, found, 2, True, True)
    want = {"gate_proj": "S(0)", "up_proj": "S(0)", "down_proj": "S(1)"}
    for i, name in enumerate(sg.param_names):
        if ".experts." in name:
            assert placement_str(rules.placements[i]) == want[name.rsplit(".", 2)[-2]], name
    sorted_rows = [n for n in sg.gm.graph.nodes if n.target == torch.ops.aten.index.Tensor and
                   any(u.target == GROUPED_MM for u in n.users)]
    assert sorted_rows and all(any(n in readers for readers in rules.gathered.values()) for n in sorted_rows)


class ScaledExpert(nn.Module):
    """An expert with a parameter outside its linears (a learned output scale)."""

    def __init__(self, dim=16):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False)
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) * self.scale


class ScaledMoE(nn.Module):
    def __init__(self, dim=16, n=4, k=2):
        super().__init__()
        self.top_k, self.norm_topk_prob = k, True
        self.gate = nn.Linear(dim, n, bias=False)
        self.experts = nn.ModuleList(ScaledExpert(dim) for _ in range(n))

    def forward(self, x):  # the block's own routed loop, as transformers writes it
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        logits = self.gate(flat)
        w, sel = torch.topk(torch.softmax(logits, dim=1, dtype=torch.float), self.top_k, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e in range(len(self.experts)):
            tok, slot = torch.where(sel == e)
            out.index_add_(0, tok, self.experts[e](flat[tok]) * w[tok, slot, None])
        return out.reshape(b, s, h), logits


def test_experts_with_other_parameters_run_dense_and_are_priced_so():
    """Experts the grouped form cannot apply (a parameter outside their linears) run every expert
    on every token, checked against the block's own routing, and are priced at that cost: two
    more experts per token cost no more FLOPs."""
    torch.manual_seed(0)
    model = nn.Sequential(ScaledMoE())
    (r,) = traceable.check_routed_experts(model)
    assert r.linears is None
    x = torch.randn(2, 8, 16)
    torch.testing.assert_close(traceable.routed_experts_forward(r, x)[0], model[0](x)[0], rtol=1e-6, atol=1e-7)

    def expert_flops(k: int) -> int:
        from autopar.analysis import _node_costs

        m = ScaledMoE(k=k)
        with traceable._RoutedForm(m):
            gm = torch.fx.experimental.proxy_tensor.make_fx(lambda t: m(t)[0])(x)
        return sum(c[0] for c in _node_costs(gm, set()).values())

    assert expert_flops(4) == expert_flops(2)


@pytest.mark.parametrize("sp,model", [(0, "hf-mixtral"), (1, "hf-mixtral"), (1, "custom-mixtral-3d")])
def test_tp_collectives_are_the_priced_ones_over_tokens_not_their_rows(sp, model):
    """Under TP (with and without SP) a routed experts' block moves what a dense MLP moves, as
    the plan prices it: the tokens gathered once at the block's input (router and experts read
    them), the experts' partial sums kept through their weighting and combine and reduced once
    over the tokens where they rejoin the residual stream, never over the tokens x top_k rows;
    in the backward the mirror images. Besides, only the routing weights' gradients (tokens x
    top_k values) are all-reduced where they are made. Experts held as 3-D parameters (combined
    by the model's own index_add of each row onto its token) move the same."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, os.path.join(here, "scripts", "tp_collectives.py"), str(sp), model],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.path.dirname(here)})
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    msg = 4 * 2 * 16 * d["hidden"]  # fp32 bytes of the step's tokens x hidden (2 sequences of 16)
    full = {"all_gather_into_tensor": ("all_gather", msg), "reduce_scatter_tensor": ("reduce_scatter", msg // 2),
            "all_reduce": ("all_reduce", msg)}  # a reduce-scatter is recorded by its output (1/tp)
    executed, small = {}, []
    for key, count in d["got"].items():
        graph, kind, nbytes = key.rsplit(":", 2)
        if full[kind][1] == int(nbytes):
            executed[full[kind][0]] = executed.get(full[kind][0], 0) + count
        else:
            assert int(nbytes) < msg // 2, key  # nothing of tokens x top_k rows, nothing else of tokens x hidden
            small += [(graph, kind, int(nbytes))] * count
    assert executed == {k.split(":")[0]: v for k, v in d["plan"].items() if int(float(k.split(":")[1])) == msg}
    assert executed == ({"all_gather": 5 * 2, "reduce_scatter": 5 * 2} if sp else {"all_reduce": 5 * 2})
    # Besides: the loss's three per-token all-reduces (loss parallelism); each layer's routing weights'
    # gradient (tokens x top_k fp32 values); under SP also the five norms' weight gradients
    # (hidden fp32 values, the same 256 bytes here).
    per_token, top_k_values = 4 * 2 * 16, 4 * 2 * 16 * d["top_k"]
    assert d["hidden"] * 4 == top_k_values
    assert {kind for _, kind, _ in small} == {"all_reduce"}, small
    assert sum(b for g, _, b in small if g == "forward") == 3 * per_token, small
    assert sum(b for g, _, b in small if g == "backward") == (2 + 5 * sp) * top_k_values, small


def test_latent_attention_gathers_its_latent_as_priced():
    """DeepSeek-V2 under TP 2 + SP: each layer's key/value projection reads the compressed latent
    (16 features here), which the executor gathers at its own width, not the hidden width; the
    plan prices that gather (forward) and its reduce-scatter (backward), one per layer."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, os.path.join(here, "scripts", "tp_collectives.py"), "1", "hf-deepseek-v2"],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.path.dirname(here)})
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    latent = 4 * 2 * 16 * d["latent"]  # fp32 bytes of the step's tokens x latent features
    layers = 3
    assert d["got"][f"forward:all_gather_into_tensor:{latent}"] == layers == d["plan"][f"all_gather:{latent}"]
    # a reduce-scatter is recorded by its output (1/tp)
    assert d["got"][f"backward:reduce_scatter_tensor:{latent // 2}"] == layers == d["plan"][f"reduce_scatter:{latent}"]


@pytest.mark.parametrize("reshard,tp,ep", [(0, 1, 4), (1, 1, 4), (1, 2, 2), (1, 1, 2)])
def test_ep_collectives_are_the_priced_ones(reshard, tp, ep):
    """Under expert parallelism (ep 4 over FSDP 4; ep 2 over FSDP 2 x TP 2; ep 2 over FSDP 4) a
    routed experts' block moves what the plan prices, per layer: the experts' row counts, each
    token's top_k rows to their experts' ranks and the outputs back (sized by the routing:
    recorded without bytes; every TP rank moves its tokens' rows), their gradients back in the
    backward; each rank receives only its own experts' weights (their TP shards: one all-to-all
    per grouped linear of 1/ep of those bytes, again in the backward after reshard, and their
    gradients back; over FSDP 4 with ep 2, half of them from its ep group and the rest gathered
    over the 2 ranks at its place in the other, their gradients reduced over those), and FSDP
    gathers and reduces only the other parameters."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    pins = f"ep={ep},dp={4 // tp},tp={tp},sp=0,fsdp=1,mb=2,ac=none,reshard={reshard},once=microbatch"
    r = subprocess.run([sys.executable, os.path.join(here, "scripts", "ep_collectives.py"), pins],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.path.dirname(here)})
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    got, plan, L = d["got"], d["plan"], d["layers"]

    def executed(kind, nbytes=None, graph=None, by=None):
        return sum(v for k, v in got.items() if k.split(":")[1] == kind and (graph is None or k.split(":")[0] == graph)
                   and (nbytes is None or k.split(":")[3] == str(nbytes)) and (by is None or k.split(":")[2] == by))

    def priced(kind, group):
        return {int(k.split(":")[2]): v for k, v in plan.items() if k.split(":")[:2] == [group, kind]}

    a2a = priced("all_to_all", "ep")
    counts, rows = 8 * d["experts"], 4 * 2 * 16 * d["top_k"] * d["hidden"]  # int64 counts; fp32 rows of 2 x 16 tokens
    weights = {b: n for b, n in a2a.items() if b not in (counts, rows)}
    assert a2a[counts] == executed("all_to_all_single", counts) == L
    assert a2a[rows] == executed("all_to_all_single", "None") == 4 * L  # dispatch + combine, forward and backward
    assert executed("all_to_all_single", "None", "forward") == 2 * L
    (wbytes, wcount), = weights.items()
    assert executed("all_to_all_single", wbytes) == wcount == 3 * L * (2 + reshard)  # gate, up, down
    k = 4 // tp // ep  # the ranks beyond the ep group that an expert's FSDP shards are spread over
    if k > 1:
        (whole, n), = priced("all_gather", "dp_shard / ep").items()
        assert whole == k * wbytes and executed("all_gather_into_tensor", whole, by="ep") == n == 3 * L * (1 + reshard)
        (whole, n), = priced("reduce_scatter", "dp_shard / ep").items()
        assert executed("reduce_scatter_tensor", whole // k) == n == 3 * L  # recorded by its output
    else:
        assert not priced("all_gather", "dp_shard / ep")
    # FSDP: the gathers and reductions of the other parameters only, as priced per layer.
    if tp > 1:  # the TP collectives of the other linears are another test's
        return
    (layer_bytes, gathers), = priced("all_gather", "dp_shard").items()
    assert executed("all_gather_into_tensor", layer_bytes) == gathers == L * (1 + reshard)


@pytest.mark.parametrize("ep", [2, 4])
def test_every_expert_all_to_all_is_recorded_under_ep(ep):
    """Experts in 3-D parameters, ep 2 over FSDP 4 (each rank gathers its own experts' other piece)
    and ep 4 over FSDP 4 (the ep group is all of dp_shard, FSDP's group): the backward's all-to-alls
    of the rows, which carry no annotation of their own, are recorded (``pm.info.collectives``,
    what ``explain`` lists) as expert parallelism's, not by their group's mesh dim."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    pins = f"ep={ep},dp=4,tp=1,sp=0,fsdp=1,mb=2,ac=none,reshard=1,once=microbatch"
    r = subprocess.run([sys.executable, os.path.join(here, "scripts", "ep_collectives.py"), pins, "custom-mixtral-3d"],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.path.dirname(here)})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])["got"]
    assert not [k for k in got if k.split(":")[2] == "?"], got
    a2a = {k.split(":")[0]: v for k, v in got.items() if k.split(":")[1:4] == ["all_to_all_single", "ep", "None"]}
    assert a2a == {"forward": 4, "backward": 4}, got


@pytest.mark.parametrize("kind", ["custom-mixtral-3d", "hf-gpt-oss"])
def test_ep_of_experts_in_3d_parameters_moves_what_is_priced(kind):
    """Experts held as 3-D parameters under expert parallelism (ep 4 over FSDP 4, reshard after
    forward): each rank runs its own experts on the rows routed to them (the row counts and the
    rows' all-to-alls as priced; gpt-oss's biased experts also each row's expert index, one
    integer all-to-all per layer in the forward, as priced). FSDP splits the 3-D weights along the
    experts, so each rank's shard is its own experts' weights: it gathers and reduces only the
    layer's other parameters (as priced), again in the backward, and nothing moves the experts'
    weights."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    pins = "ep=4,dp=4,tp=1,sp=0,fsdp=1,mb=2,ac=none,reshard=1,once=microbatch"
    r = subprocess.run([sys.executable, os.path.join(here, "scripts", "ep_collectives.py"), pins, kind],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.path.dirname(here)})
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    got, plan, L = d["got"], d["plan"], d["layers"]

    def executed(kind, nbytes, graph=None, dtype=None):
        return sum(v for k, v in got.items() if k.split(":")[1] == kind and k.split(":")[3] == str(nbytes)
                   and (graph is None or k.split(":")[0] == graph) and (dtype is None or k.split(":")[4] == dtype))

    counts, rows = 8 * d["experts"], 4 * 2 * 16 * d["top_k"] * d["hidden"]
    biased = kind == "hf-gpt-oss"
    indices = {8 * 2 * 16 * d["top_k"]: L} if biased else {}
    assert {int(k.split(":")[2]): v for k, v in plan.items() if k.startswith("ep:")} == {counts: L, rows: 4 * L, **indices}
    assert executed("all_to_all_single", counts) == L
    assert executed("all_to_all_single", "None", dtype="float32") == 4 * L
    assert executed("all_to_all_single", "None", "forward", "int64") == (L if biased else 0)
    assert executed("all_to_all_single", "None", "backward", "int64") == 0
    (layer_bytes, gathers), = [(int(k.split(":")[2]), v) for k, v in plan.items() if k.startswith("dp_shard:all_gather")]
    assert layer_bytes == d["layer_bytes"] - d["bytes_3d"] and d["bytes_3d"] > layer_bytes / 2
    assert executed("all_gather_into_tensor", layer_bytes, "forward") == L == gathers - L
    # The backward regathers the layer but the values its gradients do not read (gpt-oss's
    # biases and sinks: 3.4% of those bytes), a little less than priced.
    again = [int(k.split(":")[3]) for k, v in got.items() for _ in range(v) if k.startswith("backward:all_gather")
             and k.split(":")[3] != "None" and 0.95 * layer_bytes <= int(k.split(":")[3]) <= layer_bytes]
    assert len(again) == L and (biased or set(again) == {layer_bytes})


def test_ep_imbalance_prices_the_busiest_rank():
    """``ep_imbalance`` (``--ep-imbalance``): the busiest ep rank's expert matmuls and routed rows
    at that multiple of the even share, the rest of the layer as it was; said in the plan."""
    from autopar import api

    m = zoo.build("hf-mixtral")
    xs, _ = zoo.example("hf-mixtral", 1, B=8, S=32)
    prof = api.profile_model(m, example_inputs=xs)

    def price(imbalance):
        return api.estimate_plan(m, 4, "ep=4,dp=4,fsdp=1,mb=2", hardware="h100", global_batch=8, profiled=prof,
                                 ep_imbalance=imbalance)

    (even, e1, _), (skew, e2, _) = price(1.0), price(2.0)
    extra = e2.breakdown["compute"] - e1.breakdown["compute"]
    assert 0 < extra < 0.5 * e1.breakdown["compute"]  # the experts' share, not the whole layer
    rows = [{c["why"]: c["bytes"] for c in p.collectives if c["group"] == "ep"} for p in (even, skew)]
    routed = next(k for k in rows[0] if "routed rows" in k)
    assert rows[1][routed] == 2 * rows[0][routed]
    assert not even.notes and "2x the mean rows" in skew.notes[0]
    with pytest.raises(AutoparError, match="at least 1"):
        price(0.5)


def test_ep_overlap_hides_the_all_to_alls_behind_the_layer_compute():
    """``ep_overlap=1`` (``autopar estimate`` only: DeepSeek's DualPipe runs a forward and a
    backward chunk together): the expert all-to-alls count only where they outlast the layer's
    computation, per layer and microbatch; the planner and ``autopar.compile`` refuse it, as
    autopar's executor runs them exposed."""
    from autopar import api

    m = zoo.build("hf-mixtral")
    xs, _ = zoo.example("hf-mixtral", 1, B=8, S=32)
    prof = api.profile_model(m, example_inputs=xs)

    def layer_parts(overlap, hardware):
        ctx = api.make_context(prof.profile, world=4, hardware=hardware, global_batch=8, precision="bf16")
        cfg = Config(dp=4, dp_shard=4, fsdp=True, mb=2, ep=4, ep_overlap=overlap)
        return StageModel(ctx, cfg).coeffs.parts

    hid = []
    for hardware in ("h100", "cpu-gloo"):
        exposed, hidden = layer_parts(False, hardware), layer_parts(True, hardware)
        for ac in ("none", "full"):
            e, h = exposed[ac], hidden[ac]
            assert e["ep_comm"] > 0 and {k: v for k, v in e.items() if k != "ep_comm"} == \
                {k: v for k, v in h.items() if k != "ep_comm"}
            assert h["ep_comm"] == pytest.approx(max(0.0, e["ep_comm"] - e["compute"] - e["recompute"]))
        hid.append(hidden["none"]["ep_comm"] == 0.0)
    assert hid == [False, True]  # on h100 they outlast the tiny layer's matmuls; on this CPU they do not
    priced, _, _ = api.estimate_plan(m, 4, "ep=4,dp=4,fsdp=1,mb=2,ep_overlap=1", global_batch=8, profiled=prof)
    assert any("ep_overlap=True" in n and "executor does not" in n for n in priced.notes), priced.notes
    with pytest.raises(AutoparError, match="add ep=N"):
        api.estimate_plan(m, 4, "dp=4,fsdp=1,ep_overlap=1", global_batch=8, profiled=prof)
    with pytest.raises(AutoparError, match="ep_overlap=True is priced by `autopar estimate` only"):
        api.plan(m, 4, pin="ep=4,ep_overlap=1", global_batch=8, profiled=prof)


def test_node_limited_fp8_dispatch_is_priced_as_a_published_run_sent_it():
    """``ep_nodes=N`` and ``ep_fp8=1`` (``autopar estimate`` only: DeepSeek-V3's node-limited
    routing and FP8 dispatch): with an ep group over 2 nodes, each token crosses the network once
    per node its experts are on (here at most 1 of Mixtral's top 2) instead of once per expert,
    is fanned out to its experts inside the node, and its forward dispatch moves 1 byte a value;
    the combine and the backward stay in the compute dtype. The planner refuses both."""
    from autopar import api

    m = zoo.build("hf-mixtral")
    xs, _ = zoo.example("hf-mixtral", 1, B=16, S=32)
    prof = api.profile_model(m, example_inputs=xs)
    ctx = api.make_context(prof.profile, world=16, hardware="h100", global_batch=16, precision="bf16")
    base = Config(tp=4, dp=4, dp_shard=4, fsdp=True, mb=2, ep=4)  # ep ranks 4 apart: 2 a node

    def priced(**kw):
        sm = StageModel(ctx, dataclasses.replace(base, **kw))
        rows = {(c["group"], c["group_size"], c["bytes"]) for c in sm.collectives(uniform_assignment(sm, "none"))
                if c["group"].startswith("ep") and "row count" not in c["why"] and c["why"] not in (EP_WEIGHTS, EP_WEIGHTS_SHARDS)}
        return rows, sm.coeffs.parts["none"]["ep_comm"]

    (plain, plain_t), (limited, limited_t) = priced(), priced(ep_nodes=1, ep_fp8=True)
    assert len(plain) == 1
    (_, size, row_bytes), = plain
    n_experts, top_k = next(b.experts for b in prof.profile.blocks if b.experts)
    assert (size, top_k) == (4, 2)
    token = row_bytes / top_k  # a token's hidden state in bf16
    assert limited == {("ep, one rank a node", 2, token / 2), ("ep, one rank a node", 2, token),
                       ("ep within a node", 2, row_bytes / 2), ("ep within a node", 2, row_bytes)}
    assert 0 < limited_t < plain_t
    est, _, _ = api.estimate_plan(m, 16, "tp=4,dp=4,fsdp=1,mb=2,ep=4,ep_nodes=1,ep_fp8=1", global_batch=16,
                                  profiled=prof)
    assert any("ep_nodes=1" in n for n in est.notes) and any("ep_fp8=True" in n for n in est.notes), est.notes
    with pytest.raises(AutoparError, match="add ep=N"):
        api.estimate_plan(m, 16, "tp=4,dp=4,fsdp=1,ep_nodes=4", global_batch=16, profiled=prof)
    with pytest.raises(AutoparError, match="ep_fp8=True is priced by `autopar estimate` only"):
        api.plan(m, 16, pin="ep=4,ep_fp8=1", global_batch=16, profiled=prof)


def test_ep_rank_reads_only_its_own_experts_weights():
    """Under ep the expert matmuls of a rank read its own experts' weights, 1/ep of the block's
    (a small batch's expert matmuls are bound by those reads): the layer's compute is cheaper by
    exactly the expert matmuls' reads that moved to the other ranks, the rest as it was."""
    import dataclasses

    from autopar import api
    from autopar.cost_models import hardware
    from autopar.cost_models.compute import node_times

    m = zoo.build("hf-mixtral")
    xs, _ = zoo.example("hf-mixtral", 1, B=8, S=32)
    prof = api.profile_model(m, example_inputs=xs)

    def compute(plan):
        return api.estimate_plan(m, 4, plan, hardware="h100", global_batch=8, profiled=prof)[1].breakdown["compute"]

    whole, own = compute("dp=4,fsdp=1,mb=2"), compute("ep=4,dp=4,fsdp=1,mb=2")
    hw = hardware.load("h100")
    layers = prof.profile.layer_sequence()
    saved = 0.0
    for b in layers:
        ex = b.costs.subset(b.costs.experts())
        assert len(ex.names) == 3  # gate, up and down
        quarter = dataclasses.replace(ex, weight_bytes=ex.weight_bytes / 4)
        t = [node_times(c, hw, mb=2, tp=1, sp=False, compute="fp32") for c in (ex, quarter)]
        saved += (t[0].fwd + t[0].bwd) - (t[1].fwd + t[1].bwd)
    assert saved > 0.1 * whole
    assert whole - own == pytest.approx(saved, rel=1e-6)  # one microbatch of 2 per rank


def test_ep_of_experts_with_biases_is_searched_and_priced():
    """Experts whose linears have biases (module experts here; gpt-oss's 3-D ones below) run
    under expert parallelism: each row's index into the bias table travels with the row. Pinned,
    the plan prices that integer all-to-all once per layer and microbatch (forward only) beside
    the rows'; searched, EP is tried as for unbiased experts."""
    from autopar import api, search
    from tests import zoo

    torch.manual_seed(0)
    model = zoo.build("custom-qwen2-moe-biased")
    prof = api.profile_model(model, seq_len=16)
    assert all(b.experts_biased for b in prof.profile.blocks if b.experts)
    ctx = api.make_context(prof.profile, world=4, global_batch=8)
    assert {c.ep for c in search.enumerate_configs(ctx, 4, {})} == {1, 2, 4}
    plan = api.estimate_plan(model, 4, "ep=2,dp=4,fsdp=1,mb=2,ac=none", global_batch=8, profiled=prof)[0]
    idx = [c for c in plan.collectives if c["group"] == "ep" and "expert indices" in c["why"]]
    layers, top_k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    assert [(c["kind"], c["bytes"], c["count"]) for c in idx] == [("all_to_all", 8 * 2 * 16 * top_k, layers)]


# Experts held as 3-D parameters (gpt-oss; every transformers 5 mixture-of-experts, whose experts
# interface tests/zoo.py's custom-mixtral-3d writes as 5.x does): their own loop over the experts
# hit, run once for every expert by traceable.stacked_experts_forward.
@pytest.mark.parametrize("kind", ["custom-mixtral-3d", "hf-gpt-oss"])
def test_experts_in_3d_parameters_run_their_own_loop_for_all_experts_at_once(kind):
    """The fixed-shape form computes what the experts' own loop computes, forward and backward
    (the block's output; the input's and every weight's gradients), and the traced step applies
    each 3-D weight as one grouped matmul over tokens x top_k rows (no nonzero, no loop), split by
    the role finder along its features like a linear of every expert (the fused gate/up in two
    parts; gpt-oss's (experts, in, out) storage read as such)."""
    from autopar import roles
    from autopar.grouped_mm import GROUPED_MM

    torch.manual_seed(0)
    model = zoo.build(kind)
    (st, *_) = traceable.stacked_experts(model)
    assert st.n_experts == 4
    traceable.check_routed_experts(model)
    block = model.get_submodule(st.name.rpartition(".")[0])
    x = torch.randn(2, 8, 64, requires_grad=True)
    weights = [p for p in st.module.parameters()]
    st.module.forward = traceable._own_forward(st.module).__get__(st.module)
    own = block(x)[0]
    g_own = torch.autograd.grad(own.square().sum(), [x, *weights])
    st.module.forward = lambda *a, **k: traceable.stacked_experts_forward(st, *a, **k)
    mine = block(x)[0]
    g_mine = torch.autograd.grad(mine.square().sum(), [x, *weights])
    del st.module.forward
    torch.testing.assert_close(mine, own, rtol=1e-6, atol=1e-7)
    for a, b in zip(g_mine, g_own):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    sg = _step_graph(model)
    grouped = list(sg.gm.graph.find_nodes(op="call_function", target=GROUPED_MM))
    assert len(grouped) == 2 * 2 and all(n.meta["val"].shape[0] == 2 * 16 * 2 for n in grouped)
    assert not [n for n in sg.gm.graph.nodes if "nonzero" in str(n.target)]
    found = {sg.param_names[lin.weight].rsplit(".", 1)[-1]: lin for lin in roles.step_roles(sg).linears
             if lin.stacked and sg.param_names[lin.weight].startswith(sg.layers[0])}
    out = 2 if kind == "hf-gpt-oss" else 1  # (experts, in, out) or (experts, out, in)
    parts = 1 if kind == "hf-gpt-oss" else 2  # gpt-oss interleaves gate and up: contiguous pairs
    assert {k: (v.role, v.out_dim, v.in_dim, v.parts) for k, v in found.items()} == {
        "gate_up_proj": ("column", out, 3 - out, parts), "down_proj": ("row", out, 3 - out, 1)}


def test_experts_in_3d_parameters_priced_as_the_same_experts_as_modules():
    """Mixtral with its experts as modules and as transformers 5 holds them is one model: the
    planner prices the same matmul FLOPs (the active share) and the same weights read."""
    torch.manual_seed(0)
    costs = [api.profile_model(zoo.build(k), seq_len=32).profile.blocks[0].costs for k in ("hf-mixtral", "custom-mixtral-3d")]
    mm = [c.kind == KIND_MATMUL for c in costs]
    assert costs[1].flops[mm[1]].sum() == pytest.approx(costs[0].flops[mm[0]].sum(), rel=1e-9)
    assert costs[1].weight_bytes.sum() == pytest.approx(costs[0].weight_bytes.sum(), rel=1e-9)
    assert costs[1].flops[costs[1].experts()].sum() == pytest.approx(costs[0].flops[costs[0].experts()].sum())


class _IndexedExperts(zoo.StackedExperts):
    """Experts whose loop reads its expert index as a Python int: not the experts interface's loop."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            rows = (top_k_index == e).any(-1)
            out[rows] += F.linear(F.linear(hidden_states[rows], self.gate_up_proj[e]).chunk(2, -1)[0], self.down_proj[e])
        return out


def test_experts_in_3d_parameters_looping_otherwise_are_refused():
    """Experts in 3-D parameters whose loop is not the one the fixed-shape form runs are refused in
    words, naming the experts, before anything trains; the model is not changed."""
    import re

    import autopar

    torch.manual_seed(0)
    model = zoo.build("custom-mixtral-3d")
    found = traceable.stacked_experts(model)  # the block's attribute is ``mlp`` on transformers 5
    for st in found:
        st.module.__class__ = _IndexedExperts
    with pytest.raises((AutoparError, TraceError), match=rf"experts {re.escape(found[0].name)} \(_IndexedExperts\)"):
        autopar.compile(model, 1, example_inputs=(torch.randint(0, 100, (2, 16)),))


# Expert modules looped over by their block's own routing code (Ernie 4.5's bias-corrected top-k,
# Hunyuan's gate module): the block's forward run once for every expert by
# traceable.looped_experts_forward.
@pytest.mark.parametrize("kind", ["hf:ernie4_5_moe-3layers", "hf:hunyuan_v1_moe"])
def test_experts_looped_by_their_blocks_own_routing_run_for_all_experts_at_once(kind):
    """The block's own forward with its loop run once computes what the loop computes, forward
    and backward (the input's and every trained weight's gradients: router, experts, shared
    expert), and the traced step applies each expert linear as one grouped matmul over tokens x
    top_k rows (no nonzero)."""
    from autopar.grouped_mm import GROUPED_MM

    torch.manual_seed(0)
    model = zoo.build(kind)
    loops = traceable.looped_experts(model)
    assert loops and not traceable.routed_experts(model) and all(lp.n_experts == 4 for lp in loops)
    traceable.check_routed_experts(model)
    lp = loops[0]
    m = lp.module
    x = torch.randn(2, 8, 64, requires_grad=True)
    weights = [p for p in m.parameters() if p.requires_grad]

    def out(y):
        return y[0] if isinstance(y, tuple) else y

    own = out(m(x))
    g_own = torch.autograd.grad(own.square().sum(), [x, *weights])
    with traceable._forward_as(m, lambda *a, **k: traceable.looped_experts_forward(lp, *a, **k)):
        mine = out(m(x))
    g_mine = torch.autograd.grad(mine.square().sum(), [x, *weights])
    torch.testing.assert_close(mine, own, rtol=1e-6, atol=1e-7)
    for a, b in zip(g_mine, g_own):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    sg = _step_graph(model)
    top_k = int(next(getattr(model.config, k) for k in ("moe_k", "moe_topk", "num_experts_per_tok") if hasattr(model.config, k)))
    grouped = list(sg.gm.graph.find_nodes(op="call_function", target=GROUPED_MM))
    assert len(grouped) == 3 * len(loops) and all(n.meta["val"].shape[0] == 2 * 16 * top_k for n in grouped)
    assert not [n for n in sg.gm.graph.nodes if "nonzero" in str(n.target)]


class _ListedLoop(nn.Module):
    """Experts scored by the block's own router and looped over by the experts' indices as
    Python ints: not the loop the fixed-shape form runs."""

    def __init__(self, dim=16, n=4):
        super().__init__()
        self.router = nn.Linear(dim, n, bias=False)
        self.scale = nn.Identity()  # a child the routed form does not know
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim)) for _ in range(n))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        chosen = self.router(flat).topk(2, dim=-1).indices
        mask = F.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)
        out = torch.zeros_like(flat)
        for e in mask.sum(dim=(-1, -2)).nonzero().flatten().tolist():
            pos, tok = torch.where(mask[e])
            out.index_add_(0, tok, self.experts[e](flat[tok]))
        return out.reshape(x.shape)


def test_experts_looped_otherwise_are_refused():
    """A block of expert modules that loops over its experts otherwise is refused in words,
    naming the block, before anything trains."""
    model = nn.Sequential(_ListedLoop())
    assert [lp.name for lp in traceable.looped_experts(model)] == ["0"]
    with pytest.raises((AutoparError, TraceError), match=r"experts 0 \(_ListedLoop\)"):
        traceable.check_routed_experts(model)


def test_experts_given_their_rows_per_expert_run_as_one_grouped_matmul():
    """Granite MoE's router sorts the rows by expert and hands its experts (3-D parameters) each
    one's row count as a Python list (``tolist``: values no static graph holds), which they split
    their rows by. Traced, the experts run as one grouped matmul over those rows, the counts'
    offsets made once per block (one routing under EP): the block's output and gradients are its
    own split-and-loop's, and the trace reads no value."""
    from autopar.grouped_mm import GROUPED_MM

    torch.manual_seed(0)
    model = zoo.build("hf:granitemoe")
    assert len(traceable.stacked_experts(model)) == 4  # input and output experts of 2 layers
    traceable.check_routed_experts(model)
    block = model.model.layers[0].block_sparse_moe
    x = torch.randn(2, 8, 64, requires_grad=True)
    weights = list(block.parameters())

    def out(y):  # (output, router logits) on transformers 4, the output (zoo.SplitMoeBlock) on 5
        return y[0] if isinstance(y, tuple) else y

    own = out(block(x))
    g_own = torch.autograd.grad(own.square().sum(), [x, *weights])
    with traceable._RoutedForm(model):
        mine = out(block(x))
    g_mine = torch.autograd.grad(mine.square().sum(), [x, *weights])
    torch.testing.assert_close(mine, own, rtol=1e-6, atol=1e-7)
    for a, b in zip(g_mine, g_own):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    sg = _step_graph(model)
    grouped = list(sg.gm.graph.find_nodes(op="call_function", target=GROUPED_MM))
    assert len(grouped) == 4 and all(n.meta["val"].shape[0] == 2 * 16 * 2 for n in grouped)
    assert len({n.args[2] for n in grouped}) == 2  # one offsets node per block
    assert not [n for n in sg.gm.graph.nodes if "local_scalar_dense" in str(n.target) or "nonzero" in str(n.target)]


def test_experts_run_on_every_token_by_their_block_run_on_their_tokens_only():
    """Llama 4's block runs every expert on every token, scaled by the expert's score (0 where the
    router did not choose it): traced, each token goes through its chosen experts only, one grouped
    matmul per 3-D weight over tokens x top_k rows (no batched matmul over experts x tokens), with
    the block's own output and gradients."""
    from autopar.grouped_mm import GROUPED_MM

    torch.manual_seed(0)
    model = zoo.build("hf:llama4_text")
    blocks = traceable.scored_experts(model)
    assert len(blocks) == 2 and all(b.n_experts == 4 for b in blocks)
    traceable.check_routed_experts(model)
    b = blocks[0]
    x = torch.randn(2, 8, 64, requires_grad=True)
    weights = list(b.module.parameters())
    own = b.module(x)[0]
    g_own = torch.autograd.grad(own.square().sum(), [x, *weights])
    mine = traceable.scored_experts_forward(b, x)[0]
    g_mine = torch.autograd.grad(mine.square().sum(), [x, *weights])
    torch.testing.assert_close(mine, own.reshape(mine.shape), rtol=1e-6, atol=1e-7)
    for a, c in zip(g_mine, g_own):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)

    sg = _step_graph(model)
    grouped = list(sg.gm.graph.find_nodes(op="call_function", target=GROUPED_MM))
    assert len(grouped) == 2 * 2 and all(n.meta["val"].shape[0] == 2 * 16 * 2 for n in grouped)
    bmm = sg.gm.graph.find_nodes(op="call_function", target=torch.ops.aten.bmm.default)
    assert all(n.meta["val"].shape[0] != 4 for n in bmm)  # the rotary table's only (batch 1)


class _MapOnlyExperts(nn.Module):
    """Experts in a 3-D parameter whose block is not called on tokens (JetMoE's attention experts:
    their block raises in forward and is driven through methods of its own)."""

    def __init__(self, dim=16, n=4):
        super().__init__()
        self.router = nn.Linear(dim, n, bias=False)
        self.experts = nn.Module()
        self.experts.num_experts = n
        self.experts.weight = nn.Parameter(torch.randn(n, dim, dim))

    def forward(self, x):
        raise NotImplementedError("This module doesn't support call and forward.")


def test_experts_whose_block_runs_otherwise_than_on_tokens_are_refused_in_words():
    with pytest.raises(AutoparError, match=r"experts 0.experts \(Module\): their block _MapOnlyExperts cannot be run "
                                           r"on tokens alone \(NotImplementedError"):
        traceable.check_routed_experts(nn.Sequential(_MapOnlyExperts()))


def test_grouped_kernel_reads_a_3d_expert_weight_in_place():
    """On the GPU path ``torch._grouped_mm`` takes every expert's matrix as one (E, out, in)
    tensor: for a 3-D expert weight's experts (unbind, transposed or not) that is a view of the
    weight itself, not a copy of it per call; experts of their own are stacked."""
    from autopar.grouped_mm import stacked

    w = torch.randn(4, 8, 16)
    for pieces in (list(w.unbind(0)), [p.t() for p in w.unbind(0)]):
        got = stacked(pieces)
        assert got.data_ptr() == w.data_ptr() and torch.equal(got, torch.stack(pieces))
    own = [torch.randn(8, 16) for _ in range(4)]
    assert torch.equal(stacked(own), torch.stack(own))
    backwards = list(w.unbind(0))[::-1]  # not in storage order: copied, in the given order
    assert torch.equal(stacked(backwards), torch.stack(backwards))


def test_routing_sampled_in_training_is_checked_on_the_same_draws_and_compiles():
    """PhiMoE samples its routing while training (sparsemixer: Gumbel noise from ``exponential_``
    and ``rand_like``), so two runs of its block differ: the check of autopar's form of its experts
    runs both on the same random draws, and the step, random draws in its graph, compiles with
    Inductor (whose seed pass reads the fake mode ``torch.compile`` would have set) and trains."""
    import autopar

    model = zoo.build("hf:phimoe")
    with torch.no_grad():  # every expert scored alike: each token's expert drawn at random
        for layer in model.model.layers:
            layer.mlp.router.weight.zero_()
    block = model.model.layers[0].mlp
    x = torch.randn(2, 8, model.config.hidden_size)
    with torch.no_grad():
        assert not torch.equal(block(x), block(x))  # the routing is sampled: a check must not compare two draws
    for _ in range(3):
        traceable.check_routed_experts(model)
    xs, tgt = zoo.example("hf:phimoe", 1)
    pm = autopar.compile(model, 1, example_inputs=xs, example_target=tgt, global_batch=tgt.shape[0])
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    losses = []
    for seed in (2, 3):
        xs, tgt = zoo.example("hf:phimoe", seed)
        losses.append(float(pm.step(xs, target=tgt)))
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in pm.parameters())
        opt.step()
        opt.zero_grad()
    assert all(4.0 < v < 7.0 for v in losses), losses  # about ln(256) = 5.5 at initialisation
