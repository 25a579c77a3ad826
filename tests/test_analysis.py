"""Capture and analysis: pairs, heads, regions and saved activations, on several model families."""

import dataclasses
import resource

import pytest
import torch
import transformers

from autopar import analysis, api, capture, models
from autopar.roles import step_roles
from tests.conftest import profile


def roles(p):
    return {l.weight: l.role for b in p.blocks for l in b.linears}


def test_llama_pairs_heads_and_params(llama8b):
    b = llama8b.blocks[0]
    r = roles(llama8b)
    assert {k for k, v in r.items() if v == "column"} == {
        "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
        "feed_forward.w1.weight", "feed_forward.w3.weight"}
    assert {k for k, v in r.items() if v == "row"} == {"attention.wo.weight", "feed_forward.w2.weight"}
    assert (b.heads, b.kv_heads, b.head_dim) == (32, 8, 128)
    assert b.count == 32 and llama8b.hidden == 4096 and llama8b.vocab == 128256
    assert llama8b.n_params == pytest.approx(8.03e9, rel=1e-3)
    assert llama8b.max_tp_check(8) == []
    assert any("heads (8)" in x for x in llama8b.max_tp_check(16))
    # 6N + attention, per token (torchtitan's MFU convention): N excludes the embedding.
    n = llama8b.n_params - 128256 * 4096
    attn = 12 * 32 * 4096 * 8192
    assert llama8b.model_flops_per_token() == pytest.approx(6 * n + attn, rel=0.01)


def test_gpt_activation_memory_matches_korthikanti():
    # Korthikanti et al. 2022, eq. 1-2 and Table 2: per layer, 16-bit activations, 1-byte masks.
    h, a, s = 768, 12, 2048
    cfg = models.GPTConfig(h, 2, a, 51200, s, dropout=0.1)
    p = analysis.analyze(capture.trace_model(lambda: models.GPT(cfg), batch=1, seq_len=s))
    sv = p.blocks[0].saved
    sbh = s * h
    none = sum(sv["none"]) / sbh
    # Our GPT also keeps its s x s boolean causal mask (s*s bytes) which Megatron's fused kernel does not.
    assert none == pytest.approx(34 + 5 * a * s / h + s / h, rel=0.01)
    assert sum(sv["selective"]) / sbh == pytest.approx(34, rel=0.01)
    assert sum(sv["full"]) / sbh == pytest.approx(2, rel=1e-6)
    # With tensor parallelism t and sequence parallelism: everything divides by t (eq. 4-5).
    tp_part, rep_part = sv["selective"]
    assert rep_part / sbh == pytest.approx(10, rel=0.01)  # norms, residual, dropout masks, block input
    assert tp_part / sbh == pytest.approx(24, rel=0.01)


def test_batch_scaling_is_linear():
    p1 = profile("llama-tiny")
    src = models.resolve("llama-tiny")
    p4 = analysis.analyze(capture.trace_model(src.build, batch=4, seq_len=64))
    for mode in ("none", "selective", "full"):
        assert sum(p4.blocks[0].saved[mode]) == pytest.approx(sum(p1.blocks[0].saved[mode]), rel=1e-6)
    assert p4.blocks[0].costs.flops.sum() == pytest.approx(p1.blocks[0].costs.flops.sum(), rel=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_hf_families_pairs(family):
    kw = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=512)
    cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[family](**kw)
    src = models.hf_source_from_config(cfg)
    p = analysis.analyze(capture.trace_model(src.build, batch=1, seq_len=32, vocab_size=512))
    b = p.blocks[0]
    assert b.count == 2
    assert sorted(v for v in roles(p).values()) == ["column"] * 5 + ["row"] * 2
    assert (b.heads, b.kv_heads) == (8, 4)
    assert p.max_tp_check(4) == [] and p.max_tp_check(8)


