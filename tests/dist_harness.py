"""Run parity cases in real processes over gloo and compare with the one-process model.

One launch runs a list of cases (process start and gloo set-up cost seconds), each comparing the
loss and every gradient after one step, and the loss trajectory over three AdamW steps.
"""

from __future__ import annotations

import copy
import json
import os
import time
import traceback

import torch
import torch.distributed as dist

from autopar import launch


def inductor_cache() -> str:
    """Set, unless already set, the Inductor cache every test process compiles into, and return
    it: one for the in-process tests, the launches' ranks and the subprocess tests (kept across
    runs on one machine), so kernels of the same shapes are compiled once for all."""
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                                 os.path.join(os.path.expanduser("~"), ".cache", "autopar-test-inductor"))


def build(kind: str) -> torch.nn.Module:
    """A tiny model of each family, seeded: ``hf-*`` from transformers, ``custom-llama`` written
    as another project would, the rest autopar's own presets."""
    from tests import zoo

    torch.manual_seed(0)
    return zoo.build(kind)


def batch(seed: int, B: int = 8, S: int = 32, vocab: int = 256):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, S), generator=g), torch.randint(0, vocab, (B, S), generator=g)


def model_batch(case: dict, seed: int):
    """The case's model's inputs (a tuple: token ids, or images) and target for one batch."""
    from tests import zoo

    return zoo.example(case.get("model", "llama-tiny"), seed, B=case.get("batch", 8), S=case.get("seq", 32))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run_case(world: int, case: dict) -> dict:
    """One case: the same model trained by autopar (default options unless the case says) and
    by one process, compared by original parameter name."""
    import autopar
    from tests import zoo

    ref = build(case.get("model", "llama-tiny"))
    par = copy.deepcopy(ref)
    xs, tgt = model_batch(case, 1)
    loss_fn = zoo.loss_of(case.get("model", "llama-tiny"))
    kw = {k: case[k] for k in ("compile", "disable_passes") if k in case}
    fsdp2 = None
    if case.get("mp"):  # mixed precision: FSDP2 with the same policy, on these processes, is the reference
        kw["mp_policy"] = policy(case["mp"])
        fsdp2 = fsdp2_run(copy.deepcopy(ref), world, kw["mp_policy"], case)
    pm = autopar.compile(par, world, example_inputs=xs, example_target=tgt, loss_fn=loss_fn,
                         plan=case.get("plan", "auto"), global_batch=tgt.shape[0], **kw)
    # The distributed weights gathered back: bit for bit the original's, loadable by a fresh model.
    full = pm.full_state_dict()
    ref_sd = ref.state_dict()
    fresh = build(case.get("model", "llama-tiny"))
    fresh.load_state_dict(full, strict=True)
    full_ok = sorted(full) == sorted(ref_sd) and all(torch.equal(full[k], ref_sd[k]) for k in ref_sd)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    out = {"name": case["name"], "plan": pm.plan.as_config_string(), "losses": [], "ref_losses": [],
           "is_module": isinstance(pm, torch.nn.Module), "full_state_dict_exact": full_ok,
           "compile_s": pm.info.compile_s, "timings": dict(pm.info.timings), "compiled_here": dict(pm.info.compiled_here),
           # what moved: (kind, group size, pass, whether of experts' weights) of each collective
           "collectives": sorted({(r["kind"], r["group_size"], r["pass"], ".experts." in r["source"])
                                  for recs in pm.info.collectives.values() for r in recs})}
    if case.get("user_loop") and pm.plan.pp == 1:
        # The module path, on the initial weights: each data-parallel rank runs its slice of the
        # batch through pm(x) and the loss in its own loop.
        xs, tgt = model_batch(case, 200)
        loss_fn(ref(*xs), tgt).backward()
        dp, rank = pm.plan.dp, pm._dp_rank
        n = tgt.shape[0] // dp
        sl = slice(rank * n, (rank + 1) * n)
        loss_fn(pm(*(x[sl] for x in xs)), tgt[sl]).backward()
        out["user_loop"] = _grad_diffs(pm, ref)
    for step in range(case.get("steps", 3)):
        xs, tgt = model_batch(case, 100 + step)
        ref_opt.zero_grad()
        rl = loss_fn(ref(*xs), tgt)
        rl.backward()
        opt.zero_grad()
        loss = pm.step(xs, target=tgt)
        if step == 0:
            out.update(_grad_diffs(pm, ref))
            if case.get("clip"):
                norm = pm.clip_grad_norm_(1e-3)
                ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
                out["clip_norm_diff"] = float((norm - ref_norm).abs())
        out["losses"].append(float(loss))
        out["ref_losses"].append(float(rl.detach()))
        ref_opt.step()
        opt.step()
    if case.get("save_ckpt"):
        out.update(save_checkpoint(pm, opt, ref, ref_opt, case))
    if case.get("load_ckpt"):
        out.update(resume(pm, case))
    if fsdp2 is not None:
        out["fsdp2_losses"] = fsdp2["losses"]
        out["dtypes"] = {"params": sorted({str(q.dtype) for q in pm.parameters()}),
                         "grads": sorted({str(q.grad.dtype) for q in pm.parameters() if q.grad is not None})}
        from autopar.fxops import op_name

        runners = [pm._step_runner] if pm._step_runner is not None else [r for _, r in pm._stages.values()]
        out["dtypes"]["matmul"] = sorted({str(a.meta["val"].dtype) for r in runners for n in r.compiled.fw_graph.graph.nodes
                                          if n.op == "call_function" and op_name(n.target) in _MATMULS
                                          for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)})
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            out["dtypes"][kind] = sorted({r.get("dtype") for recs in pm.info.collectives.values() for r in recs
                                          if r["kind"].startswith(kind) and r["pass"] in ("fsdp", "ddp")})
    return out


