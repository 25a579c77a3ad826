"""Micro benchmarks (pytest-benchmark): the planner's parts one at a time, so a regression in one
shows on its own. Run by ``make bench`` (``pytest bench/test_micro.py --benchmark-json=...``);
not part of the test suite (``testpaths`` is ``tests``).

- trace + analysis of a model on fake tensors (llama3-8b: one block traced, the rest reused);
- pricing one configuration (``StageModel``: coefficients, then one evaluation);
- the whole search for llama3-8b on 64 H100 and llama3-405b on 16,384;
- ``autopar.compile`` on one process (trace, plan, passes; eager, so no Inductor time).
"""

import pytest
import torch

from autopar import api, models
from autopar.cost_models.step import Config, CostContext, StageModel, uniform_assignment


@pytest.fixture(scope="module")
def llama8b():
    return api.profile_model("llama3-8b")


@pytest.fixture(scope="module")
def llama405b():
    return api.profile_model("llama3-405b")


def test_trace_and_analyse_llama3_8b(benchmark, tmp_path, monkeypatch):
    # Each round in an empty profile cache: a cached profile would time a file read.
    import tempfile

    def fresh():
        monkeypatch.setenv("AUTOPAR_CACHE_DIR", tempfile.mkdtemp(dir=tmp_path))
        return (), {}

    prof = benchmark.pedantic(lambda: api.profile_model("llama3-8b"), setup=fresh, rounds=3, iterations=1)
    assert prof.profile.n_layers == 32


def test_price_one_config(benchmark, llama8b):
    ctx = CostContext(llama8b.profile, api.load_hardware("h100"), 512)

    def price():
        sm = StageModel(ctx, Config(tp=8, pp=2, dp=4, dp_shard=4, sp=True, fsdp=True, mb=1, schedule="1f1b"))
        return sm.evaluate(uniform_assignment(sm, "selective"))

    est = benchmark(price)
    assert est.step_time_s > 0


@pytest.mark.parametrize("gpus", [64])
def test_search_llama3_8b(benchmark, llama8b, gpus):
    plan = benchmark.pedantic(lambda: api.plan("llama3-8b", gpus, profiled=llama8b), rounds=3, iterations=1)
    assert plan.world_size == gpus


def test_search_llama3_405b_16k(benchmark, llama405b):
    plan = benchmark.pedantic(lambda: api.plan("llama3-405b", 16384, profiled=llama405b), rounds=2, iterations=1)
    assert plan.world_size == 16384


def test_compile_one_process(benchmark):
    import autopar

    ids = torch.randint(0, 1024, (4, 256), generator=torch.Generator().manual_seed(0))

    def build():
        return autopar.compile(models.build_preset("llama-small"), 1, example_inputs=(ids,), hardware="cpu-gloo",
                               compile=False)

    pm = benchmark.pedantic(build, rounds=3, iterations=1)
    assert pm.plan.world_size == 1
