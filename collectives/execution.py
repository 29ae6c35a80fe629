"""Running one call: plans, sequence numbers, prepared calls, failures.

A mixin of :class:`~collectives.communicator.Communicator`: everything
between a public method and the algorithm. A call is planned
(:mod:`.planning`), takes the next sequence number, and runs either as a
prepared call (:mod:`.prepared`; a shared window's compiled call where there
is one) or through :meth:`CallExecution._execute`: the call's signature is
published (``transport.begin_call``), a refusing rank takes part in the
call to refuse it everywhere, a call that moves no data still meets every
rank, a rooted call over messages starts by gathering every rank's
signature on every rank (:meth:`CallExecution._root_verdict`), and then
the algorithm runs. :meth:`CallExecution._failed` names every error and
aborts the communicator unless the call was refused alike everywhere.

It reads the communicator's ``rank``, ``size``, ``transport``, ``timeout``,
``segment_bytes``, ``_planner``, ``_prepared``, ``_scratch``,
``_recorder``, ``_tracer``, ``_signed``, ``_log_calls``, ``_queue`` and
``_closed``, and keeps ``_broken`` and ``_eager``, and ``_seq`` in ``_fast``
(:mod:`.fast_calls`, whose calls it adds there once they ran here).
"""

from __future__ import annotations

import contextlib
import logging
import struct
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from . import compiled, debug_log, signature
from .algorithms.barrier import dissemination
from .context import CallContext
from .errors import BadArgument, CollectiveError, CollectiveTimeout, PeerLost, abort_reason, annotate
from .handles import Handle
from .planning import ROOTED, Plan
from .prepared import ApartOrAt, CopyIn, apart
from .signature import NO_SIG, REFUSED, Sig

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["CallExecution", "RECORD_BYTES", "CHECKED", "TAG_SPACE", "run_algorithm"]

log = logging.getLogger("collectives")
_call_log = logging.getLogger("collectives.call")
_now = time.monotonic
#: Sequence numbers wrap around here (collective tags are 2 * seq + 1).
TAG_SPACE = 1 << 27
#: Bytes of one rank's record in the signature check of a rooted call over
#: messages: its signature (three words), its reason's length, the reason
#: (a refusal's, else nothing).
RECORD_BYTES = 256
_HEAD = struct.Struct("<4Q")
#: Collectives that start with the signature check over messages: those in
#: which a rank may only send or only receive from the root's side, so that
#: no message of the algorithm itself tells every rank that all agree.
CHECKED = ROOTED | {"bcast"}


def _release(stages: list[Callable[[bool], None]]) -> None:
    """Free staged device buffers' host copies, writing nothing back (a call
    that failed or never ran); a failure here does not hide the call's own."""
    for finish in stages:
        try:
            finish(False)
        except Exception as exc:
            _call_log.warning("a staged device buffer was not released: %s", exc)


def _write_back(stages: list[Callable[[bool], None]]) -> None:
    """Copy a completed call's results into its staged device buffers; every
    one is finished even when one fails (the first failure is raised)."""
    failed = None
    for finish in stages:
        try:
            finish(True)
        except Exception as exc:
            failed = failed or exc
    if failed is not None:
        raise failed


def run_algorithm(algo: Any, func: Callable, ctx: CallContext, args: tuple,
                  copy_in: tuple[np.ndarray, np.ndarray] | None) -> None:
    """Run ``func`` (``algo``'s function or its prepared call) on ``args``.
    An out-of-place call's copy ``copy_in``, ``(place, source)``, comes
    first; an algorithm that ``copies_in`` makes it itself, once every rank
    agreed on the call (``func(ctx, *args, source=source)``), so a call
    that a peer refuses or that mismatches changes no buffer."""
    if copy_in is None:
        func(ctx, *args)
    elif algo.copies_in:
        func(ctx, *args, source=copy_in[1])
    else:
        if copy_in[1].size:
            compiled.copy(*copy_in)
        func(ctx, *args)


class _Refused(Exception):
    """A refusal the peers learn only through an abort (a non-root's own
    arguments, over messages)."""

    def __init__(self, error: BadArgument) -> None:
        super().__init__(str(error))
        self.error = error


