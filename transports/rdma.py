"""RDMA transport: reliable-connected queue pairs through libibverbs (cffi).

One RC queue pair per peer, one completion queue. Messages are cut into
chunks of at most ``chunk`` bytes; each chunk is one SEND with two
scatter-gather entries: a 40-byte header (tag, total length, the call's
signature) from a small registered header pool, and the payload straight
from the user's buffer,
registered once and found again in a registration cache (registering per
call costs tens of microseconds). Receives land in pre-posted registered
slots and are copied into the matching receive's buffer; chunks of one
peer arrive in the order they were posted, and a sender never interleaves
two messages to the same peer, so matching by (peer, tag) is FIFO.

Checks: a message's first chunk is checked against its receive before any
of it is copied (:func:`~collectives.signature.check_message`, then the
size); a refused message is consumed and dropped, and its receive fails. A
collective message (odd tag) that no receive waits for fails the peer's
pending collective receives of other calls, and a collective receive
posted while such a message of another call is queued fails at once
(:func:`~collectives.signature.out_of_step`): messages of a pair keep their
order, so the peer moved past the call. :meth:`RdmaTransport.abort` sends
its reason unchanged, with the first call it did not complete; the peers
raise ``errors.from_abort(reason, peer, rank)`` in every wait and every
later operation, as this rank does, but for those of earlier calls, which
may finish.
Queue pairs retry forever when the receiver has no slot posted (RNR retry
7), which is the flow control. Connection information (LID, GID, QP number)
is exchanged through the job's rendezvous store.
"""

from __future__ import annotations

import collections
import json
import struct
import time
from typing import Any

import numpy as np

from ..errors import CollectiveError, MismatchedCollective, PeerLost, TransportUnavailable, from_abort
from ..signature import NO_SIG, SEQ_MASK, Sig, check_message, out_of_step
from ..transport import Request, Transport
from ..waiting import Backoff
from . import verbs
from .rendezvous import wait_for_key

__all__ = ["RdmaTransport", "RegistrationCache"]

HEADER = struct.Struct("<qQ3Q")  # tag (negative: control), total bytes, the call's signature (three words)
ABORT_TAG = -1
_SEND_BIT = 1 << 63


class RegistrationCache:
    """Memory registrations reused across calls (page-aligned ranges, LRU bounded)."""

    def __init__(self, dev: verbs.Verbs, max_entries: int = 256) -> None:
        self.dev, self.max_entries = dev, max_entries
        self._mrs: "collections.OrderedDict[tuple[int, int], Any]" = collections.OrderedDict()

    def lkey(self, addr: int, nbytes: int) -> int:
        """The local key of a registration covering [addr, addr + nbytes)."""
        for (start, end), mr in reversed(self._mrs.items()):
            if start <= addr and addr + nbytes <= end:
                self._mrs.move_to_end((start, end))
                return int(mr.lkey)
        start, end = addr & ~4095, (addr + nbytes + 4095) & ~4095
        mr = self.dev.reg_mr(start, end - start)
        self._mrs[(start, end)] = mr
        while len(self._mrs) > self.max_entries:
            _, old = self._mrs.popitem(last=False)
            self.dev.dereg_mr(old)
        return int(mr.lkey)

    def close(self) -> None:
        while self._mrs:
            self.dev.dereg_mr(self._mrs.popitem()[1])


