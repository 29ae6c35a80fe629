"""This process's pages: whether a buffer lies in huge pages, and moving a
private buffer's pages into a shared pool in place.

:class:`Adoptions` is the shared-memory transport's way to give ordinary
buffers the speed of buffers allocated in shared memory: the whole pages
inside a buffer that collectives use again and again are copied into the
rank's shared pool once, and the pool's pages are then mapped at the
buffer's own addresses (``mremap`` of a shared mapping with old size 0
maps the same pages a second time). The buffer keeps its addresses and
contents; every rank that maps the pool now reads and writes it with plain
loads and stores instead of the kernel's cross-memory copies. Memory
outside those pages is untouched.

What changes for the buffer's owner: its pages are 4 KiB pages of shared
memory (the pool has no huge pages), and stay so after the buffer is freed
(malloc may hand the memory out again: it is still right, only shared with
the ranks) until the transport closes, which makes them private again; a
child made with ``os.fork`` gets private copies first thing (a fork made
in C, which runs no Python hook, would share them).
``shm_adopt=0`` / ``COLLECTIVES_SHM_ADOPT=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Callable

import numpy as np

__all__ = ["PAGE", "HUGE_PAGE", "libc_function", "huge_pages", "every_page_huge", "populate", "Adoptions"]

PAGE = 4096
HUGE_PAGE = 2 << 20


def libc_function(name: str, restype, argtypes: list):
    """The C library's function ``name`` with its types, or None."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.restype = restype
    fn.argtypes = argtypes
    return fn


# --------------------------------------------------------------------------- what backs a page


class _PmScanArg(ctypes.Structure):
    """``struct pm_scan_arg`` of <linux/fs.h> (Linux 6.7 on)."""
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


class _PageRegion(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


_PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_PmScanArg) << 16) | (ord("f") << 8) | 16  # _IOWR('f', 16, ...)
_PAGE_IS_HUGE = 1 << 6
_pagemap: list = [None, -1]  # [pid, fd]: a forked child must open its own
_ioctl = libc_function("ioctl", ctypes.c_int, [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p])


def _pagemap_fd() -> int:
    """This process's /proc/self/pagemap (opened once per process), or -1."""
    pid = os.getpid()
    if _pagemap[0] != pid:
        _pagemap[0] = pid
        try:
            _pagemap[1] = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            _pagemap[1] = -1
    return _pagemap[1]


def _some_page_lacks(lo: int, hi: int, category: int) -> bool | None:
    """Whether some page in [lo, hi) lacks ``category``; None when the kernel
    cannot tell (its PAGEMAP_SCAN query arrived in Linux 6.7). One query,
    stopping at the first such page: a few microseconds."""
    fd = _pagemap_fd()
    if fd < 0 or _ioctl is None:
        return None
    found = _PageRegion()
    arg = _PmScanArg(ctypes.sizeof(_PmScanArg), 0, lo, hi, 0, ctypes.addressof(found), 1, 1,
                     category, category, 0, category)
    n = _ioctl(fd, _PAGEMAP_SCAN, ctypes.byref(arg))
    return None if n < 0 else n > 0


