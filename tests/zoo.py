"""Tiny models of every family the tests train: HuggingFace ones from a config (no download),
a Llama written the way another project writes one, and autopar's own presets. The HuggingFace
configs keep the families' ``use_cache`` default (on, as users have it: the models then build a
key/value cache in training too)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256
IMAGE = (3, 32, 32)  # channels, height, width of the vision models' inputs
CLASSES = 10
VISION = ("hf-deit", "hf-vit", "hf-swin")
DROPOUT_OFF = {"attention_dropout": 0.0}


def _hf(kind: str, **overrides) -> nn.Module:
    """``overrides``: config fields set after the family's own (e.g. ``num_experts_per_tok``)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, max_position_embeddings=64)
    llama_like = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, **common)
    if kind == "hf-llama":
        cfg, cls = tf.LlamaConfig(**llama_like), tf.LlamaForCausalLM
    elif kind == "hf-qwen2":
        cfg, cls = tf.Qwen2Config(**llama_like, tie_word_embeddings=False), tf.Qwen2ForCausalLM
    elif kind == "hf-mistral":
        cfg, cls = tf.MistralConfig(**llama_like, sliding_window=None), tf.MistralForCausalLM
    elif kind == "hf-gemma":
        cfg, cls = tf.GemmaConfig(**llama_like, head_dim=8, tie_word_embeddings=True), tf.GemmaForCausalLM
    elif kind == "hf-phi3":
        cfg, cls = tf.Phi3Config(**{**llama_like, "num_key_value_heads": 8}, pad_token_id=0,
                                 resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0), tf.Phi3ForCausalLM
    elif kind == "hf-gpt2":
        cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=8, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        cls = tf.GPT2LMHeadModel
    elif kind == "hf-neox":
        cfg = tf.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                               rotary_pct=0.25, hidden_dropout=0.0, attention_dropout=0.0, **common)
        cls = tf.GPTNeoXForCausalLM
    elif kind == "hf-opt":  # learned positions with an offset, biases, ReLU; LayerDrop probability 0
        cfg = tf.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=8,
                           word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0, layerdrop=0.0, **common)
        cls = tf.OPTForCausalLM
    elif kind == "hf-qwen2-moe":  # 4 routed experts (top 2, unnormalised) and a gated shared expert
        cfg = tf.Qwen2MoeConfig(**llama_like, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)
        cls = tf.Qwen2MoeForCausalLM
    elif kind == "hf-qwen3-moe":  # 4 routed experts (top 2, renormalised), no shared expert; per-head q/k norms
        cfg = tf.Qwen3MoeConfig(**llama_like, head_dim=8, moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        cls = tf.Qwen3MoeForCausalLM
    elif kind == "hf-mixtral":  # 4 experts, top 2 renormalised, no jitter
        cfg = tf.MixtralConfig(**llama_like, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
                               sliding_window=None)
        cls = tf.MixtralForCausalLM
    elif kind == "hf-gptj":  # separate q/k/v without biases, partial rotary, parallel attention and MLP
        cfg = tf.GPTJConfig(n_embd=64, n_layer=2, n_head=8, rotary_dim=4, n_positions=64, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, vocab_size=VOCAB)
        cls = tf.GPTJForCausalLM
    elif kind == "hf-bloom":  # ALiBi, per-head interleaved fused QKV, embedding layer norm, tied head
        cfg = tf.BloomConfig(hidden_size=64, n_layer=2, n_head=8, hidden_dropout=0.0, attention_dropout=0.0,
                             vocab_size=VOCAB)
        cls = tf.BloomForCausalLM
    elif kind == "hf-falcon":  # multi-query fused QKV (one K and V head), parallel attention, x @ w.T
        cfg = tf.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, multi_query=True,
                              parallel_attn=True, new_decoder_architecture=False, alibi=False, bias=False,
                              hidden_dropout=0.0, attention_dropout=0.0, **common)
        cls = tf.FalconForCausalLM
    elif kind == "hf-falcon-new":  # Falcon 40B/180B layout: QKV grouped per KV head, two layer norms
        cfg = tf.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_kv_heads=2,
                              new_decoder_architecture=True, alibi=False, bias=False, hidden_dropout=0.0,
                              attention_dropout=0.0, **common)
        cls = tf.FalconForCausalLM
    elif kind == "hf-bigcode":  # StarCoder: multi-query c_attn split (hidden, head, head)
        cfg = tf.GPTBigCodeConfig(n_embd=64, n_layer=2, n_head=8, multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, n_positions=64, vocab_size=VOCAB)
        cls = tf.GPTBigCodeForCausalLM
    elif kind == "hf-deepseek-v2":  # MLA attention, a dense first layer, 4 routed experts (gate module) + shared
        cfg = tf.DeepseekV2Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                                  num_attention_heads=8, num_key_value_heads=8, n_routed_experts=4, n_shared_experts=1,
                                  num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, topk_method="greedy",
                                  routed_scaling_factor=1.0, **common)
        cls = tf.DeepseekV2ForCausalLM
    elif kind == "hf-qwen3":  # RMS norms over each head's queries and keys (head-local)
        cfg, cls = tf.Qwen3Config(**llama_like, head_dim=8, tie_word_embeddings=False), tf.Qwen3ForCausalLM
    elif kind == "hf-olmo2":  # RMS norms over all the query and key features (not head-local)
        cfg, cls = tf.Olmo2Config(**llama_like), tf.Olmo2ForCausalLM
    elif kind == "hf-gemma2":  # attention and final logit soft-capping, sandwich norms, alternating sliding windows
        cfg = tf.Gemma2Config(**llama_like, head_dim=8, sliding_window=16, query_pre_attn_scalar=8)
        cls = tf.Gemma2ForCausalLM
    elif kind == "hf-gemma3":  # per-head q/k norms, local and global layers with their own rotary bases
        cfg = tf.Gemma3TextConfig(**llama_like, head_dim=8, sliding_window=16, query_pre_attn_scalar=8)
        cls = tf.Gemma3ForCausalLM
    elif kind == "hf-phi":  # Phi-2: partial rotary, parallel attention and MLP, biases, layer norm
        cfg = tf.PhiConfig(**{**llama_like, "num_key_value_heads": 8}, partial_rotary_factor=0.5, resid_pdrop=0.0,
                           embd_pdrop=0.0, attention_dropout=0.0)
        cls = tf.PhiForCausalLM
    elif kind == "hf-stablelm":  # layer norms, partial rotary, q/k/v biases
        cfg = tf.StableLmConfig(**llama_like, partial_rotary_factor=0.25, use_qkv_bias=True, hidden_dropout=0.0,
                                attention_dropout=0.0)
        cls = tf.StableLmForCausalLM
    elif kind == "hf-starcoder2":  # layer norms with biases, GELU MLP (c_fc, c_proj), grouped-query attention
        cfg = tf.Starcoder2Config(**llama_like, sliding_window=None, residual_dropout=0.0, embedding_dropout=0.0,
                                  attention_dropout=0.0)
        cls = tf.Starcoder2ForCausalLM
    elif kind == "hf-cohere":  # parallel attention and MLP, one layer norm, scaled logits, tied head
        cfg, cls = tf.CohereConfig(**llama_like, logit_scale=0.25), tf.CohereForCausalLM
    elif kind == "hf-granite":  # Llama with multipliers on embeddings, residuals, attention and logits
        cfg = tf.GraniteConfig(**llama_like, embedding_multiplier=2.0, residual_multiplier=0.5,
                               attention_multiplier=0.125, logits_scaling=4.0)
        cls = tf.GraniteForCausalLM
    elif kind == "hf-gpt-oss":  # experts held as 3-D parameters (with biases), attention sinks, alternating windows
        cfg = tf.GptOssConfig(**llama_like, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                              layer_types=["sliding_attention", "full_attention"], rope_scaling=None)
        cfg.intermediate_size = 32
        cls = tf.GptOssForCausalLM
    elif kind == "hf-roberta":  # an encoder: bidirectional attention, masked-LM head (dense, GELU, layer norm) tied
        cfg = tf.RobertaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                               type_vocab_size=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                               **{**common, "max_position_embeddings": 66})  # positions start after the padding id
        cls = tf.RobertaForMaskedLM
    elif kind == "hf-modernbert":  # an encoder: fused Wqkv viewed as stacked (3, heads, head_dim), local and
        # global attention layers, gated MLP, no biases, masked-LM head tied
        cfg = tf.ModernBertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=8, max_position_embeddings=64, global_attn_every_n_layers=2,
                                  local_attention=16, embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0,
                                  pad_token_id=0)
        cls = tf.ModernBertForMaskedLM
    elif kind == "hf-bart":  # encoder-decoder: cross-attention, learned positions, tied embeddings and head
        cfg = tf.BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=8,
                            decoder_attention_heads=8, encoder_ffn_dim=128, decoder_ffn_dim=128, dropout=0.0,
                            attention_dropout=0.0, activation_dropout=0.0, **common)
        cls = tf.BartForConditionalGeneration
    elif kind == "hf-mt5":  # encoder-decoder: relative position bias, gated GELU, untied head
        cfg = tf.MT5Config(d_model=64, d_kv=8, d_ff=128, num_layers=2, num_heads=8, dropout_rate=0.0,
                           feed_forward_proj="gated-gelu", tie_word_embeddings=False, vocab_size=VOCAB,
                           # Weights at 0.3 of T5's scale: at 1.0 the first loss is 23 (transformers 4.57)
                           # or 41 (5.x, another head initialisation), far above ln(vocab), and AdamW's
                           # third step amplifies fp32's own rounding beyond TRAJ_TOL (5e-5 from an fp64
                           # run). At 0.3: 5.8-6.5 and within 5e-7 of fp64 under both versions.
                           initializer_factor=0.3)
        cls = tf.MT5ForConditionalGeneration
    elif kind == "hf-deit":  # images: patch-embedding convolution, class and distillation tokens, classifier
        cfg = tf.DeiTConfig(image_size=IMAGE[1], patch_size=4, num_channels=IMAGE[0], hidden_size=64,
                            num_hidden_layers=2, num_attention_heads=8, intermediate_size=128, num_labels=CLASSES,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        cls = tf.DeiTForImageClassification
    elif kind == "hf-vit":  # one class token: 65 tokens, which a sequence split over 2 ranks cannot halve
        cfg = tf.ViTConfig(image_size=IMAGE[1], patch_size=4, num_channels=IMAGE[0], hidden_size=64,
                           num_hidden_layers=2, num_attention_heads=8, intermediate_size=128, num_labels=CLASSES,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        cls = tf.ViTForImageClassification
    elif kind == "hf-swin":  # images in stages of different widths (two kinds of layers), shifted windows
        cfg = tf.SwinConfig(image_size=IMAGE[1], patch_size=2, num_channels=IMAGE[0], embed_dim=32, depths=[2, 2],
                            num_heads=[2, 4], window_size=4, mlp_ratio=2.0, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=CLASSES)
        cls = tf.SwinForImageClassification
    elif kind.startswith("hf:"):  # any causal LM by transformers' model type, at the llama-like sizes
        moe = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        cfg = tf.AutoConfig.for_model(kind[3:], **llama_like, **moe, head_dim=8, attention_dropout=0.0, pad_token_id=0)
        cls = tf.AutoModelForCausalLM._model_mapping[type(cfg)]
        if getattr(cfg, "rotary_dim", None):  # a rotary width of its own (CodeGen): half of each head's
            cfg.rotary_dim = 64 // 8 // 2
        if getattr(cfg, "kv_lora_rank", None):  # latent attention (DeepSeek-V3's): its own per-head widths at
            # these sizes, a key and value per query head, the 4 experts in 2 groups (the best one kept)
            for k, v in dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                             head_dim=4, num_key_value_heads=8, n_group=2, topk_group=1, first_k_dense_replace=1).items():
                if hasattr(cfg, k):
                    setattr(cfg, k, v)
        for k, v in vars(cfg).items():  # every dropout off, as in the families above
            if k.endswith(("dropout", "pdrop", "dropout_prob", "layerdrop")) and isinstance(v, float):
                setattr(cfg, k, 0.0)
    else:
        raise KeyError(kind)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    types = getattr(cfg, "layer_types", None)
    if "num_hidden_layers" in overrides and types is not None and len(types) != cfg.num_hidden_layers:
        # the family's own pattern of layer kinds (local/global attention) over the new depth
        cfg = type(cfg)(**{**cfg.to_dict(), "layer_types": None})
    # GPT-J, BLOOM, T5, Swin and gpt-oss (its attention sinks) have no SDPA path in transformers; their
    # eager attention is what users run.
    eager = kind in ("hf-gptj", "hf-bloom", "hf-mt5", "hf-swin", "hf-gpt-oss") or not getattr(cls, "_supports_sdpa", True)
    cfg._attn_implementation = "eager" if eager else "sdpa"
    model = cls(cfg)
    if kind in VISION:
        # The class tokens as training leaves them, not at their zero initialisation: there the
        # class token's first layer norm reads an all-zero row and its gradient is ~1e6
        # (1/sqrt(eps)), where fp32 summation order alone moves it by more than GRAD_TOL.
        emb = model.get_submodule(f"{cfg.model_type}.embeddings")
        with torch.no_grad():
            for name in ("cls_token", "distillation_token", "position_embeddings"):
                if getattr(emb, name, None) is not None:
                    torch.nn.init.trunc_normal_(getattr(emb, name), std=cfg.initializer_range)
    if cfg.is_encoder_decoder:  # as a user wraps one to train on token ids: the same ids into both
        from autopar.models import SameIds

        return SameIds(model)
    return model


class StackedExperts(nn.Module):
    """Experts as transformers 5 holds them (``MixtralExperts``): every expert's weights in one 3-D
    parameter, run by the experts interface's eager loop over the experts hit, written as 5.x
    writes it, so the suite covers that form on transformers 4."""

    def __init__(self, experts: nn.ModuleList):
        super().__init__()
        self.num_experts = len(experts)
        self.gate_up_proj = nn.Parameter(torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in experts]).detach())
        self.down_proj = nn.Parameter(torch.stack([e.w2.weight for e in experts]).detach())
        self.act_fn = experts[0].act_fn

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            gate, up = F.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current_hidden_states = self.act_fn(gate) * up
            current_hidden_states = F.linear(current_hidden_states, self.down_proj[expert_idx])
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        return final_hidden_states