# The layers' matrix products (a batched one may be a model's own fp32 rotary table, as in HF Llama).
_MATMULS = ("mm", "addmm", "convolution")


def policy(name: str):
    """FSDP2's MixedPrecisionPolicy for a precision name (what a user of FSDP2 passes)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from autopar.plan import precision

    p = precision(name)
    return MixedPrecisionPolicy(param_dtype=getattr(torch, p.compute), reduce_dtype=getattr(torch, p.reduce))


def fsdp2_run(model: torch.nn.Module, world: int, mp_policy, case: dict) -> dict:
    """What an FSDP2 user runs, on these processes: ``fully_shard`` on each layer and the root
    with ``mp_policy``, data parallel over the whole world (each rank its slice of the batch),
    AdamW; the loss of each step (averaged over ranks) on the batches ``run_case`` uses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from autopar.capture import find_layers
    from tests import zoo

    mesh = init_device_mesh("cpu", (world,))
    for name in find_layers(model):
        fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    n, rank, losses = case.get("batch", 8) // world, dist.get_rank(), []
    for step in range(case.get("steps", 3)):
        xs, tgt = model_batch(case, 100 + step)
        opt.zero_grad()
        sl = slice(rank * n, (rank + 1) * n)
        loss = zoo.loss_of(case.get("model", "llama-tiny"))(model(*(x[sl] for x in xs)), tgt[sl])
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return {"losses": losses}


# The batches both trajectories take after a checkpoint: the reference's from the saved state, the
# plan's that loaded it.
RESUME_SEEDS = (300, 301)


def save_checkpoint(pm, opt, ref, ref_opt, case: dict) -> dict:
    """After the case's steps: the model and the optimizer (AdamW moments) saved under the case's
    plan (``pm.save_checkpoint``: torch.distributed.checkpoint and the plan) in ``case["save_ckpt"]``,
    the full weights beside them, and the single-process trajectory from the same state (the
    reference's next two steps), for a loader under another plan to follow."""
    from tests import zoo

    d = case["save_ckpt"]
    saved = pm.full_state_dict()
    pm.save_checkpoint(d, opt)
    loss_fn, ref_losses = zoo.loss_of(case["model"]), []
    for seed in RESUME_SEEDS:
        xs, tgt = model_batch(case, seed)
        ref_opt.zero_grad()
        loss = loss_fn(ref(*xs), tgt)
        loss.backward()
        ref_opt.step()
        ref_losses.append(float(loss.detach()))
    if dist.get_rank() == 0:
        torch.save(saved, os.path.join(d, "full_state_dict.pt"))
        with open(os.path.join(d, "trajectory.json"), "w") as f:
            json.dump(ref_losses, f)
    dist.barrier()  # written before any rank reads them
    return {"saved_plan": pm.plan.as_config_string()}


def resume(pm, case: dict) -> dict:
    """Load the checkpoint in ``case["load_ckpt"]`` (written under another plan, maybe by another
    number of processes) into ``pm`` with a fresh optimizer, over weights made different first:
    the weights must come back bit for bit (by original name), and training goes on along the
    single-process trajectory from the saved state (its second step checks the moments)."""
    d = case["load_ckpt"]
    with torch.no_grad():
        for q in pm.parameters():
            q.add_(1.0)  # a load that left anything as it was shows
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    old = pm.load_checkpoint(d, opt)
    got, saved = pm.full_state_dict(), torch.load(os.path.join(d, "full_state_dict.pt"))
    with open(os.path.join(d, "trajectory.json")) as f:
        ref_losses = json.load(f)
    same = sorted(got) == sorted(saved) and all(torch.equal(got[k], saved[k]) for k in saved)
    losses = []
    for seed in RESUME_SEEDS:
        xs, tgt = model_batch(case, seed)
        opt.zero_grad()
        losses.append(float(pm.step(xs, target=tgt)))
        opt.step()
    return {"resumed": {"plans": [old.as_config_string() if old else None, pm.plan.as_config_string()],
                        "saved_world": old.world_size if old else None, "identical": same, "n": len(saved),
                        "losses": losses, "ref_losses": ref_losses,
                        "differ": [k for k in saved if k not in got or not torch.equal(got[k], saved[k])][:6]}}


