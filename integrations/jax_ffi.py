"""The library's calls inside ``jax.jit`` as an XLA FFI custom call (CPU).

:func:`call` binds a JAX primitive whose lowering is the FFI target
``collectives_call`` (``jax_ffi.cc``, compiled here on first use with the C++
compiler and jaxlib's FFI headers, cached under the user's cache folder).
XLA runs it on its own buffers: each output aliases its input (XLA copies
the input first where it cannot give it up), and the handler passes the
outputs as memoryviews to the registered host function, which works on
them in place, with no copy of its own and without JAX's callback machinery (an ordered
``io_callback`` costs about 135 µs a call here). The primitive carries an
ordered effect, so every rank makes its calls in program order and none is
removed as dead code. Where it cannot be built (no compiler, no headers),
:func:`available` says why and :mod:`.jax` falls back on ``io_callback``.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import itertools
import os
import shutil
import subprocess
import sys
import sysconfig
from typing import Any, Callable, Sequence

import jax
import numpy as np

__all__ = ["available", "call"]

TARGET = "collectives_call"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jax_ffi.cc")

_FLAGS = ("-std=c++17", "-O2", "-shared", "-fPIC")
_state: dict[str, Any] = {}
_hosts: dict[int, Callable[[tuple], None]] = {}
_keys = itertools.count(1)


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "collectives", "jax-ffi")


def _library_path() -> str:
    """Where the compiled target lies: named by the source, flags, jaxlib and Python it was built for."""
    import jaxlib

    with open(_SOURCE, "rb") as f:
        made_of = f.read() + " ".join(_FLAGS).encode() + jaxlib.__version__.encode() + sys.version.encode()
    digest = hashlib.sha256(made_of).hexdigest()[:16]
    return os.path.join(_cache_dir(), f"collectives_jax_ffi-{digest}.so")


def _build(path: str) -> None:
    """Compile ``jax_ffi.cc`` to ``path`` (under a lock: every rank may ask at once)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++ or g++, or $CXX) to build the XLA FFI target")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        cmd = [cxx, *_FLAGS, _SOURCE, "-o", tmp,
               "-I", jax.ffi.include_dir(), "-I", sysconfig.get_paths()["include"]]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"building the XLA FFI target failed: {' '.join(cmd)}\n{res.stderr[-2000:]}")
        os.replace(tmp, path)


def _dispatch(key: int, outputs: tuple) -> None:
    _hosts[key](outputs)


def _load() -> None:
    path = _library_path()
    if not os.path.exists(path):
        _build(path)
    lib = ctypes.PyDLL(path)  # PyDLL: calls keep the GIL (the setter takes a Python object)
    lib.CollectivesJaxSetDispatch.argtypes = [ctypes.py_object]
    lib.CollectivesJaxSetDispatch(_dispatch)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.CollectivesJaxCall), platform="cpu")
    _state["lib"] = lib
    _state["primitive"] = _make_primitive()


def available() -> tuple[bool, str]:
    """(True, "") when the FFI target is built and registered (building it
    the first time), else (False, why)."""
    if "ok" not in _state:
        try:
            _load()
            _state["ok"], _state["why"] = True, ""
        except Exception as exc:  # no compiler, no headers, an older jaxlib: say why, fall back
            _state["ok"], _state["why"] = False, f"{type(exc).__name__}: {exc}"
    return _state["ok"], _state["why"]


class _Ordered(jax._src.effects.Effect):
    """The effect that keeps the calls in program order on every rank."""

    def __hash__(self) -> int:
        return hash("collectives.jax_ffi ordered")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Ordered)


def _make_primitive():
    from jax._src import effects
    from jax.core import ShapedArray
    from jax.extend.core import Primitive

    abstract_token = getattr(jax.ffi, "abstract_token", None)  # public from jax 0.11 on
    if abstract_token is None:
        from jax._src.core import abstract_token
    from jax.interpreters import mlir
    from jax.interpreters.mlir import TokenSet

    effect = _Ordered()
    for kind in (effects.lowerable_effects, effects.ordered_effects, effects.control_flow_allowed_effects,
                 effects.custom_derivatives_allowed_effects):
        kind.add_type(_Ordered)

    prim = Primitive("collectives_call")
    prim.multiple_results = True

    def abstract(*avals, key):
        return [ShapedArray(a.shape, a.dtype) for a in avals], {effect}

    def lowering(ctx, *args, key):
        token = ctx.tokens_in.get(effect)
        n = len(args)
        with_token = ctx.replace(avals_in=(*ctx.avals_in, abstract_token),
                                 avals_out=(*ctx.avals_out, abstract_token))
        rule = jax.ffi.ffi_lowering(TARGET, has_side_effect=True,
                                    operand_output_aliases={i: i for i in range(n)})
        results = list(rule(with_token, *args, token, key=np.int64(key)))
        ctx.set_tokens_out(TokenSet({effect: results.pop()}))
        return results

    prim.def_effectful_abstract_eval(abstract)
    prim.def_impl(lambda *args, key: jax.jit(lambda *a: prim.bind(*a, key=key))(*args))
    mlir.register_lowering(prim, lowering, platform="cpu")
    return prim


def call(host: Callable[[tuple], None], arrays: Sequence[Any]) -> list[Any]:
    """Run ``host(outputs)`` on ``arrays`` inside jit: ``outputs`` are
    writable memoryviews over XLA's buffers, one per array, each holding its
    array's values, valid during the call only; ``host`` replaces them with
    the results. Returns the outputs as arrays. Needs :func:`available`."""
    key = next(_keys)
    _hosts[key] = host
    return _state["primitive"].bind(*arrays, key=key)
