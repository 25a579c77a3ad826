"""Mixture-of-experts blocks that route tokens with ``nonzero`` (transformers' Mixtral, Qwen2-MoE):
traced in a fixed-shape form that computes the same thing, priced at their active FLOPs, checked on
the model's own weights before training, and refused where routing differs (parity runs in
tests/test_parity.py)."""

import pytest
import torch
import torch.nn as nn

from autopar import api, traceable
from autopar.analysis import KIND_MATMUL
from autopar.errors import AutoparError, TraceError
from tests import zoo


def _qwen2_moe(top_k: int) -> nn.Module:
    import transformers as tf

    cfg = tf.Qwen2MoeConfig(vocab_size=256, max_position_embeddings=64, use_cache=False, hidden_size=64,
                            intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                            moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                            num_experts_per_tok=top_k, norm_topk_prob=False)
    cfg._attn_implementation = "sdpa"
    return tf.Qwen2MoeForCausalLM(cfg)


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


@pytest.mark.parametrize("kind", ["hf-qwen2-moe", "hf-mixtral"])
def test_fixed_shape_form_matches_the_block(kind):
    torch.manual_seed(0)
    model = zoo.build(kind)
    blocks = traceable.check_routed_experts(model)
    assert len(blocks) == 2 and all(b.top_k == 2 and b.n_experts == 4 for b in blocks)
    x = torch.randn(2, 16, 64, requires_grad=True)
    m = blocks[0].module
    own, _ = m(x)
    mine, _ = traceable.fixed_shape_experts_forward(blocks[0], x)
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
    own, mine = m(x), traceable.fixed_shape_experts_forward(blocks[0], x)
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


def test_router_jitter_is_refused_with_the_setting():
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=256, max_position_embeddings=64, use_cache=False, hidden_size=64,
                           intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                           num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1)
    cfg._attn_implementation = "sdpa"
    with pytest.raises(TraceError, match="router_jitter_noise=0"):
        api.profile_model(tf.MixtralForCausalLM(cfg), seq_len=32)


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