def test_hf_gptj_bloom_falcon_priced_as_the_executor_shards_them():
    """The planner's analysis agrees with the executor's (test_step_roles_by_data_flow): GPT-J's
    q/k/v and BLOOM's per-head QKV are columns, TP divides their heads; Falcon 7B's multi-query
    QKV and the projection that reads it stay replicated (its MLP is sharded); Falcon 40B's QKV
    is sharded by KV group, which TP must divide."""
    def prof(cfg):
        src = models.hf_source_from_config(cfg)
        return analysis.analyze(capture.trace_model(src.build, batch=1, seq_len=32, vocab_size=512))

    common = dict(vocab_size=512, hidden_dropout=0.0, attention_dropout=0.0)
    gptj = prof(transformers.GPTJConfig(n_embd=128, n_layer=2, n_head=8, rotary_dim=8, vocab_size=512))
    assert sorted(roles(gptj).values()) == ["column"] * 4 + ["row"] * 2
    assert gptj.blocks[0].heads == 8 and gptj.max_tp_check(8) == [] and gptj.max_tp_check(16)
    bloom = prof(transformers.BloomConfig(hidden_size=128, n_layer=2, n_head=8, **common))
    assert sorted(roles(bloom).values()) == ["column", "column", "row", "row"]
    assert bloom.blocks[0].heads == 8 and bloom.max_tp_check(8) == [] and bloom.max_tp_check(16)
    mqa = prof(transformers.FalconConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=8,
                                         multi_query=True, parallel_attn=True, bias=False, **common))
    r = roles(mqa)
    assert r["self_attention.query_key_value.weight"] == r["self_attention.dense.weight"] == "replicated"
    assert (r["mlp.dense_h_to_4h.weight"], r["mlp.dense_4h_to_h.weight"]) == ("column", "row")
    b = mqa.blocks[0]
    # Priced as the fused attention a GPU runs, not this CPU's math path for shared KV heads.
    assert int((b.costs.kind == analysis.KIND_ATTN).sum()) == 1
    assert not any("softmax" in n for n in b.costs.names)
    qkv = 128 * (128 + 2 * 16)
    assert b.params_tp == 2 * 128 * 512 and b.params_rep >= qkv + 128 * 128
    grouped = prof(transformers.FalconConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=8,
                                             num_kv_heads=2, new_decoder_architecture=True, bias=False, **common))
    assert sorted(roles(grouped).values()) == ["column", "column", "row", "row"]
    assert grouped.max_tp_check(2) == [] and grouped.max_tp_check(4)


def test_hf_gpt2_fused_qkv_is_a_column():
    cfg = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=512)
    src = models.hf_source_from_config(cfg)
    p = analysis.analyze(capture.trace_model(src.build, batch=1, seq_len=32, vocab_size=512))
    b = p.blocks[0]
    lin = {l.weight: l for l in b.linears}
    # The executor splits a fused projection in interleaved parts and Conv1D (in, out) weights
    # along their output dim: both are columns for the planner too.
    assert lin["attn.c_attn.weight"].parts == 3 and lin["attn.c_attn.weight"].role == "column"
    assert sorted(l.role for l in lin.values()) == ["column", "column", "row", "row"]
    assert p.max_tp_check(2) == []
    # Conv1D stores (in, out): the analysis reads the orientation from the graph.
    assert (lin["mlp.c_fc.weight"].in_features, lin["mlp.c_fc.weight"].out_features) == (128, 512)


