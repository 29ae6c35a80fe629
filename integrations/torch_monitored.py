"""``monitored_barrier``, as Gloo's.

``pg.monitored_barrier(timeout, wait_all_ranks)`` works as Gloo's (rank 0
hears from every rank within the timeout, then releases them, and names
the ranks that did not come); torch's front end ``dist.monitored_barrier``
refuses every backend but Gloo by name.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import numpy as np

from collectives.errors import CollectiveTimeout

from .torch_p2p import MONITORED_TAG_BASE
from .torch_work import fresh_copy

__all__ = ["MonitoredBarrier"]


class MonitoredBarrier:
    """The process group's ``monitored_barrier`` (a part of
    :class:`~.torch_backend.CollectivesProcessGroup`, whose ``comm``, ``timeout``
    and ``_lock`` it uses)."""

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not reach it, as Gloo's does:
        every rank tells rank 0 it arrived; rank 0 waits for them within
        ``timeout`` (a timedelta or seconds; default: the group's), then
        releases them. A failure aborts the group, so that the waiting ranks
        fail too.

        Raises:
            CollectiveTimeout: on rank 0, ``Rank r failed to pass
                monitoredBarrier in T ms`` (``Ranks r, s ...`` with
                ``wait_all_ranks``) or ``Rank 0 timed out in monitoredBarrier
                after T ms``; on the others, ``Rank r successfully reached
                monitoredBarrier, but received errors while waiting for
                send/recv from rank 0``.
        """
        seconds = self.timeout if timeout is None else (
            timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout))
        with self._lock:
            self._monitored_seq = (self._monitored_seq + 1) % (1 << 24)
            arrive = MONITORED_TAG_BASE + 2 * self._monitored_seq
        token = np.array([self.rank()], np.int64)
        try:
            if self.rank() != 0:
                self._monitored_peer(token, arrive)
            else:
                self._monitored_root(token, arrive, seconds, wait_all_ranks)
        except BaseException as exc:
            try:
                self.comm.abort(f"{type(exc).__name__}: {exc}")
            except Exception:
                pass
            raise

    def _monitored_peer(self, token: np.ndarray, arrive: int) -> None:
        """A rank other than 0: arrive, then wait for rank 0's release."""
        reply = np.empty(1, np.int64)
        try:
            with self._lock:
                sent = self.comm.isend(token, 0, arrive, timeout=self.timeout)
                released = self.comm.irecv(reply, 0, arrive + 1, timeout=self.timeout)
            sent.wait()
            released.wait()
        except BaseException as exc:
            shown = fresh_copy(exc)
            shown.args = (f"Rank {self.rank()} successfully reached monitoredBarrier, but received errors while "
                          f"waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank. "
                          f"Original exception: {exc}",)
            raise shown from None

    def _monitored_root(self, token: np.ndarray, arrive: int, seconds: float, wait_all_ranks: bool) -> None:
        """Rank 0: hear from every rank within ``seconds``, then release them."""
        ms = int(round(seconds * 1000))
        replies = {peer: np.empty(1, np.int64) for peer in range(1, self.size())}
        with self._lock:
            arrivals = {peer: self.comm.irecv(buf, peer, arrive, timeout=seconds) for peer, buf in replies.items()}
        self._monitored_wait(arrivals, seconds, ms, wait_all_ranks)
        with self._lock:
            releases = {peer: self.comm.isend(token, peer, arrive + 1, timeout=seconds) for peer in replies}
        self._monitored_wait(releases, seconds, ms, wait_all_ranks)

    def _monitored_wait(self, requests: dict[int, Any], seconds: float, ms: int, wait_all_ranks: bool) -> None:
        start = time.monotonic()
        done: list[int] = []
        for peer, request in requests.items():
            left = seconds if wait_all_ranks else seconds - (time.monotonic() - start)
            if not wait_all_ranks and left < 0:
                passed = (f"Successfully processed ranks: {', '.join(map(str, done))}" if done
                          else "No ranks successfully processed in monitoredBarrier.")
                raise CollectiveTimeout(f"Rank {self.rank()} timed out in monitoredBarrier after {ms} ms.\n{passed}")
            try:
                request.wait(max(left, 0.0))
            except Exception as exc:
                if not wait_all_ranks:
                    raise CollectiveTimeout(f"[Rank 0]: Rank {peer} failed to pass monitoredBarrier in {ms} ms. "
                                            f"Original exception: {exc}") from None
            else:
                done.append(peer)
        missing = [peer for peer in requests if peer not in done]
        if missing:
            raise CollectiveTimeout(f"[Rank 0]: Ranks {', '.join(map(str, missing))} failed to pass "
                                    f"monitoredBarrier in {ms} ms")
