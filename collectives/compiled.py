"""The optional compiled fast path (``collectives._compiled``, a small C extension).

It is built by ``pip install`` where a C compiler is present and skipped
where not; everything then runs in Python, slower. ``COLLECTIVES_COMPILED=0``
in the environment of a rank turns it off for the transports it opens after
that (:func:`enabled`). What it offers (fences over shared epoch counters, the
one-fence allreduce of small vectors, reductions on raw memory) is used by
the shared-memory window; :func:`kernel_codes` says which dtype and op it can
reduce, exactly as numpy's ufuncs would. :func:`copy` copies between
buffers without the slow case of the C library's copy (see below). Its
``vm_move`` is the shared-memory transport's cross-memory copy, used
whenever the extension is built (as :func:`copy` is).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["ext", "built", "enabled", "rings", "rings_enabled", "kernel_codes", "kernel_itemsize", "reduce_into",
           "copy", "rep_movsb"]

ext: Any = None
try:
    from . import _compiled as ext
except ImportError:  # not built (no compiler at install time)
    ext = None

#: True when the extension is built.
built = ext is not None

#: The rings' compiled whole-message path (``collectives._rings``), or None.
rings: Any = None
try:
    from . import _rings as rings
except ImportError:
    rings = None


def enabled() -> Any:
    """The extension module, or None when it is not built or is turned off
    (``COLLECTIVES_COMPILED=0``)."""
    from . import config

    return ext if ext is not None and config.get("COMPILED") else None


def rings_enabled() -> Any:
    """The rings' compiled module (see ``_rings.c``), or None when it is not
    built or the compiled path is turned off (``COLLECTIVES_COMPILED=0``)."""
    from . import config

    return rings if rings is not None and config.get("COMPILED") else None

if ext is not None:
    _DTYPES = {np.dtype(t): getattr(ext, "DT_" + c) for t, c in (
        (np.float32, "F32"), (np.float64, "F64"), (np.int8, "I8"), (np.int16, "I16"),
        (np.int32, "I32"), (np.int64, "I64"), (np.uint8, "U8"), (np.uint16, "U16"),
        (np.uint32, "U32"), (np.uint64, "U64"))}
    _OPS = {"sum": ext.OP_SUM, "prod": ext.OP_PROD, "min": ext.OP_MIN, "max": ext.OP_MAX,
            "band": ext.OP_BAND, "bor": ext.OP_BOR, "bxor": ext.OP_BXOR}
else:
    _DTYPES, _OPS = {}, {}


_UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
           "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def kernel_codes(dtype: np.dtype, op_name: str, ufunc: Any = None) -> tuple[int, int] | None:
    """(dtype code, op code) of the compiled kernel for ``dtype`` and ``op_name``,
    or None when there is none (no extension, a half float, a logical op, a
    bitwise op on floats, an op whose ``ufunc`` is not the standard one)."""
    d, o = _DTYPES.get(np.dtype(dtype)), _OPS.get(op_name)
    if d is None or o is None or (o >= _OPS["band"] and np.dtype(dtype).kind == "f"):
        return None
    if ufunc is not None and ufunc is not _UFUNCS[op_name]:
        return None
    return d, o


def kernel_itemsize(code: int) -> int:
    """Bytes an element of the dtype whose kernel code (:func:`kernel_codes`) is ``code``."""
    return next(dt.itemsize for dt, c in _DTYPES.items() if c == code)


def reduce_into(dst: np.ndarray, srcs: Sequence[np.ndarray], codes: tuple[int, int],
                copies: Sequence[np.ndarray] = ()) -> None:
    """``dst = srcs[0] op srcs[1] op ...`` in C (``codes`` from
    :func:`kernel_codes`), and the result also into each of ``copies`` as it
    is made, with stores that bypass the cache (for memory another process
    reads next); every array C-contiguous with dst's size and dtype, dst
    distinct from all but srcs[0], the copies from everything."""
    ext.reduce_into(dst, srcs, *codes, copies)


_ext_copy = ext.copy if ext is not None else None


def _set_copy_instruction() -> bool:
    """Let the compiled copies of 4 KiB and more be one ``rep movsb`` where
    the processor has fast string copies (ERMS), unless
    ``COLLECTIVES_COPY_REP_MOVSB=0``; whether they are. Why: ``copy_apart``
    in ``_compiled.c`` and docs/shared-memory.md, "Copies"."""
    from . import config

    return bool(ext.set_rep_movsb(bool(config.get("COPY_REP_MOVSB")))) if ext is not None else False


#: Whether the compiled copies of 4 KiB and more are one ``rep movsb``.
rep_movsb = _set_copy_instruction()


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for C-contiguous arrays of one dtype and size.

    Where the extension is built, in C: the C library's copy runs about
    ten times slower here when ``dst`` starts 1 to 63 bytes past ``src``'s
    place in a 4 KiB page, which is where malloc puts two arrays of one size
    allocated one after the other (a send buffer and its receive buffer);
    the compiled copy avoids that case. The bytes are the same either way.
    """
    if _ext_copy is not None and dst.dtype == src.dtype:
        try:
            _ext_copy(dst, src)
            return
        except (ValueError, TypeError, BufferError):  # a dtype without a buffer format: numpy's copy
            pass
    np.copyto(dst, src)