def _grad_diffs(pm, ref) -> dict:
    ref_g = dict(ref.named_parameters())
    diffs = {}
    for name, p in pm.named_parameters():
        g = _full(p.grad) if p.grad is not None else None
        r = ref_g[name].grad
        if g is None and r is None and not ref_g[name].requires_grad:  # frozen on both sides
            diffs[name] = 0.0
            continue
        diffs[name] = float((g - r).abs().max()) if g is not None else float("inf")
    return {"grad_max_diff": max(diffs.values()), "worst_param": max(diffs, key=diffs.get), "n_params": len(diffs),
            "param_names": sorted(diffs), "n_ref_params": len(ref_g),
            "grad_scale": max(float(ref_g[n].grad.abs().max()) for n in diffs if ref_g[n].grad is not None)}


def _cpu() -> float:
    """CPU seconds this process and the processes it waited for (g++, compile workers) used."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _worker(rank: int, world: int, port: int, cases: list, cache: str):
    """One rank of a launch: each case's result as it is done; after an error, nothing more."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      TORCHINDUCTOR_CACHE_DIR=cache)
    torch.set_num_threads(1)
    import faulthandler

    faulthandler.enable(all_threads=True)  # a crash prints every thread's Python stack
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        for case in cases:
            t0, c0 = time.perf_counter(), _cpu()
            try:
                res = run_case(world, case)
                res.update(case_s=time.perf_counter() - t0, cpu_s=_cpu() - c0)
            except Exception as e:  # report it; the parent stops every rank
                res = {"name": case["name"], "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
            yield res
            if "error" in res:
                return
        import autopar

        autopar.shutdown()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(world: int, cases: list[dict], timeout: float | None = None, _retry: bool = True) -> list[list[dict]]:
    """Results per rank (a list per case). An error on any rank ends the launch: the other
    ranks, which may wait in a collective for it, are stopped and reported as such. A launch
    in which a process died of a signal (gloo's transport was seen to crash, SIGSEGV or a heap
    check's SIGABRT, under load on this 2-core machine), or whose rendezvous port another launch took first, is run once more, and says so; any other failure is reported as is.
    ``timeout``: seconds for the whole launch; by default 10 minutes and 4 more per case, which a
    cold Inductor cache on 2 shared cores needs (a fixed 25 minutes was seen to run out there)."""
    import signal
    import sys

    if timeout is None:  # a cold Inductor cache on 2 shared cores: minutes per case (compiles)
        timeout = 600 + 240 * len(cases)
    cache = inductor_cache()
    res = launch.spawn(world, _worker, cases, cache, expect=len(cases), timeout=timeout,
                       failed=lambda r: "error" in r)
    codes = res.exitcodes
    out = {r: [x for x in xs if isinstance(x, dict)] for r, xs in res.results.items()}
    for f in res.failures:  # raised outside a case (e.g. joining the process group): its next case's
        done = {x["name"] for x in out[f.rank]}
        out[f.rank] += [{"name": c["name"], "error": f.message} for c in cases if c["name"] not in done][:1]
    # A process killed by a signal we did not send (SIGSEGV/SIGABRT in gloo's transport under load
    # on this 2-core machine) makes every result of this launch suspect, including the errors its
    # peers then report ("Connection reset by peer"): the launch runs once more.
    crashed = [r for r, c in enumerate(codes) if c is not None and c < 0 and c != -signal.SIGTERM]
    # A rank that exited without reporting anything (no error of its own, e.g. stopped by the
    # failure watch because a peer died): also a crash, not a parity result.
    reported = {r for r in range(world) if any("error" in x for x in out[r])}
    if not reported:
        crashed += [r for r, c in enumerate(codes) if c not in (0, None, -signal.SIGTERM) and r not in crashed]
    # The rendezvous port taken between its choice and the bind (another launch beside this one,
    # on the other xdist worker): nothing ran, the launch runs once more on another port.
    busy = any("EADDRINUSE" in x.get("error", "") for xs in out.values() for x in xs)
    if (crashed or busy) and _retry:
        why = "the rendezvous port was taken" if busy else \
            f"rank(s) {crashed} crashed (exit codes {[codes[r] for r in crashed]})"
        print(f"dist_harness: {why}; running the launch once more", file=sys.stderr)
        return run(world, cases, timeout, _retry=False)
    for r in range(world):
        done = {x["name"] for x in out[r]}
        out[r] += [{"name": c["name"], "error": f"stopped: another rank failed or the launch timed out (exit codes {codes})"}
                   for c in cases if c["name"] not in done]
    return [sorted(out[r], key=lambda x: [c["name"] for c in cases].index(x["name"])) for r in range(world)]
