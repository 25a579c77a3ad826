"""The CPU kernels of a graph built together (autopar/cpp_kernels.py): the same results as
Inductor's kernels built one by one, fewer g++ runs, a kernel met again loaded from the index, and
a batch that does not build falling back to one build per kernel."""

import torch
import torch._inductor.cpp_builder as cpp_builder
from torch._inductor.utils import fresh_cache

from autopar import cpp_kernels


def _step(x, w):  # kernels between matmuls: an epilogue, a softmax, reductions
    h = torch.nn.functional.silu(x @ w)
    a = h.softmax(-1) @ w.t()
    b = torch.tanh(a) @ w
    return b.amax(0), (b - b.mean()).pow(2).sum(), a.sum(0)


def _other(x, w):  # shares its first kernel with _step (the silu epilogue), and has its own
    h = torch.nn.functional.silu(x @ w)
    return h.cos() @ w.t()


def _run(fn, args, batched: bool, builds: list):
    torch._dynamo.reset()
    orig = cpp_builder._run_compile_cmd

    def counted(cmd, cwd):
        if ".main.cpp" in cmd:
            builds.append(cmd)
        return orig(cmd, cwd)

    cpp_builder._run_compile_cmd = counted
    try:
        if batched:
            with cpp_kernels.batched_cpp_kernels():
                return torch.compile(fn)(*args)
        return torch.compile(fn)(*args)
    finally:
        cpp_builder._run_compile_cmd = orig


def test_kernels_built_together_compute_what_they_compute_alone(monkeypatch):
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)  # g++ runs in this process
    x, w = torch.randn(32, 48), torch.randn(48, 48)
    with fresh_cache():
        alone_builds, together_builds, again_builds = [], [], []
        alone = _run(_step, (x, w), False, alone_builds)
    with fresh_cache():
        together = _run(_step, (x, w), True, together_builds)
        other = _run(_other, (x, w), True, again_builds)
    assert len(alone_builds) == 3, alone_builds  # the kernels Inductor builds one by one
    assert len(together_builds) == 1, together_builds  # one library per compile worker
    for a, b in zip(alone, together):
        assert torch.equal(a, b)
    assert torch.allclose(other, torch.nn.functional.silu(x @ w).cos() @ w.t(), atol=1e-5)
    # _other's silu kernel came from the index: one library for what is new to it
    assert len(again_builds) == 1, again_builds


def test_a_batch_that_does_not_build_falls_back_to_one_build_per_kernel(monkeypatch):
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    real = cpp_kernels._library_source

    def broken(held):
        source, names = real(held)
        return source + "\nthis does not compile;\n", names

    monkeypatch.setattr(cpp_kernels, "_library_source", broken)
    x, w = torch.randn(16, 24), torch.randn(24, 24)
    with fresh_cache():
        builds = []
        out = _run(_step, (x, w), True, builds)
    for got, want in zip(out, _step(x, w)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len(builds) == 4  # the failed library, then each kernel alone
