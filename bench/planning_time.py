"""Planning time on this machine, from model to plan (capture, analysis, costing, search), with
``import torch, autopar`` excluded, and peak RSS. Each case runs in a fresh process with an empty
profile cache. A preset's profile at its default shapes ships with the package (``make profiles``),
so planning a preset never traces it; the last cases, Llama 3 8B, DeepSeek-V3 and
Qwen3-235B-A22B given as HuggingFace ``config.json`` files, are traced (the first fake-tensor use
imports Dynamo, about 1 s here): what a model of the user's own costs the first time.

Targets (issue 11): planning beyond ``import torch, autopar`` within 0.3 s for llama3-8b on 64
H100 and within 1 s for llama3-405b on 16,384 (issue 2's were 1 s and 10 s, RSS < 4 GB). Each
row also says whether the search alone meets the target.
"""

import json
import os
import subprocess
import sys
import tempfile

from bench.common import write

LLAMA3_8B_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                    "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                    "num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 8192,
                    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
# Mixture-of-experts configs as published (DeepSeek-V3's and Qwen3-235B-A22B's config.json: the
# fields transformers reads), traced the first time: the first plan of a new MoE config.
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16", "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "use_cache": False}
QWEN3_235B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
    "tie_word_embeddings": False, "hidden_act": "silu", "decoder_sparse_step": 1, "mlp_only_layers": [],
    "torch_dtype": "bfloat16", "use_cache": False}
CONFIGS = {"llama3-8b config.json (traced)": LLAMA3_8B_CONFIG, "deepseek-v3 config.json (traced)": DEEPSEEK_V3_CONFIG,
           "qwen3-235b-a22b config.json (traced)": QWEN3_235B_CONFIG}
CASES = [("llama3-8b", 64, 0.3), ("llama3-70b", 512, None), ("gpt-175b", 1024, None), ("llama3-405b", 16384, 1.0),
         ("llama3-8b config.json (traced)", 64, None), ("deepseek-v3 config.json (traced)", 2048, None),
         ("qwen3-235b-a22b config.json (traced)", 1024, None)]

CHILD = r"""
import json, resource, sys, time
import torch, autopar
from autopar import api
name, gpus = sys.argv[1], int(sys.argv[2])
t0 = time.perf_counter()
prof = api.profile_model(name)
t1 = time.perf_counter()
plan = api.plan(name, gpus, profiled=prof)
t2 = time.perf_counter()
print(json.dumps({"capture_s": t1 - t0, "search_s": t2 - t1, "total_s": t2 - t0,
                  "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "plan": plan.as_config_string(), "mfu": plan.predicted["mfu"]}))
"""


def main() -> int:
    rows, ok = [], True
    for name, gpus, target in CASES:
        cache = tempfile.mkdtemp(prefix="autopar-planning-")
        env = dict(os.environ, AUTOPAR_CACHE_DIR=cache)
        model = name
        if name in CONFIGS:
            model = os.path.join(cache, "config.json")
            with open(model, "w") as f:
                json.dump(CONFIGS[name], f)
        out = subprocess.run([sys.executable, "-c", CHILD, model, str(gpus)], capture_output=True, text=True, check=True,
                             env=env)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r.update(model=name, gpus=gpus, target_s=target or "", meets=(r["total_s"] < target) if target else "",
                 search_meets=(r["search_s"] < target) if target else "")
        if target and not r["meets"]:
            ok = False
        rows.append(r)
        print(f"{name:12s} {gpus:6d} GPUs  capture {r['capture_s']:.2f}s  search {r['search_s']:.2f}s  "
              f"total {r['total_s']:.2f}s  RSS {r['rss_gb']:.2f} GB  -> {r['plan']}")
    write("planning_time", rows, {"all targets met": ok},
          ["model", "gpus", "capture_s", "search_s", "total_s", "target_s", "meets", "search_meets", "rss_gb", "plan"],
          "Planning time (2-core CPU machine, fresh process per case)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
