"""Private buffers placed in huge or in 4 KiB pages, for ``collectives bench --pages``.

Whether a buffer lies in huge pages moves a cross-memory read several times
over (the kernel pins each page it reads: one per 2 MiB, or one per 4 KiB).
MPI libraries read peers' buffers that way from some size on, and so do the
shared window's direct calls (docs/shared-memory.md, "Huge pages"). numpy
asks for huge pages for arrays of 4 MiB and more; smaller ones get them or
not by what the heap held before, so one run's 1 MiB rows may differ from
the next's by that alone. ``--pages huge`` or ``small`` places every peer's
buffers alike:

* ``numpy``: ``np.empty`` (the default);
* ``huge``: a 2 MiB-aligned span of a fresh mapping, advised
  ``MADV_HUGEPAGE`` (the kernel backs it with huge pages where transparent
  huge pages are on, ``madvise`` or ``always``);
* ``small``: the same advised ``MADV_NOHUGEPAGE``.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

from collectives.transports.shm.pages import HUGE_PAGE, PAGE, libc_function

__all__ = ["PAGES", "empty"]

#: The choices of ``--pages``.
PAGES = ("numpy", "huge", "small")

_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15
_advise = libc_function("madvise", ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])


def empty(count: int, dtype: np.dtype, pages: str = "numpy") -> np.ndarray:
    """An uninitialised array of ``count`` ``dtype``, its pages as ``pages``
    says (one of :data:`PAGES`); the kernel's refusal of the advice (no
    transparent huge pages) leaves what it gives."""
    if pages not in PAGES:
        raise ValueError(f"pages must be one of {', '.join(PAGES)}, not {pages!r}")
    dtype = np.dtype(dtype)
    if pages == "numpy" or count == 0 or _advise is None:
        return np.empty(count, dtype)
    span = -(-count * dtype.itemsize // HUGE_PAGE) * HUGE_PAGE
    # a fresh private mapping: heap memory used before keeps the pages it has, whatever the advice
    raw = np.frombuffer(mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)
    start = (-raw.ctypes.data) % HUGE_PAGE
    area = raw[start:start + span]
    _advise(area.ctypes.data, span, _MADV_HUGEPAGE if pages == "huge" else _MADV_NOHUGEPAGE)
    area[::PAGE] = 0  # the first touch, page by page: the kernel backs them now
    return area[:count * dtype.itemsize].view(dtype)
