import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar import analysis, capture, models
from tests import dist_harness

dist_harness.inductor_cache()  # before anything compiles; inherited by every subprocess


@functools.cache
def profile(name: str, seq_len: int | None = None) -> analysis.ModelProfile:
    src = models.resolve(name)
    tr = capture.trace_model(src.build, batch=1, seq_len=seq_len or src.seq_len, vocab_size=src.vocab_size, name=name)
    return analysis.analyze(tr)


@pytest.fixture(scope="session")
def llama8b():
    return profile("llama3-8b")


@pytest.fixture(scope="session")
def llama_small():
    return profile("llama-small")


@pytest.fixture(autouse=True, scope="session")
def _warm_fake():
    with FakeTensorMode():
        torch.ones(1)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The multi-process launches (test_parity, test_checkpoint) share one launch per xdist group:
    if the group does not reach the test's id (pytest-xdist's loadgroup does not work with pytest
    9), each worker would run the whole launch again. Stop rather than double CI's time."""
    if not getattr(config.option, "loadgroup", False):
        return
    ungrouped = [it.nodeid for it in items if any(True for _ in it.iter_markers("xdist_group")) and "@" not in it.nodeid]
    if ungrouped:
        pytest.exit(f"xdist_group is not applied ({ungrouped[0]}): install pytest<9 (pyproject's test extras)",
                    returncode=3)
