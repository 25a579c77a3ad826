"""Inductor's probe of the CPU's vector instructions: started early, cut short, answered once a machine.

Inductor's first CPU compile in a process decides which vector instruction set its kernels use by
building and loading a test library per set the CPU reports (AMX, AVX-512 VNNI, AVX-512, AVX2),
one after another, each load in a child Python: 9.4 s on a 2-core machine with an empty cache,
1.4 s with a warm one (the loads), in every process that compiles. Here:

- ``warm`` starts the probe in a thread when ``autopar.compile`` starts, so it runs beside the
  trace and the passes (g++ and the loads are child processes).
- Inductor's pick is the best valid set unless ``ATEN_CPU_CAPABILITY`` or ``cpp.simdlen`` asks
  for another: then the sets are tried best first and the first that builds and loads ends the
  probe (AMX here: 4 test libraries built, not the 10 of all four sets). Otherwise every set is tried,
  each in a thread of its own.
- The answer (which sets were tried, which build and load) is written to Inductor's cache
  directory under a digest of what decides it: the CPU's instruction flags, and for each set the
  fingerprint Inductor keys its own test build with (the compiler's version, the set's flags,
  torch's version). The ranks of a machine take a file lock around the probe: one probes, the
  others (and later runs) read.
- A rank that reads the answer gives it to Inductor where Inductor caches its own (on each set,
  ``_seed``), so a later ask in the process reads it.
- ``waits`` is in force while ``backend.compile_graph`` compiles: Inductor's list of valid sets
  (what every ask for the chosen set reads) first waits for the thread, and where the probe
  stopped at the best set, is that set. Elsewhere Inductor's list is its own.

``AUTOPAR_ISA_PROBE=0`` leaves the probe to Inductor.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import sys
import threading

log = logging.getLogger(__name__)

_DIR = "autopar-isa"
# "thread": the probe; "best": the set Inductor picks, where the probe stopped at it
_STATE: dict = {}


def _candidates() -> list:
    """The sets Inductor would try on this machine (those whose flags the CPU reports), best first."""
    from torch._inductor import cpu_vec_isa

    have = cpu_vec_isa.x86_isa_checker()
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in have for f in str(isa).split())]


def _best_is_picked() -> bool:
    """Whether Inductor picks the first valid set (no variable or setting asks for another)."""
    from torch._inductor import config

    return config.cpp.simdlen is None and not os.environ.get("ATEN_CPU_CAPABILITY")


def _answer_path(cands: list) -> str:
    import torch
    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    h = hashlib.sha256(repr((sys.platform, platform.machine(), torch.__version__,
                             cpu_vec_isa.x86_isa_checker())).encode())
    for isa in cands:
        h.update(cpu_vec_isa._get_isa_dry_compile_fingerprint(isa.build_arch_flags()).encode())
    return os.path.join(cache_dir(), _DIR, h.hexdigest()[:32] + ".json")


def _asked(isa) -> bool:
    """Inductor's own test of ``isa`` (it builds and loads the test library and caches the answer
    on the set); False where the test itself fails."""
    try:
        return bool(isa)
    except Exception as e:  # noqa: BLE001 - Inductor tries it again, and says why, when it compiles
        log.debug("cpu_isa: probing %s failed: %s", isa, e)
        return False


def _probe(cands: list, every: bool) -> dict:
    """The answer: each set tried (``every``: all of them, side by side; else best first, up to
    the first valid one) and whether it is valid."""
    valid: dict = {}
    if every:
        sets = [threading.Thread(target=lambda isa=isa: valid.__setitem__(isa, _asked(isa)), daemon=True)
                for isa in cands]
        for t in sets:
            t.start()
        for t in sets:
            t.join()
    else:
        for isa in cands:
            valid[isa] = _asked(isa)
            if valid[isa]:
                break
    tried = [isa for isa in cands if isa in valid]
    return {"complete": len(tried) == len(cands),
            "sets": [{"name": str(isa), "valid": valid[isa],
                      "amx_fp16": bool(getattr(isa, "_is_amx_fp16_supported", False))} for isa in tried]}


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            stored = json.load(f)
        answer = {"complete": bool(stored["complete"]),
                  "sets": [{"name": str(e["name"]), "valid": bool(e["valid"]), "amx_fp16": bool(e["amx_fp16"])}
                           for e in stored["sets"]]}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # A probe cut short ends at the valid set it stopped at; anything else was not written here.
    return answer if answer["complete"] or (answer["sets"] and answer["sets"][-1]["valid"]) else None


def _seed(cands: list, answer: dict) -> None:
    """Each tried set's answer where Inductor caches it (on the set), as its own test would give
    it: the test itself answers from ``answer`` while the set is asked once. What the ask does
    besides the test (the AMX set enables AMX for this process) runs as it does in Inductor."""
    by_name = {str(isa): isa for isa in cands}
    for e in answer["sets"]:
        isa = by_name[e["name"]]
        fp16_code = getattr(type(isa), "_amx_fp16_code", None)

        def test(code, e=e, fp16_code=fp16_code):
            return e["valid"] and (code != fp16_code or e["amx_fp16"])

        isa.check_build = test  # shadows the method for this one ask
        try:
            bool(isa)
        finally:
            del isa.check_build


def _run() -> None:
    from torch._inductor import config, cpu_vec_isa
    from torch._inductor.codecache import LOCK_TIMEOUT, write_atomic
    from torch.utils._filelock import FileLock

    if (sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64") or config.is_fbcode()
            or config.cpp.vec_isa_ok is not None):
        cpu_vec_isa.pick_vec_isa()  # one set, or an answer forced by the setting: nothing to share
        return
    cands = _candidates()
    path = _answer_path(cands)
    every = not _best_is_picked()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with FileLock(path + ".lock", timeout=LOCK_TIMEOUT):
        answer = _read(path)
        if answer is None or (every and not answer["complete"]):
            answer = _probe(cands, every)
            write_atomic(path, json.dumps(answer))
        else:
            _seed(cands, answer)
    if answer["complete"]:
        cpu_vec_isa.pick_vec_isa()  # Inductor's list, from the answers on the sets
    else:
        _STATE["best"] = {str(isa): isa for isa in cands}[answer["sets"][-1]["name"]]


def warm() -> None:
    """Start the probe in the background (once a process)."""
    if "thread" in _STATE or os.environ.get("AUTOPAR_ISA_PROBE") == "0":
        return

    def run():
        try:
            _run()
        except Exception as e:  # noqa: BLE001 - Inductor probes for itself, and says why, when it compiles
            log.debug("cpu_isa: the background probe failed: %s: %s", type(e).__name__, e)

    _STATE["thread"] = threading.Thread(target=run, name="autopar-cpu-isa-probe", daemon=True)
    _STATE["thread"].start()


@contextlib.contextmanager
def waits():
    """While it lasts, Inductor's list of valid sets first waits for ``warm``'s probe (the list
    is cached without a lock: an ask while the thread probes would probe again), and where the
    probe stopped at the best set and Inductor picks the best, it is that set. The trace,
    Inductor's graph passes and its lowering run before that ask, beside the probe."""
    from torch._inductor import cpu_vec_isa

    t = _STATE.get("thread")
    if t is None:
        yield
        return
    listed = cpu_vec_isa.valid_vec_isa_list

    def waiting():
        if threading.current_thread() is t:
            return listed()
        t.join()
        best = _STATE.get("best")
        return [best] if best is not None and _best_is_picked() else listed()

    waiting.cache_clear = listed.cache_clear
    cpu_vec_isa.valid_vec_isa_list = waiting
    try:
        yield
    finally:
        cpu_vec_isa.valid_vec_isa_list = listed
