"""On a fake process group of 64 and 256 ranks, the graphs the executor builds for an 8B-shaped
Llama under TP 8 x FSDP hold the collectives the plan's TP rules imply, counted from the graphs."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "fake_pg_collectives.py")


@pytest.mark.parametrize("sp,world", [(0, 64), (1, 64), (1, 256)])
def test_collectives_in_the_graph(sp, world):
    r = subprocess.run([sys.executable, SCRIPT, str(sp), str(world)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])
    got, plan = d["got"], d["plan"]
    layers, params = 2, 21
    # FSDP: every parameter gathered over the 8 data-parallel ranks before use, its gradient
    # reduce-scattered back, in buckets of at most one layer (passes/bucket.py): one per layer,
    # plus the embedding and the head, which are each larger than a layer under TP 8.
    fwd_ag = sum(v for k, v in got.items() if k.startswith("forward:all_gather_into_tensor") and k.endswith(":8:fsdp"))
    bwd_rs = got["backward:reduce_scatter_tensor:8:fsdp"]
    assert layers <= fwd_ag <= layers + 3 < params and layers <= bwd_rs <= layers + 3
    if world == 256:
        # HSDP (4 replicas of 8 shards): each bucket's gradient reduce-scattered over its shard
        # group, then only the shard all-reduced over the replicas, as the plan prices it.
        assert got["backward:all_reduce:4:ddp"] == bwd_rs
        assert d["bytes"]["backward:all_reduce:4:ddp"] == d["bytes"]["backward:reduce_scatter_tensor:8:fsdp"]
    tp_gathers = sum(v for k, v in got.items() if k.endswith("all_gather_into_tensor:8:tp"))
    if sp:
        # Column inputs gathered (2 per layer + head), the logits never (loss parallelism: three
        # per-token all-reduces); backward mirrors each row reduce-scatter (2 per layer +
        # embedding) with an all-gather: what the plan prices.
        assert got["forward:all_gather_into_tensor:8:tp"] == 2 * layers + 1
        assert got["forward:all_reduce:8:tp"] == 3
        assert got["forward:reduce_scatter_tensor:8:tp"] == 2 * layers + 1
        assert got["backward:reduce_scatter_tensor:8:tp"] == 2 * layers + 1
        assert got["backward:all_gather_into_tensor:8:tp"] == 2 * layers + 1
        assert tp_gathers == sum(v for k, v in plan.items() if k.startswith("tp:all_gather"))
    else:
        # Megatron: an all-reduce after each row linear and the embedding, one per column group
        # input gradient in backward; the loss's three per-token all-reduces; the logits never gathered.
        assert got["forward:all_reduce:8:tp"] == 2 * layers + 1 + 3
        assert got["backward:all_reduce:8:tp"] == 2 * layers + 1
        assert tp_gathers == 0


def test_context_parallel_collectives_are_the_priced_ones():
    """CP 4 x TP 8 + SP x FSDP 2 on 64 ranks: per layer, the keys and values (one kv head per TP
    rank, not the four query heads they serve) gathered over cp in the forward and again in the
    backward, their gradients reduce-scattered, half the queries and the outputs swapped each way;
    the parameters sharded over dp_shard x cp (8). The bytes are those the plan prices."""
    r = subprocess.run([sys.executable, SCRIPT, "1", "64", "4"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])
    got, nbytes, plan = d["got"], d["bytes"], d["plan"]
    layers = 2
    for key in ("forward:all_gather_into_tensor:4:cp", "backward:all_gather_into_tensor:4:cp",
                "backward:reduce_scatter_tensor:4:cp", "forward:mirror_swap:4:cp", "backward:mirror_swap:4:cp"):
        assert got[key] == 2 * layers, (key, got)
    kv = 1 * 256 * 1 * 128 * 2  # batch 1 x 256 tokens x one kv head x head dim 128, bf16
    assert nbytes["forward:all_gather_into_tensor:4:cp"] == 2 * layers * kv
    priced = {k.split(":")[1]: int(k.split(":")[2]) * v for k, v in plan.items() if k.startswith("cp:")}
    assert priced["all_gather"] == nbytes["forward:all_gather_into_tensor:4:cp"] + nbytes["backward:all_gather_into_tensor:4:cp"]
    assert priced["reduce_scatter"] == 4 * nbytes["backward:reduce_scatter_tensor:4:cp"]  # recorded: each rank's part
    # the swap: priced as the half each rank sends; the exchange's buffer is that half
    assert priced["send_recv"] == nbytes["forward:mirror_swap:4:cp"] + nbytes["backward:mirror_swap:4:cp"]
    assert got["backward:reduce_scatter_tensor:8:fsdp"] >= layers


def test_pipeline_stages_under_cp_send_each_ranks_tokens():
    """PP 2 x CP 2, 64-token sequences: the second stage receives its cp rank's 32 tokens of the
    activations and of the token ids (not the whole sequence), and the plan prices exactly that
    message: one microbatch x 32 tokens x hidden 64, fp32."""
    script = os.path.join(os.path.dirname(__file__), "scripts", "fake_pg_pipeline_cp.py")
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])
    assert d["received"] == [[[1, 32, d["hidden"]], "float32", True], [[1, 32], "int64", False]], d
    assert d["priced"] == [1 * 32 * d["hidden"] * 4], d


def _graphs_of(ranks: tuple, *mode: str) -> list[dict]:
    """``scripts/fake_pg_same_graphs.py`` as each of ``ranks``, each in a process of its own,
    side by side: the key of the graphs each hands Inductor and its run-time rank reads."""
    script = os.path.join(os.path.dirname(__file__), "scripts", "fake_pg_same_graphs.py")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    procs = [subprocess.Popen([sys.executable, script, str(r), *mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in ranks]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [json.loads([l for l in out.splitlines() if l.startswith("{")][-1]) for out, _ in outs]


def test_tensor_parallel_ranks_compile_the_same_graphs():
    """TP 2 x FSDP 2 + SP on GPT: the two TP ranks' graphs are the same text (their vocabulary
    offsets and chunk choices read at run time, ``passes/coords.py``), so one of them compiles
    and the other loads its code."""
    d = _graphs_of((0, 1))
    # the embedding's and the loss's masks (forward, loss backward) and the embedding gradient's chunk
    assert d[0]["reads"] >= 3, d
    assert d[0]["key"] == d[1]["key"], d


def test_expert_parallel_groups_compile_the_same_graphs():
    """Mixtral under ep 2 x HSDP 2x2: ranks 0 and 2 are in different ep groups, whose collectives
    name their group alike (``groups.register_group``), so their graphs are the same text and one
    compile serves both."""
    d = _graphs_of((0, 2), "ep")
    assert d[0]["key"] == d[1]["key"], d


def test_context_parallel_ranks_compile_the_same_graphs():
    """Llama under CP 4: ranks 0 and 3 compute other query rows (chunks 0 and 7, 6 and 1 of 8)
    and swap half their queries with each other, yet their graphs are the same text: the rows
    are worked out from the rank read at run time (one read per attention, forward and
    backward) and the swap's partner is found when it runs (``cp.mirror_swap``)."""
    d = _graphs_of((0, 3), "cp")
    assert d[0]["reads"] >= 2, d  # the zoo's Llama has two layers
    assert d[0]["key"] == d[1]["key"], d


