"""The threads that complete the torch backend's works, and waiting for them.

A call that must wait (a receive, one from any source) hands its body (wait
for the requests, then complete the Work) to a pool of threads here, so
that the Work completes whether or not anyone waits for it. Threads are
reused (starting one took about 120 µs here, half of a small receive's
time), and a caller that waits for the Work without a timeout runs the body
itself if no thread has taken it yet (:meth:`Task.claim`), which saves the
hand-over between threads.

A thread goes on for a moment after the Work completes: it drops its
references, which may be the last ones to a tensor. A tensor freed while
the interpreter shuts down lets go of the GIL and cannot take it back, and
the thread is killed inside torch's native code, which aborts the process
("terminate called without an active exception"). So the process group's
shutdown and the interpreter's exit (before it shuts down) wait until no
body runs, a few seconds at most (:func:`settle`).
"""

from __future__ import annotations

import atexit
import collections
import threading
from typing import Callable

__all__ = ["Task", "submit", "settle", "JOIN_SECONDS", "IDLE_SECONDS"]

#: How long a shutdown or the interpreter's exit waits for running bodies, in all.
JOIN_SECONDS = 5.0
#: An idle thread of the pool ends after this long without work.
IDLE_SECONDS = 30.0


class Task:
    """A body that runs once: in a thread of the pool, or in a waiter that
    claims it first."""

    def __init__(self, run: Callable[[], None]) -> None:
        self._run: Callable[[], None] | None = run
        self._lock = threading.Lock()

    def claim(self) -> Callable[[], None] | None:
        """The body, to run now, for the first caller; None for every later one."""
        with self._lock:
            run, self._run = self._run, None
        return run


_tasks: collections.deque[Task] = collections.deque()
_cv = threading.Condition()
_idle = 0  # threads waiting for a task
_busy = 0  # tasks queued or being run by the pool, references not yet dropped


def submit(task: Task) -> None:
    """Have a thread of the pool run ``task`` (unless a waiter claims it first)."""
    global _busy
    with _cv:
        _tasks.append(task)
        _busy += 1
        if _idle >= len(_tasks):
            _cv.notify()
            return
    threading.Thread(target=_serve, name="collectives-work", daemon=True).start()


def _serve() -> None:
    """A pool thread: run tasks as they come; end after IDLE_SECONDS without one."""
    global _idle, _busy
    while True:
        with _cv:
            _idle += 1
            _cv.wait_for(lambda: _tasks, IDLE_SECONDS)
            _idle -= 1
            if not _tasks:
                return
            task = _tasks.popleft()
        run = task.claim()
        if run is not None:
            run()
        del run, task  # the last references to the call's tensors go here, before it counts as done
        with _cv:
            _busy -= 1
            _cv.notify_all()


def settle(timeout: float = JOIN_SECONDS) -> bool:
    """Wait until the pool runs no body and has none queued (``timeout``
    seconds at most); True if so."""
    with _cv:
        return _cv.wait_for(lambda: _busy == 0, timeout)


atexit.register(settle)