@pytest.mark.parametrize("kind,want", [
    ("hf-gpt2", {"attn.c_attn.weight": ("column", 1, 3), "attn.c_proj.weight": ("row", 1, 1),
                 "mlp.c_fc.weight": ("column", 1, 1), "mlp.c_proj.weight": ("row", 1, 1)}),
    ("custom-llama", {"wqkv.weight": ("column", 0, 3), "proj.weight": ("row", 0, 1),
                      "w13.weight": ("column", 0, 2), "w2.weight": ("row", 0, 1)}),
    ("hf-neox", {"attention.query_key_value.weight": ("column", 0, 1), "attention.dense.weight": ("row", 0, 1)}),
    ("hf-phi3", {"self_attn.qkv_proj.weight": ("column", 0, 3), "mlp.gate_up_proj.weight": ("column", 0, 2),
                 "self_attn.o_proj.weight": ("row", 0, 1), "mlp.down_proj.weight": ("row", 0, 1)}),
    ("hf-gptj", {"attn.q_proj.weight": ("column", 0, 1), "attn.v_proj.weight": ("column", 0, 1),
                 "attn.out_proj.weight": ("row", 0, 1), "mlp.fc_out.weight": ("row", 0, 1)}),
    # BLOOM views its QKV as (heads, 3, head dim): each rank's contiguous heads carry their q, k, v.
    ("hf-bloom", {"self_attention.query_key_value.weight": ("column", 0, 1), "self_attention.dense.weight": ("row", 0, 1)}),
    # Falcon computes x @ w.T (a permute of the weight). Multi-query: q heads, then one k and one v
    # head in one projection, indexed unevenly: no contiguous shard is a rank's share, so it and
    # the row that reads it stay replicated (the MLP is still sharded). Falcon 40B's layout groups
    # each KV head with its queries: sharded by groups.
    ("hf-falcon", {"self_attention.query_key_value.weight": ("replicated", 0, 1),
                   "self_attention.dense.weight": ("replicated", 0, 1),
                   "mlp.dense_h_to_4h.weight": ("column", 0, 1), "mlp.dense_4h_to_h.weight": ("row", 0, 1)}),
    ("hf-bigcode", {"attn.c_attn.weight": ("replicated", 0, 1), "attn.c_proj.weight": ("replicated", 0, 1),
                    "mlp.c_fc.weight": ("column", 0, 1), "mlp.c_proj.weight": ("row", 0, 1)}),
    ("hf-falcon-new", {"self_attention.query_key_value.weight": ("column", 0, 1),
                       "self_attention.dense.weight": ("row", 0, 1)}),
    # A masked-LM head normalizes its dense layer's output over all its features before the
    # tied decoder reads it: no column/row pair, the decoder is the head (vocabulary-split logits).
    # Query/key norms: over each head's features (Qwen3) or over all of them before attention
    # (OLMo 2, its norm gathers the query): attention stays split by heads either way.
    ("hf-qwen3", {"self_attn.q_proj.weight": ("column", 0, 1), "self_attn.k_proj.weight": ("column", 0, 1),
                  "self_attn.o_proj.weight": ("row", 0, 1)}),
    ("hf-olmo2", {"self_attn.q_proj.weight": ("column", 0, 1), "self_attn.k_proj.weight": ("column", 0, 1),
                  "self_attn.o_proj.weight": ("row", 0, 1)}),
    # Phi-2's and Cohere's attention and MLP read one norm's output side by side; Gemma 2's extra
    # norms after attention and after the MLP are over the row linears' reduced outputs.
    ("hf-phi", {"self_attn.q_proj.weight": ("column", 0, 1), "self_attn.dense.weight": ("row", 0, 1),
                "mlp.fc1.weight": ("column", 0, 1), "mlp.fc2.weight": ("row", 0, 1)}),
    ("hf-cohere", {"self_attn.v_proj.weight": ("column", 0, 1), "self_attn.o_proj.weight": ("row", 0, 1),
                   "mlp.up_proj.weight": ("column", 0, 1), "mlp.down_proj.weight": ("row", 0, 1)}),
    ("hf-gemma2", {"self_attn.k_proj.weight": ("column", 0, 1), "self_attn.o_proj.weight": ("row", 0, 1),
                   "mlp.gate_proj.weight": ("column", 0, 1), "mlp.down_proj.weight": ("row", 0, 1)}),
    ("hf-starcoder2", {"mlp.c_fc.weight": ("column", 0, 1), "mlp.c_proj.weight": ("row", 0, 1)}),
    ("hf-roberta", {"attention.self.query.weight": ("column", 0, 1), "attention.output.dense.weight": ("row", 0, 1),
                    "intermediate.dense.weight": ("column", 0, 1), "output.dense.weight": ("row", 0, 1)}),
    # ModernBERT views its fused Wqkv as (3, heads, head dim), transposes and unbinds the 3:
    # stacked q, k, v, split in 3 interleaved parts as if split along the features.
    ("hf-modernbert", {"attn.Wqkv.weight": ("column", 0, 3), "attn.Wo.weight": ("row", 0, 1),
                       "mlp.Wi.weight": ("column", 0, 2), "mlp.Wo.weight": ("row", 0, 1)}),
])
def test_step_roles_by_data_flow(kind, want):
    """The executor's roles from the traced step: fused projections split into their equal parts
    (GPT-2's Conv1D c_attn stored (in, out), Phi-3's qkv and gate/up, a custom fused Llama in a
    ModuleDict); NeoX's and BLOOM's per-head interleaved QKV needs no interleaving; Falcon's
    multi-query QKV cannot be sharded."""
    from tests import zoo

    torch.manual_seed(0)
    m = zoo.build(kind)
    sg = capture.trace_step(m, (torch.zeros(2, 16, dtype=torch.long),), target=torch.ones(2, 16, dtype=torch.long))
    assert len(sg.layers) == 2
    found = step_roles(sg)
    got = {}
    for lin in found.linears:
        name = sg.param_names[lin.weight]
        if name.startswith(sg.layers[0] + "."):
            got[name[len(sg.layers[0]) + 1:]] = (lin.role, lin.out_dim, lin.parts)
    for k, v in want.items():
        assert got[k] == v, (k, got)
    heads = [sg.param_names[l.weight] for l in found.linears if l.role == "head"]
    assert len(heads) == 1