def test_reads_of_a_ranks_place_are_noted():
    """What ``coords.recording`` notes while the passes run, on rank 0 of a (dp 2, tp 2) fake
    mesh: the graphs traced there are shared with exactly the ranks every read agrees on
    (``passes/shared.py``). A membership test, the whole mesh's members, an even shard's shape
    (also as DTensor's redistribution planner works it out for a value split over both dims)
    and the rank read at run time read nothing; an index into the coordinates, a local rank or a
    submesh's members read one dim; the global rank and an uneven nested split, all of them."""
    script = os.path.join(os.path.dirname(__file__), "scripts", "coordinate_reads.py")
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode == 0, r.stderr[-3000:]
    got = {d["probe"]: d["ranks"] for d in map(json.loads, r.stdout.splitlines())}
    everyone, same_tp, same_dp = [0, 1, 2, 3], [0, 2], [0, 1]
    assert got == {"membership test": everyone, "tp coordinate by index": same_tp, "every coordinate": [0],
                   "dp local rank": same_dp, "tp submesh members": same_dp, "whole mesh members": everyone,
                   "global rank": [0], "even shard shape": everyone, "uneven shard shape": same_tp,
                   "shard offset": same_tp, "run-time rank": everyone, "discharged": everyone,
                   "even nested shard redistributed": everyone, "uneven nested shard redistributed": [0]}


def test_eager_attention_runs_on_each_ranks_heads():
    """GPT-J (eager attention: heads folded into the batch dim of two batched matmuls) under TP 2 +
    SP: the attention's matmuls run on each rank's heads, forward and backward, so the step's TP
    all-gathers are the priced ones (each layer's sequence-parallel gather, and the head's), at
    their bytes. The backward gathered every head's probabilities and values before: its view
    back to (batch, heads, ...) remade the gradient's placement as a shard order."""
    script = os.path.join(os.path.dirname(__file__), "scripts", "tp_collectives.py")
    r = subprocess.run([sys.executable, script, "1", "hf-gptj"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])
    got = {k.split(":", 1)[1]: 0 for k in d["got"]}
    for k, v in d["got"].items():
        got[k.split(":", 1)[1]] += v
    gathers = {k.rsplit(":", 1)[1]: v for k, v in got.items() if k.startswith("all_gather")}
    priced = {k.rsplit(":", 1)[1]: v for k, v in d["plan"].items() if k.startswith("all_gather")}
    assert gathers == priced and sum(gathers.values()) == 2 * 3, (d["got"], d["plan"])
