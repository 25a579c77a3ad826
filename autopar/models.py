"""Reference models and model sources.

Two reference families, written as ordinary single-device ``nn.Module``s with no parallelism in
them (autopar adds it):

- ``Llama``: RMSNorm, rotary embeddings (real-valued cos/sin), grouped-query attention through
  ``scaled_dot_product_attention``, SwiGLU MLP. Presets match Llama 3.1 8B/70B/405B.
- ``GPT``: LayerNorm, learned positions, multi-head attention written out (QK^T, softmax, dropout,
  AV) as in Megatron-LM, GELU MLP of 4h. Presets follow Table 1 of Narayanan et al. 2021
  ("Efficient Large-Scale Language Model Training on GPU Clusters"), 1.7B ... 1T.

A *model source* is what the CLI and ``autopar.plan`` accept by name: a preset (``llama3-8b``), a
HuggingFace ``config.json`` (Llama, Qwen2, Mistral, GPT-2 families, through ``transformers``) or a
``package.module:factory`` that returns any ``nn.Module``. ``ModelSource.build()`` constructs the
model; callers decide whether that happens on fake tensors (planning) or real ones (training).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.capture import noise_mse
from autopar.errors import AutoparError


# --------------------------------------------------------------------------------------------
# Llama
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 14336
    vocab_size: int = 128256
    max_seq_len: int = 8192
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5


def _rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, seq, heads, head_dim); rotate pairs (even, odd) as in Llama.
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Head counts are inferred (-1) so that a column-sharded projection works unchanged.
        q = _apply_rope(self.wq(x).view(b, s, -1, self.head_dim), cos, sin)
        k = _apply_rope(self.wk(x).view(b, s, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = LlamaAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = _rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


# --------------------------------------------------------------------------------------------
# GPT (Megatron-style)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPTConfig:
    dim: int = 2304
    n_layers: int = 24
    n_heads: int = 24
    vocab_size: int = 51200
    max_seq_len: int = 2048
    dropout: float = 0.0
    tie_embeddings: bool = False  # the head shares the token embedding's weight (GPT-2, GPT-3)


class GPTAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)  # fused, as Megatron-LM and GPT-2 do
        self.out_proj = nn.Linear(cfg.dim, cfg.dim)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in self.qkv(x).split(d, dim=-1))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        probs = F.dropout(probs, self.dropout, self.training)
        out = (probs @ v).transpose(1, 2).reshape(b, s, -1)
        return F.dropout(self.out_proj(out), self.dropout, self.training)


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.attn = GPTAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.fc_in = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.fc_out = nn.Linear(4 * cfg.dim, cfg.dim)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        y = self.fc_out(F.gelu(self.fc_in(self.ln_2(x))))
        return x + F.dropout(y, self.dropout, self.training)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        nn.init.normal_(self.wte.weight, std=0.02)  # GPT-2's initialisation
        nn.init.normal_(self.wpe.weight, std=0.01)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.wte(tokens) + self.wpe(pos)[None]
        for blk in self.blocks:
            h = blk(h)
        return self.lm_head(self.ln_f(h))


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------
def _llama(dim, layers, heads, kv, ffn, vocab=128256, seq=8192, theta=500000.0):
    return LlamaConfig(dim, layers, heads, kv, ffn, vocab, seq, theta)


# GPT family of Narayanan et al. 2021, Table 1: (hidden, heads, layers); vocab 51200, seq 2048.
_GPT_TABLE = {
    "gpt-1.7b": (2304, 24, 24),
    "gpt-3.6b": (3072, 32, 30),
    "gpt-7.5b": (4096, 32, 36),
    "gpt-18b": (6144, 48, 40),
    "gpt-39b": (8192, 64, 48),
    "gpt-76b": (10240, 80, 60),
    "gpt-145b": (12288, 96, 80),
    "gpt-175b": (12288, 96, 96),
    "gpt-310b": (16384, 128, 96),
    "gpt-530b": (20480, 128, 105),
    "gpt-1t": (25600, 160, 128),
}

PRESETS: dict[str, Any] = {
    "llama3-8b": _llama(4096, 32, 32, 8, 14336),
    "llama3-70b": _llama(8192, 80, 64, 8, 28672),
    "llama3-405b": _llama(16384, 126, 128, 8, 53248),
    "llama2-7b": _llama(4096, 32, 32, 32, 11008, vocab=32000, seq=4096, theta=10000.0),
    "llama2-13b": _llama(5120, 40, 40, 40, 13824, vocab=32000, seq=4096, theta=10000.0),
    "llama2-70b": _llama(8192, 80, 64, 8, 28672, vocab=32000, seq=4096, theta=10000.0),
    # Small shapes for tests and CPU demos.
    "llama-tiny": _llama(64, 4, 8, 4, 160, vocab=256, seq=64, theta=10000.0),
    "llama-small": _llama(256, 8, 8, 4, 688, vocab=1024, seq=256, theta=10000.0),
    "gpt-tiny": GPTConfig(64, 4, 4, 256, 64, tie_embeddings=True),
    # Megatron-LM shares the input embedding with the output head by default, as GPT-3 did.
    **{k: GPTConfig(h, n, a, 51200, 2048, tie_embeddings=True) for k, (h, a, n) in _GPT_TABLE.items()},
}


def build_preset(name: str, seq_len: int | None = None) -> nn.Module:
    cfg = PRESETS[name]
    if seq_len and seq_len > cfg.max_seq_len:  # longer contexts need longer position tables
        cfg = dataclasses.replace(cfg, max_seq_len=seq_len)
    return Llama(cfg) if isinstance(cfg, LlamaConfig) else GPT(cfg)


# --------------------------------------------------------------------------------------------
# Model sources
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSource:
    """Something that builds a model: a name for reports plus a zero-argument constructor.

    ``seq_len`` and ``vocab_size`` are the model's natural defaults (None when unknown);
    ``hf`` is True for HuggingFace models, whose forward returns an output object.
    """

    name: str
    build: Callable[[], nn.Module]
    seq_len: int | None = None
    vocab_size: int | None = None
    hf: bool = False
    spec: dict = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()  # what autopar assumed about the model (shown with the plan)
    # A model not fed token ids: each forward input's shape per sample and dtype (images; latents,
    # timesteps, class labels), what they are in words, and the loss it trains with (None: the
    # default cross-entropy).
    inputs: tuple[tuple[tuple[int, ...], str], ...] = ()
    takes: str = ""
    loss_fn: Callable | None = None

    def example(self, batch: int) -> tuple[torch.Tensor, ...]:
        """One batch of the inputs, zeros (planning traces shapes, not values)."""
        return tuple(torch.zeros((batch, *shape), dtype=getattr(torch, dtype)) for shape, dtype in self.inputs)


def _check_config_fields(path: str, raw: dict, cls: type) -> None:
    """Refuse a field that looks like a misspelling of one the config class reads (transformers
    would keep it as an unused attribute without a word). Fields unlike any known one are kept:
    configs carry extras (architectures, auto_map, ...) that newer versions add."""
    import difflib

    known = set(cls().to_dict()) | set(inspect.signature(cls.__init__).parameters)
    known |= set(getattr(cls, "attribute_map", {}))
    for key in raw:
        if key in known or key.startswith("_"):
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.85)
        if close:
            raise AutoparError(f"{path}: unknown field {key!r} for a {raw['model_type']} config; did you mean "
                               f"{close[0]!r}? (transformers would ignore it and build a different model)")


# The fields that decide a decoder's shape. Without the first three transformers builds its own
# default model (a 4096-wide, 32-head one under the file's name): refused. The others have
# conventional defaults (KV heads = heads, FFN from the width): used, and said in a note.
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads")
_DEFAULTED = ("vocab_size", "intermediate_size", "num_key_value_heads")


def _shape_fields(path: str, raw: dict, cfg) -> tuple[str, ...]:
    """Refuse a config without the fields that define its shape; name the defaults it takes."""
    aliases = dict(getattr(type(cfg), "attribute_map", {}))  # the standard name -> the family's (n_embd)

    def given(field: str) -> bool:
        return field in raw or aliases.get(field) in raw

    missing = [f for f in _REQUIRED if hasattr(cfg, f) and not given(f)]
    if missing:
        raise AutoparError(f"{path} has no {', '.join(repr(aliases.get(f, f)) for f in missing)}: without it "
                           f"transformers builds its default {raw['model_type']} shape ("
                           + ", ".join(f"{f}={getattr(cfg, f)}" for f in missing)
                           + "), not this model; add the field(s) from the model's own config.json")
    notes = []
    for f in _DEFAULTED:
        v = getattr(cfg, f, None)
        if v is not None and not given(f):
            notes.append(f"{os.path.basename(path)} has no {aliases.get(f, f)!r}: transformers' default {v} used")
    heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
        why = "" if given("num_key_value_heads") else f" (no num_key_value_heads in the file: {kv} is transformers' default)"
        raise AutoparError(f"{path}: {heads} attention heads are not divisible by {kv} KV heads{why}; "
                           "num_key_value_heads must divide num_attention_heads")
    return tuple(notes)


def cache_dir() -> str:
    """autopar's cache: profiles of presets and configs, what a config file was found to be."""
    return os.environ.get("AUTOPAR_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "autopar")


def _hf_source(path: str) -> ModelSource:
    """A HuggingFace config file as a model source. What transformers makes of the file (checked
    once: family, defaults, length, attention kernel) is cached by its contents, transformers'
    version and this module's source, so planning a config seen before does not import
    transformers (seconds) until a model has to be built."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise AutoparError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
                           "give the config.json of a HuggingFace model") from e
    except OSError as e:
        raise AutoparError(f"cannot read {path}: {e.strerror}") from e
    if isinstance(raw, dict) and "_class_name" in raw and "model_type" not in raw:
        return _diffusers_source(path, raw)
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise AutoparError(f"{path} has no 'model_type': give the config.json of a HuggingFace model "
                           "(it names its family, e.g. \"model_type\": \"llama\")")
    import hashlib
    from importlib import metadata

    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError as e:  # pragma: no cover - transformers is a dependency
        raise AutoparError(f"reading {path} needs the 'transformers' package") from e
    h = hashlib.sha256(json.dumps([raw, os.path.basename(path), version], sort_keys=True, default=str).encode())
    with open(__file__, "rb") as f:  # the checks below are this module's: a change to it checks again
        h.update(f.read())
    key = h.hexdigest()[:32]
    cached = os.path.join(cache_dir(), "configs", key + ".json")
    meta = None
    if os.path.exists(cached):
        try:
            with open(cached) as f:
                meta = json.load(f)
        except (OSError, json.JSONDecodeError):
            meta = None
    if meta is None:
        meta = _hf_meta(path, raw)
        try:
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            with open(cached + ".tmp", "w") as f:
                json.dump(meta, f)
            os.replace(cached + ".tmp", cached)
        except OSError:
            pass  # a read-only home: checked again next time
    attn = meta["attn"]
    image = tuple(meta["image"]) if meta.get("image") else None
    inputs = ((image, "float32"),) if image else ()

    def build() -> nn.Module:
        import contextlib

        import transformers
        from torch._subclasses.fake_tensor import FakeTensor
        try:  # transformers 5 keeps it in ``initialization``, 4.x in ``modeling_utils``
            from transformers.initialization import no_init_weights
        except ImportError:
            from transformers.modeling_utils import no_init_weights

        cfg = transformers.AutoConfig.for_model(**raw)
        if hasattr(cfg, "use_cache"):
            cfg.use_cache = False
        cfg._attn_implementation = attn
        auto = "AutoModelForImageClassification" if image else _LM_CLASSES[meta.get("task", "causal")][1]
        # Built on fake or meta tensors (planning): transformers' weight initialisation (a call per
        # module on values that do not exist; half of building DeepSeek-V3's 15,000 experts) is
        # skipped, and with it the tying of weights, which is done here. Real weights are initialised.
        probe = torch.empty(0)
        shapes_only = probe.is_meta or isinstance(probe, FakeTensor)
        with no_init_weights() if shapes_only else contextlib.nullcontext():
            model = getattr(transformers, auto).from_config(cfg, attn_implementation=attn)
        if shapes_only:
            model.tie_weights()
        return SameIds(model) if meta.get("task") == "seq2seq" else model

    # The model's own name where the config has one (a hub id), else the file's.
    name = str(raw.get("_name_or_path") or "") or _file_name(path) or meta["model_type"]
    return ModelSource(
        name=f"hf:{meta['model_type']}:{name}",
        build=build,
        seq_len=meta["seq_len"],
        vocab_size=meta["vocab_size"],
        hf=True,
        spec={"kind": "hf", "config": raw},
        notes=tuple(meta["notes"]),
        inputs=inputs,
        takes=f"images of {'x'.join(map(str, image))}" if image else "",
    )


def _file_name(path: str) -> str:
    """A config file's name for reports: its directory for a config.json, the file's stem else."""
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.basename(os.path.dirname(os.path.abspath(path))) if stem == "config" else stem


# A text encoder's tokens a diffusion model's conditioning is planned at (CLIP's 77).
TEXT_TOKENS = 77


def _diffusion_inputs(cls: type, cfg: dict) -> tuple[tuple, list[str]]:
    """The forward inputs of a diffusers transformer, per sample, from its config: the leading
    arguments it is called with in training (latents, timestep, class labels, text conditioning),
    up to the first it does not need. Returns ((shape, dtype) per input, their names)."""
    size = cfg.get("sample_size")
    size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
    text = cfg.get("joint_attention_dim") or cfg.get("cross_attention_dim") or cfg.get("caption_channels")
    known = {
        "hidden_states": ((cfg.get("in_channels"), *size), "float32") if cfg.get("in_channels") and size[0] else None,
        "timestep": ((), "float32"),
        "class_labels": ((), "int64") if cfg.get("num_embeds_ada_norm") else None,
        "encoder_hidden_states": ((TEXT_TOKENS, text), "float32") if text else None,
        "pooled_projections": ((cfg["pooled_projection_dim"],), "float32") if cfg.get("pooled_projection_dim") else None,
    }
    params = list(inspect.signature(cls.forward).parameters.items())[1:]
    if not params or params[0][0] != "hidden_states" or known["hidden_states"] is None:
        raise AutoparError(f"{cls.__name__}'s config gives no latents' shape (in_channels, sample_size): plan it from "
                           "the module: autopar.plan(model, gpus, example_inputs=(...), example_target=...)")
    specs, names = [], []
    for name, param in params:
        spec = known.get(name)
        if spec is None:
            if param.default is inspect.Parameter.empty:
                raise AutoparError(f"{cls.__name__}'s forward needs {name!r}, which autopar cannot make from its "
                                   "config: plan it from the module and one batch of its inputs: "
                                   "autopar.plan(model, gpus, example_inputs=(...), example_target=...)")
            break
        specs.append(spec)
        names.append(name)
    return tuple(specs), names


def _diffusers_source(path: str, raw: dict) -> ModelSource:
    """A diffusers model's config.json (``_class_name``: a transformer such as
    ``DiTTransformer2DModel`` or ``SD3Transformer2DModel``): planned on latents of its sample size
    with the other inputs its forward takes, trained on the noise's mean squared error."""
    name = str(raw["_class_name"])
    try:
        import diffusers
    except ImportError as e:
        raise AutoparError(f"{path} is a diffusers config ({name}): planning it needs the 'diffusers' package "
                           "(pip install diffusers)") from e
    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module) and hasattr(cls, "from_config")):
        raise AutoparError(f"{path}: diffusers {diffusers.__version__} has no model class {name[:60]!r}")
    try:  # a legacy class name that diffusers maps by the config (Transformer2DModel with DiT's norm)
        from diffusers.models.model_loading_utils import _CLASS_REMAPPING_DICT

        cls = getattr(diffusers, _CLASS_REMAPPING_DICT.get(cls.__name__, {}).get(raw.get("norm_type"), ""), cls)
    except ImportError:  # pragma: no cover - older diffusers
        pass
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    inputs, names = _diffusion_inputs(cls, {**defaults, **{k: v for k, v in raw.items() if not k.startswith("_")}})
    notes = (f"planned on {', '.join(names)} (forward inputs, zeros), the noise's mean squared error as the loss",)
    if "encoder_hidden_states" in names:
        notes += (f"text conditioning of {TEXT_TOKENS} tokens; plan another with autopar.plan(model, gpus, "
                  "example_inputs=(...))",)

    def build() -> nn.Module:
        return cls.from_config(raw)

    return ModelSource(name=f"diffusers:{cls.__name__}:{_file_name(path)}", build=build, spec={"kind": "diffusers", "config": raw},
                       notes=notes, inputs=inputs, takes="latents of " + "x".join(map(str, inputs[0][0])),
                       loss_fn=noise_mse)