def test_latent_attention_splits_by_heads_and_keeps_the_latents_whole():
    """DeepSeek's multi-head latent attention under TP: the per-head projections (queries, and
    the keys and values made from the compressed latent) are columns and the output projection
    their row; the projection to the compressed latent and the rotary key (one head's features
    per token, expanded to every head) stays whole, with the reason. The planner prices what the
    executor's finder splits."""
    from tests import zoo

    torch.manual_seed(0)
    m = zoo.build("hf-deepseek-v2")
    sg = capture.trace_step(m, (torch.zeros(2, 16, dtype=torch.long),), target=torch.ones(2, 16, dtype=torch.long))
    found = step_roles(sg)
    for layer in sg.layers:
        got = {sg.param_names[l.weight][len(layer) + 1:]: l for l in found.linears
               if sg.param_names[l.weight].startswith(layer + ".self_attn.")}
        assert {k: v.role for k, v in got.items()} == {
            "self_attn.q_proj.weight": "column", "self_attn.kv_b_proj.weight": "column",
            "self_attn.o_proj.weight": "row", "self_attn.kv_a_proj_with_mqa.weight": "replicated"}
        assert "shared by every head" in got["self_attn.kv_a_proj_with_mqa.weight"].reason
    prof = analysis.analyze(capture.trace_model(m, batch=2, seq_len=16, dtype=torch.float32))
    for b in prof.blocks:
        roles = {l.weight: l.role for l in b.linears if l.weight.startswith("self_attn.")}
        assert roles == {"self_attn.q_proj.weight": "column", "self_attn.kv_b_proj.weight": "column",
                         "self_attn.o_proj.weight": "row", "self_attn.kv_a_proj_with_mqa.weight": "replicated"}