def huge_pages(address: int, nbytes: int) -> bool | None:
    """Whether the memory at ``address`` is backed by huge pages: True when
    every page of the 2 MiB-aligned interior of the ``nbytes`` there is huge,
    False when one is not (or there is no such interior), None when the
    kernel cannot tell.

    Cross-memory copies pin every page they touch; from 4 KiB pages they run
    at about half the speed (see :data:`~collectives.algorithms.window.tuning.DIRECT_FROM`).
    """
    lo = -(-address // HUGE_PAGE) * HUGE_PAGE
    hi = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return False
    small = _some_page_lacks(lo, hi, _PAGE_IS_HUGE)
    return None if small is None else not small


def every_page_huge(address: int, nbytes: int) -> bool | None:
    """Whether every 4 KiB page that the ``nbytes`` at ``address`` touch
    lies in a huge page (a buffer smaller than one too, unlike
    :func:`huge_pages`); None when the kernel cannot tell, True for no bytes."""
    lo, hi = address // PAGE * PAGE, -(-(address + nbytes) // PAGE) * PAGE
    if hi <= lo:
        return True
    small = _some_page_lacks(lo, hi, _PAGE_IS_HUGE)
    return None if small is None else not small


def _mappings() -> list[tuple[int, int, str, int, str, int, str]]:
    """This process's mappings, from /proc/self/maps (a few hundred
    microseconds): (start, end, permissions, file offset, device, inode, name)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                start, end = (int(x, 16) for x in fields[0].split("-"))
                name = fields[5].strip() if len(fields) > 5 else ""
                out.append((start, end, fields[1], int(fields[2], 16), fields[3], int(fields[4]), name))
    except (OSError, ValueError, IndexError):
        return []
    return out


def _covered(lo: int, hi: int, maps: list, fits: Callable[[tuple], bool]) -> bool:
    """Whether [lo, hi) lies wholly in mappings for which ``fits(mapping)``."""
    want = lo
    for m in maps:
        if m[1] <= want:
            continue
        if m[0] > want or not fits(m):
            return False
        want = m[1]
        if want >= hi:
            return True
    return False


def _private_anonymous(m: tuple) -> bool:
    """Whether a mapping is private, writable memory of this process alone: the
    heap or malloc's own, or what an earlier transport's adoption left
    (a private mapping of its deleted pool file, see :func:`_make_private`)."""
    _, _, perms, _, _, inode, name = m
    if perms != "rw-p":
        return False
    return (not inode and (not name or name.startswith(("[heap", "[anon")))) or _leftover_adoption(name)


#: The names of the library's segments (see layout.segment_path), as /proc/self/maps shows them.
_SEGMENT_FILES = "/dev/shm/coll-"


def _leftover_adoption(name: str) -> bool:
    return name.startswith(_SEGMENT_FILES) and name.endswith(" (deleted)")


def _mapped_file(lo: int, hi: int) -> str | None:
    """The file that the one mapping spanning exactly [lo, hi) maps, or None
    (no such mapping: freed, cut, or merged with a neighbour). Microseconds."""
    try:
        return os.readlink(f"/proc/self/map_files/{lo:x}-{hi:x}")
    except OSError:
        return None


_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MADV_REMOVE, _MADV_POPULATE_WRITE = 9, 23
_PROT_RW, _MAP_PRIVATE_ANON_FIXED, _MAP_PRIVATE_FIXED = 3, 0x02 | 0x20 | 0x10, 0x02 | 0x10
_mremap = libc_function("mremap", ctypes.c_void_p,
                        [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p])
_mmap = libc_function("mmap", ctypes.c_void_p,
                      [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long])
_madvise = libc_function("madvise", ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
_fallocate = libc_function("fallocate", ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long])
_FALLOC_PUNCH_HOLE_KEEP_SIZE = 0x02 | 0x01


def populate(address: int, nbytes: int) -> None:
    """Fill the page tables for the shared pages at [address, address + nbytes)
    now, in one call, rather than one fault per page at first touch (for
    16 MiB, about 4096 faults)."""
    if _madvise is not None:
        first = address // PAGE * PAGE
        _madvise(first, -(-(address + nbytes - first) // PAGE) * PAGE, _MADV_POPULATE_WRITE)


def _map_again(src: int, nbytes: int, dst: int) -> bool:
    """Map the shared pages at [src, src + nbytes) a second time at ``dst``,
    replacing whatever was mapped there."""
    return _mremap(src, 0, nbytes, _MREMAP_MAYMOVE | _MREMAP_FIXED, dst) == dst


def _make_private(lo: int, hi: int, fd: int, offset: int) -> None:
    """Make the mapping of the pool's file at [lo, hi) (``offset`` into the
    file, ``fd`` open on it) private to this process, with the same bytes.

    One ``mmap(MAP_PRIVATE | MAP_FIXED)`` of the same part of the file
    replaces the shared mapping atomically: a thread that writes there
    meanwhile (malloc hands freed adopted pages out again) writes either into
    the file, which the private mapping shows, or into the private mapping.
    ``MADV_POPULATE_WRITE`` then copies every page now, so that nothing a
    peer might still write into the pool shows here any more, and the file's
    pages there are freed (on kernels without it, a page is copied when this
    process first writes it, and the file keeps its pages).
    Without a descriptor (-1), the bytes are copied out and back around an
    anonymous mapping, which is right only while no other thread runs (a
    forked child).
    """
    if fd >= 0:
        if _mmap(lo, hi - lo, _PROT_RW, _MAP_PRIVATE_FIXED, fd, offset) == lo:
            if _madvise(lo, hi - lo, _MADV_POPULATE_WRITE) == 0:  # every page copied: the file's can go
                _fallocate(fd, _FALLOC_PUNCH_HOLE_KEEP_SIZE, offset, hi - lo)
            return
    with mmap.mmap(-1, hi - lo) as keep:
        kept = np.frombuffer(keep, np.uint8)
        np.copyto(kept, _bytes_at(lo, hi - lo))
        if _mmap(lo, hi - lo, _PROT_RW, _MAP_PRIVATE_ANON_FIXED, -1, 0) == lo:
            np.copyto(_bytes_at(lo, hi - lo), kept)
        del kept


def _bytes_at(address: int, nbytes: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), np.uint8)


# --------------------------------------------------------------------------- adoption


class Adoptions:
    """Private buffers whose whole pages now live in this rank's shared pool.

    A buffer is adopted the second time :meth:`find` sees the same address
    and size (buffers used once are not worth the copy: moving 16 MiB costs
    about 15 ms, mostly the pool's first touch of each page). Each later
    :meth:`find` checks that exactly that range still maps the pool's file
    (one ``readlink`` in /proc/self/map_files, a few microseconds). When it
    does not (the owner freed the buffer and something else is there now),
    the entry is dropped; if it served fewer than :data:`MIN_USES` calls,
    that address and size are never adopted again (a buffer made anew for
    every call, often at the same address, would pay the copy every time).

    A freed buffer's pages may stay mapped (malloc keeps heap memory and
    hands it out again); they are still the pool's, and still right. A
    pool block goes back to the pool only when /proc/self/maps shows that
    no mapping uses it any more (checked when the next buffer is adopted).
    :meth:`close` (when the transport closes, and first thing in a child
    made with ``os.fork``) makes every adopted range private again, so that
    no memory malloc may hand out stays shared with anything.

    Args:
        pool: this rank's mapping of its shared pool.
        take: ``take(nbytes)`` -> offset of a free page-aligned block in the
            pool, or None.
        give: ``give(offset, nbytes)`` returns a block.
        fd: a descriptor of the pool's file (-1 if none), which :meth:`close`
            makes adopted ranges private with, atomically (see :func:`_make_private`).
    """

    #: Buffers smaller than this are never adopted.
    MIN_BYTES = 1 << 20
    #: An address and size whose adopted buffer served fewer calls than this
    #: before it was freed is not adopted again.
    MIN_USES = 4
    _SEEN_MAX = 1024

    def __init__(self, pool: np.ndarray, take: Callable[[int], int | None],
                 give: Callable[[int, int], None], fd: int = -1) -> None:
        self._pool = pool
        self._fd = fd
        self._base = pool.ctypes.data
        self._take, self._give = take, give
        self._entries: dict[tuple[int, int], tuple[int, int, int, int]] = {}  # key -> (lo, hi, pool offset, uses)
        self._blocks: dict[int, int] = {}  # pool offset -> bytes, of every block adopted and not yet returned
        self._seen: set[tuple[int, int]] = set()
        self._refused: set[tuple[int, int]] = set()
        self._file = self._pool_file()
        self.works = None not in (_mremap, _mmap, _madvise) and self._file is not None
        _open.add(self)

    def _pool_file(self) -> tuple[str, int, int, int, str, int] | None:
        """(name, start, end, file offset, device, inode) of the mapping the pool
        is in; None where /proc/self/map_files cannot name it."""
        for start, end, _, offset, dev, inode, _ in _mappings():
            if start <= self._base < end:
                name = _mapped_file(start, end)
                return None if name is None else (name, start, end, offset, dev, inode)
        return None

    def find(self, address: int, nbytes: int, adopt: bool) -> tuple[int, int, int] | None:
        """Where the ``nbytes`` at ``address`` are in the pool: (pool offset
        of byte 0 (the byte itself may lie outside the pool), first byte, end
        byte of the part that does lie there), or None. With ``adopt``, the
        buffer may be adopted now (see the class)."""
        part = None
        for key, (lo, hi, off, uses) in list(self._entries.items()):
            a, b = max(lo, address), min(hi, address + nbytes)
            if b > a:
                if _mapped_file(lo, hi) == self._file[0]:
                    part = off + (address - lo), a - address, b - address
                    if lo <= address + PAGE and address + nbytes <= hi + PAGE:
                        self._entries[key] = (lo, hi, off, uses + 1)
                        return part  # every whole page of the buffer
                    break  # a part of it: an earlier buffer's, freed and handed out again
                del self._entries[key]  # freed, and something else is there now
                self._seen.discard(key)
                if uses < self.MIN_USES:
                    self._refused.add(key)  # made anew for every call, it seems: not worth a copy each time
                break
        key = (address, nbytes)
        if not adopt or not self.works or nbytes < self.MIN_BYTES or key in self._refused:
            return part
        if key not in self._seen:
            if len(self._seen) >= self._SEEN_MAX:
                self._seen.clear()
            self._seen.add(key)
            return part
        return self._adopt(address, nbytes) or part

    def _adopt(self, address: int, nbytes: int) -> tuple[int, int, int] | None:
        key = (address, nbytes)
        lo = -(-address // PAGE) * PAGE
        hi = (address + nbytes) // PAGE * PAGE
        maps = _mappings()
        if hi - lo < self.MIN_BYTES // 2 or not _covered(lo, hi, maps, self._replaceable):
            self._refused.add(key)
            return None
        off = self._take(hi - lo + PAGE)  # a page apart from other blocks: their mappings never merge
        if off is None:
            return None
        for k, (a, b, _, _) in list(self._entries.items()):
            if a < hi and lo < b:
                del self._entries[k]  # their memory, freed and handed out again, is in this buffer
        block = self._pool[off:off + hi - lo]
        populate(block.ctypes.data, block.nbytes)
        np.copyto(block, _bytes_at(lo, hi - lo))
        moved = _map_again(block.ctypes.data, hi - lo, lo)
        self._blocks[off] = hi - lo + PAGE
        self._return_unused(_mappings())
        if not moved:
            self._refused.add(key)
            return None
        populate(lo, hi - lo)
        self._entries[key] = (lo, hi, off, 0)
        self._seen.discard(key)
        return off - (lo - address), lo - address, hi - address

    def _replaceable(self, m: tuple) -> bool:
        """Whether adoption may map the pool over this mapping: private memory,
        or another mapping of the pool's file (an adopted buffer's, freed)."""
        return _private_anonymous(m) or (m[4:6] == self._file[4:6] and m[0:2] != self._file[1:3])

    def _others(self, maps: list) -> list[tuple[int, int, int]]:
        """(start, end, file offset) of every mapping of the pool's file but the pool's own."""
        _, start, end, _, dev, inode = self._file
        return [(s, e, o) for s, e, _, o, d, i, _ in maps if d == dev and i == inode and (s, e) != (start, end)]

    def _return_unused(self, maps: list) -> None:
        """Return the blocks that no mapping uses any more to the pool."""
        _, start, _, offset, _, _ = self._file
        used = [(o, o + e - s) for s, e, o in self._others(maps)]
        held = {off for _, _, off, _ in self._entries.values()}
        for off, n in list(self._blocks.items()):
            at = offset + (self._base - start) + off  # the block's place in the file
            if off not in held and not any(a < at + n and at < b for a, b in used):
                del self._blocks[off]
                self._release(off, n)

    def _release(self, off: int, nbytes: int) -> None:
        _madvise(self._base + off, nbytes, _MADV_REMOVE)  # the pages' memory goes back now
        self._give(off, nbytes)

    def close(self, forked: bool = False) -> None:
        """Make every range that maps the pool's file private again (before the
        pool goes, and in a forked child, which must leave the file alone: it
        copies); adopt nothing more."""
        _open.discard(self)
        if self._file is not None and self.works:
            for s, e, offset in self._others(_mappings()):
                _make_private(s, e, -1 if forked else self._fd, offset)
        self._entries.clear()
        self._blocks.clear()
        self.works = False


_open: set[Adoptions] = set()  # not closed yet: a forked child closes them all


def _privatize_after_fork() -> None:
    for adoptions in list(_open):  # the child runs alone: copying out and back is safe
        adoptions.close(forked=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_privatize_after_fork)
