"""Planning time on this machine, from model to plan (capture, analysis, costing, search), with
``import torch, autopar`` excluded, and peak RSS. Each case runs in a fresh process with an empty
profile cache. A preset's profile at its default shapes ships with the package (``make profiles``),
so planning a preset never traces it; the last case, Llama 3 8B given as a HuggingFace
``config.json``, is traced (its first fake-tensor use imports Dynamo, about 1 s here): what a
model of the user's own costs the first time.

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
CASES = [("llama3-8b", 64, 0.3), ("llama3-70b", 512, None), ("gpt-175b", 1024, None), ("llama3-405b", 16384, 1.0),
         ("llama3-8b config.json (traced)", 64, None)]

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
        if name.endswith("config.json (traced)"):
            model = os.path.join(cache, "config.json")
            with open(model, "w") as f:
                json.dump(LLAMA3_8B_CONFIG, f)
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