def _hf_meta(path: str, raw: dict) -> dict:
    """What transformers makes of a config (the checks that refuse a bad one included)."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - transformers is a dependency
        raise AutoparError(f"reading {path} needs the 'transformers' package: {e}") from e
    known = transformers.CONFIG_MAPPING
    if raw["model_type"] not in known:
        import difflib

        close = difflib.get_close_matches(str(raw["model_type"]), list(known.keys()), n=3)
        hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else (
            "supported families include llama, qwen2, mistral, gemma, phi3, gpt2, gptj, gpt_neox, opt, bloom, "
            "falcon, mixtral")
        raise AutoparError(f"{path}: model_type {str(raw['model_type'])[:60]!r} is not a family transformers "
                           f"{transformers.__version__} knows; {hint}")
    _check_config_fields(path, raw, known[raw["model_type"]])
    try:
        cfg = transformers.AutoConfig.for_model(**raw)
    except (ValueError, KeyError, TypeError) as e:
        raise AutoparError(f"{path} is not a valid {raw['model_type']} config: {e}") from e
    if type(cfg) in transformers.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING and hasattr(cfg, "image_size"):
        # An image classifier: planned on images of the config's size (its sequence is the tokens
        # per image that its layers see, found in the trace), its classes the head's outputs.
        size = cfg.image_size if isinstance(cfg.image_size, (list, tuple)) else (cfg.image_size, cfg.image_size)
        cls = transformers.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING[type(cfg)]
        return {"model_type": cfg.model_type, "seq_len": None, "vocab_size": cfg.num_labels,
                "attn": "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager",
                "image": [getattr(cfg, "num_channels", 3), *size], "notes": []}
    task = _lm_task(transformers, cfg)
    if task is None:
        raise AutoparError(
            f"{path}: a {cfg.model_type} config is neither a language model's (causal, masked or "
            f"encoder-decoder) nor an image classifier's in transformers {transformers.__version__}, which is "
            "what autopar plans from a config file; plan it from the module and one batch of its inputs: "
            "autopar.plan(model, gpus, example_inputs=(...))")
    notes = _shape_fields(path, raw, cfg)
    if task == "seq2seq":
        notes += ("an encoder-decoder: the same token ids into the encoder and the decoder (one sequence length)",)
    # SDPA (the fused kernel) where transformers has it for the family; GPT-J, BLOOM and T5 have
    # only their eager attention, which is what their users run.
    cls = getattr(transformers, _LM_CLASSES[task][0]).get(type(cfg), None)
    attn = "sdpa" if cls is None or getattr(cls, "_supports_sdpa", False) else "eager"
    seq = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return {"model_type": cfg.model_type, "seq_len": seq, "vocab_size": cfg.vocab_size, "attn": attn,
            "notes": list(notes), "task": task}


# The language-model tasks a config is built for: transformers' mapping of configs to model
# classes, and its auto class, by task.
_LM_CLASSES = {
    "causal": ("MODEL_FOR_CAUSAL_LM_MAPPING", "AutoModelForCausalLM"),
    "masked": ("MODEL_FOR_MASKED_LM_MAPPING", "AutoModelForMaskedLM"),
    "seq2seq": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING", "AutoModelForSeq2SeqLM"),
}


def _lm_task(tf, cfg) -> str | None:
    """What a text config is trained as: an encoder-decoder; an encoder (a family with a masked-LM
    head and no causal flag: BERT, RoBERTa, ModernBERT, whose causal-LM classes are for
    fine-tuning as decoders); else a decoder; None for none of them."""
    def has(task: str) -> bool:
        return type(cfg) in getattr(tf, _LM_CLASSES[task][0])

    if not hasattr(cfg, "vocab_size"):
        return None
    if getattr(cfg, "is_encoder_decoder", False) and has("seq2seq"):
        return "seq2seq"
    if has("masked") and not getattr(cfg, "is_decoder", False):
        return "masked"
    return "causal" if has("causal") else None


class SameIds(nn.Module):
    """An encoder-decoder trained on token ids as one sequence: the same ids into the encoder and
    the decoder (how autopar plans an encoder-decoder config: one sequence length for both)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, decoder_input_ids=ids).logits


