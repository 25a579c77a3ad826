"""The CPU instruction-set probe (autopar/cpu_isa.py): probed once a machine, read by the others,
the same pick as Inductor's own."""

import os
import platform
import sys

import pytest
from torch._inductor import cpu_vec_isa

from autopar import cpu_isa

pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"),
                                reason="the probe is shared on x86 Linux only")


def _forget(monkeypatch):
    """This process as a new one: no probe thread, nothing cached on the sets by Inductor."""
    monkeypatch.setattr(cpu_isa, "_STATE", {})
    cpu_vec_isa.VecISA._VecISA__bool__impl.cache_clear()
    cpu_vec_isa.VecAMX.__bool__.cache_clear()
    cpu_vec_isa.valid_vec_isa_list.cache_clear()


def _probe_in_background():
    cpu_isa.warm()
    cpu_isa._STATE["thread"].join()
    with cpu_isa.waits():
        return cpu_vec_isa.pick_vec_isa()


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("AUTOPAR_ISA_PROBE", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    inductors = cpu_vec_isa.pick_vec_isa()  # Inductor's own answers, before anything here runs
    own = {str(isa): bool(isa) for isa in cpu_isa._candidates()}
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    yield inductors, own
    _forget(monkeypatch)  # Inductor answers for itself again after the test


def test_one_probe_is_read_by_the_next_process_and_picks_what_inductor_picks(fresh_cache, monkeypatch):
    inductors, own = fresh_cache
    _forget(monkeypatch)
    assert str(_probe_in_background()) == str(inductors)
    # Only the sets up to the first valid one were tried (Inductor picks the best).
    path = cpu_isa._answer_path(cpu_isa._candidates())
    assert os.path.exists(path)
    answer = cpu_isa._read(path)
    assert [e["name"] for e in answer["sets"]][-1] == str(inductors)
    assert all(e["valid"] == own[e["name"]] for e in answer["sets"])

    # The next process reads the answer: no test library is built or loaded.
    _forget(monkeypatch)

    def built(*args):
        raise AssertionError("the probe ran again")

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", built)
    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", built)
    assert str(_probe_in_background()) == str(inductors)
    if answer["complete"]:  # the first valid set was the last one tried (an AVX2-only CPU): every set
        assert str(cpu_vec_isa.pick_vec_isa()) == str(inductors)  # answered from Inductor's caches on them
    else:
        assert bool(cpu_isa._STATE["best"])  # Inductor's own cache on the set holds the answer


def test_a_capability_variable_gets_every_set_probed_and_picked_as_inductor_does(fresh_cache, monkeypatch):
    inductors, own = fresh_cache
    _forget(monkeypatch)
    _probe_in_background()  # the best only
    _forget(monkeypatch)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    picked = _probe_in_background()  # asks for a set the stored answer did not try: every set is tried
    answer = cpu_isa._read(cpu_isa._answer_path(cpu_isa._candidates()))
    assert answer["complete"] and {e["name"]: e["valid"] for e in answer["sets"]} == own
    assert "best" not in cpu_isa._STATE
    if own.get("avx2"):
        assert str(picked) == "avx2"


def test_an_answer_that_does_not_read_as_one_is_probed_again(fresh_cache, monkeypatch):
    inductors, own = fresh_cache
    path = cpu_isa._answer_path(cpu_isa._candidates())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for text in ("{", '{"complete": false, "sets": [{"name": "avx2", "valid": false, "amx_fp16": false}]}'):
        with open(path, "w") as f:
            f.write(text)
        _forget(monkeypatch)
        assert str(_probe_in_background()) == str(inductors)
        assert cpu_isa._read(path)["sets"][-1]["name"] == str(inductors)
