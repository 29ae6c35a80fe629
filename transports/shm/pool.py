"""The shared allocation pool's allocator.

Each rank's segment ends in a pool (sparse: its pages cost memory only once
touched) from which :meth:`~.transport.SharedMemoryTransport.alloc` carves
user buffers, and into which :class:`~.pages.Adoptions` moves the pages of
private buffers used again and again. Every rank maps every rank's pool, so
window algorithms read and write buffers there with plain loads and stores.
"""

from __future__ import annotations

import threading

from .layout import align
from .pages import PAGE

__all__ = ["Pool"]


class Pool:
    """First-fit allocator over one rank's pool, by byte offset; blocks come
    back through :meth:`give` (the transport's arrays give theirs when they,
    and every view of them, are garbage collected)."""

    ALIGN = 64

    def __init__(self, nbytes: int) -> None:
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes else []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> int | None:
        """Offset of a free block of at least ``nbytes`` (page-aligned from
        64 KiB on, else 64-byte aligned), or None when none is free."""
        size = align(max(nbytes, 1), PAGE if nbytes >= 64 * 1024 else self.ALIGN)
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, length - size)
                    return off
        return None

    def give(self, off: int, nbytes: int) -> None:
        """Return the block that :meth:`take` gave for ``nbytes`` at ``off``."""
        size = align(max(nbytes, 1), PAGE if nbytes >= 64 * 1024 else self.ALIGN)
        with self._lock:
            blocks = sorted(self._free + [(off, size)])
            merged: list[tuple[int, int]] = []
            for o, n in blocks:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((o, n))
            self._free = merged