DEFAULT_SEQ_LEN = 4096
# A config whose maximum is above this (long-context models: 32k to 1M positions) is planned at
# DEFAULT_SEQ_LEN unless a length is given: that maximum is what the model can read, not the
# length it is usually trained at.
LONG_CONTEXT = 8192


def planning_seq_len(src: ModelSource, seq_len: int | None) -> tuple[int, tuple[str, ...]]:
    """The sequence length to plan ``src`` at and, when autopar chose it, a note saying so."""
    limit = src.seq_len
    if seq_len is not None:
        if seq_len < 1:
            raise AutoparError(f"the sequence length must be positive, got {seq_len}")
        if src.hf and limit and seq_len > limit:
            raise AutoparError(
                f"--seq-len {seq_len} is above {src.name}'s {limit} positions (max_position_embeddings); "
                f"give at most {limit}, or a config with a longer context"
            )
        return seq_len, ()
    if not limit:
        return DEFAULT_SEQ_LEN, (f"sequence length {DEFAULT_SEQ_LEN} (default: the config gives no maximum; "
                                 "pass --seq-len to plan another)",)
    if limit > LONG_CONTEXT:
        return DEFAULT_SEQ_LEN, (f"sequence length {DEFAULT_SEQ_LEN} (default: the config allows {limit}; "
                                 "pass --seq-len to plan a longer context)",)
    return limit, ()


