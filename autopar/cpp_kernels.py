"""The CPU kernels of one compiled graph built as a few C++ translation units, not one each.

Inductor's Python wrapper builds every C++ kernel of a graph as a shared library of its own: one
g++ run per kernel, and each run loads the ~150 MB precompiled header and links against libtorch
before it compiles the kernel's few dozen lines (measured on a 2-core machine, g++ 12, torch 2.13:
1.2-1.4 s a kernel, 0.9 s of it the header and the link). Here the kernels a graph's module
declares are held until the module waits for them, and then those not built before are built
together: as many libraries as Inductor has compile workers, each with every kernel of its share
under a name of its own and one Python entry per kernel. The code, the flags and so the results are
the kernels' own; only how many g++ runs build them changes.

An index in Inductor's cache directory maps each kernel's code to the library that holds it, so a
kernel met again (another graph, another rank, another run) is loaded, not rebuilt. Where a batch
does not build or load, its kernels are built one by one as Inductor builds them. The hold is
installed only while ``backend.compile_graph`` compiles and only over the methods as this torch
has them (``batched_cpp_kernels``); elsewhere Inductor is untouched. ``AUTOPAR_CPP_KERNELS_ALONE=1``
builds each kernel alone, as Inductor does.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import os

log = logging.getLogger(__name__)

_INDEX = "autopar-cpp-kernels"


class _Held:
    """A kernel Inductor's module declared (``async_compile.cpp_pybinding``), built at its wait."""

    __slots__ = ("argtypes", "source", "key")

    def __init__(self, argtypes, source: str):
        self.argtypes, self.source = list(argtypes), source
        self.key = hashlib.sha256(repr((self.argtypes, self.source)).encode()).hexdigest()[:40]


def _bindings(names: list[str], held: list[_Held]) -> str:
    """One Python module ``kernel`` with an entry per kernel, read the way Inductor's own
    bindings read their arguments: a tensor as its data pointer (the function whose address
    Inductor's loader puts in ``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR``), ints and floats as
    numbers."""
    entries, table = [], []
    for name, k in zip(names, held):
        args = ", ".join(f"autopar_arg<{t.replace('const ', '')}>(args, {i})" for i, t in enumerate(k.argtypes))
        entries.append(f"""
static PyObject* {name}_py(PyObject*, PyObject* args) {{
    try {{
        if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != {len(k.argtypes)}) [[unlikely]]
            throw std::runtime_error("{name} takes {len(k.argtypes)} arguments");
        {name}({args});
        Py_RETURN_NONE;
    }} catch (std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }}
}}""")
        table.append(f'    {{"{name}", {name}_py, METH_VARARGS, ""}},')
    return """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <type_traits>

static void* (*autopar_data_ptr)(PyObject*);

template <typename T> static inline T autopar_arg(PyObject* args, Py_ssize_t n) {
    static_assert(std::is_pointer_v<T>, "a kernel argument is a pointer, an int or a float");
    return static_cast<T>(autopar_data_ptr(PyTuple_GET_ITEM(args, n)));
}
template <> inline int64_t autopar_arg<int64_t>(PyObject* args, Py_ssize_t n) {
    auto v = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, n));
    if (v == -1 && PyErr_Occurred()) [[unlikely]] throw std::runtime_error("expected an int argument");
    return v;
}
template <> inline uintptr_t autopar_arg<uintptr_t>(PyObject* args, Py_ssize_t n) {
    auto v = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, n));
    if (v == reinterpret_cast<void*>(-1) && PyErr_Occurred()) [[unlikely]] throw std::runtime_error("expected an int argument");
    return reinterpret_cast<uintptr_t>(v);
}
template <> inline float autopar_arg<float>(PyObject* args, Py_ssize_t n) {
    auto v = PyFloat_AsDouble(PyTuple_GET_ITEM(args, n));
    if (v == -1.0 && PyErr_Occurred()) [[unlikely]] throw std::runtime_error("expected a float argument");
    return static_cast<float>(v);
}
""" + "\n".join(entries) + """

static PyMethodDef autopar_methods[] = {
""" + "\n".join(table) + """
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef autopar_module = {PyModuleDef_HEAD_INIT, "kernel", NULL, -1, autopar_methods};

PyMODINIT_FUNC PyInit_kernel(void) {
    const char* s = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    char* end = nullptr;
    errno = 0;
    uintptr_t addr = s ? std::strtoull(s, &end, 10) : 0;
    if (!s || errno != 0 || end == s || addr == 0) {
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not set");
        return nullptr;
    }
    autopar_data_ptr = reinterpret_cast<void* (*)(PyObject*)>(addr);
    return PyModule_Create(&autopar_module);
}
"""


def _library_source(held: list[_Held]) -> tuple[str, list[str]]:
    """The kernels as one translation unit: each kernel's own code with its entry ``kernel``
    renamed (the prefix header its code includes is included once, first), then the bindings."""
    names = [f"autopar_k{k.key}" for k in held]
    includes, bodies = [], []
    for name, k in zip(names, held):
        lines = k.source.splitlines()
        head = [ln for ln in lines if ln.startswith("#include")]
        includes += [ln for ln in head if ln not in includes]
        body = "\n".join(ln for ln in lines if not ln.startswith("#include"))
        bodies.append(f"#define kernel {name}\n{body}\n#undef kernel\n")
    return "\n".join(includes) + "\n" + "\n".join(bodies) + _bindings(names, held), names