@pytest.mark.parametrize("kind,split", [("hf-llama", True), ("hf-deit", True), ("diffusers-dit", False)])
def test_head_split_only_under_a_cross_entropy(kind, split):
    """The head's logits stay split over TP only when the loss reads them through a log-softmax
    (a language model's next token, an image classifier's class); a diffusion transformer's
    noise MSE reads its patch outputs whole (DTensor's MSE on shards doubles the gradient)."""
    from autopar.passes.tp import tp_rules
    from autopar.roles import head_feeds_cross_entropy
    from tests import zoo

    torch.manual_seed(0)
    m = zoo.build(kind)
    xs, y = zoo.example(kind, 1, B=2, S=16)
    sg = capture.trace_step(m, xs, target=y, loss_fn=zoo.loss_of(kind))
    assert head_feeds_cross_entropy(sg) is split
    rules = tp_rules(sg, step_roles(sg), 2, True, split)
    (head,) = [lin for lin in step_roles(sg).linears if lin.role == "head"]
    assert rules.vocab_split is split
    assert (head.weight in rules.placements and type(rules.placements[head.weight]).__name__ == "Shard") is split
    # The planner prices what runs: the head's parameters and ops on vocabulary shards, or whole.
    seq = xs[0].shape[1] if capture.is_token_ids(xs[0]) else None
    prof = analysis.analyze(capture.trace_model(lambda: zoo.build(kind), batch=2, seq_len=seq, example_inputs=xs,
                                                example_target=y, loss_fn=zoo.loss_of(kind)))
    assert (prof.post.params_vocab > 0) is split and bool(prof.post.costs.tp.any()) is split


def test_405b_planned_without_allocating():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    p = profile("llama3-405b")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert p.n_params == pytest.approx(405.85e9, rel=1e-3)
    assert p.n_layers == 126 and len(p.blocks) == 1
    assert (after - before) * 1024 < 2 * 2**30  # far below the 810 GB the bf16 weights would take


def test_untraceable_model_names_the_line():
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
            self.emb = torch.nn.Embedding(16, 8)

        def forward(self, x):
            h = self.emb(x)
            if h.sum().item() > 0:  # data-dependent control flow
                h = h * 2
            for l in self.layers:
                h = l(h)
            return h

    from autopar.errors import TraceError

    with pytest.raises(TraceError, match=r"test_analysis.py:\d+.*item"):
        capture.trace_model(Bad, batch=1, seq_len=4, vocab_size=16)


def test_flops_expression_in_batch(llama8b):
    import sympy

    b = sympy.Symbol("b", positive=True)
    e = llama8b.flops_expr()
    one = float(e.subs(b, 1))
    assert float(e.subs(b, 4)) == pytest.approx(4 * one)
    assert one * 3 / llama8b.seq_len == pytest.approx(llama8b.model_flops_per_token(), rel=1e-6)


def test_attention_dropout_priced_as_the_fused_kernel(tmp_path, monkeypatch):
    """Attention dropout makes this CPU take the unfused math path; the planner must price the
    fused kernel the GPU runs, so dropout does not change the predicted step."""
    import json

    from autopar import api

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    cfg = {"model_type": "gpt2", "n_embd": 256, "n_head": 4, "n_layer": 2, "n_positions": 512, "vocab_size": 1024}
    times = []
    for p in (0.0, 0.1):
        d = tmp_path / f"p{p}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, "attn_pdrop": p}))
        times.append(api.plan(str(d / "config.json"), 8, pin="tp=1,pp=1").predicted["step_time_s"])
    assert times[0] == pytest.approx(times[1], rel=0.02), times


@pytest.mark.parametrize("kind", ["hf-gpt2", "hf-phi3", "hf-falcon", "custom-llama", "hf-mixtral", "gpt-tiny",
                                  "hf-modernbert"])
def test_planner_prices_the_roles_the_executor_shards(kind):
    """One role finder: the planner's roles of a block's linears (``analyze_block``, on the block's
    graph) are the executor's (``step_roles``, on the step graph), fused projections included."""
    from tests import zoo

    torch.manual_seed(0)
    prof = analysis.analyze(capture.trace_model(lambda: zoo.build(kind), batch=1, seq_len=16, vocab_size=256))
    planned = {l.weight: (l.role, l.parts) for l in prof.blocks[0].linears}
    sg = capture.trace_step(zoo.build(kind), (torch.zeros(2, 16, dtype=torch.long),),
                            target=torch.ones(2, 16, dtype=torch.long))
    run = {}
    for lin in step_roles(sg).linears:
        name = sg.param_names[lin.weight]
        if name.startswith(sg.layers[0] + "."):
            run[name[len(sg.layers[0]) + 1:]] = (lin.role, lin.parts if lin.role == "column" else 1)
    assert planned == run


