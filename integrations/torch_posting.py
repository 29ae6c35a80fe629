"""The post lock and the sequence numbers shared by every torch adapter of a communicator.

The process group, the DDP hooks and the optimizer wrapper may post to the
same communicator from several threads (autograd, hooks, the main loop);
they take their sequence numbers one at a time under one lock per
communicator. ``pg._get_sequence_number_for_group()`` and the profiler
spans' ``Seq`` are these numbers.
"""

from __future__ import annotations

import threading
import weakref

from collectives import Communicator

__all__ = ["post_lock", "next_sequence", "posted_sequence"]


class _Posting:
    """What every torch adapter of one communicator shares: the lock held while
    posting, and the count of collectives posted through the adapters."""

    __slots__ = ("lock", "sequence", "__weakref__")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sequence = 0


_postings: "weakref.WeakKeyDictionary[Communicator, _Posting]" = weakref.WeakKeyDictionary()
_postings_guard = threading.Lock()


def _posting(comm: Communicator) -> _Posting:
    with _postings_guard:
        posting = _postings.get(comm)
        if posting is None:
            posting = _postings[comm] = _Posting()
        return posting


def post_lock(comm: Communicator) -> threading.Lock:
    """The lock held while posting to ``comm``, shared by every adapter of it, so
    that calls from several threads (autograd, hooks, the main loop) take their
    sequence numbers one at a time."""
    return _posting(comm).lock


def next_sequence(comm: Communicator) -> int:
    """Count one more collective posted to ``comm`` through the torch adapters and
    return its number (1, 2, ...); call it holding :func:`post_lock`."""
    posting = _posting(comm)
    posting.sequence += 1
    return posting.sequence


def posted_sequence(comm: Communicator) -> int:
    """The number of collectives posted to ``comm`` through the torch adapters."""
    return _posting(comm).sequence
