"""The threads that complete the torch backend's works, and joining them.

A call that must wait (a receive, one from any source) waits in a thread of
its own, which completes the call's Work. Such a thread goes on for a moment
after the Work completes: it returns and drops its references, which may be
the last ones to a tensor. A tensor freed while the interpreter shuts down
lets go of the GIL and cannot take it back, and the thread is killed inside
torch's native code, which aborts the process ("terminate called without an
active exception"). So every such thread is kept here and joined, a few
seconds at most in all, when the process group shuts down and when the
interpreter exits (before it shuts down).
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Callable

__all__ = ["start", "join_all", "JOIN_SECONDS"]

#: How long a shutdown or the interpreter's exit waits for these threads, in all.
JOIN_SECONDS = 5.0

_threads: set[threading.Thread] = set()
_lock = threading.Lock()


def start(run: Callable[[], None], name: str) -> threading.Thread:
    """Run ``run`` in a daemon thread that :func:`join_all` waits for."""
    thread = threading.Thread(target=run, name=name, daemon=True)
    with _lock:
        for done in [t for t in _threads if not t.is_alive()]:
            _threads.discard(done)
        _threads.add(thread)
    thread.start()
    return thread


def join_all(timeout: float = JOIN_SECONDS) -> list[threading.Thread]:
    """Wait until every thread started here has ended (``timeout`` seconds
    at most in all); returns those still running then."""
    deadline = time.monotonic() + timeout
    with _lock:
        threads = [t for t in _threads if t is not threading.current_thread()]
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    with _lock:
        for done in [t for t in _threads if not t.is_alive()]:
            _threads.discard(done)
        return [t for t in _threads if t.is_alive()]


atexit.register(join_all)