def test_a_module_traced_again_is_analysed_once(monkeypatch, tmp_path):
    """The profile of a module's traced step is cached by everything the analysis reads: the same
    model traced again (another rank, plan or run) is not analysed again; one width changed is."""
    from autopar import api
    from tests import zoo

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    analysed = []
    real = analysis.analyze
    monkeypatch.setattr(analysis, "analyze", lambda tr: analysed.append(tr.name) or real(tr))

    def profile(model):
        xs, tgt = zoo.example("llama-tiny", 0, B=2, S=16)
        step = capture.trace_step(model, xs, target=tgt, loss_fn=capture.default_loss, name="m")
        return api.profile_model(model, example_inputs=xs, loss_fn=capture.default_loss, step=step).profile

    first = profile(zoo.build("llama-tiny"))
    again = profile(zoo.build("llama-tiny"))
    assert len(analysed) == 1
    assert (again.blocks[0].saved_partitioned, again.n_params) == (first.blocks[0].saved_partitioned, first.n_params)
    cfg = models.PRESETS["llama-tiny"]
    profile(models.Llama(dataclasses.replace(cfg, n_layers=2, ffn_dim=cfg.ffn_dim + 32)))
    assert len(analysed) == 2


def test_tp_degree_must_divide_every_blocks_heads():
    """Swin's stages are blocks of the same weights with 2 and 4 heads: a TP degree is checked
    against each (a degree only the later stage's heads allow was taken, and DTensor then failed
    mid-trace on the first stage's 2 heads)."""
    from tests import zoo

    xs, y = zoo.example("hf-swin", 1, B=2)
    prof = analysis.analyze(capture.trace_model(lambda: zoo.build("hf-swin"), batch=2, seq_len=None, example_inputs=xs,
                                                example_target=y, loss_fn=zoo.loss_of("hf-swin")))
    assert len(prof.blocks) > 1 and not prof.max_tp_check(2)
    bad = prof.max_tp_check(4)
    assert bad and all("heads (2)" in b and ".layers.0." in b for b in bad), bad


def test_an_encoder_decoders_row_reduces_are_priced_over_its_own_tokens():
    """Each row linear of mT5 (encoder and decoder blocks: a decoder block also reads the
    encoder's output) reduces one tokens x hidden message: its rows per token are counted over
    the block's own hidden states, its first hidden input (they were counted over whichever
    hidden input a set's order gave first, which varies with the process's hash seed)."""
    from tests import zoo

    xs, y = zoo.example("hf-mt5", 1, B=2, S=16)
    prof = analysis.analyze(capture.trace_model(lambda: zoo.build("hf-mt5"), batch=2, seq_len=16, example_inputs=xs,
                                                example_target=y, loss_fn=zoo.loss_of("hf-mt5")))
    rows = [(b.fqns[0], l.weight, l.reduce_rows) for b in prof.blocks for l in b.linears if l.role == "row"]
    assert len(rows) >= 4 and all(r == 1.0 for _, _, r in rows), rows


@pytest.mark.parametrize("kind", ["hf-gpt-oss", "hf-qwen3-moe"])
def test_expert_blocks_saved_activations_are_the_partitioners(kind):
    """A mixture-of-experts block's saved activations come from the min-cut partition of its
    joint (what the executor saves), not the eager estimate: gpt-oss's clamped GLU, whose
    backward writes a mask in place, included: selective AC saves less than none, full AC the
    block's input alone."""
    from tests import zoo

    prof = api.profile_model(zoo.build(kind), seq_len=32).profile
    for b in prof.blocks:
        got = b.saved_partitioned
        assert set(got) == {"none", "selective", "full"}, (kind, got)
        none, sel = sum(got["none"]), sum(got["selective"])
        assert none > sel > got["full"][1] > 0, got
