"""A ``torch.distributed`` backend named ``"collectives"``.

Once the name is registered (by ``import torch`` itself, through the
package's ``torch.backends`` entry point, or by importing
:mod:`collectives.integrations.torch`),
``torch.distributed.init_process_group(backend="collectives")`` builds a
:class:`CollectivesProcessGroup`: a Python subclass of
``torch.distributed.ProcessGroup`` whose collectives run on a
:class:`~collectives.Communicator`. Every collective is posted to the
communicator's call queue (its nonblocking form), so every rank runs them in
call order, and returns a :class:`CollectivesWork` whose future's value is
the list of output tensors. ``send``/``recv`` go straight to the transport
with their own tags.

Errors reach the caller as with Gloo (see :mod:`.torch_work`): a failed
call's ``wait()`` raises, its future fails, and the communicator is aborted.

torch's ``c10d.Backend`` has no constructor reachable from Python, so the
backend is a whole ``ProcessGroup`` (as torch's own Python process groups
are); torch then calls its methods directly and ``pg._get_backend(device)``
returns the group itself.

The group is composed of parts, one module each:

=======================  =========================================================
``torch_backend``        the group: identity, Works of calls, failure, lifetime;
                         the creator torch calls; :func:`communicator_of`
``torch_collectives``    the collectives (``allreduce`` ... ``barrier``)
``torch_alltoall``       even and uneven all-to-all
``torch_sparse``         sparse ``all_reduce``
``torch_p2p``            ``send``, ``recv``, receiving from any source; the tag space
``torch_monitored``      ``monitored_barrier``
``torch_work``           :class:`CollectivesWork`, its future, errors as torch shows them
``torch_tensors``        op names, numpy views, staging, autograd version bumps
``torch_store``          :func:`configure`, :class:`StoreAdapter`, the group's communicator
``torch_posting``        the post lock and sequence numbers shared by the adapters
``torch_profiling``      profiler spans
``torch_threads``        the threads that complete works; waiting for them at exit
=======================  =========================================================

Every name that this module gave before it was split is still importable
from it.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from collectives import Communicator
from collectives.errors import BadArgument

from . import torch_threads
from .torch import BACKEND_NAME
from .torch_alltoall import AllToAll
from .torch_collectives import Collectives
from .torch_monitored import MonitoredBarrier
from .torch_p2p import TAG_LIMIT, Notices, PointToPoint
from .torch_posting import next_sequence, post_lock, posted_sequence
from .torch_profiling import Span, adapter_span, comms_span, profiling
from .torch_sparse import SparseAllreduce
from .torch_store import StoreAdapter, configure, open_communicator
from .torch_tensors import as_numpy, mark_written, reduce_op_name, tensors_in
from .torch_work import CollectivesWork, Outcome, for_torch

__all__ = ["BACKEND_NAME", "CollectivesProcessGroup", "CollectivesWork", "configure", "communicator_of",
           "reduce_op_name", "StoreAdapter", "post_lock", "next_sequence", "posted_sequence", "as_numpy", "Outcome",
           "for_torch", "Span", "comms_span", "adapter_span", "profiling", "TAG_LIMIT"]


class CollectivesProcessGroup(Collectives, AllToAll, SparseAllreduce, MonitoredBarrier, PointToPoint,
                              dist.ProcessGroup):
    """A torch process group whose collectives run on a :class:`~collectives.Communicator`.

    Args:
        comm: the communicator of this group (rank and size must match).
        timeout: default timeout of the group's operations, seconds.
        owns_comm: close ``comm`` on :meth:`shutdown`.
    """

    def __init__(self, comm: Communicator, *, timeout: float | None = None, owns_comm: bool = True) -> None:
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self.timeout = comm.timeout if timeout is None else float(timeout)
        self._owns_comm = owns_comm
        self._lock = post_lock(comm)
        self._group_name = ""
        self._group_desc = ""
        self._global_ranks: list[int] | None = None
        self._p2p_seq = 0
        self._monitored_seq = 0
        self._notices = Notices(comm, self.timeout)

    # ------------------------------------------------------------ identity

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND_NAME

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def _set_group_name(self, name: str) -> None:
        self._group_name = name
        super()._set_group_name(name)

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc
        super()._set_group_desc(desc)

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def name(self) -> str:
        return BACKEND_NAME

    def _get_sequence_number_for_group(self) -> int:
        """The number of collectives issued on this group's communicator through
        the torch adapters (the backend, the DDP hooks, the optimizer wrapper)."""
        return posted_sequence(self.comm)

    def _set_sequence_number_for_group(self) -> None:
        """Nothing to agree on: every rank counts from zero when the group is made."""

    def _get_backend(self, device: Any = None) -> "CollectivesProcessGroup":
        """The group itself: it is its own backend for every device it takes (CPU)."""
        return self

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False
    supports_tensor_alloc = False

    def __repr__(self) -> str:
        return f"CollectivesProcessGroup(rank={self.comm.rank}, size={self.comm.size}, comm={self.comm!r})"

    # ----------------------------------------------------------- machinery

    def _ranks(self) -> list[int]:
        """The group's global ranks (for profiler events)."""
        if self._global_ranks is None:
            try:
                self._global_ranks = list(dist.get_process_group_ranks(self))
            except Exception:  # not registered with torch (yet): the group's own ranks
                return list(range(self.size()))
        return self._global_ranks

    def _span(self, event: str, inputs: Any, outputs: Any, seq: int, **extra: Any) -> Span | None:
        if not profiling():
            return None
        return comms_span(event, tensors_in(inputs), tensors_in(outputs), rank=self.rank(), size=self.size(),
                          seq=seq, group_name=self._group_name, group_desc=self._group_desc, ranks=self._ranks(),
                          **extra)

    def _collective_work(self, what: str, event: str, inputs: Any, outputs: Any, result: Any,
                         **extra: Any) -> CollectivesWork:
        """The Work of a collective about to be posted (holding the post lock): it
        takes the next sequence number and, while profiling, starts its span."""
        seq = next_sequence(self.comm)
        return CollectivesWork(result, what, self.comm.rank, span=self._span(event, inputs, outputs, seq, **extra))

    def _p2p_work(self, what: str, event: str, tensors: Any, source_rank: int | None = None,
                  peer: tuple[str, int] | None = None) -> CollectivesWork:
        """The Work of a send or receive about to be posted (holding the post lock)."""
        self._p2p_seq += 1
        span = self._span(event, tensors, tensors, self._p2p_seq, peer=peer)
        return CollectivesWork(tensors, what, self.comm.rank, source_rank, span=span)

    def _fail(self, work: CollectivesWork, exc: BaseException) -> None:
        """Fail ``work`` with ``exc``. Unless every rank refused the call alike
        (BadArgument), abort the communicator first: every peer's pending and
        later calls fail too, and this rank's later calls fail at once with
        the first reason."""
        exc = for_torch(exc)
        if not isinstance(exc, BadArgument):
            try:
                self.comm.abort(f"{type(exc).__name__}: {exc}")
            except Exception:  # the work's own error is what the caller needs
                pass
        work.complete(exc)

    def _finish(self, work: CollectivesWork, finish: Callable[[], None] | None) -> None:
        """Complete ``work`` after ``finish`` (copies into the caller's tensors)."""
        if work.is_completed():
            return
        try:
            if finish is not None:
                with torch.no_grad():  # the writes are the collective's, not graph operations
                    finish()
        except BaseException as exc:
            self._fail(work, exc)
        else:
            work.complete()

    def _complete_when_done(self, work: CollectivesWork, handles: list[Any],
                            finish: Callable[[], None] | None) -> None:
        """Complete ``work`` when every handle is done: at the first error, or
        after ``finish`` once all succeeded."""
        if not handles:
            self._finish(work, finish)
            return
        remaining = [len(handles)]
        lock = threading.Lock()

        def done(handle: Any) -> None:
            error = handle.exception()
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if error is not None:
                self._fail(work, error)
            elif last:
                self._finish(work, finish)

        for handle in handles:
            handle.add_done_callback(done)

    def _chain(self, what: str, event: str, steps: Sequence[Callable[[], Any]], result: Any,
               finish: Callable[[], None] | None = None, opts: Any = None, written: Any = (), *,
               inputs: Any = (), **extra: Any) -> CollectivesWork:
        """Post several nonblocking collectives back to back; one Work for all.

        Args:
            what: the call, for messages.
            event: the call's name in profiler events (Gloo's: ``all_reduce``).
            steps: each posts one collective and returns its handle.
            result: the Work's value.
            finish: copies results into the caller's tensors once all succeeded.
            opts: the call's options; when they say it blocks (``asyncOp``
                false), the steps run in this thread if nothing else is pending.
            written: the caller's tensors the call writes in place (its outputs).
            inputs: the caller's input tensors (for profiler events).
            **extra: more fields of the profiler event (split sizes).

        Raises:
            BadArgument: the call's arguments were refused (before anything
                was sent). Every other error fails the returned Work.
        """
        mark_written(written)
        blocking = getattr(opts, "asyncOp", True) is False
        work: CollectivesWork | None = None
        try:
            with self._lock, (self.comm.eager() if blocking else contextlib.nullcontext()):
                work = self._collective_work(what, event, inputs, written, result, **extra)
                handles = [s() for s in steps]
        except BadArgument as exc:
            if work is not None:
                work.complete(exc)
            raise
        except BaseException as exc:  # e.g. the communicator broke earlier
            work = work if work is not None else CollectivesWork(result, what, self.comm.rank)
            self._fail(work, exc)
            return work
        self._complete_when_done(work, handles, finish)
        return work

    def _in_thread(self, work: CollectivesWork, body: Callable[[], None],
                   finish: Callable[[], None] | None = None) -> CollectivesWork:
        """Run ``body`` (which waits) in a thread of the pool, or in the
        caller of ``work.wait()`` if it comes first; complete ``work`` after it."""
        def run() -> None:
            try:
                body()
            except BaseException as exc:
                self._fail(work, exc)
            else:
                self._finish(work, finish)

        task = torch_threads.Task(run)
        work.run_by_waiter(task)
        torch_threads.submit(task)
        return work

    # ------------------------------------------------------------- lifetime

    def shutdown(self) -> None:
        """Finish queued work and close the communicator (if this group owns
        it), then wait a few seconds at most until no thread completes a
        work (:mod:`.torch_threads`)."""
        if self._owns_comm:
            self.comm.close()
        torch_threads.settle()

    def abort(self) -> None:
        """Make every peer's pending and future operations fail at once."""
        self.comm.abort("process group aborted")


def _create_process_group(store: dist.Store, group_rank: int, group_size: int,
                          timeout: datetime.timedelta) -> CollectivesProcessGroup:
    """The creator registered with ``torch.distributed.Backend.register_backend``."""
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return CollectivesProcessGroup(open_communicator(store, group_rank, group_size, seconds), timeout=seconds)


def communicator_of(group: dist.ProcessGroup | None = None) -> Communicator:
    """The Communicator behind a process group of this backend (default: the world group).

    Raises:
        BadArgument: if the group does not use the collectives backend.
    """
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    if isinstance(group, CollectivesProcessGroup):
        return group.comm
    raise BadArgument(f"process group {group!r} does not use the {BACKEND_NAME!r} backend")


def _register() -> None:
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create_process_group, devices=["cpu"])


_register()