class CallExecution:
    """The machinery of the communicator's calls (see the module docstring)."""

    @property
    def _seq(self) -> int:
        """The number of the last call (kept with the fast calls, which count too)."""
        return self._fast.seq

    @_seq.setter
    def _seq(self, value: int) -> None:
        self._fast.seq = value

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
        except BaseException as exc:
            _release(self._planner.stages)
            self._planner.stages = []
            if isinstance(exc, BadArgument):
                what = make.__name__.removesuffix("v")
                if not str(exc).startswith("rank "):
                    exc.args = (f"rank {self.rank}, {what}: {exc}",)
            raise
        plan.write_backs, self._planner.stages = self._planner.stages, []
        return plan

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) % TAG_SPACE
        return self._seq

    def _run_prepared(self, key: tuple | None, arrays: tuple, timeout: float | None) -> bool:
        """Run the prepared call of ``key`` (:func:`~collectives.prepared.call_key`);
        False (nothing done) when there is none (or no key) or this call needs
        the full path."""
        entry = self._prepared.get(key)
        if entry is None or self._broken is not None or self._closed or self._queue.busy:
            return False  # (tracing keeps no prepared calls: every call takes the full path)
        first = arrays[0] if arrays else None
        if first is not None:  # unrolled: none, one or two arrays
            flags = first.flags
            if not flags.c_contiguous or (entry.writes[0] and not flags.writeable):
                return False
        if len(arrays) > 1:
            writes = entry.writes
            flags = arrays[1].flags if arrays[1] is not None else None
            if flags is not None and (not flags.c_contiguous or (writes[1] and not flags.writeable)):
                return False
            if entry.check is not None and not entry.check(arrays):
                return False
        limit = self.timeout if timeout is None else float(timeout)
        self._seq = seq = (self._seq + 1) % TAG_SPACE  # tags in step with the full path: ranks may mix both
        rec = self._recorder
        direct = entry.direct
        if direct is not None:  # a compiled call on the call's arrays as they are; it records itself
            if timeout is not None and rec is not None:
                rec.timed(seq, limit)
            try:
                late = direct[0](arrays, seq, entry.sig)
                if late is not None:  # the deadline counts from the plan's own start where recorded
                    direct[1](arrays, late, self._started(seq) + limit)
            except BaseException as exc:
                raise self._failed(entry.collective, entry.algo.name, seq, exc, self._started(seq), limit) from None
            if entry.call is not None and entry.fast_generation != self._fast.generation:  # from now on, from C
                copied = entry.copy_in
                self._fast.add(key[0], key[1], key[2], key[3], arrays, entry.call, entry.sig, entry.writes,
                               entry.check is apart or isinstance(entry.check, ApartOrAt),
                               (entry.collective, entry.algo.name, direct[1]),
                               -1 if copied is None else copied.at * arrays[0].itemsize,
                               entry.check.at if isinstance(entry.check, ApartOrAt) else -1)
                entry.fast_generation = self._fast.generation
            return True
        start = _now()
        if rec is not None:
            rec.begin(seq, entry.sig, start, limit)
        try:
            ctx = entry.ctx
            ctx.tag, ctx.deadline = 2 * seq + 1, start + limit
            ctx.sig = signature.with_seq(entry.sig, seq)
            self.transport.begin_call(seq, ctx.sig)
            if entry.collective == "bcast" and not entry.algo.needs and self.size > 1 and self._signed:
                self._agree(ctx, ctx.sig, None, True)
            copied = entry.copy_in
            run_algorithm(entry.algo, entry.func, ctx, entry.args(arrays),
                          None if copied is None else copied.pair(arrays))
        except BaseException as exc:
            raise self._failed(entry.collective, entry.algo.name, seq, exc, start, limit) from None
        if rec is not None:
            rec.finish(seq, _now())
        return True

    def _fast_wait(self, info: tuple, arrays: tuple, late: Any, seq: int) -> None:
        """The rest of a fast call's run that has to wait, or why it stopped
        (see :mod:`.fast_calls`); raises as the Python path does."""
        collective, algo, settle = info
        limit = self.timeout
        try:
            settle(arrays, late, self._started(seq) + limit)
        except BaseException as exc:
            raise self._failed(collective, algo, seq, exc, self._started(seq), limit) from None

    def _started(self, seq: int) -> float:
        """When call ``seq`` started, as its compiled call recorded it (now, where nothing did)."""
        rec = self._recorder
        return float(rec.start[seq & (rec.capacity - 1)]) if rec is not None else _now()

    def _remember(self, key: tuple | None, plan: Plan, writes: tuple[bool, ...], args: Callable[[tuple], tuple],
                  check: Callable[[tuple], bool] | None = None, as_is: bool | CopyIn = True) -> None:
        if key is None or self._tracer is not None or self._log_calls:
            return  # no key: not a call that can be prepared; tracing and logging every call take the full path
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
            if plan.refusal is not None and self.size > 1 and self._checks(plan):
                # the refusal travels in the signature check alone: a transport that tells
                # its waits of a peer's refusal would end some ranks' check before others'
                self.transport.begin_call(seq, (sig[0] & ~REFUSED, sig[1], sig[2]))
            else:
                self.transport.begin_call(seq, sig, plan.refusal)
            if plan.refusal is not None:
                self._refuse(ctx, plan)
            if plan.empty and self.size > 1 and "native" not in plan.algo.needs:
                self._empty(ctx, plan)
            else:
                if self.size > 1 and self._checks(plan):
                    self._root_verdict(ctx, plan)
                run_algorithm(plan.algo, plan.algo.func, ctx, plan.args, plan.copy_in)
        except BaseException as exc:
            if tracer is not None:
                tracer.end(start, _now(), "failed")
            _release(plan.write_backs)
            raise self._failed(plan.collective, plan.algo.name, seq, exc, start, timeout, plan.refusal) from None
        if tracer is not None:
            tracer.end(start, _now(), "completed")
        if plan.finalize is not None:
            plan.finalize()
        if plan.write_backs:
            _write_back(plan.write_backs)
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
        if self._checks(plan):  # the refusal travels in the signature check: every rank raises it alike
            self._root_verdict(ctx, plan)
            raise own
        raise _Refused(own)

    def _empty(self, ctx: CallContext, plan: Plan) -> None:
        """A call that moves no data still meets every rank, so that a rank
        that made another call finds out in this one: the window's arrival,
        or a dissemination barrier whose messages carry the signature."""
        if "window" in plan.algo.needs:
            self.transport.window.arrive(ctx.tag >> 1, ctx.deadline)
        else:
            dissemination(ctx)

    def _checks(self, plan: Plan) -> bool:
        """Whether ``plan`` starts with the signature check (a rooted call over
        messages; a bcast only while signatures are checked)."""
        return (plan.collective in CHECKED and not plan.algo.needs
                and (self._signed or plan.collective != "bcast"))

    def _root_verdict(self, ctx: CallContext, plan: Plan) -> None:
        """A rooted call over messages starts with every rank's signature and
        refusal, gathered by every rank (:meth:`_agree`): ranks that disagree
        about anything, the root included, raise MismatchedCollective in this
        call, and a refusal (the root's, or any rank's own arguments) is
        BadArgument on every rank before any data moves."""
        sig = signature.with_seq(plan.sig, ctx.tag >> 1)
        self._agree(ctx, sig, plan.refusal, self._signed)

    def _agree(self, ctx: CallContext, sig: Sig, refusal: str | None, signed: bool) -> None:
        """Every rank's record (its signature ``sig``, the reason of its
        ``refusal``) reaches every rank, by the Bruck allgather: in round k
        each rank sends the records it holds, at most 2**k of them, to rank
        - 2**k and receives as many from rank + 2**k (ceil(log2 p) rounds of
        one message each way). Its pattern does not depend on the root or on
        any field that may differ, so ranks that disagree still meet; the
        messages carry only the call's number and collective
        (:func:`~collectives.signature.agreement`), so a rank in another call
        or collective fails at once. Every rank then holds the same records
        and comes to the same verdict (:func:`~collectives.signature.check_all`),
        which it raises; none finishes a call that another found wrong. With
        the checks off (``signed`` False), only refusals count."""
        n, r, t = self.size, self.rank, self.transport
        raw = np.zeros(n * RECORD_BYTES, np.uint8)  # record j: rank (r + j) % n's
        text = b"" if refusal is None else refusal.encode("utf-8", "replace")[:RECORD_BYTES - _HEAD.size]
        _HEAD.pack_into(raw, 0, *sig, len(text))
        raw[_HEAD.size:_HEAD.size + len(text)] = np.frombuffer(text, np.uint8)
        header = signature.agreement(sig) if signed else NO_SIG
        dist = 1
        while dist < n:
            k = min(dist, n - dist)
            recv = t.irecv(raw[dist * RECORD_BYTES:(dist + k) * RECORD_BYTES], (r + dist) % n, ctx.tag, header)
            ctx.waitall([t.isend(raw[:k * RECORD_BYTES], (r - dist) % n, ctx.tag, header), recv])
            dist <<= 1
        sigs: list[Sig] = [NO_SIG] * n
        reasons: dict[int, str] = {}
        for j in range(n):
            w0, w1, w2, length = _HEAD.unpack_from(raw, j * RECORD_BYTES)
            q = (r + j) % n
            sigs[q] = (w0, w1, w2)
            if length:
                at = j * RECORD_BYTES + _HEAD.size
                said = raw[at:at + min(length, RECORD_BYTES - _HEAD.size)]
                reasons[q] = said.tobytes().decode("utf-8", "replace")
        if not signed:  # only refusals: every other rank is taken to agree with this one
            sigs = [s if s[0] & REFUSED else (sig[0] & ~REFUSED, sig[1], sig[2]) for s in sigs]
        error = signature.check_all(sigs, r, reasons)
        if error is not None:
            raise error

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
            self._fast.open = 0
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
        if not self._queue.idle:
            self._queue.drain(timeout)
        return self._execute(plan, seq, timeout)

    def _post(self, plan: Plan, timeout: float | None) -> Handle:
        timeout = self.timeout if timeout is None else float(timeout)
        seq = self._next_seq()
        handle = Handle(timeout)
        if self._recorder is not None and not (self._eager and self._queue.idle):
            self._recorder.schedule(seq, plan.sig, timeout)
        if self._eager and self._queue.idle:
            try:
                result = self._execute(plan, seq, timeout)
            except BaseException as exc:  # delivered to the waiter, as from the worker
                handle._finish(error=exc)
            else:
                handle._finish(result=result)
            return handle
        return self._queue.submit(lambda: self._execute(plan, seq, timeout), handle)

    @contextlib.contextmanager
    def eager(self) -> Iterator["Communicator"]:
        """Within this block, a nonblocking collective posted while nothing else
        is pending runs to completion in the calling thread and returns a done
        handle. For callers that wait at once (a framework's blocking call made
        through its nonblocking interface): it saves the two thread hand-offs
        of the call queue's worker thread, tens of microseconds per call."""
        previous, self._eager = self._eager, True
        try:
            yield self
        finally:
            self._eager = previous
