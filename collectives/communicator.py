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
  the call: on a shared window (and for a root's arguments everywhere)
  every rank raises :class:`~collectives.errors.BadArgument` in that same
  call and the communicator stays usable; over messages a non-root's
  refusal aborts the communicator, so that the others raise at once.
* Any other error during a call (a timeout, a lost peer, a mismatch) aborts
  the communicator on every rank: later calls raise at once with the
  original reason. :meth:`Communicator.abort` does the same on demand.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import debug_log, flight_recorder, native, signature, tracing
from .algorithms.barrier import dissemination
from .buffers import element_count, flat
from .context import SEGMENT_BYTES, CallContext
from .flight_recorder import FlightRecorder
from .errors import BadArgument, CollectiveError, CollectiveTimeout, PeerLost, abort_reason, annotate
from .handles import Handle, Lane, RequestHandle
from .planning import ROOTED, Plan, Planner
from .prepared import PreparedCalls, apart, flat_array, rooted_key
from .selection import RuleSelector, Selector, size_bucket
from .signature import NO_SIG, REFUSED
from .transport import Transport
from .window_contract import NATIVE_PLANS

__all__ = ["Communicator", "live_communicators", "VERDICT_BYTES"]

log = logging.getLogger("collectives")
_select_log = logging.getLogger("collectives.select")
_call_log = logging.getLogger("collectives.call")
_now = time.monotonic
_TAG_SPACE = 1 << 27
_live: "weakref.WeakSet[Communicator]" = weakref.WeakSet()
#: Bytes of a root's verdict on a rooted call over messages: a status byte, a reason.
VERDICT_BYTES = 256


def live_communicators() -> list["Communicator"]:
    """Every communicator not yet closed (for abort-on-crash hooks)."""
    return list(_live)


class _Refused(Exception):
    """A refusal the peers learn only through an abort (a non-root's own
    arguments, over messages)."""

    def __init__(self, error: BadArgument) -> None:
        super().__init__(str(error))
        self.error = error


class Communicator:
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
        self._capabilities = frozenset(transport.capabilities)
        self.selector = selector if selector is not None else RuleSelector()
        self.segment_bytes = segment_bytes
        self._planner = Planner(self.rank, self.size, transport, self._choose)
        self._signed = signature.checks_enabled()
        self._seq = 0
        self._scratch: dict = {}
        self._lane = Lane(f"collectives-rank{self.rank}")
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
            if window is not None and NATIVE_PLANS in window.features:
                r = self._recorder  # native plans record their own calls
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
        try:
            if not self._lane.idle:
                self._lane.drain(self.timeout)
            if self._tracer is not None:
                try:
                    self._tracer.write()
                except OSError as err:
                    log.warning("rank %d: cannot write the timeline: %s", self.rank, err)
        finally:
            self._lane.close()
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

    # ------------------------------------------------------ surviving failures

    def failed_ranks(self) -> set[int]:
        """The ranks this rank knows to have failed (their process exited or
        they left), as of the last agreement and what the transport sees now."""
        if "agree" in self._capabilities and not self._closed:
            return self._known_failed | self.transport.failed_peers(closed_too=False)
        return set(self._known_failed)

    def agree(self, flag: bool = True, *, timeout: float | None = None) -> bool:
        """A fault-tolerant AND of ``flag`` over the surviving ranks (as ULFM's
        agree): every survivor gets the same answer and the same set of failed
        ranks (:meth:`failed_ranks`), even if another rank fails meanwhile.
        Collective over the survivors; works on an aborted communicator.

        Raises:
            BadArgument: the transport cannot agree (see docs/failures.md).
            CollectiveTimeout: a rank neither took part nor failed in time.
            PeerLost: the survivors count this rank as failed.
        """
        if "agree" not in self._capabilities:
            raise BadArgument(f"rank {self.rank}: the {self.transport.name} transport cannot agree among "
                              "survivors; shared memory and TCP can")
        if self._closed:
            raise BadArgument(f"rank {self.rank}: the communicator is closed")
        self._agreements += 1
        deadline = _now() + (self.timeout if timeout is None else float(timeout))
        failed, result = self.transport.agree(self._agreements, self._known_failed | self.transport.failed_peers(),
                                              bool(flag), deadline)
        self._known_failed = set(failed)
        return result

    def shrink(self, *, timeout: float | None = None) -> "Communicator":
        """A new communicator of the surviving ranks, after a failure: the
        survivors agree on who failed (:meth:`agree`), then each gets dense
        ranks 0..q-1 in the old order, a new epoch and a transport of its own
        (nothing sent on this communicator reaches the new one). Collective
        over the survivors. Close this communicator when done with it.

        Raises:
            As :meth:`agree`; and what opening the new transport raises.
        """
        while True:
            self.agree(True, timeout=timeout)
            survivors = [r for r in range(self.size) if r not in self._known_failed]
            job = f"{self._job}.e{self.epoch + 1}.{self._agreements}"
            options = {**self._options, **self.transport.reopen_options(survivors)}
            try:
                tr = type(self.transport).open(survivors.index(self.rank), len(survivors), job=job,
                                               timeout=self.timeout if timeout is None else float(timeout),
                                               options=options)
                break
            except PeerLost as exc:  # a survivor died before it joined: agree again, without it
                log.info("rank %d: %s; the survivors agree again", self.rank, exc)
        new = Communicator(tr, timeout=self.timeout, selector=self.selector, segment_bytes=self.segment_bytes,
                           job=job, options=self._options)
        new.epoch = self.epoch + 1
        new.original_ranks = [self.original_ranks[r] for r in survivors]
        log.info("rank %d: shrank to %d ranks (failed: %s), now rank %d of epoch %d", self.rank, len(survivors),
                 sorted(self._known_failed), new.rank, new.epoch)
        return new

    @property
    def aborted(self) -> CollectiveError | None:
        """The error that aborted this communicator, or None while it works."""
        return self._broken

    def abort(self, reason: str = "aborted by the application") -> None:
        """Abort the communicator on every rank, without waiting for anyone:
        every peer's pending and later calls raise PeerLost(reason), and so
        do this rank's."""
        err = PeerLost(f"rank {self.rank}: {reason}", self.rank)
        err.origin = self.rank
        if self._broken is None:
            self._broken = err
        self._tell_abort(abort_reason(PeerLost(reason, self.rank)), self._seq + 1)

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

    def _check_open(self) -> None:
        self._planner.stages = []
        if self._broken is not None:
            raise self._again()
        if self._closed:
            raise BadArgument(f"rank {self.rank}: the communicator is closed")

    def _again(self) -> CollectiveError:
        """The error every call raises once the communicator is aborted."""
        b = self._broken
        said = str(b).removeprefix(f"rank {self.rank}: ")
        text = f"rank {self.rank}: the communicator was aborted by an earlier error: {said}"
        err = PeerLost(text, b.peer) if isinstance(b, PeerLost) else type(b)(text)
        err.origin, err.collective, err.seq = b.origin, b.collective, b.seq
        return err

    def _plan(self, make: Callable[..., Plan], *args: Any) -> Plan:
        """``make(*args)`` on an open communicator, with the staged device buffers' write-backs."""
        self._check_open()
        try:
            plan = make(*args)
        except BadArgument as exc:
            what = make.__name__.removesuffix("v")
            if not str(exc).startswith("rank "):
                exc.args = (f"rank {self.rank}, {what}: {exc}",)
            raise
        plan.write_backs, self._planner.stages = self._planner.stages, []
        return plan

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) % _TAG_SPACE
        return self._seq

    def _run_prepared(self, key: tuple, arrays: tuple, timeout: float | None) -> bool:
        """Run the prepared call of ``key``; False (nothing done) when there is
        none or this call needs the full path."""
        entry = self._prepared.get(key)
        if entry is None or self._broken is not None or self._closed or self._lane.busy:
            return False  # (tracing keeps no prepared calls: every call takes the full path)
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
        limit = self.timeout if timeout is None else float(timeout)
        self._seq = seq = (self._seq + 1) % _TAG_SPACE  # tags in step with the full path: ranks may mix both
        rec = self._recorder
        direct = entry.direct
        if direct is not None:  # a native plan on the call's arrays as they are; it records itself
            if timeout is not None and rec is not None:
                rec.timed(seq, limit)
            try:
                late = direct[0](arrays, seq, entry.sig)
                if late is not None:  # the deadline counts from the plan's own start where recorded
                    direct[1](arrays, late, self._started(seq) + limit)
            except BaseException as exc:
                raise self._failed(entry.collective, entry.algo.name, seq, exc, self._started(seq), limit) from None
            return True
        start = _now()
        if rec is not None:
            rec.begin(seq, entry.sig, start, limit)
        try:
            ctx = entry.ctx
            ctx.tag, ctx.deadline = 2 * seq + 1, start + limit
            ctx.sig = signature.with_seq(entry.sig, seq)
            self.transport.begin_call(seq, ctx.sig)
            entry.func(ctx, *entry.args(arrays))
        except BaseException as exc:
            raise self._failed(entry.collective, entry.algo.name, seq, exc, start, limit) from None
        if rec is not None:
            rec.finish(seq, _now())
        return True

    def _started(self, seq: int) -> float:
        """When call ``seq`` started, as its native plan recorded it (now, where nothing did)."""
        rec = self._recorder
        return float(rec.start[seq & (rec.capacity - 1)]) if rec is not None else _now()

    def _remember(self, key: tuple, plan: Plan, writes: tuple[bool, ...], args: Callable[[tuple], tuple],
                  check: Callable[[tuple], bool] | None = None, as_is: bool = True) -> None:
        if self._tracer is not None or self._log_calls:
            return  # tracing and logging every call take the full path
        self._prepared.remember(key, plan, self.transport, self.segment_bytes, self._scratch, writes, args,
                                bool(plan.write_backs), check, as_is)

    def _execute(self, plan: Plan, seq: int, timeout: float) -> Any:
        start = time.monotonic()
        sig = signature.with_seq(plan.sig, seq) if self._signed else NO_SIG
        ctx = CallContext(self.transport, 2 * seq + 1, start + timeout, self.segment_bytes, self._scratch, sig)
        rec, tracer = self._recorder, self._tracer
        if rec is not None:
            rec.begin(seq, plan.sig, start, timeout)
        if self._log_calls:
            _call_log.log(debug_log.TRACE, "rank %d: %s", self.rank, signature.describe(
                signature.with_seq(plan.sig, seq)))
        if tracer is not None:
            tracer.begin(seq, plan.sig, plan.itemsize)
            ctx.tracer = tracer
        try:
            self.transport.begin_call(seq, sig, plan.refusal)
            if plan.refusal is not None:
                self._refuse(ctx, plan)
            if plan.empty and self.size > 1 and "native" not in plan.algo.needs:
                self._empty(ctx, plan)
            else:
                if plan.root is not None and plan.collective in ROOTED and self.size > 1 and not plan.algo.needs:
                    self._root_verdict(ctx, plan)
                plan.algo.func(ctx, *plan.args)
        except BaseException as exc:
            if tracer is not None:
                tracer.end(start, _now(), "failed")
            raise self._failed(plan.collective, plan.algo.name, seq, exc, start, timeout, plan.refusal) from None
        if tracer is not None:
            tracer.end(start, _now(), "completed")
        if plan.finalize is not None:
            plan.finalize()
        for write_back in plan.write_backs:
            write_back()
        if rec is not None:
            rec.finish(seq, _now())
        return plan.result

    def _refuse(self, ctx: CallContext, plan: Plan) -> None:
        """Take part in a call this rank refuses, so that every rank raises
        BadArgument in it (see the module docstring); always raises."""
        own = BadArgument(f"rank {self.rank}: {plan.refusal}")
        if self.size == 1:
            raise own
        if "window" in plan.algo.needs:  # every rank's first step through the window: the verdict
            try:
                self.transport.window.arrive(ctx.tag >> 1, ctx.deadline)
            except BadArgument:
                raise own from None
            raise own
        if plan.collective in ROOTED and plan.root == self.rank and not plan.algo.needs:
            self._root_verdict(ctx, plan)
        raise _Refused(own)

    def _empty(self, ctx: CallContext, plan: Plan) -> None:
        """A call that moves no data still meets every rank, so that a rank
        that made another call finds out in this one: the window's arrival,
        or a dissemination barrier whose messages carry the signature."""
        if "window" in plan.algo.needs:
            self.transport.window.arrive(ctx.tag >> 1, ctx.deadline)
        else:
            dissemination(ctx)

    def _root_verdict(self, ctx: CallContext, plan: Plan) -> None:
        """A rooted call over messages starts with the root's verdict on its
        own arguments, sent to every other rank before any data: a refusal
        then reaches every rank before anything is sent."""
        buf = np.zeros(VERDICT_BYTES, np.uint8)
        sig = (ctx.sig[0] & ~REFUSED, ctx.sig[1], ctx.sig[2])
        root, t = plan.root, self.transport
        if self.rank == root:
            if plan.refusal is not None:
                text = plan.refusal.encode("utf-8", "replace")[:VERDICT_BYTES - 1]
                buf[0], buf[1:1 + len(text)] = 1, np.frombuffer(text, np.uint8)
            ctx.waitall([t.isend(buf, r, ctx.tag, sig) for r in range(self.size) if r != root])
            if plan.refusal is not None:
                raise BadArgument(f"rank {self.rank}: {plan.refusal}")
            return
        t.irecv(buf, root, ctx.tag, sig).wait(ctx.remaining())
        if buf[0]:
            why = bytes(buf[1:]).rstrip(b"\0").decode("utf-8", "replace")
            raise BadArgument(f"rank {self.rank}: {signature.describe(sig)} was refused by its root, "
                              f"rank {root}: {why}")

    def _failed(self, collective: str, algorithm: str, seq: int, exc: BaseException, start: float,
                timeout: float, refusal: str | None = None) -> BaseException:
        """The error to raise for ``exc`` from call ``seq``: named, and, unless
        the call was refused alike everywhere, the communicator aborted on
        every rank (``exc`` itself when it is no error of the library's)."""
        refused_alone = isinstance(exc, _Refused)
        if refused_alone:
            exc = exc.error
        if self._recorder is not None:
            self._recorder.fail(seq, exc)
        if not isinstance(exc, CollectiveError):
            self._abort_after(PeerLost(f"rank {self.rank}, {collective} #{seq}: {type(exc).__name__}: {exc}",
                                       self.rank), seq)
            self._dump_after_failure(exc)
            return exc
        if isinstance(exc, CollectiveTimeout) and exc.collective is None and exc.origin is None:
            elapsed = time.monotonic() - start
            exc.args = (f"{exc.args[0] if exc.args else ''} (timed out after {elapsed:.3g} s; "
                        f"the timeout is {timeout:.3g} s)",)
        annotate(exc, self.rank, collective, seq, algorithm)
        if isinstance(exc, BadArgument) and not refused_alone and self._broken is None:
            return exc  # refused alike on every rank in this call: the communicator goes on
        self._abort_after(exc, seq)
        self._dump_after_failure(exc)
        return exc

    def _dump_after_failure(self, exc: BaseException) -> None:
        """Write the flight record once, when the communicator is aborted."""
        rec = self._recorder
        if rec is not None and rec.dumped is None:
            try:
                path = rec.dump(reason=f"{type(exc).__name__}: {exc}")
                log.info("rank %d: flight record written to %s", self.rank, path)
            except OSError as err:
                log.warning("rank %d: cannot write the flight record: %s", self.rank, err)

    def _abort_after(self, exc: CollectiveError, seq: int) -> None:
        """Abort the communicator after ``exc`` in call ``seq`` (the first reason stays)."""
        if self._broken is None:
            self._broken = exc
        self._tell_abort(abort_reason(exc), seq)

    def _tell_abort(self, reason: str, seq: int) -> None:
        """The transport's abort, with the first call this rank did not complete."""
        try:
            try:
                self.transport.abort(reason, seq)
            except TypeError:  # a transport whose abort takes no call number
                self.transport.abort(reason)
        except Exception:
            pass

    def _call(self, plan: Plan, timeout: float | None) -> Any:
        timeout = self.timeout if timeout is None else float(timeout)
        seq = self._next_seq()
        if not self._lane.idle:
            self._lane.drain(timeout)
        return self._execute(plan, seq, timeout)

    def _post(self, plan: Plan, timeout: float | None) -> Handle:
        timeout = self.timeout if timeout is None else float(timeout)
        seq = self._next_seq()
        handle = Handle(timeout)
        if self._recorder is not None and not (self._eager and self._lane.idle):
            self._recorder.schedule(seq)
        if self._eager and self._lane.idle:
            try:
                result = self._execute(plan, seq, timeout)
            except BaseException as exc:  # delivered to the waiter, as from the worker
                handle._finish(error=exc)
            else:
                handle._finish(result=result)
            return handle
        return self._lane.submit(lambda: self._execute(plan, seq, timeout), handle)

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
        key = ("bcast", algorithm, root, buf.dtype, buf.size) if flat_array(buf) and type(root) is int else None
        if key is not None and self._run_prepared(key, (buf,), timeout):
            return buf
        plan = self._plan(self._planner.bcast, buf, root, algorithm)
        if key is not None:
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
        key = (("reduce", algorithm, root, op, buf.dtype, buf.size)
               if flat_array(buf) and type(root) is int and type(op) is str else None)
        if key is not None and self._run_prepared(key, (buf,), timeout):
            return buf
        plan = self._plan(self._planner.reduce, buf, root, op, algorithm)
        if key is not None and plan.args is not None:
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
        key = (("allreduce", algorithm, op, buf.dtype, buf.size)
               if out is None and type(buf) is np.ndarray and buf.ndim == 1 and type(op) is str else None)
        if key is not None and self._run_prepared(key, (buf,), timeout):
            return buf
        plan = self._plan(self._planner.allreduce, buf, op, algorithm, out)
        if key is not None and plan.args is not None:
            o = plan.args[1]
            self._remember(key, plan, (True,), lambda a: (a[0], o))
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
        key, send = rooted_key("scatter", algorithm, root, recvbuf, sendbuf, self.rank)
        if key is not None and self._run_prepared(key, (send, recvbuf), timeout):
            return recvbuf
        counts = [element_count(recvbuf)] * self.size
        plan = self._plan(self._planner.scatterv, sendbuf, recvbuf, counts, root, algorithm, False)
        if key is not None:
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
        key, recv = rooted_key("gather", algorithm, root, sendbuf, recvbuf, self.rank)
        if key is not None and self._run_prepared(key, (sendbuf, recv), timeout):
            return recv
        counts = [element_count(sendbuf)] * self.size
        plan = self._plan(self._planner.gatherv, sendbuf, recvbuf, counts, root, algorithm, False)
        if key is not None:
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

    def allgather(self, sendbuf: Any, recvbuf: Any, *, algorithm: str = "auto",
                  timeout: float | None = None) -> Any:
        """Every rank's ``sendbuf`` becomes block i of every rank's ``recvbuf``.

        ``sendbuf`` may be None when the rank's block is already in place.
        Returns ``recvbuf``.
        """
        key = None
        if flat_array(recvbuf) and (sendbuf is None or flat_array(sendbuf)):
            key = ("allgather", algorithm, recvbuf.dtype, recvbuf.size,
                   None if sendbuf is None else (sendbuf.dtype, sendbuf.size))
            if self._run_prepared(key, (recvbuf, sendbuf), timeout):
                return recvbuf
        counts = self._even_counts(element_count(recvbuf), "recvbuf")
        plan = self._plan(self._planner.allgatherv, sendbuf, recvbuf, counts, algorithm, False)
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
        return self._post(self._plan(self._planner.allgatherv, sendbuf, recvbuf, counts, algorithm, False), timeout)

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
        key = None
        if flat_array(sendbuf) and flat_array(recvbuf) and type(op) is str:
            key = ("reduce_scatter", algorithm, op, sendbuf.dtype, sendbuf.size, recvbuf.dtype, recvbuf.size)
            if self._run_prepared(key, (sendbuf, recvbuf), timeout):
                return recvbuf
        plan = self._plan(self._planner.reduce_scatter, sendbuf, recvbuf, op, algorithm)
        if key is not None and plan.args is not None:
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
        key = None
        if flat_array(sendbuf) and flat_array(recvbuf):
            key = ("alltoall", algorithm, sendbuf.dtype, sendbuf.size, recvbuf.dtype, recvbuf.size)
            if self._run_prepared(key, (sendbuf, recvbuf), timeout):
                return recvbuf
        plan = self._plan(self._planner.alltoall, sendbuf, recvbuf, algorithm)
        if key is not None:
            self._remember(key, plan, (False, True), lambda a: a, check=apart)
        return self._call(plan, timeout)

    def ialltoall(self, sendbuf: Any, recvbuf: Any, *, algorithm: str = "auto",
                  timeout: float | None = None) -> Handle:
        """Nonblocking :meth:`alltoall`."""
        return self._post(self._plan(self._planner.alltoall, sendbuf, recvbuf, algorithm), timeout)

    def barrier(self, *, algorithm: str = "auto", timeout: float | None = None) -> None:
        """Wait until every rank has entered the barrier."""
        key = ("barrier", algorithm)
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
        if not isinstance(tag, (int, np.integer)) or not 0 <= tag < _TAG_SPACE:
            raise BadArgument(f"tag must be an integer in [0, {_TAG_SPACE}), got {tag!r}")
        return 2 * int(tag)

    def isend(self, buf: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> RequestHandle:
        """Start sending ``buf`` to ``dst``; do not modify ``buf`` until it completes."""
        self._check_open()
        dst = self._planner.check_rank(dst, "dst")
        arr = flat(buf, writable=False, what="buf")
        req = self.transport.isend(arr, dst, self._p2p_tag(tag))
        return RequestHandle(req, None, self.timeout if timeout is None else timeout)

    def irecv(self, buf: Any, src: int, tag: int = 0, *, timeout: float | None = None) -> RequestHandle:
        """Start receiving into ``buf`` from ``src`` (exactly ``buf``'s size)."""
        self._check_open()
        src = self._planner.check_rank(src, "src")
        arr = flat(buf, writable=True, what="buf")
        req = self.transport.irecv(arr, src, self._p2p_tag(tag))
        return RequestHandle(req, buf, self.timeout if timeout is None else timeout)

    def send(self, buf: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send ``buf`` to ``dst`` with ``tag``."""
        self.isend(buf, dst, tag, timeout=timeout).wait()

    def recv(self, buf: Any, src: int, tag: int = 0, *, timeout: float | None = None) -> Any:
        """Receive into ``buf`` from ``src`` with ``tag``; returns ``buf``."""
        return self.irecv(buf, src, tag, timeout=timeout).wait()
