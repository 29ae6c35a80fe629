"""Surviving failures: abort, agree among the survivors, shrink to them.

A mixin of :class:`~collectives.communicator.Communicator`. It reads the
communicator's ``rank``, ``size``, ``transport``, ``timeout``, ``selector``,
``segment_bytes``, ``_capabilities``, ``_closed``, ``_seq``, ``_job`` and
``_options``, and keeps ``_broken`` (the error that aborted it),
``_known_failed``, ``_agreements``, ``epoch`` and ``original_ranks``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .errors import BadArgument, CollectiveError, PeerLost, abort_reason

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["Survival"]

log = logging.getLogger("collectives")
_now = time.monotonic


class Survival:
    """``abort``, ``aborted``, ``failed_ranks``, ``agree`` and ``shrink``."""

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
        from .communicator import Communicator

        new = Communicator(tr, timeout=self.timeout, selector=self.selector, segment_bytes=self.segment_bytes,
                           job=job, options=self._options)
        new.epoch = self.epoch + 1
        new.original_ranks = [self.original_ranks[r] for r in survivors]
        if new._recorder is not None:  # its records name the ranks of the job as it started
            new._recorder.peers = list(new.original_ranks)
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
            self._fast.open = 0
        self._tell_abort(abort_reason(PeerLost(reason, self.rank)), self._seq + 1)
