"""Time to the first step: from the call that prepares a model to the end of its first training
step (forward, loss, backward), on one process, against what a user would otherwise write on the
same model: ``torch.compile`` applied to each decoder block (torchtitan's way: identical blocks
reuse one compiled graph; the model is configured for training, ``use_cache=False``: with the
key-value cache on, each block reads its ``layer_idx``, Dynamo guards on it, compiles each block
again up to its recompile limit of 8 and runs the blocks after the eighth eagerly). Each measurement runs in a fresh process with an empty Inductor cache,
so nothing is reused between them. HF Llama, hidden 64, fp32, batch 4 x 64, at several depths.

``python -m bench.compile_time [--layers 8 16 32]``: autopar as it is by default (its ``regions``
pass: each distinct layer compiled once) and without it (``disable_passes=("regions",)``: every
layer compiled inline); ``--no-flat`` leaves that row out. Each autopar row also says where its
time went (``parts_s``: each graph pass, Inductor, and the rest: the trace, the plan, placing the
parameters).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from bench.common import write

BATCH, SEQ = 4, 64


def _model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      use_cache=False)
    return LlamaForCausalLM(cfg)


def _measure(rank: int, world: int, port: int, how: str, layers: int) -> dict:
    """One measurement in this (fresh) process: seconds to the end of the first step and of a second one."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-inductor-")
    os.environ["AUTOPAR_QUIET"] = "1"
    torch.set_num_threads(1)
    from autopar.capture import default_loss

    model = _model(layers)
    ids = torch.randint(0, 1024, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    tgt = torch.roll(ids, -1, dims=1)
    t0 = time.perf_counter()
    if how.startswith("autopar"):
        import autopar

        pm = autopar.compile(model, 1, example_inputs=(ids,), plan=f"mb={BATCH}", global_batch=BATCH,
                             hardware="cpu", disable_passes=("regions",) if how == "autopar flat" else ())
        ready = time.perf_counter()
        # where the time went: each pass and Inductor, and the rest (trace, plan, placing)
        parts = {**pm.info.timings, "rest": ready - t0 - sum(pm.info.timings.values())}

        def step():
            return pm.step(ids, target=tgt)
    else:
        for layer in model.model.layers:
            layer.compile()
        ready = time.perf_counter()

        def step():
            loss = default_loss(model(ids), tgt)
            loss.backward()
            return loss

    loss = float(step())
    first = time.perf_counter()
    step()
    second = time.perf_counter()
    out = {"how": how, "layers": layers, "prepare_s": ready - t0, "first_step_s": first - t0,
           "step_s": second - first, "loss": loss}
    if how.startswith("autopar"):
        out["parts_s"] = {k: round(v, 2) for k, v in parts.items()}
    return out


def main(argv=None) -> int:
    from autopar import launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--no-flat", action="store_true", help="leave out autopar without its regions pass")
    a = ap.parse_args(argv)
    hows = ["torch.compile per block", "autopar"] + ([] if a.no_flat else ["autopar flat"])
    rows = []
    for layers in a.layers:
        for how in hows:
            r = launch.spawn(1, _measure, how, layers, timeout=1800).results[0][0]
            rows.append(r)
            print(f"{layers:3d} layers  {how:24s} first step at {r['first_step_s']:6.1f} s "
                  f"(prepare {r['prepare_s']:.1f} s), next step {r['step_s']:.3f} s, loss {r['loss']:.5f}", flush=True)
    base = {r["layers"]: r["first_step_s"] for r in rows if r["how"] == "torch.compile per block"}
    for r in rows:
        r["vs_per_block"] = r["first_step_s"] / base[r["layers"]]
    summary = {"model": f"HF Llama hidden 64, batch {BATCH} x {SEQ}, fp32, one process, empty Inductor cache each"}
    for how in hows[1:]:
        mine = {r["layers"]: r["first_step_s"] for r in rows if r["how"] == how}
        lo, hi = min(mine), max(mine)
        summary[f"{how}: growth {lo} -> {hi} layers"] = round(mine[hi] / mine[lo], 3)
    write("compile_time", rows, summary, ["layers", "how", "first_step_s", "vs_per_block", "prepare_s", "step_s", "loss", "parts_s"],
          "Time to the end of the first step (CPU, one process)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
