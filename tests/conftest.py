import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar import analysis, capture, models


@functools.lru_cache(maxsize=None)
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
