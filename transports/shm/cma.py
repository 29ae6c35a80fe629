"""Cross-memory copies: reading and writing a peer's private memory.

Linux's ``process_vm_readv`` and ``process_vm_writev`` copy between this
process and another in one system call, when the kernel permits it (the
same user, and ptrace rules that allow it). The window uses them to read
and write peers' buffers that do not lie in shared memory; the rendezvous
probes once whether every rank may (:func:`probe`). Copies whose
destination sits just past the source's place in a page go through a
bounce buffer (:func:`skewed`, :class:`CrossMemory`).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from collectives import compiled
from collectives.errors import PeerLost

from .pages import PAGE, libc_function

__all__ = ["CrossMemory", "SKEW_SLOW_BYTES", "BOUNCE_BYTES", "skewed", "cma_read", "cma_write", "probe"]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load_vm(name: str):
    """libc's ``process_vm_readv`` or ``process_vm_writev``, or None."""
    return libc_function(name, ctypes.c_ssize_t, [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                          ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong])


_readv = _load_vm("process_vm_readv")
_writev = _load_vm("process_vm_writev")


def _cma(fn, pid: int, address: int, local: np.ndarray) -> bool:
    """Move ``local.nbytes`` bytes between ``local`` and ``address`` in process
    ``pid`` with ``fn`` (:data:`_readv`: into ``local``; :data:`_writev`: out
    of it). Returns False when the kernel refuses (no permission, no support)."""
    if fn is None:
        return False
    want = local.nbytes
    done = 0
    base = local.ctypes.data
    while done < want:
        mine = _IoVec(base + done, want - done)
        theirs = _IoVec(address + done, want - done)
        n = fn(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
        if n <= 0:
            return False
        done += n
    return True


#: The kernel's copy for cross-memory attach runs about 4.4 times slower when
#: the destination starts 1 to 31 bytes past the source's place in a 4 KiB
#: page (measured here: 1 MiB in 440 us against 100 us; 32 bytes and more,
#: or any place before the source's, run at full speed). Heap buffers land
#: at any 16-byte place, so two ranks' buffers meet that way often.
SKEW_SLOW_BYTES = 32
#: Such copies go through a bounce buffer placed like the source, this many
#: bytes at a time (the extra copy is in user space, which handles the skew).
BOUNCE_BYTES = 256 << 10


def skewed(src: int, dst: int) -> bool:
    """True when a kernel copy from address ``src`` to ``dst`` would be slow (see :data:`SKEW_SLOW_BYTES`)."""
    return 0 < (dst - src) % PAGE < SKEW_SLOW_BYTES


#: The compiled extension's cross-memory copy (one C call for the whole
#: move: about 1 us of the call's own against 6 to 10 through ctypes), or None.
_vm_move = getattr(compiled.ext, "vm_move", None)


def _moved(write: bool, pid: int, address: int, local: np.ndarray) -> bool:
    """Move ``local.nbytes`` bytes between ``local`` and ``address`` in process
    ``pid`` (``write``: out of ``local``); False when the kernel refuses,
    its errno then in ``ctypes.get_errno()``."""
    if _vm_move is not None:
        try:
            err = _vm_move(pid, address, local, write)
        except (BufferError, TypeError, ValueError):  # a layout the buffer protocol refuses: ctypes
            pass
        else:
            if err:
                ctypes.set_errno(err)
            return not err
    return _cma(_writev if write else _readv, pid, address, local)


def cma_read(pid: int, address: int, out: np.ndarray) -> bool:
    """Copy ``out.nbytes`` bytes at ``address`` in process ``pid`` into ``out``."""
    return _moved(False, pid, address, out)


def cma_write(pid: int, address: int, src: np.ndarray) -> bool:
    """Copy ``src`` to ``address`` in process ``pid``."""
    return _moved(True, pid, address, src)


def probe(pid: int, address: int, expect: int) -> bool:
    """Whether this process may read and write process ``pid``'s memory: read
    the word at ``address`` (it must hold ``expect``), write it back."""
    got = np.zeros(1, np.uint64)
    return cma_read(pid, address, got) and got[0] == expect and cma_write(pid, address, got)


class CrossMemory:
    """Reads and writes of the peers' private memory, by rank.

    Args:
        rank: this rank (for error messages).
        pids: every rank's process id.
    """

    def __init__(self, rank: int, pids: list[int]) -> None:
        self._rank = rank
        self._pids = pids
        self._bounce: np.ndarray | None = None

    def read(self, rank: int, address: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes at ``address`` in ``rank``'s memory into ``out``.

        Raises:
            PeerLost: the read failed (the peer exited, or its memory is gone).
        """
        if not out.nbytes:
            return
        if skewed(address, out.ctypes.data):
            self._bounced(True, rank, address, out)
        elif not cma_read(self._pids[rank], address, out):
            self._lost("read", out.nbytes, "from", rank)

    def write(self, rank: int, address: int, src: np.ndarray) -> None:
        """Copy ``src`` to ``address`` in ``rank``'s memory.

        Raises:
            PeerLost: the write failed (the peer exited, or its memory is gone).
        """
        if not src.nbytes:
            return
        if skewed(src.ctypes.data, address):
            self._bounced(False, rank, address, src)
        elif not cma_write(self._pids[rank], address, src):
            self._lost("write", src.nbytes, "to", rank)

    def _bounced(self, reading: bool, rank: int, address: int, local: np.ndarray) -> None:
        """:meth:`read` (``reading``) or :meth:`write` through a bounce buffer
        placed in its pages where ``address`` is, so the kernel copies unskewed."""
        if self._bounce is None:
            self._bounce = np.empty(BOUNCE_BYTES + PAGE, np.uint8)
        skip = (address - self._bounce.ctypes.data) % PAGE
        bounce = self._bounce[skip:skip + BOUNCE_BYTES]
        data = local.reshape(-1).view(np.uint8)
        pid = self._pids[rank]
        for start in range(0, data.nbytes, BOUNCE_BYTES):
            part = data[start:start + BOUNCE_BYTES]
            via = bounce[:part.nbytes]
            if reading:
                moved = cma_read(pid, address + start, via)
                if moved:
                    compiled.copy(part, via)
            else:
                compiled.copy(via, part)
                moved = cma_write(pid, address + start, via)
            if not moved:
                self._lost(*(("read", part.nbytes, "from") if reading else ("write", part.nbytes, "to")), rank)

    @property
    def pids(self) -> list[int]:
        """Every rank's process id."""
        return self._pids

    def refused(self, rank: int, err: int) -> None:
        """Raise for a read of ``rank``'s memory that the kernel refused with errno ``err``.

        Raises:
            PeerLost: always.
        """
        raise PeerLost(f"rank {self._rank}: cannot read from rank {rank}'s memory ({os.strerror(err)})", rank)

    def _lost(self, what: str, nbytes: int, way: str, rank: int) -> None:
        err = ctypes.get_errno()
        raise PeerLost(f"rank {self._rank}: cannot {what} {nbytes} B {way} rank {rank}'s "
                       f"memory ({os.strerror(err)})", rank)