def _jittered(block: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Mixtral's router jitter: the block's input times uniform noise while training."""
    if block.training and block.jitter_noise > 0:
        noise = torch.empty_like(hidden_states).uniform_(1.0 - block.jitter_noise, 1.0 + block.jitter_noise)
        return hidden_states * noise
    return hidden_states


class TopKRouter(nn.Module):
    """transformers 5's ``MixtralTopKRouter``: its own ``(experts, hidden)`` weight, the tokens
    flattened again (a view of the block's flattened tokens), (logits, weights, chosen experts)."""

    def __init__(self, gate: nn.Linear, top_k: int):
        super().__init__()
        self.top_k, self.hidden_dim = top_k, gate.in_features
        self.weight = gate.weight

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight)
        weights, chosen = torch.topk(F.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        return logits, weights / weights.sum(dim=-1, keepdim=True), chosen


class StackedMoeBlock(nn.Module):
    """transformers 5's ``MixtralSparseMoeBlock``: its router (``TopKRouter``) returns (logits,
    weights, chosen experts), its experts are ``StackedExperts``; (output, router logits) as 4.x's
    block returns."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.top_k, self.jitter_noise = block.top_k, block.jitter_noise
        self.gate = TopKRouter(block.gate, block.top_k)
        self.experts = StackedExperts(block.experts)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        hidden_states = _jittered(self, hidden_states)
        x = hidden_states.view(-1, h)
        logits, weights, chosen = self.gate(x)
        return self.experts(x, chosen, weights.to(x.dtype)).reshape(b, s, h), logits


class ExpertMLP(nn.Module):
    """One expert as transformers 4 holds it: three linears (``gate_proj``, ``up_proj``,
    ``down_proj``), the weights of one entry of transformers 5's 3-D experts."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act_fn):
        super().__init__()
        inter, hidden = gate_up.shape[0] // 2, gate_up.shape[1]
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        with torch.no_grad():
            self.gate_proj.weight.copy_(gate_up[:inter])
            self.up_proj.weight.copy_(gate_up[inter:])
            self.down_proj.weight.copy_(down)
        self.act_fn = act_fn

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ModuleMoeBlock(nn.Module):
    """A mixture-of-experts block as transformers 4 writes Mixtral's, Qwen2-MoE's, Qwen3-MoE's and
    DeepSeek-V2's: a router, the experts a list of modules, looped over the experts hit
    (``one_hot``, ``nonzero``, ``torch.where``, ``index_add_``), and the shared experts (Qwen2-MoE's
    gated). Made from transformers 5's block (3-D experts, a router module) with the same weights,
    so the suite covers the module form on 5.x too. The router is a linear whose softmax top-k the
    block takes (renormalised where ``norm_topk_prob``), or with ``keep_router`` the block's own
    router module, whose chosen experts and weights it reads (DeepSeek-V2's gate: scaled, not
    renormalised). Returns what 4.x's block returns: (output, router logits) with a linear router
    (``FirstOutput`` hands 5.x's decoder layer the output), the output alone with a router module."""

    def __init__(self, block: nn.Module, keep_router: bool = False):
        super().__init__()
        router, ex = block.gate, block.experts
        n, hidden = router.weight.shape
        self.top_k, self.norm_topk_prob, self.keep_router = router.top_k, getattr(router, "norm_topk_prob", True), keep_router
        self.jitter_noise = getattr(block, "jitter_noise", 0.0)
        if keep_router:
            self.gate = router
        else:
            self.gate = nn.Linear(hidden, n, bias=False)
            self.gate.weight = router.weight
        self.experts = _expert_modules(ex)
        for name in ("shared_expert", "shared_expert_gate", "shared_experts"):
            if getattr(block, name, None) is not None:
                setattr(self, name, getattr(block, name))

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        hidden_states = _jittered(self, hidden_states)
        x = hidden_states.view(-1, h)
        if self.keep_router:
            _, weights, chosen = self.gate(hidden_states)
        else:
            logits = self.gate(x)
            weights, chosen = torch.topk(F.softmax(logits, dim=1, dtype=torch.float), self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        out = _loop_experts(self.experts, x, weights.to(x.dtype), chosen)
        if hasattr(self, "shared_expert"):
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        out = out.reshape(b, s, h)
        if self.keep_router:
            return out + self.shared_experts(hidden_states) if hasattr(self, "shared_experts") else out
        return out, logits


class FirstOutput(nn.Module):
    """A 4.x block returning (output, router logits) where a 5.x decoder layer takes the output."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, hidden_states):
        return self.block(hidden_states)[0]


def module_experts(model: nn.Module, keep_router: bool = False) -> nn.Module:
    """``model`` with each block of transformers 5's 3-D experts and router module made a
    ``ModuleMoeBlock`` (nothing to do on transformers 4, whose blocks are so already)."""
    return four_x_blocks(model, lambda m: ModuleMoeBlock(m, True) if keep_router else FirstOutput(ModuleMoeBlock(m)))


# The families whose suite cases read their experts as transformers 4 holds them (modules), and
# whether the block keeps its router module (``ModuleMoeBlock``).
MODULE_EXPERTS = {"hf-mixtral": False, "hf-qwen2-moe": False, "hf-qwen3-moe": False, "hf-deepseek-v2": True}


def _expert_modules(ex: nn.Module) -> nn.ModuleList:
    """transformers 5's 3-D experts (``gate_up_proj``, ``down_proj``) as a list of ``ExpertMLP``."""
    return nn.ModuleList(ExpertMLP(ex.gate_up_proj[e].detach(), ex.down_proj[e].detach(), ex.act_fn)
                         for e in range(ex.gate_up_proj.shape[0]))


def _loop_experts(experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """transformers 4's loop over the experts hit: each on its rows, scaled, added in place."""
    h = x.shape[-1]
    out = torch.zeros_like(x)
    mask = F.one_hot(chosen, num_classes=len(experts)).permute(2, 1, 0)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        slot, rows = torch.where(mask[e].squeeze(0))
        y = experts[e](x[None, rows].reshape(-1, h)) * weights[rows, slot, None]
        out.index_add_(0, rows, y.to(x.dtype))
    return out


class LogitsGate(nn.Module):
    """transformers 4's Hunyuan gate: the router's logits only (fp32 where its weight is)."""

    def __init__(self, wg: nn.Linear):
        super().__init__()
        self.wg = wg

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        return self.wg(x.float() if self.wg.weight.dtype == torch.float32 else x)


class LoopedMoeBlock(nn.Module):
    """A block that routes by code of its own and loops over expert modules, as transformers 4
    writes Ernie 4.5's (an fp32 linear router, top-k of the bias-corrected scores, the chosen
    scores renormalised with a floor; shared experts) and Hunyuan's (a gate module returning the
    logits; a shared MLP). Made from transformers 5's block (a router module, 3-D experts) with
    the same weights; returns the output, as 5.x's decoder layer takes it."""

    def __init__(self, block: nn.Module):
        super().__init__()
        router = block.gate
        self.top_k = router.top_k
        self.ernie = hasattr(router, "moe_statics")
        if self.ernie:
            self.gate = nn.Linear(router.weight.shape[1], router.weight.shape[0], bias=False, dtype=torch.float32)
            self.gate.weight = router.weight
            self.moe_statics, self.norm_min = router.moe_statics, router.norm_min
            self.shared_experts = block.shared_experts
        else:
            self.gate = LogitsGate(router.wg)
            self.shared_mlp = block.shared_mlp
        self.experts = _expert_modules(block.experts)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        if self.ernie:
            x = hidden_states.view(-1, h)
            shared = self.shared_experts(x) if self.shared_experts is not None else None
            with torch.autocast(device_type=x.device.type, enabled=False):
                probs = F.softmax(self.gate(x.float()), dim=1, dtype=torch.float)
                _, chosen = torch.topk(self.moe_statics(probs), self.top_k, dim=-1)
                weights = torch.gather(probs, dim=-1, index=chosen)
                weights = weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=self.norm_min)
        else:
            shared = self.shared_mlp(hidden_states).view(-1, h)
            probs = F.softmax(self.gate(hidden_states), dim=1, dtype=torch.float)
            x = hidden_states.view(-1, h)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = _loop_experts(self.experts, x, weights.to(x.dtype), chosen)
        if shared is not None:
            out = out + shared
        return out.reshape(b, s, h)


class ParallelExperts(nn.Module):
    """transformers 4's Granite MoE experts: a 3-D weight, the rows split by the router's list of
    rows per expert, one linear each."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.num_experts = weight.shape[0]

    def forward(self, inputs, expert_size):
        parts = inputs.split(expert_size, dim=0)
        return torch.cat([F.linear(parts[i], self.weight[i]) for i in range(self.num_experts)], dim=0)


class SortingGate(nn.Module):
    """transformers 4's Granite MoE router: top-k of the logits, softmax over the chosen, the
    rows sorted by expert and each expert's row count as a Python list."""

    def __init__(self, weight: torch.Tensor, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = weight.shape[0], top_k
        self.layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        self.layer.weight = weight

    def forward(self, hidden_states):
        logits = self.layer(hidden_states).float()
        top_logits, top_idx = logits.topk(self.top_k, dim=1)
        gates = torch.softmax(top_logits, dim=1).type_as(hidden_states)
        zeros = torch.zeros([gates.size(0), self.num_experts], dtype=gates.dtype, device=gates.device)
        expert_size = zeros.scatter(1, top_idx, 1).long().sum(0).tolist()
        _, order = top_idx.flatten().sort(0)
        return order, order.div(self.top_k, rounding_mode="trunc"), gates.flatten()[order], expert_size, logits


class SplitMoeBlock(nn.Module):
    """transformers 4's Granite MoE block (``SortingGate``, ``ParallelExperts`` in and out) made
    from transformers 5's (a router, 3-D experts) with the same weights; returns the output."""

    def __init__(self, block: nn.Module):
        super().__init__()
        ex = block.experts
        self.input_size, self.activation = ex.gate_up_proj.shape[2], ex.act_fn
        self.input_linear = ParallelExperts(ex.gate_up_proj)
        self.output_linear = ParallelExperts(ex.down_proj)
        self.router = SortingGate(block.router.weight, block.router.top_k)

    def forward(self, layer_input):
        b, s, h = layer_input.size()
        x = layer_input.reshape(-1, h)
        _, rows, gates, expert_size, _ = self.router(x)
        hidden = self.input_linear(x[rows], expert_size).chunk(2, dim=-1)
        out = self.output_linear(self.activation(hidden[0]) * hidden[1], expert_size) * gates[:, None]
        return torch.zeros((b * s, h), dtype=out.dtype, device=out.device).index_add(0, rows, out).view(b, s, h)


def four_x_blocks(model: nn.Module, form) -> nn.Module:
    """``model`` with each block of transformers 5's 3-D experts made ``form`` (a block as 4.x
    writes it; nothing to do on 4.x, whose blocks are so already)."""
    for name, m in list(model.named_modules()):
        ex = m._modules.get("experts")
        if ex is not None and getattr(ex, "gate_up_proj", None) is not None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, form(m))
    return model


# The families whose suite cases read their experts in a form transformers 4 writes and 5 no
# longer does: looped by the block's own routing (Ernie 4.5, Hunyuan), split by a list of rows
# per expert (Granite MoE).
FOUR_X_FORMS = {"hf:ernie4_5_moe": LoopedMoeBlock, "hf:hunyuan_v1_moe": LoopedMoeBlock, "hf:granitemoe": SplitMoeBlock}


def _biased_experts(model: nn.Module) -> nn.Module:
    """``model`` with a bias (random, so that its gradient differs per expert) on every routed
    expert's linear: experts as modules whose biases each row takes by its expert."""
    g = torch.Generator().manual_seed(2)
    for block in model.modules():
        experts = block._modules.get("experts")
        for expert in experts if isinstance(experts, nn.ModuleList) else ():
            for lin in (expert.gate_proj, expert.up_proj, expert.down_proj):
                lin.bias = nn.Parameter(0.1 * torch.randn(lin.out_features, generator=g))
    return model


def _stacked_mixtral(**overrides) -> nn.Module:
    """Mixtral with its experts as transformers 5 holds them (the same weights): made so on 4.x,
    as built on 5.x."""
    model = _hf("hf-mixtral", **overrides)
    for layer in model.model.layers:
        if hasattr(layer, "block_sparse_moe"):  # transformers 4: experts as modules
            layer.block_sparse_moe = StackedMoeBlock(layer.block_sparse_moe)
    return model


class TokenTable(nn.Module):
    """An embedding of the project's own (not nn.Embedding)."""

    def __init__(self, n: int, dim: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(n, dim) * 0.02)

    def forward(self, ids):
        return F.embedding(ids, self.table)


class Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale


class FusedBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = Norm(dim), Norm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.w13 = nn.Linear(dim, 4 * dim, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.wqkv(self.n1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        g, u = self.w13(self.n2(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(g) * u)


class CustomLlama(nn.Module):
    """Blocks in a ModuleDict, fused QKV and gate/up projections, its own embedding class."""

    def __init__(self, dim: int = 64, heads: int = 8, layers: int = 2):
        super().__init__()
        self.tok = TokenTable(VOCAB, dim)
        self.stack = nn.ModuleDict({f"block_{i}": FusedBlock(dim, heads) for i in range(layers)})
        self.norm = Norm(dim)
        self.out = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids):
        x = self.tok(ids)
        for blk in self.stack.values():
            x = blk(x)
        return self.out(self.norm(x))


class TitanAttention(nn.Module):
    """Attention as torchtitan's Llama 3 writes it: complex rotary embeddings (a complex buffer,
    ``view_as_complex``/``view_as_real``), grouped KV heads repeated, SDPA."""

    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.hd)
        k = self.wk(x).view(b, s, self.kv_heads, self.hd)
        v = self.wv(x).view(b, s, self.kv_heads, self.hd)
        f = freqs_cis[:s].view(1, s, 1, -1)
        q = torch.view_as_real(torch.view_as_complex(q.float().reshape(b, s, self.heads, -1, 2)) * f).flatten(3)
        k = torch.view_as_real(torch.view_as_complex(k.float().reshape(b, s, self.kv_heads, -1, 2)) * f).flatten(3)
        rep = self.heads // self.kv_heads
        k = k[:, :, :, None, :].expand(b, s, self.kv_heads, rep, self.hd).reshape(b, s, self.heads, self.hd)
        v = v[:, :, :, None, :].expand(b, s, self.kv_heads, rep, self.hd).reshape(b, s, self.heads, self.hd)
        q, k, v = (t.type_as(x).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).contiguous().view(b, s, -1))


class TitanBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.attention = TitanAttention(dim, heads, kv_heads)
        self.w1, self.w2, self.w3 = (nn.Linear(a, b, bias=False) for a, b in ((dim, hidden), (hidden, dim), (dim, hidden)))
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class TitanLlama(nn.Module):
    """Blocks in a ModuleDict keyed by layer number and a complex ``freqs_cis`` buffer passed to
    each, the way torchtitan's Llama 3 is written."""

    def __init__(self, dim: int = 64, heads: int = 8, kv_heads: int = 4, layers: int = 4, seq: int = 64):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleDict({str(i): TitanBlock(dim, heads, kv_heads, 128) for i in range(layers)})
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, VOCAB, bias=False)
        hd = dim // heads
        freqs = 1.0 / (500000.0 ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(seq).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=True)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


LATENT = (4, 8, 8)  # the diffusion transformer's latents: channels, height, width


def _dit() -> nn.Module:
    """diffusers' class-conditional DiT (adaptive layer norm from timestep and class, patchified
    latents in, noise prediction out), tiny. Its training-time class-label dropout (for
    classifier-free guidance) is off: a random draw the one-process reference would make differently."""
    from diffusers import DiTTransformer2DModel
    from diffusers.models.embeddings import LabelEmbedding

    model = DiTTransformer2DModel(num_attention_heads=8, attention_head_dim=8, in_channels=LATENT[0], num_layers=2,
                                  sample_size=LATENT[1], patch_size=2, num_embeds_ada_norm=CLASSES, dropout=0.0)
    for m in model.modules():
        if isinstance(m, LabelEmbedding):
            m.dropout_prob = 0.0
    return model


def loss_of(kind: str):
    """The loss ``kind`` trains with: the noise MSE for the diffusion transformer, else autopar's
    default (cross-entropy over the logits' last dim)."""
    from autopar.capture import default_loss, noise_mse

    return noise_mse if kind.startswith("diffusers-dit") else default_loss


def example(kind: str, seed: int, B: int = 8, S: int = 32) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """One batch for ``kind``: its inputs (token ids; images; latents, timesteps and class labels)
    and target (next-token labels, class labels, the noise), seeded."""
    g = torch.Generator().manual_seed(seed)
    if kind in VISION or kind.rsplit("-", 1)[0] in VISION:  # "hf-deit-4layers"
        return (torch.randn((B, *IMAGE), generator=g),), torch.randint(0, CLASSES, (B,), generator=g)
    if kind.startswith("diffusers-dit"):
        inputs = (torch.randn((B, *LATENT), generator=g), torch.randint(0, 1000, (B,), generator=g),
                  torch.randint(0, CLASSES, (B,), generator=g))
        return inputs, torch.randn((B, *LATENT), generator=g)
    return (torch.randint(0, VOCAB, (B, S), generator=g),), torch.randint(0, VOCAB, (B, S), generator=g)


def build(kind: str, **overrides) -> nn.Module:
    if kind == "titan-llama":
        return TitanLlama()
    if kind == "diffusers-dit":
        return _dit()
    if kind.startswith(("hf-", "hf:")):
        base = kind
        if kind.endswith("layers"):  # "hf-<family>-<n>layers": n decoder layers
            base, n = kind.rsplit("-", 1)
            overrides = {"num_hidden_layers": int(n.removesuffix("layers")), **overrides}
        model = _hf(base, **overrides)
        if base in FOUR_X_FORMS:
            return four_x_blocks(model, FOUR_X_FORMS[base])
        return module_experts(model, MODULE_EXPERTS[base]) if base in MODULE_EXPERTS else model
    if kind == "custom-llama":
        return CustomLlama()
    if kind == "custom-mixtral-3d":
        return _stacked_mixtral(**overrides)
    if kind == "custom-qwen2-moe-biased":
        return _biased_experts(build("hf-qwen2-moe"))
    import dataclasses

    from autopar import models

    if kind.endswith("layers"):  # "<preset>-<n>layers": the preset with n layers (4: the preset as it is)
        base, n = kind.rsplit("-", 1)
        cfg = dataclasses.replace(models.PRESETS[base], n_layers=int(n.removesuffix("layers")))
        return (models.Llama if isinstance(cfg, models.LlamaConfig) else models.GPT)(cfg)
    if kind in ("llama-tiny", "gpt-tiny"):  # 2 layers: less to compile
        cfg = dataclasses.replace(models.PRESETS[kind], n_layers=2)
        return (models.Llama if kind == "llama-tiny" else models.GPT)(cfg)
    return models.build_preset(kind)
