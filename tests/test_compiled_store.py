"""A graph compiled once is loaded, not compiled again (``backend._stored_key``): by the ranks
that load what another rank compiled and by the next run, found by autopar's digest of the graph
before Inductor's trace and passes."""

import glob
import os

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from autopar import backend


def _key(gm) -> str:
    with torch._inductor.config.patch(backend._inductor_config(gm)):
        return backend._stored_key(gm, backend._example(gm))


def _new_width(start: int) -> int:
    """A width whose graph no earlier run stored (the tests' Inductor cache outlives a run)."""
    w = start
    while os.path.exists(backend._store_path(_key(_graph(w)[0]))):
        w += 1
    return w


def _graph(width: int):
    def step(w, h):
        return [torch.mm(h, w).tanh().sum(0), w.t() * 2]

    args = [torch.randn(width, width), torch.randn(8, width)]
    return make_fx(step, tracing_mode="fake")(*args), args


def test_a_compiled_graph_is_loaded_again_and_computes_the_same(monkeypatch):
    # A width of its own: no earlier run's entry answers for it.
    width = _new_width(16 + os.getpid() % 97)
    gm, args = _graph(width)
    key = _key(gm)
    want = [t.clone() for t in backend.compile_graph(gm, inductor=True)(list(args))]
    assert os.path.isfile(backend._store_path(key)), "the compile noted its cache entry"

    def no_compile(gm, vals):
        raise AssertionError("compiled again")

    monkeypatch.setattr(backend, "_inductor", no_compile)
    got = backend.compile_graph(gm, inductor=True)(list(args))
    for g, w in zip(got, want):
        assert torch.equal(g, w)

    # Another shape, or another Inductor setting, is another graph: never the stored one.
    other, _ = _graph(_new_width(width + 1))
    assert _key(other) != key
    with torch._inductor.config.patch({"cpp.simdlen": 8}):
        assert _key(gm) != key
    with pytest.raises(AssertionError, match="compiled again"):
        backend.compile_graph(other, inductor=True)


def test_a_store_entry_whose_compiled_graph_is_gone_compiles_it(monkeypatch):
    """The store only names an entry of Inductor's cache: where that entry was removed, the graph
    is compiled (and noted again), never anything else loaded."""
    gm, args = _graph(_new_width(8 + os.getpid() % 89))
    want = [t.clone() for t in backend.compile_graph(gm, inductor=True)(list(args))]
    key = _key(gm)
    with open(backend._store_path(key)) as f:
        fx_key = f.read().strip()
    from torch._inductor.codecache import FxGraphCache

    for path in glob.glob(os.path.join(FxGraphCache._get_tmp_dir_for_key(fx_key), "*")):
        os.remove(path)
    compiled = []
    real = backend._inductor
    monkeypatch.setattr(backend, "_inductor", lambda gm, vals: compiled.append(gm) or real(gm, vals))
    got = backend.compile_graph(gm, inductor=True)(list(args))
    assert len(compiled) == 1
    for g, w in zip(got, want):
        assert torch.allclose(g, w)
