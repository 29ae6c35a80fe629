"""The Work of the torch backend's calls, and how their errors reach torch.

Errors reach the caller as with Gloo: a failed call's ``wait()`` (so every
blocking call) raises the library's error (a RuntimeError; a timeout's
message starts with ``Timed out``), its future fails (DDP's backward
raises), ``is_success()`` is False, and the communicator is aborted, so the
peers' calls fail too and later calls here fail at once with the first
reason. The tensors a call writes in place (outputs, received tensors) have
their autograd version counters bumped when it is made, so a tensor saved
for backward and then overwritten makes backward raise torch's in-place
error.
"""

from __future__ import annotations

import copy
import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from collectives.errors import BadArgument, CollectiveError, CollectiveTimeout

from .torch_profiling import Span
from .torch_tensors import tensors_in

__all__ = ["CollectivesWork", "Outcome", "for_torch", "fresh_copy"]


class _Failed:
    """The value that stands for an error in an :class:`Outcome`'s source future."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _settle(source: Future) -> Any:
    value = source.value()
    if isinstance(value, _Failed):
        raise fresh_copy(value.error) from None
    return value


class Outcome:
    """A torch future set once, from any thread, that fails in a way torch's
    C++ side sees.

    ``Future.set_exception`` stores the exception as the future's *value*:
    Python's ``wait()`` raises it, but C++ consumers (DDP's reducer) take it
    for a result. Here ``future`` is chained to a source future by a callback
    that raises on an error, which makes torch fail ``future`` itself, with a
    RuntimeError whose message holds the error's kind and message.
    """

    def __init__(self) -> None:
        self._source: Future = Future()
        self.future: Future = self._source.then(_settle)

    def set_result(self, value: Any) -> None:
        """Complete ``future`` with ``value``."""
        self._source.set_result(value)

    def set_exception(self, error: BaseException) -> None:
        """Fail ``future`` with ``error``."""
        self._source.set_result(_Failed(error))


def fresh_copy(exc: BaseException) -> BaseException:
    """A copy of ``exc`` (same kind, message and attributes, no traceback)."""
    try:
        return copy.copy(exc)
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


_ABORT_SEPARATOR = "\x1f"  # between an abort's kind and its message (collectives.errors)


def for_torch(exc: BaseException) -> BaseException:
    """``exc`` as the backend reports it: a timeout (this rank's, or a peer's
    that reached it through an abort, decoded or not) as a copy whose message
    starts with ``Timed out`` (the words torch's users and tests look for);
    an abort's text that a transport passed on undecoded made readable; any
    other error as it is."""
    if not isinstance(exc, CollectiveError) or not exc.args:
        return exc
    text = str(exc.args[0])
    timed_out = isinstance(exc, CollectiveTimeout) or f"CollectiveTimeout{_ABORT_SEPARATOR}" in text
    readable = text.replace(_ABORT_SEPARATOR, ": ")
    if timed_out and "Timed out" not in readable:
        readable = f"Timed out: {readable}"
    if readable == text:
        return exc
    shown = fresh_copy(exc)
    shown.args = (readable,) + tuple(exc.args[1:])
    return shown


def _seconds(timeout: Any) -> float | None:
    """A Work.wait timeout in seconds; None for none (torch's default is zero)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return seconds if seconds > 0 else None


class CollectivesWork(dist.Work):
    """The ``torch.distributed.Work`` of one call of the backend.

    ``wait()`` returns True once the call succeeded and raises its error
    (a :class:`~collectives.errors.CollectiveError`, a RuntimeError) when it
    failed; ``get_future()`` completes with the call's outputs or fails
    (torch wraps the error in a RuntimeError carrying its kind and message);
    ``is_success()`` is True only after success.

    Args:
        result: the future's value on success (the call's output tensors).
        what: the call, for messages (``"allreduce"``).
        rank: this rank, for messages.
        source_rank: the sender, for a receive (set later for a receive from any source).
        span: the call's profiler span, ended when the call completes.
    """

    def __init__(self, result: Any, what: str, rank: int, source_rank: int | None = None,
                 span: Span | None = None) -> None:
        super().__init__()
        self._result = result
        self._what = what
        self._rank = rank
        self._sender = source_rank
        self._span = span
        self._lock = threading.Lock()
        self._finished = False  # complete() began: the outcome is decided
        self._completed = False  # complete() ended: the future is set, waiters are let go
        self._error: BaseException | None = None
        # made when first needed (most Works complete before anyone waits or asks for a future)
        self._done: threading.Event | None = None
        self._outcome: Outcome | None = None
        self._task: Any = None

    def run_by_waiter(self, task: Any) -> None:
        """``task`` (a :class:`~.torch_threads.Task`) completes this Work;
        :meth:`wait` without a timeout runs it itself if no thread took it yet."""
        self._task = task

    def complete(self, error: BaseException | None = None) -> None:
        """Finish the Work (once; later calls are ignored): with ``error``, or successfully."""
        with self._lock:
            if self._finished:
                return
            self._finished, self._error = True, error
            outcome = self._outcome
        if self._span is not None:
            self._span.end()
        if outcome is not None:
            self._settle(outcome)
        with self._lock:
            self._completed = True
            done = self._done
        if done is not None:
            done.set()

    def _settle(self, outcome: Outcome) -> None:
        """Set ``outcome`` as the finished call came out."""
        if self._error is None:
            outcome.set_result(self._result)
        else:
            outcome.set_exception(self._error)

    def wait(self, timeout: Any = None) -> bool:
        """Wait for the call (``timeout``: a timedelta or seconds; zero or None: until
        it completes, which every call does within its own timeout).

        Raises:
            CollectiveError: the call's error.
            CollectiveTimeout: ``timeout`` passed first (the call goes on).
        """
        if not self._completed:
            seconds = _seconds(timeout)
            task = self._task
            if seconds is None and task is not None:
                run = task.claim()  # a thread would only hand the result over
                if run is not None:
                    run()
            with self._lock:
                if not self._completed and self._done is None:
                    self._done = threading.Event()
                done = None if self._completed else self._done
            if done is not None and not done.wait(seconds):
                raise CollectiveTimeout(f"Timed out: rank {self._rank}: {self._what} did not complete "
                                        f"within the wait's {seconds:.3g}s (it is still running)")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """True once the call succeeded or failed."""
        return self._completed

    def is_success(self) -> bool:
        """True once the call completed without error."""
        return self._completed and self._error is None

    def exception(self) -> BaseException | None:
        """The call's error (None while it runs or when it succeeded)."""
        return self._error

    def get_future(self) -> Future:
        """A future of the call's outputs; it fails when the call does."""
        with self._lock:
            outcome = self._outcome
            settle = outcome is None and self._finished  # complete() did not see it: set it here
            if outcome is None:
                outcome = self._outcome = Outcome()
        if settle:
            self._settle(outcome)
        return outcome.future

    def result(self) -> list[torch.Tensor]:
        """The call's output tensors (waits for the call; raises its error)."""
        self.wait()
        return tensors_in(self._result)

    def source_rank(self) -> int:
        """The sender of a receive (of a receive from any source: once it completed)."""
        if self._sender is None:
            raise BadArgument(f"{self._what}: the sender is known for completed receives only")
        return self._sender

    def set_source_rank(self, rank: int) -> None:
        """Record the sender of a receive from any source (before completing it)."""
        self._sender = int(rank)

    def _source_rank(self) -> int:  # torch's name (dist.recv without src calls it)
        return self.source_rank()

    def synchronize(self) -> None:
        """Nothing to do: the backend's tensors are on the CPU."""

    def __repr__(self) -> str:
        state = "pending" if not self._completed else "ok" if self._error is None else "failed"
        return f"CollectivesWork({self._what}, rank {self._rank}, {state})"