def hf_source_from_config(config: Any) -> ModelSource:
    """A source for a ``transformers`` config object (used by tests and the Python API)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config.to_dict(), f)
    return _hf_source(f.name)


def resolve(spec: str, seq_len: int | None = None) -> ModelSource:
    """Turn a CLI model argument into a ModelSource, with an error that lists what is known."""
    if spec in PRESETS:
        cfg = PRESETS[spec]
        return ModelSource(
            name=spec,
            build=lambda: build_preset(spec, seq_len),
            seq_len=cfg.max_seq_len,
            vocab_size=cfg.vocab_size,
            spec={"kind": "preset", "name": spec},
        )
    if spec.endswith(".json") or os.path.isdir(spec):
        path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
        if not os.path.exists(path):
            raise AutoparError(f"no HuggingFace config at {path}")
        return _hf_source(path)
    if ":" in spec:
        mod_name, _, attr = spec.partition(":")
        if os.getcwd() not in sys.path and "" not in sys.path:  # console scripts: import from here too
            sys.path.insert(0, os.getcwd())
        try:
            factory = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as e:
            raise AutoparError(f"cannot load factory {spec!r}: {e}") from e
        return ModelSource(name=spec, build=factory, spec={"kind": "factory", "name": spec})
    raise AutoparError(
        f"unknown model {spec!r}. Known presets: {', '.join(sorted(PRESETS))}; or give a "
        "HuggingFace config.json path, or a 'package.module:factory' that returns an nn.Module"
    )
