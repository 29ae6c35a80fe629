"""The Communicator: rank, size and the collectives over one transport.

Each collective validates its arguments (nothing is sent when they are
wrong), picks the algorithm (by name, or the selector's choice for
``"auto"``), takes the next tag and runs the algorithm on flat numpy views of
the user's buffers. ``iX`` forms return a :class:`~collectives.handles.Handle`.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import native
from .buffers import element_count, flat
from .context import SEGMENT_BYTES, CallContext
from .errors import BadArgument, CollectiveError, PeerLost
from .handles import Handle, Lane, RequestHandle
from .ops import Op, get_op
from .registry import Algorithm, algorithm as lookup_algorithm
from .selection import RuleSelector, Selector
from .transport import Transport

__all__ = ["Communicator", "live_communicators"]

_TAG_SPACE = 1 << 27
_live: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


def live_communicators() -> list["Communicator"]:
    """Every communicator not yet closed (for abort-on-crash hooks)."""
    return list(_live)


class _Plan:
    """A validated call: the algorithm, its arguments, the result and a finalizer."""

    __slots__ = ("algo", "args", "result", "finalize", "write_backs")

    def __init__(self, algo: Algorithm, args: tuple, result: Any,
                 finalize: Callable[[], None] | None = None) -> None:
        self.algo, self.args, self.result, self.finalize = algo, args, result, finalize
        self.write_backs: list[Callable[[], None]] = []


class _Prepared:
    """A blocking call validated once for its signature (collective, algorithm,
    root, op, and each buffer's dtype and size): repeated calls with the same
    signature skip validation and selection and run at once, as MPI's
    persistent collectives do.

    Attributes:
        algo: the algorithm.
        writes: per array of the call, whether it is written (checked writable).
        args: ``args(arrays)``, the algorithm's arguments for this call's arrays.
        func: the algorithm's own persistent plan for this signature (see
            :class:`~collectives.registry.Algorithm`), else its function.
        ctx: the call context, reused (its tag and deadline set per call).
        check: an extra per-call check ``check(arrays) -> bool`` (False: full path).
        direct: the persistent plan's ``on_arrays``, ``(go, settle)``: it runs
            from the call's arrays, ``go(arrays)``, and when that returns what
            to wait for, ``settle(arrays, late, deadline)``; None if it has none.
    """

    __slots__ = ("algo", "writes", "args", "func", "ctx", "check", "direct")

    def __init__(self, algo: Algorithm, writes: tuple[bool, ...], args: Callable[[tuple], tuple],
                 func: Callable, ctx: CallContext, check: Callable[[tuple], bool] | None,
                 direct: tuple | None = None) -> None:
        self.algo, self.writes, self.args, self.func, self.ctx, self.check = algo, writes, args, func, ctx, check
        self.direct = direct


def _flat_array(buf: Any) -> bool:
    """Whether ``buf`` can take a prepared call: a 1-D numpy array."""
    return type(buf) is np.ndarray and buf.ndim == 1


def _apart(arrays: tuple) -> bool:
    """Whether two contiguous arrays' memory does not overlap (alltoall's sendbuf and recvbuf)."""
    return not np.may_share_memory(arrays[0], arrays[1])


class Communicator:
    """A group of ranks and the collectives among them.

    Args:
        transport: an open transport.
        timeout: default timeout in seconds of every blocking call.
        selector: chooses algorithms for ``algorithm="auto"`` (default:
            :class:`~collectives.selection.RuleSelector`).
        segment_bytes: pipeline segment size of large messages.

    A communicator is used from one thread at a time. Every rank must call
    the collectives in the same order with matching arguments.
    """

    def __init__(self, transport: Transport, *, timeout: float = 60.0,
                 selector: Selector | None = None, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.transport = transport
        self.rank: int = transport.rank
        self.size: int = transport.size
        self.timeout = float(timeout)
        self._prepared: dict[tuple, _Prepared | None] = {}
        self.selector = selector if selector is not None else RuleSelector()
        self.segment_bytes = segment_bytes
        self._capabilities = frozenset(transport.capabilities)
        self._seq = 0
        self._scratch: dict = {}
        self._lane = Lane(f"collectives-rank{self.rank}")
        self._broken: CollectiveError | None = None
        self._closed = False
        self._stages: list[Callable[[], None]] = []
        self._ok_dtypes: set[np.dtype] = set()
        self._algorithms: dict[tuple[str, str], Algorithm] = {}
        self._eager = False
        self._ops: dict[tuple[str, np.dtype], Op] = {}
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
        try:
            if not self._lane.idle:
                self._lane.drain(self.timeout)
        finally:
            self._lane.close()
            self.transport.close()
            _live.discard(self)

    def abort(self, reason: str) -> None:
        """Make every peer's pending and future operations raise PeerLost(reason)."""
        self._broken = self._broken or PeerLost(f"rank {self.rank} aborted: {reason}", self.rank)
        self.transport.abort(f"rank {self.rank}: {reason}")

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

    # ------------------------------------------------------------- machinery

    def _flat(self, buf: Any, *, writable: bool, what: str) -> np.ndarray:
        """A flat host view of ``buf``; device arrays are staged (see buffers.flat)."""
        if type(buf) is np.ndarray and buf.ndim == 1 and buf.dtype in self._ok_dtypes:
            flags = buf.flags  # the hot path: a contiguous 1-D numpy array
            if flags.c_contiguous and (flags.writeable or not writable):
                return buf
        arr = flat(buf, writable=writable, what=what, stages=self._stages)
        self._ok_dtypes.add(arr.dtype)
        return arr

    def _take_stages(self, plan: _Plan) -> _Plan:
        plan.write_backs, self._stages = self._stages, []
        return plan

    def _check_open(self) -> None:
        self._stages = []
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise BadArgument("communicator is closed")

    def _check_rank(self, r: int, what: str) -> int:
        if not isinstance(r, (int, np.integer)) or not 0 <= r < self.size:
            raise BadArgument(f"{what} {r!r} out of range for {self.size} ranks")
        return int(r)

    def _pick(self, collective: str, name: str, nbytes: int, dtype: np.dtype) -> Algorithm:
        if name == "auto":
            name = self.selector.choose(collective, nbytes, self.size, dtype, self._capabilities)
        algo = self._algorithms.get((collective, name))
        if algo is not None:
            return algo
        algo = lookup_algorithm(collective, name)
        if not algo.needs <= self._capabilities:
            raise BadArgument(
                f"{collective} algorithm {name!r} needs {', '.join(sorted(algo.needs))}, "
                f"which transport {self.transport.name!r} does not offer")
        self._algorithms[(collective, name)] = algo
        return algo

    def _run_prepared(self, key: tuple, arrays: tuple, timeout: float | None) -> bool:
        """Run the prepared call of ``key``; False (nothing done) when there is
        none or this call needs the full path."""
        entry = self._prepared.get(key)
        if entry is None or self._broken is not None or self._closed or self._lane.busy:
            return False
        writes = entry.writes
        flags = arrays[0].flags if arrays and arrays[0] is not None else None  # unrolled: one or two arrays
        if flags is not None and (not flags.c_contiguous or (writes[0] and not flags.writeable)):
            return False
        if len(arrays) > 1:
            flags = arrays[1].flags if arrays[1] is not None else None
            if flags is not None and (not flags.c_contiguous or (writes[1] and not flags.writeable)):
                return False
            if entry.check is not None and not entry.check(arrays):
                return False
        deadline = time.monotonic() + (self.timeout if timeout is None else float(timeout))
        self._seq = seq = (self._seq + 1) % _TAG_SPACE  # tags in step with the full path: ranks may mix both
        try:
            direct = entry.direct
            if direct is not None:  # a native plan on the call's arrays as they are
                late = direct[0](arrays)
                if late is not None:
                    direct[1](arrays, late, deadline)
            else:
                ctx = entry.ctx
                ctx.tag, ctx.deadline = 2 * seq + 1, deadline
                entry.func(ctx, *entry.args(arrays))
        except BadArgument:
            raise  # every rank detects it alike, before sending
        except BaseException as exc:
            self._fail(entry.algo, exc)
            raise
        return True

    def _rooted_key(self, collective: str, algorithm: str, root: Any, everywhere: Any,
                    on_root: Any) -> tuple[tuple | None, Any]:
        """Key of a prepared gather or scatter, whose ``everywhere`` buffer every
        rank passes and ``on_root`` only the root, with that buffer as this
        rank takes it (None off the root); (None, None) where the call cannot
        be prepared."""
        if not (_flat_array(everywhere) and type(root) is int):
            return None, None
        mine = on_root if root == self.rank else None
        if mine is not None and not _flat_array(mine):
            return None, None
        return (collective, algorithm, root, everywhere.dtype, everywhere.size,
                None if mine is None else (mine.dtype, mine.size)), mine

    def _remember(self, key: tuple, plan: _Plan, writes: tuple[bool, ...], args: Callable[[tuple], tuple],
                  check: Callable[[tuple], bool] | None = None, as_is: bool = True) -> None:
        """Keep ``plan`` (just validated by the full path) for repeated calls of
        ``key``, with the algorithm's own persistent plan where it offers one.
        ``as_is``: the call's arrays are the algorithm's array arguments, in
        order (so a persistent plan's ``on_arrays`` may take them directly).
        Plans with a finalizer (``avg``) or staged device buffers are not kept."""
        if key in self._prepared:
            return
        entry = None
        if plan.finalize is None and not self._stages:
            func = plan.algo.func
            if plan.algo.prepare is not None:
                func = plan.algo.prepare(self.transport, *plan.args) or func
            ctx = CallContext(self.transport, 0, 0.0, self.segment_bytes, self._scratch)
            entry = _Prepared(plan.algo, writes, args, func, ctx, check,
                              getattr(func, "on_arrays", None) if as_is else None)
        if len(self._prepared) >= 256:
            self._prepared.clear()
        self._prepared[key] = entry

    def _next_tag(self) -> int:
        self._seq = (self._seq + 1) % _TAG_SPACE
        return 2 * self._seq + 1

    def _execute(self, plan: _Plan, tag: int, timeout: float) -> Any:
        ctx = CallContext(self.transport, tag, time.monotonic() + timeout,
                          self.segment_bytes, self._scratch)
        try:
            plan.algo.func(ctx, *plan.args)
        except BadArgument:
            raise  # every rank detects it alike, before sending
        except BaseException as exc:
            self._fail(plan.algo, exc)
            raise
        if plan.finalize is not None:
            plan.finalize()
        for write_back in plan.write_backs:
            write_back()
        return plan.result

    def _fail(self, algo: Algorithm, exc: BaseException) -> None:
        """A failure mid-collective breaks the communicator and aborts the peers."""
        if isinstance(exc, PeerLost):
            self._broken = exc
        reason = f"{algo.collective}/{algo.name} failed: {type(exc).__name__}: {exc}"
        if self._broken is None:
            self._broken = PeerLost(f"rank {self.rank}: {reason}", self.rank)
        try:
            self.transport.abort(f"rank {self.rank}: {reason}")
        except Exception:
            pass

    def _call(self, plan: _Plan, timeout: float | None) -> Any:
        timeout = self.timeout if timeout is None else float(timeout)
        self._take_stages(plan)
        tag = self._next_tag()
        if not self._lane.idle:
            self._lane.drain(timeout)
        return self._execute(plan, tag, timeout)

    def _post(self, plan: _Plan, timeout: float | None) -> Handle:
        timeout = self.timeout if timeout is None else float(timeout)
        self._take_stages(plan)
        tag = self._next_tag()
        handle = Handle(timeout)
        if self._eager and self._lane.idle:
            try:
                result = self._execute(plan, tag, timeout)
            except BaseException as exc:  # delivered to the waiter, as from the worker
                handle._finish(error=exc)
            else:
                handle._finish(result=result)
            return handle
        return self._lane.submit(lambda: self._execute(plan, tag, timeout), handle)

    @contextlib.contextmanager
    def eager(self) -> Iterator["Communicator"]:
        """Within this block, a nonblocking collective posted while nothing else
        is pending runs to completion in the calling thread and returns a done
        handle. For callers that wait at once (a framework's blocking call made
        through its nonblocking interface): it saves the two thread hand-offs
        of the worker lane, tens of microseconds per call."""
        previous, self._eager = self._eager, True
        try:
            yield self
        finally:
            self._eager = previous

    def _op(self, op: Any, dtype: np.dtype) -> Op:
        key = (op, dtype) if isinstance(op, str) else None
        o = self._ops.get(key) if key is not None else None
        if o is None:
            o = get_op(op)
            o.check(dtype)
            wrap = getattr(self.transport, "wrap_op", None)  # e.g. the sim charges reductions
            if wrap is not None:
                o = wrap(o)
            if key is not None:
                self._ops[key] = o
        return o

    @staticmethod
    def _same_dtype(a: np.ndarray, b: np.ndarray, what: str) -> None:
        if a.dtype != b.dtype:
            raise BadArgument(f"{what}: sendbuf has dtype {a.dtype}, recvbuf has {b.dtype}")

    def _counts(self, counts: Sequence[int]) -> tuple[list[int], list[int]]:
        counts = [int(c) for c in counts]
        if len(counts) != self.size or any(c < 0 for c in counts):
            raise BadArgument(f"counts must be {self.size} non-negative integers, got {counts}")
        displs = [0] * self.size
        for i in range(1, self.size):
            displs[i] = displs[i - 1] + counts[i - 1]
        return counts, displs

    # ------------------------------------------------------------- planners

    def _plan_bcast(self, buf, root, algorithm) -> _Plan:
        self._check_open()
        root = self._check_rank(root, "root")
        arr = self._flat(buf, writable=True, what="buf")
        algo = self._pick("bcast", algorithm, arr.nbytes, arr.dtype)
        return _Plan(algo, (arr, root), buf)

    def _plan_reduce(self, buf, root, op, algorithm) -> _Plan:
        self._check_open()
        root = self._check_rank(root, "root")
        arr = self._flat(buf, writable=self.rank == root, what="buf")
        o = self._op(op, arr.dtype)
        algo = self._pick("reduce", algorithm, arr.nbytes, arr.dtype)
        fin = (lambda: o.finalize(arr, self.size)) if o.name == "avg" and self.rank == root else None
        return _Plan(algo, (arr, root, o), buf, fin)

    def _plan_allreduce(self, buf, op, algorithm, out) -> _Plan:
        self._check_open()
        if out is not None:
            src = self._flat(buf, writable=False, what="buf")
            arr = self._flat(out, writable=True, what="out")
            if src.shape != arr.shape or src.dtype != arr.dtype:
                raise BadArgument(f"out has {arr.size} x {arr.dtype}, buf {src.size} x {src.dtype}")
            result = out
        else:
            arr = src = self._flat(buf, writable=True, what="buf")
            result = buf
        o = self._op(op, arr.dtype)
        algo = self._pick("allreduce", algorithm, arr.nbytes, arr.dtype)
        if src is not arr:
            native.copy(arr, src)
        fin = (lambda: o.finalize(arr, self.size)) if o.name == "avg" else None
        return _Plan(algo, (arr, o), result, fin)

    def _plan_scatterv(self, sendbuf, recvbuf, counts, root, algorithm) -> _Plan:
        self._check_open()
        root = self._check_rank(root, "root")
        counts, _ = self._counts(counts)
        recv = self._flat(recvbuf, writable=True, what="recvbuf")
        if recv.size != counts[self.rank]:
            raise BadArgument(f"recvbuf holds {recv.size} elements, counts[{self.rank}] is {counts[self.rank]}")
        send = None
        if self.rank == root:
            send = self._flat(sendbuf, writable=False, what="sendbuf")
            self._same_dtype(send, recv, "scatter")
            if send.size != sum(counts):
                raise BadArgument(f"sendbuf on the root holds {send.size} elements, expected {sum(counts)}")
        algo = self._pick("scatter", algorithm, sum(counts) * recv.itemsize, recv.dtype)
        return _Plan(algo, (send, recv, root, counts), recvbuf)

    def _plan_gatherv(self, sendbuf, recvbuf, counts, root, algorithm) -> _Plan:
        self._check_open()
        root = self._check_rank(root, "root")
        counts, _ = self._counts(counts)
        send = self._flat(sendbuf, writable=False, what="sendbuf")
        if send.size != counts[self.rank]:
            raise BadArgument(f"sendbuf holds {send.size} elements, counts[{self.rank}] is {counts[self.rank]}")
        recv = None
        if self.rank == root:
            recv = self._flat(recvbuf, writable=True, what="recvbuf")
            self._same_dtype(send, recv, "gather")
            if recv.size != sum(counts):
                raise BadArgument(f"recvbuf on the root holds {recv.size} elements, expected {sum(counts)}")
        algo = self._pick("gather", algorithm, sum(counts) * send.itemsize, send.dtype)
        return _Plan(algo, (send, recv, root, counts), recvbuf if self.rank == root else None)

    def _plan_allgatherv(self, sendbuf, recvbuf, counts, algorithm) -> _Plan:
        self._check_open()
        counts, displs = self._counts(counts)
        recv = self._flat(recvbuf, writable=True, what="recvbuf")
        if recv.size != sum(counts):
            raise BadArgument(f"recvbuf holds {recv.size} elements, expected {sum(counts)}")
        mine = recv[displs[self.rank]:displs[self.rank] + counts[self.rank]]
        if sendbuf is not None:
            send = self._flat(sendbuf, writable=False, what="sendbuf")
            self._same_dtype(send, recv, "allgather")
            if send.size != counts[self.rank]:
                raise BadArgument(f"sendbuf holds {send.size} elements, counts[{self.rank}] is {counts[self.rank]}")
        else:
            send = mine
        algo = self._pick("allgather", algorithm, recv.nbytes, recv.dtype)
        if send is not mine and send.size:
            native.copy(mine, send)  # a no-op copy when sendbuf already is this rank's block
        return _Plan(algo, (recv, counts), recvbuf)

    def _even_counts(self, total: int, what: str) -> list[int]:
        if total % self.size:
            raise BadArgument(f"{what} holds {total} elements, not a multiple of {self.size} ranks")
        return [total // self.size] * self.size

    def _plan_reduce_scatter(self, sendbuf, recvbuf, op, algorithm, counts=None) -> _Plan:
        self._check_open()
        send = self._flat(sendbuf, writable=False, what="sendbuf")
        recv = self._flat(recvbuf, writable=True, what="recvbuf")
        self._same_dtype(send, recv, "reduce_scatter")
        if counts is None:
            if send.size != recv.size * self.size:
                raise BadArgument(f"sendbuf holds {send.size} elements, expected {self.size} x {recv.size}")
            counts = [recv.size] * self.size
        counts, _ = self._counts(counts)
        if send.size != sum(counts) or recv.size != counts[self.rank]:
            raise BadArgument(f"sendbuf/recvbuf sizes {send.size}/{recv.size} do not match counts {counts}")
        o = self._op(op, send.dtype)
        algo = self._pick("reduce_scatter", algorithm, send.nbytes, send.dtype)
        fin = (lambda: o.finalize(recv, self.size)) if o.name == "avg" else None
        return _Plan(algo, (send, recv, counts, o), recvbuf, fin)

    def _plan_alltoall(self, sendbuf, recvbuf, algorithm) -> _Plan:
        self._check_open()
        send = self._flat(sendbuf, writable=False, what="sendbuf")
        recv = self._flat(recvbuf, writable=True, what="recvbuf")
        self._same_dtype(send, recv, "alltoall")
        if send.size != recv.size:
            raise BadArgument(f"sendbuf holds {send.size} elements, recvbuf {recv.size}")
        self._even_counts(send.size, "sendbuf")
        if np.shares_memory(send, recv):
            raise BadArgument("alltoall: sendbuf and recvbuf overlap")
        algo = self._pick("alltoall", algorithm, send.nbytes, send.dtype)
        return _Plan(algo, (send, recv), recvbuf)

    def _plan_barrier(self, algorithm) -> _Plan:
        self._check_open()
        return _Plan(self._pick("barrier", algorithm, 0, np.dtype(np.uint8)), (), None)

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
        key = ("bcast", algorithm, root, buf.dtype, buf.size) if _flat_array(buf) and type(root) is int else None
        if key is not None and self._run_prepared(key, (buf,), timeout):
            return buf
        plan = self._plan_bcast(buf, root, algorithm)
        if key is not None:
            self._remember(key, plan, (True,), lambda a: (a[0], root))
        return self._call(plan, timeout)

    def ibcast(self, buf: Any, root: int = 0, *, algorithm: str = "auto",
               timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`bcast`."""
        return self._post(self._plan_bcast(buf, root, algorithm), timeout)

    def reduce(self, buf: Any, root: int = 0, op: Any = "sum", *, algorithm: str = "auto",
               timeout: float | None = None) -> Any:
        """Reduce ``buf`` of every rank with ``op``; the result lands in ``buf`` on ``root``.

        Other ranks' ``buf`` is left unchanged. Returns ``buf``.
        """
        key = (("reduce", algorithm, root, op, buf.dtype, buf.size)
               if _flat_array(buf) and type(root) is int and type(op) is str else None)
        if key is not None and self._run_prepared(key, (buf,), timeout):
            return buf
        plan = self._plan_reduce(buf, root, op, algorithm)
        if key is not None:
            o = plan.args[2]
            self._remember(key, plan, (self.rank == root,), lambda a: (a[0], root, o))
        return self._call(plan, timeout)

    def ireduce(self, buf: Any, root: int = 0, op: Any = "sum", *, algorithm: str = "auto",
                timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`reduce`."""
        return self._post(self._plan_reduce(buf, root, op, algorithm), timeout)

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
        key = (("allreduce", algorithm, op, buf.dtype, buf.size)
               if out is None and type(buf) is np.ndarray and buf.ndim == 1 and type(op) is str else None)
        if key is not None and self._run_prepared(key, (buf,), timeout):
            return buf
        plan = self._plan_allreduce(buf, op, algorithm, out)
        if key is not None:
            o = plan.args[1]
            self._remember(key, plan, (True,), lambda a: (a[0], o))
        return self._call(plan, timeout)

    def iallreduce(self, buf: Any, op: Any = "sum", *, algorithm: str = "auto",
                   timeout: float | None = None, out: Any = None) -> Handle:
        """Nonblocking :meth:`allreduce`."""
        return self._post(self._plan_allreduce(buf, op, algorithm, out), timeout)

    def scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, algorithm: str = "auto",
                timeout: float | None = None) -> Any:
        """Block i of ``sendbuf`` on ``root`` goes to rank i's ``recvbuf``.

        ``sendbuf`` (p times ``recvbuf``'s size) matters only on the root.
        Returns ``recvbuf``.
        """
        key, send = self._rooted_key("scatter", algorithm, root, recvbuf, sendbuf)
        if key is not None and self._run_prepared(key, (send, recvbuf), timeout):
            return recvbuf
        recv_count = element_count(recvbuf)
        counts = [recv_count] * self.size
        plan = self._plan_scatterv(sendbuf, recvbuf, counts, root, algorithm)
        if key is not None:
            self._remember(key, plan, (False, True), lambda a: (a[0], a[1], root, counts))
        return self._call(plan, timeout)

    def iscatter(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, algorithm: str = "auto",
                 timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`scatter`."""
        recv_count = element_count(recvbuf)
        return self._post(self._plan_scatterv(sendbuf, recvbuf, [recv_count] * self.size, root, algorithm), timeout)

    def scatterv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], root: int = 0, *,
                 algorithm: str = "auto", timeout: float | None = None) -> Any:
        """Scatter with ``counts[i]`` elements for rank i (same counts on every rank)."""
        return self._call(self._plan_scatterv(sendbuf, recvbuf, counts, root, algorithm), timeout)

    def iscatterv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], root: int = 0, *,
                  algorithm: str = "auto", timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`scatterv`."""
        return self._post(self._plan_scatterv(sendbuf, recvbuf, counts, root, algorithm), timeout)

    def gather(self, sendbuf: Any, recvbuf: Any = None, root: int = 0, *, algorithm: str = "auto",
               timeout: float | None = None) -> Any:
        """Rank i's ``sendbuf`` becomes block i of ``recvbuf`` on ``root``.

        ``recvbuf`` (p times ``sendbuf``'s size) matters only on the root.
        Returns ``recvbuf`` on the root, None elsewhere.
        """
        key, recv = self._rooted_key("gather", algorithm, root, sendbuf, recvbuf)
        if key is not None and self._run_prepared(key, (sendbuf, recv), timeout):
            return recv
        send_count = element_count(sendbuf)
        counts = [send_count] * self.size
        plan = self._plan_gatherv(sendbuf, recvbuf, counts, root, algorithm)
        if key is not None:
            self._remember(key, plan, (False, True), lambda a: (a[0], a[1], root, counts))
        return self._call(plan, timeout)

    def igather(self, sendbuf: Any, recvbuf: Any = None, root: int = 0, *, algorithm: str = "auto",
                timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`gather`."""
        send_count = element_count(sendbuf)
        return self._post(self._plan_gatherv(sendbuf, recvbuf, [send_count] * self.size, root, algorithm), timeout)

    def gatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], root: int = 0, *,
                algorithm: str = "auto", timeout: float | None = None) -> Any:
        """Gather with ``counts[i]`` elements from rank i (same counts on every rank)."""
        return self._call(self._plan_gatherv(sendbuf, recvbuf, counts, root, algorithm), timeout)

    def igatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], root: int = 0, *,
                 algorithm: str = "auto", timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`gatherv`."""
        return self._post(self._plan_gatherv(sendbuf, recvbuf, counts, root, algorithm), timeout)

    def allgather(self, sendbuf: Any, recvbuf: Any, *, algorithm: str = "auto",
                  timeout: float | None = None) -> Any:
        """Every rank's ``sendbuf`` becomes block i of every rank's ``recvbuf``.

        ``sendbuf`` may be None when the rank's block is already in place.
        Returns ``recvbuf``.
        """
        key = None
        if _flat_array(recvbuf) and (sendbuf is None or _flat_array(sendbuf)):
            key = ("allgather", algorithm, recvbuf.dtype, recvbuf.size,
                   None if sendbuf is None else (sendbuf.dtype, sendbuf.size))
            if self._run_prepared(key, (recvbuf, sendbuf), timeout):
                return recvbuf
        counts = self._even_counts(element_count(recvbuf), "recvbuf")
        plan = self._plan_allgatherv(sendbuf, recvbuf, counts, algorithm)
        if key is not None:
            lo = counts[0] * self.rank
            hi = lo + counts[0]

            def args(a: tuple) -> tuple:
                recv, send = a
                if send is not None and send.size:
                    native.copy(recv[lo:hi], send)  # a no-op when sendbuf already is this block
                return recv, counts
            self._remember(key, plan, (True, False), args, as_is=False)
        return self._call(plan, timeout)

    def iallgather(self, sendbuf: Any, recvbuf: Any, *, algorithm: str = "auto",
                   timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`allgather`."""
        counts = self._even_counts(element_count(recvbuf), "recvbuf")
        return self._post(self._plan_allgatherv(sendbuf, recvbuf, counts, algorithm), timeout)

    def allgatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], *,
                   algorithm: str = "auto", timeout: float | None = None) -> Any:
        """Allgather with ``counts[i]`` elements from rank i (same counts on every rank)."""
        return self._call(self._plan_allgatherv(sendbuf, recvbuf, counts, algorithm), timeout)

    def iallgatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], *,
                    algorithm: str = "auto", timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`allgatherv`."""
        return self._post(self._plan_allgatherv(sendbuf, recvbuf, counts, algorithm), timeout)

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: Any = "sum", *, algorithm: str = "auto",
                       timeout: float | None = None) -> Any:
        """Reduce ``sendbuf`` (p blocks) over ranks; rank i gets block i in ``recvbuf``.

        Returns ``recvbuf``.
        """
        key = None
        if _flat_array(sendbuf) and _flat_array(recvbuf) and type(op) is str:
            key = ("reduce_scatter", algorithm, op, sendbuf.dtype, sendbuf.size, recvbuf.dtype, recvbuf.size)
            if self._run_prepared(key, (sendbuf, recvbuf), timeout):
                return recvbuf
        plan = self._plan_reduce_scatter(sendbuf, recvbuf, op, algorithm)
        if key is not None:
            counts, o = plan.args[2], plan.args[3]
            self._remember(key, plan, (False, True), lambda a: (a[0], a[1], counts, o))
        return self._call(plan, timeout)

    def ireduce_scatter(self, sendbuf: Any, recvbuf: Any, op: Any = "sum", *, algorithm: str = "auto",
                        timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`reduce_scatter`."""
        return self._post(self._plan_reduce_scatter(sendbuf, recvbuf, op, algorithm), timeout)

    def reduce_scatterv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], op: Any = "sum", *,
                        algorithm: str = "auto", timeout: float | None = None) -> Any:
        """Reduce-scatter with blocks of ``counts[i]`` elements."""
        return self._call(self._plan_reduce_scatter(sendbuf, recvbuf, op, algorithm, counts), timeout)

    def alltoall(self, sendbuf: Any, recvbuf: Any, *, algorithm: str = "auto",
                 timeout: float | None = None) -> Any:
        """Block j of rank i's ``sendbuf`` becomes block i of rank j's ``recvbuf``.

        Returns ``recvbuf``.
        """
        key = None
        if _flat_array(sendbuf) and _flat_array(recvbuf):
            key = ("alltoall", algorithm, sendbuf.dtype, sendbuf.size, recvbuf.dtype, recvbuf.size)
            if self._run_prepared(key, (sendbuf, recvbuf), timeout):
                return recvbuf
        plan = self._plan_alltoall(sendbuf, recvbuf, algorithm)
        if key is not None:
            self._remember(key, plan, (False, True), lambda a: a, check=_apart)
        return self._call(plan, timeout)

    def ialltoall(self, sendbuf: Any, recvbuf: Any, *, algorithm: str = "auto",
                  timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`alltoall`."""
        return self._post(self._plan_alltoall(sendbuf, recvbuf, algorithm), timeout)

    def barrier(self, *, algorithm: str = "auto", timeout: float | None = None) -> None:
        """Wait until every rank has entered the barrier."""
        key = ("barrier", algorithm)
        if self._run_prepared(key, (), timeout):
            return
        plan = self._plan_barrier(algorithm)
        self._remember(key, plan, (), lambda a: ())
        self._call(plan, timeout)

    def ibarrier(self, *, algorithm: str = "auto", timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`barrier`."""
        return self._post(self._plan_barrier(algorithm), timeout)

    # -------------------------------------------------------- point to point

    def _p2p_tag(self, tag: int) -> int:
        if not isinstance(tag, (int, np.integer)) or not 0 <= tag < _TAG_SPACE:
            raise BadArgument(f"tag must be an integer in [0, {_TAG_SPACE}), got {tag!r}")
        return 2 * int(tag)

    def isend(self, buf: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> RequestHandle:
        """Start sending ``buf`` to ``dst``; do not modify ``buf`` until it completes."""
        self._check_open()
        dst = self._check_rank(dst, "dst")
        arr = flat(buf, writable=False, what="buf")
        req = self.transport.isend(arr, dst, self._p2p_tag(tag))
        return RequestHandle(req, None, self.timeout if timeout is None else timeout)

    def irecv(self, buf: Any, src: int, tag: int = 0, *, timeout: float | None = None) -> RequestHandle:
        """Start receiving into ``buf`` from ``src`` (exactly ``buf``'s size)."""
        self._check_open()
        src = self._check_rank(src, "src")
        arr = flat(buf, writable=True, what="buf")
        req = self.transport.irecv(arr, src, self._p2p_tag(tag))
        return RequestHandle(req, buf, self.timeout if timeout is None else timeout)

    def send(self, buf: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send ``buf`` to ``dst`` with ``tag``."""
        self.isend(buf, dst, tag, timeout=timeout).wait()

    def recv(self, buf: Any, src: int, tag: int = 0, *, timeout: float | None = None) -> Any:
        """Receive into ``buf`` from ``src`` with ``tag``; returns ``buf``."""
        return self.irecv(buf, src, tag, timeout=timeout).wait()