class _Builder:
    """Builds the held kernels of one wait: those in the index are loaded from their library,
    the others built in ``workers`` libraries at once."""

    def __init__(self, codecache, async_compile_cls):
        from torch._inductor.runtime.runtime_utils import cache_dir

        self.bindings, self.ac = codecache.CppPythonBindingsCodeCache, async_compile_cls
        self.index = os.path.join(cache_dir(), _INDEX)

    def _load(self, source: str):
        # Handed to the compile workers where there are some (built inline, the library's file
        # lock would be taken twice by this one process).
        submit = self.ac.submit if _compile_threads() > 1 else None
        return self.bindings.load_async(source, "cpu", submit_fn=submit)

    def _alone(self, k: _Held):
        """``k`` built as Inductor builds it: a library of its own."""
        return self.bindings.load_pybinding(k.argtypes, k.source)

    def _write(self, path: str, text: str) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    def _indexed(self, k: _Held, libs: dict):
        """(the loader of the library the index names for ``k``, ``k``'s entry in it), or None;
        ``libs`` holds the loaders of the libraries read so far."""
        try:
            with open(os.path.join(self.index, k.key)) as f:
                lib, name = f.read().split()
            if lib not in libs:
                with open(os.path.join(self.index, lib + ".cpp")) as f:
                    libs[lib] = self._load(f.read())
            return libs[lib], name
        except (OSError, ValueError):
            return None

    def build(self, held: list[_Held]) -> list:
        """The kernel functions for ``held``, in its order (a kernel declared twice built once)."""
        unique = list({k.key: k for k in held}.values())
        fns = {k.key: fn for k, fn in zip(unique, self._build(unique))}
        return [fns[k.key] for k in held]

    def _build(self, held: list[_Held]) -> list:
        os.makedirs(self.index, exist_ok=True)
        libs: dict = {}
        found = [self._indexed(k, libs) for k in held]
        missing = [i for i, f in enumerate(found) if f is None]
        workers = min(_compile_threads(), len(missing))
        shares = [missing[w::workers] for w in range(workers)]
        pending = []
        for share in shares:
            source, names = _library_source([held[i] for i in share])
            lib = hashlib.sha256(source.encode()).hexdigest()[:40]
            self._write(os.path.join(self.index, lib + ".cpp"), source)
            pending.append((share, self._load(source), names, lib))
        out = [None] * len(held)
        for i, f in enumerate(found):
            if f is not None:
                out[i] = self._entry(f[0], f[1], held[i])
        for share, get, names, lib in pending:
            try:
                module = get()
                fns = [getattr(module, n) for n in names]
            except Exception as e:  # noqa: BLE001 - the kernels are then built one by one
                log.warning("cpp_kernels: %d kernels built together failed (%s: %s); building each alone",
                            len(share), type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
                fns = [self._alone(held[i]) for i in share]
            else:
                for i, n in zip(share, names):
                    self._write(os.path.join(self.index, held[i].key), f"{lib} {n}\n")
            for i, fn in zip(share, fns):
                out[i] = fn
        return out

    def _entry(self, get, name: str, k: _Held):
        try:
            return getattr(get(), name)
        except Exception:  # noqa: BLE001 - a library the index names but this process cannot load
            return self._alone(k)


def _compile_threads() -> int:
    from torch._inductor import config

    return int(config.compile_threads or 1)


def _installable(codecache, async_compile_cls) -> bool:
    """Whether Inductor's methods are the ones this was written against."""
    try:
        hold = list(inspect.signature(async_compile_cls.cpp_pybinding).parameters)
        wait = list(inspect.signature(async_compile_cls.wait).parameters)
        load = inspect.signature(codecache.CppPythonBindingsCodeCache.load_async).parameters
        return (hold == ["self", "argtypes", "source_code"] and wait == ["self", "scope"]
                and {"main_code", "device_type", "submit_fn"} <= set(load)
                and codecache.CppPythonBindingsCodeCache.entry_function == "kernel")
    except (AttributeError, TypeError, ValueError):
        return False


@contextlib.contextmanager
def batched_cpp_kernels():
    """While open, the C++ kernels of each module Inductor loads are built together at its wait."""
    from torch._inductor import async_compile, codecache

    ac = async_compile.AsyncCompile
    if os.environ.get("AUTOPAR_CPP_KERNELS_ALONE") or not _installable(codecache, ac):
        yield
        return
    hold_orig, wait_orig = ac.cpp_pybinding, ac.wait
    builder = _Builder(codecache, ac)

    def hold(self, argtypes, source_code):
        return _Held(argtypes, source_code)

    def wait(self, scope):
        names = [n for n, v in scope.items() if isinstance(v, _Held)]
        if names:
            for n, fn in zip(names, builder.build([scope[n] for n in names])):
                scope[n] = fn
        return wait_orig(self, scope)

    ac.cpp_pybinding, ac.wait = hold, wait
    try:
        yield
    finally:
        ac.cpp_pybinding, ac.wait = hold_orig, wait_orig
