"""The Communicator: rank, size and the collectives over one transport.

Each collective is planned (:mod:`.planning`: validated, its algorithm
chosen, its signature made), takes the next sequence number and runs the
algorithm on flat numpy views of the user's buffers; ``iX`` forms return a
:class:`~collectives.handles.Handle`. Repeated blocking calls run as
prepared calls (:mod:`.prepared`).

Failures (the contract, in full in docs/failures.md):

* Every call carries its signature; ranks that disagree raise
  :class:`~collectives.errors.MismatchedCollective` before touching each
  other's data, and the communicator is aborted.
* A rank whose own arguments are wrong once the algorithm is known refuses
  the call: on a shared window, and in rooted calls everywhere, every rank
  raises :class:`~collectives.errors.BadArgument` in that same call and
  the communicator stays usable; in other calls over messages the refusal
  aborts the communicator, so that the others raise at once.
* Any other error during a call (a timeout, a lost peer, a mismatch) aborts
  the communicator on every rank: later calls raise at once with the
  original reason. :meth:`Communicator.abort` does the same on demand.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Sequence

import numpy as np

from . import debug_log, fast_calls, flight_recorder, signature, tracing
from .buffers import element_count, flat
from .context import SEGMENT_BYTES
from .errors import BadArgument, CollectiveError
from .execution import TAG_SPACE, CallExecution
from .flight_recorder import FlightRecorder
from .handles import CallQueue, Handle, RequestHandle
from .planning import Planner
from .prepared import ApartOrAt, CopyIn, PreparedCalls, apart, call_key
from .selection import RuleSelector, Selector, size_bucket
from .survival import Survival
from .transport import COMPLETED, Transport
from .window_contract import COMPILED_CALLS

__all__ = ["Communicator", "live_communicators"]

log = logging.getLogger("collectives")
_select_log = logging.getLogger("collectives.select")
_call_log = logging.getLogger("collectives.call")
_live: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


def _not_here(buf: Any, peer: Any, tag: Any) -> bool:
    """The compiled send and receive where the transport has none: never done."""
    return False


def live_communicators() -> list["Communicator"]:
    """Every communicator not yet closed (for abort-on-crash hooks)."""
    return list(_live)


class Communicator(CallExecution, Survival):
    """A group of ranks and the collectives among them.

    Args:
        transport: an open transport.
        timeout: default timeout in seconds of every blocking call.
        selector: chooses algorithms for ``algorithm="auto"`` (default:
            :class:`~collectives.selection.RuleSelector`).
        segment_bytes: pipeline segment size of large messages.

    A communicator is used from one thread at a time. Every rank must call
    the collectives in the same order with matching arguments; ranks that do
    not get :class:`~collectives.errors.MismatchedCollective`.
    """

    def __init__(self, transport: Transport, *, timeout: float = 60.0,
                 selector: Selector | None = None, segment_bytes: int = SEGMENT_BYTES, job: str = "",
                 options: dict[str, Any] | None = None) -> None:
        self.transport = transport
        self.rank: int = transport.rank
        self.size: int = transport.size
        self.timeout = float(timeout)
        self._prepared = PreparedCalls()
        self._queue = CallQueue(f"collectives-rank{self.rank}")
        this = weakref.ref(self)  # the fast calls hold this, not the communicator

        def wait(info: tuple, arrays: tuple, late: Any, seq: int) -> None:
            comm = this()
            if comm is None:
                raise RuntimeError("the communicator of this call is gone")
            comm._fast_wait(info, arrays, late, seq)
        self._fast = fast_calls.make(self._queue, wait)  # keeps the call number (``_seq``)
        self._fast_run = self._fast.run
        direct = transport.compiled_p2p(self._fast)  # send and recv from C, closed with the fast calls
        self._p2p_compiled = direct
        self._send_in_c = direct.send if direct is not None else _not_here
        self._recv_in_c = direct.recv if direct is not None else _not_here
        self._take_in_c = direct.take if direct is not None else _not_here
        self._capabilities = frozenset(transport.capabilities)
        self.selector = selector if selector is not None else RuleSelector()
        self.segment_bytes = segment_bytes
        self._planner = Planner(self.rank, self.size, transport, self._choose)
        self._signed = signature.checks_enabled()
        self._scratch: dict = {}
        self._broken: CollectiveError | None = None
        self._closed = False
        self._eager = False
        self._job = job or f"pid{os.getpid()}"
        self._options = dict(options or {})
        self._known_failed: set[int] = set()
        self._agreements = 0
        #: Shrinks since the job started (0: the original communicator).
        self.epoch = 0
        #: Rank in the original communicator of each rank of this one.
        self.original_ranks: list[int] = list(range(self.size))
        self._chosen: set = set()
        self._log_calls = _call_log.isEnabledFor(debug_log.TRACE)
        n = flight_recorder.capacity()
        self._recorder = (FlightRecorder(n, self.rank, self.size, transport.name, job or f"pid{os.getpid()}",
                                         lambda: self._seq, self.timeout) if n else None)
        where = tracing.trace_dir()
        self._tracer = tracing.Tracer(where, self.rank, self.size, transport.name) if where else None
        if self._recorder is not None:
            flight_recorder.install_dump_on_signal(self._recorder)
            window = transport.window
            if window is not None and COMPILED_CALLS in window.features:
                r = self._recorder  # compiled calls record their own calls
                window.record_calls(r.ring)
        _live.add(self)

    # ------------------------------------------------------------------ basics

    @property
    def selector(self) -> Selector:
        """Chooses the algorithm of ``algorithm="auto"`` calls."""
        return self._selector

    @selector.setter
    def selector(self, selector: Selector) -> None:
        self._selector = selector
        self._prepared.clear()  # prepared calls follow the old choices
        self._fast.clear()

    def explain(self, collective: str, nbytes: int, dtype: Any = np.float32) -> Any:
        """Why ``auto`` runs what it runs for ``collective`` of ``nbytes`` here:
        every candidate's predicted time, the choice and what ``auto`` follows
        (``.table()`` prints it; see docs/cost-models.md)."""
        from .cost_models.agreed import explain_choice

        return explain_choice(self._selector, self.transport.name, collective, int(nbytes), self.size, dtype,
                              self._capabilities)

    def _choose(self, collective: str, nbytes: int, dtype: np.dtype) -> str:
        name = self._selector.choose(collective, nbytes, self.size, dtype, self._capabilities)
        if _select_log.isEnabledFor(logging.INFO):
            key = (collective, size_bucket(nbytes), dtype)
            if key not in self._chosen:
                self._chosen.add(key)
                _select_log.info("rank %d: auto chose %s for %s of %d B (%s, %d ranks)", self.rank, name,
                                 collective, nbytes, dtype, self.size)
        return name

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size}, transport={self.transport.name!r})"

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Finish queued work and release the transport (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._fast.open = 0
        self._fast.clear()
        try:
            if not self._queue.idle:
                self._queue.drain(self.timeout)
            if self._tracer is not None:
                try:
                    self._tracer.write()
                except OSError as err:
                    log.warning("rank %d: cannot write the timeline: %s", self.rank, err)
        finally:
            self._queue.close()
            self._prepared.clear()  # its calls hold views of the transport's memory
            self._scratch.clear()
            self.transport.close()
            _live.discard(self)

    def flight_record(self) -> list[dict]:
        """This rank's last calls, oldest first (see :mod:`.flight_recorder`);
        empty when the recorder is off (``COLLECTIVES_FLIGHT_RECORDER=0``)."""
        return self._recorder.records() if self._recorder is not None else []

    def dump_flight_record(self, path: str | None = None) -> str | None:
        """Write this rank's flight record as JSON to ``path`` (default: under
        ``COLLECTIVES_DEBUG_DIR``); returns the path (None when it is off)."""
        return self._recorder.dump(path, reason="asked") if self._recorder is not None else None

    def alloc(self, shape: int | Sequence[int], dtype: Any = np.float32) -> np.ndarray:
        """An uninitialized array in the transport's shared memory (when it has
        some), so window algorithms read it without a copy, like MPI_Alloc_mem.
        """
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        count = int(np.prod(shape, dtype=np.int64))
        return self.transport.alloc(count * dtype.itemsize).view(dtype).reshape(shape)

    empty = alloc

    def zeros(self, shape: int | Sequence[int], dtype: Any = np.float32) -> np.ndarray:
        """Like :meth:`alloc`, filled with zeros."""
        arr = self.alloc(shape, dtype)
        arr[...] = 0
        return arr

    def _counts(self, counts: Sequence[int]) -> tuple[list[int], list[int]]:
        return self._planner.counts(counts)

    def _even_counts(self, total: int, what: str) -> list[int]:
        return self._planner.even_counts(total, what)

    # ----------------------------------------------------------- collectives

    def bcast(self, buf: Any, root: int = 0, *, algorithm: str = "auto",
              timeout: float | None = None) -> Any:
        """Broadcast ``buf`` from ``root`` to every rank, in place.

        Args:
            buf: the data on the root; receives it elsewhere (same size everywhere).
            root: the rank that holds the data.
            algorithm: ``"auto"`` or a registered bcast algorithm.
            timeout: seconds (None: the communicator's default).

        Returns:
            ``buf``.
        """
        if self._fast_run("bcast", algorithm, root, None, buf, None, timeout):
            return buf
        key = call_key("bcast", algorithm, root, None, buf)
        if self._run_prepared(key, (buf,), timeout):
            return buf
        plan = self._plan(self._planner.bcast, buf, root, algorithm)
        self._remember(key, plan, (True,), lambda a: (a[0], root))
        return self._call(plan, timeout)

    def ibcast(self, buf: Any, root: int = 0, *, algorithm: str = "auto",
               timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`bcast`."""
        return self._post(self._plan(self._planner.bcast, buf, root, algorithm), timeout)

    def reduce(self, buf: Any, root: int = 0, op: Any = "sum", *, algorithm: str = "auto",
               timeout: float | None = None) -> Any:
        """Reduce ``buf`` of every rank with ``op``; the result lands in ``buf`` on ``root``.

        Other ranks' ``buf`` is left unchanged. Returns ``buf``.
        """
        if self._fast_run("reduce", algorithm, root, op, buf, None, timeout):
            return buf
        key = call_key("reduce", algorithm, root, op, buf)
        if self._run_prepared(key, (buf,), timeout):
            return buf
        plan = self._plan(self._planner.reduce, buf, root, op, algorithm)
        if plan.args is not None:
            o = plan.args[2]
            self._remember(key, plan, (self.rank == root,), lambda a: (a[0], root, o))
        return self._call(plan, timeout)

    def ireduce(self, buf: Any, root: int = 0, op: Any = "sum", *, algorithm: str = "auto",
                timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`reduce`."""
        return self._post(self._plan(self._planner.reduce, buf, root, op, algorithm), timeout)

    def allreduce(self, buf: Any, op: Any = "sum", *, algorithm: str = "auto",
                  timeout: float | None = None, out: Any = None) -> Any:
        """Reduce ``buf`` of every rank with ``op``; every rank gets the result.

        Args:
            buf: input, and output unless ``out`` is given.
            op: ``sum``, ``prod``, ``min``, ``max``, ``avg``, ``band``, ``bor``,
                ``bxor``, ``land``, ``lor`` (or an :class:`~collectives.ops.Op`).
            out: optional output buffer of the same size and dtype.

        Returns:
            The buffer holding the result (``buf`` or ``out``).
        """
        if out is None:
            if self._fast_run("allreduce", algorithm, None, op, buf, None, timeout):
                return buf
            key = call_key("allreduce", algorithm, None, op, buf)
            if self._run_prepared(key, (buf,), timeout):
                return buf
        else:  # out of place: out takes buf's values first, then the call runs in place on it
            if self._fast_run("allreduce", algorithm, None, op, out, buf, timeout):
                return out
            key = call_key("allreduce", algorithm, None, op, out, buf)
            if self._run_prepared(key, (out, buf), timeout):
                return out
        plan = self._plan(self._planner.allreduce, buf, op, algorithm, out)
        if plan.args is not None:
            o = plan.args[1]
            if out is None:
                self._remember(key, plan, (True,), lambda a: (a[0], o))
            else:
                copy_in = CopyIn(0)
                self._remember(key, plan, (True, False), lambda a: (a[0], o), check=apart, as_is=copy_in)
        return self._call(plan, timeout)

    def iallreduce(self, buf: Any, op: Any = "sum", *, algorithm: str = "auto",
                   timeout: float | None = None, out: Any = None) -> Handle:
        """Nonblocking :meth:`allreduce`."""
        return self._post(self._plan(self._planner.allreduce, buf, op, algorithm, out), timeout)

    def scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, algorithm: str = "auto",
                timeout: float | None = None) -> Any:
        """Block i of ``sendbuf`` on ``root`` goes to rank i's ``recvbuf``.

        ``sendbuf`` (p times ``recvbuf``'s size) matters only on the root.
        Returns ``recvbuf``.
        """
        send = sendbuf if type(root) is int and root == self.rank else None  # matters only on the root
        if self._fast_run("scatter", algorithm, root, None, send, recvbuf, timeout):
            return recvbuf
        key = call_key("scatter", algorithm, root, None, recvbuf, send)
        if self._run_prepared(key, (send, recvbuf), timeout):
            return recvbuf
        counts = [element_count(recvbuf)] * self.size
        plan = self._plan(self._planner.scatterv, sendbuf, recvbuf, counts, root, algorithm, False)
        self._remember(key, plan, (False, True), lambda a: (a[0], a[1], root, counts))
        return self._call(plan, timeout)

    def iscatter(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, algorithm: str = "auto",
                 timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`scatter`."""
        counts = [element_count(recvbuf)] * self.size
        return self._post(self._plan(self._planner.scatterv, sendbuf, recvbuf, counts, root, algorithm, False),
                          timeout)

    def scatterv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], root: int = 0, *,
                 algorithm: str = "auto", timeout: float | None = None) -> Any:
        """Scatter with ``counts[i]`` elements for rank i (same counts on every rank)."""
        return self._call(self._plan(self._planner.scatterv, sendbuf, recvbuf, counts, root, algorithm), timeout)

    def iscatterv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], root: int = 0, *,
                  algorithm: str = "auto", timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`scatterv`."""
        return self._post(self._plan(self._planner.scatterv, sendbuf, recvbuf, counts, root, algorithm), timeout)

    def gather(self, sendbuf: Any, recvbuf: Any = None, root: int = 0, *, algorithm: str = "auto",
               timeout: float | None = None) -> Any:
        """Rank i's ``sendbuf`` becomes block i of ``recvbuf`` on ``root``.

        ``recvbuf`` (p times ``sendbuf``'s size) matters only on the root.
        Returns ``recvbuf`` on the root, None elsewhere.
        """
        recv = recvbuf if type(root) is int and root == self.rank else None  # matters only on the root
        if self._fast_run("gather", algorithm, root, None, sendbuf, recv, timeout):
            return recv
        key = call_key("gather", algorithm, root, None, sendbuf, recv)
        if self._run_prepared(key, (sendbuf, recv), timeout):
            return recv
        counts = [element_count(sendbuf)] * self.size
        plan = self._plan(self._planner.gatherv, sendbuf, recvbuf, counts, root, algorithm, False)
        self._remember(key, plan, (False, True), lambda a: (a[0], a[1], root, counts))
        return self._call(plan, timeout)

    def igather(self, sendbuf: Any, recvbuf: Any = None, root: int = 0, *, algorithm: str = "auto",
                timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`gather`."""
        counts = [element_count(sendbuf)] * self.size
        return self._post(self._plan(self._planner.gatherv, sendbuf, recvbuf, counts, root, algorithm, False),
                          timeout)

    def gatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], root: int = 0, *,
                algorithm: str = "auto", timeout: float | None = None) -> Any:
        """Gather with ``counts[i]`` elements from rank i (same counts on every rank)."""
        return self._call(self._plan(self._planner.gatherv, sendbuf, recvbuf, counts, root, algorithm), timeout)

    def igatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], root: int = 0, *,
                 algorithm: str = "auto", timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`gatherv`."""
        return self._post(self._plan(self._planner.gatherv, sendbuf, recvbuf, counts, root, algorithm), timeout)

    def allgather(self, sendbuf: Any, recvbuf: Any = None, *, algorithm: str = "auto",
                  timeout: float | None = None) -> Any:
        """Every rank's ``sendbuf`` becomes block i of every rank's ``recvbuf``.

        ``sendbuf`` may be None when the rank's block is already in place;
        without ``recvbuf`` a new numpy array of p blocks is made.
        Returns ``recvbuf``.
        """
        if recvbuf is None:
            recvbuf = self._gathered(sendbuf)
        elif self._fast_run("allgather", algorithm, None, None, recvbuf, sendbuf, timeout):
            return recvbuf
        key = call_key("allgather", algorithm, None, None, recvbuf, sendbuf)
        if self._run_prepared(key, (recvbuf,) if sendbuf is None else (recvbuf, sendbuf), timeout):
            return recvbuf
        counts = self._even_counts(element_count(recvbuf), "recvbuf")
        plan = self._plan(self._planner.allgatherv, sendbuf, recvbuf, counts, algorithm, False)
        if key is not None and sendbuf is None:
            self._remember(key, plan, (True,), lambda a: (a[0], counts))
        elif key is not None:
            copy_in = CopyIn(counts[0] * self.rank)  # sendbuf may be this block (then a no-op)
            self._remember(key, plan, (True, False), lambda a: (a[0], counts),
                           check=ApartOrAt(copy_in.at * plan.itemsize), as_is=copy_in)
        return self._call(plan, timeout)

    def iallgather(self, sendbuf: Any, recvbuf: Any = None, *, algorithm: str = "auto",
                   timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`allgather`."""
        if recvbuf is None:
            recvbuf = self._gathered(sendbuf)
        counts = self._even_counts(element_count(recvbuf), "recvbuf")
        return self._post(self._plan(self._planner.allgatherv, sendbuf, recvbuf, counts, algorithm, False), timeout)

    def _gathered(self, sendbuf: Any) -> np.ndarray:
        """A new array for every rank's ``sendbuf`` (an allgather without ``recvbuf``)."""
        if sendbuf is None:
            raise BadArgument(f"rank {self.rank}, allgather: sendbuf and recvbuf are both None; pass the "
                              "block to send, or the buffer that holds it in place")
        arr = flat(sendbuf, writable=False, what="sendbuf")
        return np.empty(arr.size * self.size, arr.dtype)

    def allgatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], *,
                   algorithm: str = "auto", timeout: float | None = None) -> Any:
        """Allgather with ``counts[i]`` elements from rank i (same counts on every rank)."""
        return self._call(self._plan(self._planner.allgatherv, sendbuf, recvbuf, counts, algorithm), timeout)

    def iallgatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], *,
                    algorithm: str = "auto", timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`allgatherv`."""
        return self._post(self._plan(self._planner.allgatherv, sendbuf, recvbuf, counts, algorithm), timeout)

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: Any = "sum", *, algorithm: str = "auto",
                       timeout: float | None = None) -> Any:
        """Reduce ``sendbuf`` (p blocks) over ranks; rank i gets block i in ``recvbuf``.

        Returns ``recvbuf``.
        """
        if self._fast_run("reduce_scatter", algorithm, None, op, sendbuf, recvbuf, timeout):
            return recvbuf
        key = call_key("reduce_scatter", algorithm, None, op, sendbuf, recvbuf)
        if self._run_prepared(key, (sendbuf, recvbuf), timeout):
            return recvbuf
        plan = self._plan(self._planner.reduce_scatter, sendbuf, recvbuf, op, algorithm)
        if plan.args is not None:
            counts, o = plan.args[2], plan.args[3]
            self._remember(key, plan, (False, True), lambda a: (a[0], a[1], counts, o))
        return self._call(plan, timeout)

    def ireduce_scatter(self, sendbuf: Any, recvbuf: Any, op: Any = "sum", *, algorithm: str = "auto",
                        timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`reduce_scatter`."""
        return self._post(self._plan(self._planner.reduce_scatter, sendbuf, recvbuf, op, algorithm), timeout)

    def reduce_scatterv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], op: Any = "sum", *,
                        algorithm: str = "auto", timeout: float | None = None) -> Any:
        """Reduce-scatter with blocks of ``counts[i]`` elements."""
        return self._call(self._plan(self._planner.reduce_scatter, sendbuf, recvbuf, op, algorithm, counts),
                          timeout)

    def ireduce_scatterv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], op: Any = "sum", *,
                         algorithm: str = "auto", timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`reduce_scatterv`."""
        return self._post(self._plan(self._planner.reduce_scatter, sendbuf, recvbuf, op, algorithm, counts),
                          timeout)

    def alltoall(self, sendbuf: Any, recvbuf: Any, *, algorithm: str = "auto",
                 timeout: float | None = None) -> Any:
        """Block j of rank i's ``sendbuf`` becomes block i of rank j's ``recvbuf``.

        Returns ``recvbuf``.
        """
        if self._fast_run("alltoall", algorithm, None, None, sendbuf, recvbuf, timeout):
            return recvbuf
        key = call_key("alltoall", algorithm, None, None, sendbuf, recvbuf)
        if self._run_prepared(key, (sendbuf, recvbuf), timeout):
            return recvbuf
        plan = self._plan(self._planner.alltoall, sendbuf, recvbuf, algorithm)
        self._remember(key, plan, (False, True), lambda a: a, check=apart)
        return self._call(plan, timeout)

    def ialltoall(self, sendbuf: Any, recvbuf: Any, *, algorithm: str = "auto",
                  timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`alltoall`."""
        return self._post(self._plan(self._planner.alltoall, sendbuf, recvbuf, algorithm), timeout)

    def alltoallv(self, sendbuf: Any, sendcounts: Sequence[int], recvbuf: Any, recvcounts: Sequence[int], *,
                  algorithm: str = "auto", timeout: float | None = None) -> Any:
        """Uneven alltoall: ``sendcounts[j]`` elements of ``sendbuf`` (blocks in
        rank order) go to rank j, which receives them as block i of ``recvbuf``
        (``recvcounts[i]`` elements from rank i). Returns ``recvbuf``."""
        return self._call(self._plan(self._planner.alltoallv, sendbuf, sendcounts, recvbuf, recvcounts, algorithm),
                          timeout)

    def ialltoallv(self, sendbuf: Any, sendcounts: Sequence[int], recvbuf: Any, recvcounts: Sequence[int], *,
                   algorithm: str = "auto", timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`alltoallv`."""
        return self._post(self._plan(self._planner.alltoallv, sendbuf, sendcounts, recvbuf, recvcounts, algorithm),
                          timeout)

    def barrier(self, *, algorithm: str = "auto", timeout: float | None = None) -> None:
        """Wait until every rank has entered the barrier."""
        if self._fast_run("barrier", algorithm, None, None, None, None, timeout):
            return
        key = call_key("barrier", algorithm, None, None)
        if self._run_prepared(key, (), timeout):
            return
        plan = self._plan(self._planner.barrier, algorithm)
        self._remember(key, plan, (), lambda a: ())
        self._call(plan, timeout)

    def ibarrier(self, *, algorithm: str = "auto", timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`barrier`."""
        return self._post(self._plan(self._planner.barrier, algorithm), timeout)

    # -------------------------------------------------------- point to point

    def _p2p_tag(self, tag: int) -> int:
        if type(tag) is int and 0 <= tag < TAG_SPACE:  # the common case, before the general checks
            return tag << 1
        if not isinstance(tag, (int, np.integer)) or not 0 <= tag < TAG_SPACE:
            raise BadArgument(f"tag must be an integer in [0, {TAG_SPACE}), got {tag!r}")
        return 2 * int(tag)

    def _p2p(self, buf: Any, peer: int, tag: int, writable: bool, what: str) -> tuple[np.ndarray, int, int]:
        """A point-to-point call's arguments, checked: the buffer as a flat
        array, the peer's rank (``what``: "dst" or "src") and the wire tag."""
        self._check_open()
        peer = self._planner.check_rank(peer, what)
        return flat(buf, writable=writable, what="buf"), peer, self._p2p_tag(tag)

    def isend(self, buf: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> RequestHandle:
        """Start sending ``buf`` to ``dst``; do not modify ``buf`` until it completes."""
        wait = self.timeout if timeout is None else timeout
        if self._send_in_c(buf, dst, tag):  # in the ring already (from C, where the transport offers it)
            return RequestHandle(COMPLETED, None, wait)
        return RequestHandle(self.transport.isend(*self._p2p(buf, dst, tag, False, "dst")), None, wait)

    def irecv(self, buf: Any, src: int, tag: int = 0, *, timeout: float | None = None) -> RequestHandle:
        """Start receiving into ``buf`` from ``src`` (exactly ``buf``'s size)."""
        wait = self.timeout if timeout is None else timeout
        if self._take_in_c(buf, src, tag):  # it was there, and is in buf now
            return RequestHandle(COMPLETED, buf, wait)
        return RequestHandle(self.transport.irecv(*self._p2p(buf, src, tag, True, "src")), buf, wait)

    def send(self, buf: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send ``buf`` to ``dst`` with ``tag``; returns once ``buf`` may be reused."""
        if self._send_in_c(buf, dst, tag):  # the common case, from C where the transport offers it
            return
        self.transport.send(*self._p2p(buf, dst, tag, False, "dst"),
                            timeout=self.timeout if timeout is None else timeout)

    def recv(self, buf: Any, src: int, tag: int = 0, *, timeout: float | None = None) -> Any:
        """Receive into ``buf`` from ``src`` with ``tag`` (exactly ``buf``'s
        size); returns ``buf``."""
        if self._recv_in_c(buf, src, tag):
            return buf
        self.transport.recv(*self._p2p(buf, src, tag, True, "src"),
                            timeout=self.timeout if timeout is None else timeout)
        return buf