class _Recv(Request):
    __slots__ = ("tr", "buf", "peer", "tag", "sig", "done", "error")

    def __init__(self, tr: "RdmaTransport", buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> None:
        self.tr, self.buf, self.peer, self.tag, self.sig = tr, buf, peer, tag, sig
        self.done, self.error = False, None

    def test(self) -> bool:
        if not self.done:
            self.tr._progress()
        if self.error is not None:
            raise self.error
        if not self.done and self.tr._aborted is not None and self.tr._refuses(self.tag):
            raise self.tr._abort_error()
        return self.done

    def wait(self, timeout: float | None = None) -> None:
        self.tr._wait(self, timeout)


class _Send(_Recv):
    __slots__ = ("chunks_left", "offset")

    def __init__(self, tr: "RdmaTransport", buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> None:
        super().__init__(tr, buf, peer, tag, sig)
        self.offset, self.chunks_left = 0, 0


class RdmaTransport(Transport):
    """Point-to-point over RC queue pairs (see the module docstring)."""

    name = "rdma"
    capabilities = frozenset()
    released_on_delivery = True  # see Transport

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return verbs.probe()

    @classmethod
    def open(cls, rank: int, size: int, *, job: str, timeout: float, options: dict[str, Any]) -> "RdmaTransport":
        """Exchange queue-pair addresses through the job's rendezvous store
        (the one the TCP transport uses: rank 0 serves it at MASTER_PORT, or
        the store torch hands over) and connect every pair."""
        import zmq

        from .rendezvous import JobCredentials, open_store
        from .zmq.options import job_secret as _secret

        ctx = zmq.Context()
        store, close_store = open_store(ctx, rank, options, JobCredentials(_secret(options, job)), None, timeout)
        try:
            tr = cls(rank, size, store, timeout=timeout, device=options.get("rdma_device"),
                     chunk=int(options.get("rdma_chunk_bytes", 1 << 16)),
                     slots=int(options.get("rdma_slots", 64)))
            store.set(f"rdma/ready/{rank}", b"1")
            if rank == 0:  # keep the store up until every rank has read what it needs
                for r in range(size):
                    wait_for_key(store, f"rdma/ready/{r}", timeout)
            return tr
        finally:
            close_store()
            ctx.term()

    def __init__(self, rank: int, size: int, store: Any, *, timeout: float = 60.0,
                 device: str | None = None, chunk: int = 1 << 16, slots: int = 64) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        self.chunk, self.slots = chunk, slots
        self.dev = verbs.Verbs(device)
        self.ffi = self.dev.ffi
        self.cache = RegistrationCache(self.dev)
        self._closed = False
        self._lost: dict[int, str] = {}
        #: (reason, the rank that aborted, the first call it did not complete or -1)
        self._aborted: tuple[str, int, int] | None = None
        self._posted: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self._unexpected: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self._incoming: dict[int, list] = {}  # peer -> [target array, received bytes, request or None]
        self._sendq: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._inflight = 0
        self._headers = np.zeros((slots, HEADER.size), dtype=np.uint8)
        self._free_headers = list(range(slots))
        self._header_owner: dict[int, _Send] = {}
        self._rslots = np.zeros((size, slots, HEADER.size + chunk), dtype=np.uint8)
        self._rkey = self.cache.lkey(self._rslots.ctypes.data, max(self._rslots.nbytes, 1))
        self._hkey = self.cache.lkey(self._headers.ctypes.data, self._headers.nbytes)
        self._wcs = self.ffi.new("struct ibv_wc[]", 64)
        self.qps: dict[int, Any] = {p: self.dev.create_rc_qp(slots, slots) for p in range(size) if p != rank}
        self._connect(store, timeout)

    # ---------------------------------------------------------------- setup

    def _connect(self, store: Any, timeout: float) -> None:
        for peer, qp in self.qps.items():
            store.set(f"rdma/{self.rank}->{peer}", json.dumps(self.dev.address(qp)).encode())
        for peer, qp in self.qps.items():
            remote = json.loads(wait_for_key(store, f"rdma/{peer}->{self.rank}", timeout))
            self.dev.connect(qp, remote)
            for s in range(self.slots):
                self._post_slot(peer, s)

    def _post_slot(self, peer: int, slot: int) -> None:
        sge = self.ffi.new("struct ibv_sge *")
        sge.addr = self._rslots[peer, slot].ctypes.data
        sge.length, sge.lkey = self._rslots.shape[2], self._rkey
        wr = self.ffi.new("struct ibv_recv_wr *")
        wr.wr_id, wr.sg_list, wr.num_sge = (peer << 32) | slot, sge, 1
        self.dev.post_recv(self.qps[peer], wr)

    # ------------------------------------------------------------ requests

    def isend(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        self._check_peer(peer, tag)
        req = _Send(self, buf.reshape(-1).view(np.uint8), peer, tag, sig)
        if peer == self.rank:
            self._deliver_local(req)
        else:
            self._sendq[peer].append(req)
            self._pump(peer)
        return req

    def irecv(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        self._check_peer(peer, tag)
        req = _Recv(self, buf.reshape(-1).view(np.uint8), peer, tag, sig)
        waiting = self._unexpected.get((peer, tag))
        if waiting:
            theirs, data = waiting.popleft()
            self._complete_from(req, data, theirs)
        elif tag & 1 and self._queued_other_call(req):
            pass
        else:
            self._posted[(peer, tag)].append(req)
        return req

    def _check_peer(self, peer: int, tag: int) -> None:
        if self._aborted is not None and self._refuses(tag):
            raise self._abort_error()
        if peer in self._lost:
            raise PeerLost(self._lost[peer], peer)

    def _refuses(self, tag: int) -> bool:
        """Whether an operation with ``tag`` fails on the aborted transport:
        always, but for one of a collective call before the first call the
        aborting rank did not complete (it may still finish)."""
        first = self._aborted[2]
        return first < 0 or not tag & 1 or not 0 < (first - (tag >> 1)) & SEQ_MASK < (SEQ_MASK + 1) >> 1

    def _abort_error(self) -> CollectiveError:
        reason, origin, _ = self._aborted
        return from_abort(reason, origin, self.rank)

    def _deliver_local(self, req: _Send) -> None:
        data = bytes(req.buf)
        posted = self._posted.get((req.peer, req.tag))
        if posted:
            self._complete_from(posted.popleft(), data, req.sig)
        else:
            self._unexpected[(req.peer, req.tag)].append((req.sig, data))
            self._fail_other_calls(req.peer, req.tag, req.sig)
        req.done = True

    def _mismatch(self, req: _Recv, theirs: Sig, total: int) -> CollectiveError | None:
        """The error of a message with signature ``theirs`` and ``total`` bytes
        arriving at ``req`` (None when it may land in ``req``'s buffer)."""
        error = check_message(req.sig, theirs, self.rank, req.peer) if theirs != req.sig else None
        if error is None and total != req.buf.nbytes:
            error = MismatchedCollective(
                f"rank {self.rank}: expected {req.buf.nbytes} bytes from rank {req.peer}, got {total} "
                "(ranks disagree about the collective or its size)")
        return error

    def _complete_from(self, req: _Recv, data: bytes | np.ndarray, theirs: Sig) -> None:
        error = self._mismatch(req, theirs, len(data))
        if error is not None:
            req.error = error
        else:
            req.buf[:] = np.frombuffer(data, dtype=np.uint8)
        req.done = True

    def _queued_other_call(self, req: _Recv) -> bool:
        """Fail the collective receive ``req`` (none queued for its own tag)
        when a collective message of another call from its peer is queued:
        the peer moved past ``req``'s call. True when it did."""
        for (peer, tag), queued in self._unexpected.items():
            if peer == req.peer and tag & 1 and tag != req.tag and queued:
                req.error = out_of_step(self.rank, peer, req.tag, tag, queued[0][0])
                return True
        return False

    def _fail_other_calls(self, peer: int, tag: int, theirs: Sig) -> None:
        """A message from ``peer`` that no receive waits for arrived: when it is
        a collective one, ``peer`` moved past the calls of the collective
        receives still waiting for it with other tags; fail them."""
        if not tag & 1:
            return
        for (p, t), queued in self._posted.items():
            if p == peer and t & 1 and t != tag:
                while queued:
                    waiting = queued.popleft()
                    waiting.error = out_of_step(self.rank, peer, waiting.tag, tag, theirs)

    # ------------------------------------------------------------ progress

    def _pump(self, peer: int) -> None:
        """Post the next chunks of ``peer``'s queued sends while header slots are free."""
        q = self._sendq[peer]
        while q and self._free_headers:
            req = q[0]
            n = min(self.chunk, req.buf.nbytes - req.offset)
            self._post_chunk(req, n)
            req.offset += n
            if req.offset >= req.buf.nbytes:
                q.popleft()

    def _post_chunk(self, req: _Send, n: int) -> None:
        h = self._free_headers.pop()
        HEADER.pack_into(self._headers[h], 0, req.tag, req.buf.nbytes, *req.sig)
        sges = self.ffi.new("struct ibv_sge[2]")
        sges[0].addr, sges[0].length, sges[0].lkey = self._headers[h].ctypes.data, HEADER.size, self._hkey
        num = 1
        if n:
            addr = req.buf.ctypes.data + req.offset
            sges[1].addr, sges[1].length, sges[1].lkey = addr, n, self.cache.lkey(addr, n)
            num = 2
        wr = self.ffi.new("struct ibv_send_wr *")
        wr.wr_id, wr.sg_list, wr.num_sge = _SEND_BIT | h, sges, num
        wr.opcode, wr.send_flags = verbs.WR_SEND, verbs.SEND_SIGNALED
        self._header_owner[h] = req
        req.chunks_left += 1
        self.dev.post_send(self.qps[req.peer], wr)

    def _progress(self) -> bool:
        """Handle every available completion; True if any."""
        n = self.dev.poll(self._wcs, 64)
        for i in range(n):
            wc = self._wcs[i]
            if wc.wr_id & _SEND_BIT:
                self._on_send_done(wc)
            else:
                self._on_recv(wc)
        return n > 0

    def _on_send_done(self, wc: Any) -> None:
        h = int(wc.wr_id & 0xFFFFFFFF)
        req = self._header_owner.pop(h)
        self._free_headers.append(h)
        if wc.status != verbs.WC_SUCCESS:
            self._peer_lost(req.peer, f"send to rank {req.peer} failed (work completion status {wc.status})")
            return
        req.chunks_left -= 1
        if req.chunks_left == 0 and req.offset >= req.buf.nbytes:
            req.done = True
        self._pump(req.peer)

    def _on_recv(self, wc: Any) -> None:
        peer, slot = int(wc.wr_id >> 32), int(wc.wr_id & 0xFFFFFFFF)
        if wc.status != verbs.WC_SUCCESS:
            self._peer_lost(peer, f"receive from rank {peer} failed (work completion status {wc.status})")
            return
        raw = self._rslots[peer, slot]
        tag, total, w0, w1, w2 = HEADER.unpack_from(raw, 0)
        payload = raw[HEADER.size:int(wc.byte_len)]
        if tag == ABORT_TAG:  # payload: the first call the peer did not complete (int64, -1: unknown), reason
            if self._aborted is None:
                text = bytes(payload)
                first = struct.unpack_from("<q", text)[0] if len(text) >= 8 else -1
                self._aborted = (text[8:].decode("utf-8", "replace"), peer, first)
        else:
            self._absorb(peer, tag, total, (w0, w1, w2), payload)
        self._post_slot(peer, slot)

    def _absorb(self, peer: int, tag: int, total: int, theirs: Sig, payload: np.ndarray) -> None:
        """Take one chunk. The first chunk of a message picks its receive and is
        checked against it: a mismatched message is consumed without a copy."""
        cur = self._incoming.get(peer)
        if cur is None:
            posted = self._posted.get((peer, tag))
            req = posted.popleft() if posted else None
            error = self._mismatch(req, theirs, total) if req is not None else None
            if req is None:
                target = np.empty(total, dtype=np.uint8)
                self._fail_other_calls(peer, tag, theirs)
            else:
                target = req.buf if error is None else None
            cur = self._incoming[peer] = [target, 0, req, theirs, error]
        target, got, req, theirs, error = cur
        if target is not None:
            target[got:got + payload.size] = payload
        cur[1] = got = got + payload.size
        if got >= total:
            del self._incoming[peer]
            if req is None:
                self._unexpected[(peer, tag)].append((theirs, target))
            else:
                req.error = error
                req.done = True

    def _peer_lost(self, peer: int, reason: str) -> None:
        self._lost.setdefault(peer, reason)
        err = PeerLost(reason, peer)
        for (p, _), q in list(self._posted.items()):
            if p == peer:
                for r in q:
                    r.error = err
        for r in self._sendq.get(peer, ()):
            r.error = err

    # ---------------------------------------------------------------- waits

    def _wait(self, req: _Recv, timeout: float | None) -> None:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        backoff = Backoff(deadline, f"rank {self.rank}: RDMA wait for rank {req.peer} (tag {req.tag})")
        while not req.done and req.error is None:
            if self._aborted is not None and self._refuses(req.tag):
                raise self._abort_error()
            if self._progress():
                backoff.reset()
                continue
            if req.peer in self._lost:
                raise PeerLost(self._lost[req.peer], req.peer)
            backoff.pause()
        if req.error is not None:
            raise req.error

    def abort(self, reason: str, seq: int | None = None) -> None:
        """Send ``reason`` unchanged (up to one chunk) to every peer, with
        ``seq``, the first call this rank did not complete (None: unknown):
        the peers' waits and later operations raise it, and this rank's, but
        for those of earlier collective calls, which may finish. A transport
        that a peer aborted tells no one (that peer told everyone). Never
        raises."""
        if self._aborted is not None or self._closed:
            return
        first = -1 if seq is None else seq & SEQ_MASK
        self._aborted = (reason, self.rank, first)
        try:
            text = struct.pack("<q", first) + reason.encode("utf-8", "replace")
            msg = np.frombuffer(text[: self.chunk], dtype=np.uint8).copy()
            for peer in self.qps:
                if peer not in self._lost:
                    self._sendq[peer].appendleft(_Send(self, msg, peer, ABORT_TAG))
                    self._pump(peer)
        except Exception:
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for qp in self.qps.values():
            self.dev.destroy_qp(qp)
        self.cache.close()
        self.dev.close()


def unavailable_reason() -> str | None:
    """None when RDMA can run here, else the reason (for ``transport="auto"``'s log line)."""
    ok, why = verbs.probe()
    return None if ok else why


def require() -> None:
    """Raise TransportUnavailable with the reason when RDMA cannot run here."""
    why = unavailable_reason()
    if why is not None:
        raise TransportUnavailable(f"transport 'rdma' is not available here: {why}")
