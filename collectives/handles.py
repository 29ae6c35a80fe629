"""Handles of nonblocking operations and the call queue that runs collectives in order.

Every rank must run its collectives in the same order (as in MPI). A
communicator's :class:`CallQueue` runs blocking calls inline when nothing
is queued and otherwise hands them, like nonblocking calls, to one FIFO
worker thread, so calls complete in the order they were made.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

from .errors import CollectiveTimeout
from .transport import Request

__all__ = ["Handle", "RequestHandle", "CallQueue"]


class Handle:
    """The result of a nonblocking collective: ``wait(timeout)`` and ``done()``.

    ``wait`` returns the operation's result (the output buffer) or raises its
    error. ``add_done_callback(fn)`` calls ``fn(handle)`` on completion (from
    the worker thread), which is what futures of frameworks build on.
    """

    __slots__ = ("_event", "_result", "_error", "_callbacks", "_lock", "default_timeout")

    def __init__(self, default_timeout: float) -> None:
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["Handle"], None]] = []
        self._lock = threading.Lock()
        self.default_timeout = default_timeout

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            self._result, self._error = result, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def done(self) -> bool:
        """True once the operation has completed (successfully or not)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for completion and return the result.

        Args:
            timeout: seconds (None: the communicator's default).

        Raises:
            CollectiveTimeout if not complete in time; the operation's own error.
        """
        timeout = self.default_timeout if timeout is None else timeout
        if not self._event.wait(timeout):
            raise CollectiveTimeout(f"nonblocking operation not complete after {timeout:.3g}s")
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self) -> BaseException | None:
        """The operation's error once done (None if it succeeded or is pending)."""
        return self._error

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Call ``fn(self)`` when done (at once if already done)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)


class RequestHandle:
    """A point-to-point request seen as a handle (``wait``/``done``)."""

    __slots__ = ("_request", "_result", "default_timeout")

    def __init__(self, request: Request, result: Any, default_timeout: float) -> None:
        self._request = request
        self._result = result
        self.default_timeout = default_timeout

    def wait(self, timeout: float | None = None) -> Any:
        self._request.wait(self.default_timeout if timeout is None else timeout)
        return self._result

    def done(self) -> bool:
        return self._request.test()


class CallQueue:
    """Runs tasks one at a time, in submission order.

    A communicator is used from one thread at a time (like
    MPI_THREAD_SERIALIZED); the worker thread only ever removes work, so the
    inline fast path needs no lock.
    """

    def __init__(self, name: str) -> None:
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        #: Tasks queued or running on the worker (0: idle); a plain attribute,
        #: read on every blocking call.
        self.busy = 0
        self._thread: threading.Thread | None = None
        self._name = name
        self._closed = False

    @property
    def idle(self) -> bool:
        """True when nothing is queued or running on the worker."""
        return self.busy == 0

    def submit(self, task: Callable[[], Any], handle: Handle) -> Handle:
        """Queue ``task``; its result or error completes ``handle``."""
        with self._cv:
            self.busy += 1
            self._queue.append((task, handle))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return handle

    def drain(self, timeout: float) -> None:
        """Wait until every queued task has finished."""
        with self._cv:
            if not self._cv.wait_for(lambda: self.busy == 0, timeout):
                raise CollectiveTimeout(
                    f"earlier nonblocking operations did not finish within {timeout:.3g}s")

    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                task, handle = self._queue.popleft()
            try:
                result = task()
            except BaseException as exc:  # delivered to the waiter
                handle._finish(error=exc)
            else:
                handle._finish(result=result)
            with self._cv:
                self.busy -= 1
                self._cv.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker once the queue is empty, and wait (``timeout`` at
        most) until it has: a worker still running a task's callbacks when the
        interpreter shuts down is killed in the middle of them (in native code,
        such as torch's, that aborts the process)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
