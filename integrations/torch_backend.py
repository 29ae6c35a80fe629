"""A ``torch.distributed`` backend named ``"collectives"``.

Once the name is registered (by ``import torch`` itself, through the
package's ``torch.backends`` entry point, or by importing
:mod:`collectives.integrations.torch`),
``torch.distributed.init_process_group(backend="collectives")`` builds a
:class:`CollectivesProcessGroup`: a Python subclass of
``torch.distributed.ProcessGroup`` whose collectives run on a
:class:`~collectives.Communicator`. Every collective is posted to the
communicator's FIFO lane (its nonblocking form), so every rank runs them in
call order, and returns a :class:`CollectivesWork` whose future's value is
the list of output tensors. ``send``/``recv`` go straight to the transport
with their own tags.

Errors reach the caller as with Gloo: a failed call's ``wait()`` (so every
blocking call) raises the library's error (a RuntimeError; a timeout's
message starts with ``Timed out``), its future fails (DDP's backward
raises), ``is_success()`` is False, and the communicator is aborted, so the
peers' calls fail too and later calls here fail at once with the first
reason. The tensors a call writes in place (outputs, received tensors) have
their autograd version counters bumped when it is made, so a tensor saved
for backward and then overwritten makes backward raise torch's in-place
error.

The ranks of a group agree on a job id through the store torch hands to the
backend (under torchrun, the agent's store on MASTER_PORT), so ``new_group``
works the same way. The transport is chosen as :func:`collectives.init`
chooses it (``COLLECTIVES_TRANSPORT`` overrides), or by :func:`configure`.

Receiving from any source (``dist.recv(t)`` without ``src``, ``irecv``):
the transports match messages by sender and tag and cannot cancel a
receive, so every ``send`` of this backend is preceded by a zero-byte
notice to the same rank on a tag of its own (``2**25 + tag``). A receive
from any source keeps one notice receive posted per peer and takes the
first that completes; a named receive takes the next notice from its
sender. Notices are taken in the order receives were posted, per sender
and tag, so a named receive and one from any source never take each
other's message. The cost: one more (empty) message per send, one more
receive per ``recv``; a receive from any source polls its peers' notices
(spinning, then yielding, then sleeping up to a millisecond).

Sparse ``all_reduce`` (sum of COO tensors, as Gloo does): every rank's
indices and values are gathered (an allgather of the counts, two
allgatherv), summed and coalesced, and the result is copied into the
tensor. It runs in the calling thread.

Profiling: while ``torch.profiler`` (or the autograd profiler) records,
every call of the backend, of the DDP hooks and of the optimizer wrapper
is a span named ``collectives:<collective>`` (``collectives:all_reduce``,
``collectives:broadcast``, ``collectives:send``, ... with Gloo's
collective names), from the call to its completion, marked asynchronous,
with the call's input tensors (their shapes with ``record_shapes``) and
the fields of torch's own ``record_param_comms`` events (collective name,
dtype, element counts, split sizes, group size, name, description and
ranks, rank, sequence number; for send and receive the peer).
``pg._get_sequence_number_for_group()`` is the number of collectives
issued through the torch adapters on the group's communicator.

``pg.monitored_barrier(timeout, wait_all_ranks)`` works as Gloo's (rank 0
hears from every rank within the timeout, then releases them, and names
the ranks that did not come); torch's front end ``dist.monitored_barrier``
refuses every backend but Gloo by name.

torch's ``c10d.Backend`` has no constructor reachable from Python, so the
backend is a whole ``ProcessGroup`` (as torch's own Python process groups
are); torch then calls its methods directly and ``pg._get_backend(device)``
returns the group itself.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import datetime
import os
import secrets
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch._C._profiler import _RecordFunctionFast
from torch.autograd.graph import increment_version
from torch.futures import Future

import collectives
from collectives import Communicator
from collectives.errors import BadArgument, CollectiveError, CollectiveTimeout
from collectives.waiting import wait_until

__all__ = ["BACKEND_NAME", "CollectivesProcessGroup", "CollectivesWork", "configure", "communicator_of",
           "reduce_op_name", "StoreAdapter", "post_lock", "next_sequence", "posted_sequence", "as_numpy", "Outcome",
           "for_torch", "Span", "comms_span", "adapter_span", "profiling", "TAG_LIMIT"]

BACKEND_NAME = "collectives"
#: Tags of send/recv: [0, 2**25). Their notices (see the module's docstring)
#: travel on 2**25 + tag, uneven all-to-all on 2**26 + call number.
TAG_LIMIT = 1 << 25
_NOTICE_TAG_BASE = 1 << 25
_ALLTOALLV_TAG_BASE = 1 << 26
_MONITORED_TAG_BASE = (1 << 26) + (1 << 25)  # monitored barriers: two tags per call
_NOTICE = np.empty(0, np.uint8)
_settings: dict[str, Any] = {"transport": "auto", "options": {}}
_RED = dist.ReduceOp.RedOpType


def configure(transport: str = "auto", **options: Any) -> None:
    """Choose the transport (and transport options) of groups created from now on.

    Args:
        transport: a transport name or ``"auto"`` (as in :func:`collectives.init`).
        **options: transport options passed to :func:`collectives.init`.
    """
    _settings["transport"] = transport
    _settings["options"] = dict(options)


# As in Gloo, on bool tensors sum and max are "or", min and product "and".
_BOOL_OPS = {_RED.SUM: "lor", _RED.MAX: "lor", _RED.BOR: "lor", _RED.MIN: "land",
             _RED.PRODUCT: "land", _RED.BAND: "land", _RED.BXOR: "bxor"}
_OPS = {_RED.SUM: "sum", _RED.AVG: "avg", _RED.PRODUCT: "prod", _RED.MIN: "min",
        _RED.MAX: "max", _RED.BAND: "band", _RED.BOR: "bor", _RED.BXOR: "bxor"}


def reduce_op_name(op: Any, dtype: torch.dtype) -> str:
    """Our op name for a ``torch.distributed.ReduceOp`` on tensors of ``dtype``.

    Raises:
        BadArgument: for ``PREMUL_SUM`` and other ops without an equivalent.
    """
    kind = op.op if hasattr(op, "op") else op
    name = (_BOOL_OPS if dtype == torch.bool else _OPS).get(kind)
    if name is None:
        raise BadArgument(f"reduce op {kind} is not supported by the collectives backend")
    return name


class StoreAdapter:
    """A ``torch.distributed.Store`` seen as the rendezvous store transports use.

    Args:
        store: a torch store (TCPStore, FileStore, PrefixStore, ...).
    """

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def set(self, key: str, value: bytes | str) -> None:
        """Publish ``value`` under ``key``."""
        self.store.set(key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to appear."""
        if timeout is not None:
            self.store.wait([key], datetime.timedelta(seconds=float(timeout)))
        return self.store.get(key)


# ------------------------------------------------------------------ helpers

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


# ---------------------------------------------------------------- profiling

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    """torch's C++ name of ``dtype`` (``Float``, ``BFloat16``, ``Long``), as its
    profiler events write it."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = torch.empty((), dtype=dtype).type().removeprefix("torch.").removesuffix("Tensor")
    return name


def profiling() -> bool:
    """True while a torch profiler records."""
    return torch.autograd._profiler_enabled()


class _Ender:
    """A long-lived thread that ends every span: torch's profiler calls a span
    asynchronous when it ends on another thread than the one it began on, and
    a thread made for one span (or one call) does not reliably count as
    another thread to it."""

    def __init__(self) -> None:
        self._queue: "collections.deque[tuple[Any, threading.Event]]" = collections.deque()
        self._ready = threading.Semaphore(0)
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()

    def end(self, record: Any) -> None:
        """End ``record`` on the ender's thread and wait until it is ended."""
        with self._guard:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="collectives-span-ender", daemon=True)
                self._thread.start()
        ended = threading.Event()
        self._queue.append((record, ended))
        self._ready.release()
        ended.wait()

    def _run(self) -> None:
        while True:
            self._ready.acquire()
            record, ended = self._queue.popleft()
            try:
                record.__exit__(None, None, None)
            finally:
                ended.set()


_ender = _Ender()


def _new_ender() -> None:
    global _ender
    _ender = _Ender()


os.register_at_fork(after_in_child=_new_ender)


class Span:
    """A profiler span over one call, from its start to its completion, as
    torch's backends record their Work: named ``collectives:<collective>``,
    holding the call's input tensors (for ``record_shapes``) and ``args``
    (shown in the trace). It is ended on a helper thread, which makes it
    asynchronous to torch's profiler, as torch's own backends mark theirs.

    Args:
        name: the span's name.
        inputs: the call's input tensors.
        args: the trace's fields (ints and strings).
    """

    __slots__ = ("_record", "_lock")

    def __init__(self, name: str, inputs: Sequence[torch.Tensor], args: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self._record: Any = _RecordFunctionFast(name, list(inputs), args)
        self._record.__enter__()

    def end(self) -> None:
        """End the span (once, from any thread; later calls do nothing)."""
        with self._lock:
            record, self._record = self._record, None
        if record is not None:
            _ender.end(record)


def _numel(tensors: Sequence[torch.Tensor]) -> int:
    return int(sum(t.numel() for t in tensors))


def _ranks_text(ranks: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(r)) for r in ranks) + "]"


def comms_span(collective: str, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *,
               rank: int, size: int, seq: int, group_name: str = "", group_desc: str = "",
               ranks: Sequence[int] | None = None, in_splits: Sequence[int] = (),
               out_splits: Sequence[int] = (), peer: tuple[str, int] | None = None) -> Span | None:
    """A :class:`Span` named ``collectives:<collective>`` with the fields of torch's
    ``record_param_comms`` events, or None when no profiler records.

    Args:
        collective: Gloo's name of the call (``all_reduce``, ``broadcast``, ``send``).
        inputs, outputs: the call's tensors (element counts, dtype).
        rank, size: this rank in the group and the group's size.
        seq: the call's sequence number.
        group_name, group_desc: torch's name and description of the group.
        ranks: the group's global ranks (default: 0 .. size - 1).
        in_splits, out_splits: split sizes of uneven calls (all-to-all).
        peer: ``("Src Rank", r)`` or ``("Dst Rank", r)`` of send and receive.
    """
    if not profiling():
        return None
    ranks = list(range(size)) if ranks is None else list(ranks)
    stride = ranks[1] - ranks[0] if len(ranks) > 1 else 1
    if any(b - a != stride for a, b in zip(ranks, ranks[1:])):
        stride = -1
    tensors = list(inputs) or list(outputs)
    args: dict[str, Any] = {
        "Collective name": collective,
        "dtype": _dtype_name(tensors[0].dtype) if tensors else "Byte",
        "In msg nelems": _numel(inputs), "Out msg nelems": _numel(outputs),
        "In split size": _ranks_text(in_splits), "Out split size": _ranks_text(out_splits),
        "Global rank start": int(ranks[0]) if ranks else 0, "Global rank stride": int(stride),
        "Group size": int(size), "Process Group Name": group_name, "Process Group Description": group_desc,
        "Process Group Ranks": _ranks_text(ranks), "Rank": int(rank), "Seq": int(seq),
    }
    if peer is not None:
        args[peer[0]] = int(peer[1])
    return Span(f"{BACKEND_NAME}:{collective}", inputs, args)


class _Failed:
    """The value that stands for an error in an :class:`Outcome`'s source future."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _settle(source: Future) -> Any:
    value = source.value()
    if isinstance(value, _Failed):
        raise _fresh(value.error) from None
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


def _fresh(exc: BaseException) -> BaseException:
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
    shown = _fresh(exc)
    shown.args = (readable,) + tuple(exc.args[1:])
    return shown


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors of ``obj`` (a tensor or nested lists of them), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors_in(item)]
    return []


def _written(*outputs: Any) -> None:
    """Tell autograd that the backend writes these tensors in place (as torch's
    own in-place operations do), so a tensor saved for backward and then
    overwritten by a collective makes backward raise instead of using the new
    values."""
    tensors = [t for out in outputs for t in _tensors_in(out)]
    if tensors:
        increment_version(tensors)


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
        self._finished = False
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._outcome = Outcome()

    def complete(self, error: BaseException | None = None) -> None:
        """Finish the Work (once; later calls are ignored): with ``error``, or successfully."""
        with self._lock:
            if self._finished:
                return
            self._finished, self._error = True, error
        if self._span is not None:
            self._span.end()
        if error is None:
            self._outcome.set_result(self._result)
        else:
            self._outcome.set_exception(error)
        self._done.set()

    def wait(self, timeout: Any = None) -> bool:
        """Wait for the call (``timeout``: a timedelta or seconds; zero or None: until
        it completes, which every call does within its own timeout).

        Raises:
            CollectiveError: the call's error.
            CollectiveTimeout: ``timeout`` passed first (the call goes on).
        """
        seconds = _seconds(timeout)
        if not self._done.wait(seconds):
            raise CollectiveTimeout(f"Timed out: rank {self._rank}: {self._what} did not complete "
                                    f"within the wait's {seconds:.3g}s (it is still running)")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """True once the call succeeded or failed."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """True once the call completed without error."""
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        """The call's error (None while it runs or when it succeeded)."""
        return self._error

    def get_future(self) -> Future:
        """A future of the call's outputs; it fails when the call does."""
        return self._outcome.future

    def result(self) -> list[torch.Tensor]:
        """The call's output tensors (waits for the call; raises its error)."""
        self.wait()
        return _tensors_in(self._result)

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
        state = "pending" if not self._done.is_set() else "ok" if self._error is None else "failed"
        return f"CollectivesWork({self._what}, rank {self._rank}, {state})"


class _Staged:
    """Contiguous stand-ins for tensors that are not, copied back when done."""

    def __init__(self) -> None:
        self.copy_backs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def writable(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous():
            return t
        c = t.contiguous()
        self.copy_backs.append((t, c))
        return c

    @staticmethod
    def readable(t: torch.Tensor) -> torch.Tensor:
        return t if t.is_contiguous() else t.contiguous()

    def finish(self) -> None:
        for dst, src in self.copy_backs:
            dst.copy_(src)


def _check_cpu(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise BadArgument(f"the collectives backend takes CPU tensors, got one on {t.device}")


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view of a contiguous CPU tensor (bfloat16 as ml_dtypes.bfloat16)."""
    from collectives.buffers import flat

    return flat(t, writable=True, what="tensor")


def _user_tag(tag: Any) -> int:
    """A send/recv tag, checked: an integer in [0, 2**25)."""
    if not isinstance(tag, (int, np.integer)) or not 0 <= int(tag) < TAG_LIMIT:
        raise BadArgument(f"the collectives backend takes send/recv tags in [0, {TAG_LIMIT}), got {tag!r}")
    return int(tag)


class _Notices:
    """The notices that precede every message of the backend (see the module's
    docstring), received per sender and tag in the order receives ask for them.

    Every method is called holding the group's post lock.

    Args:
        comm: the group's communicator.
        timeout: the group's timeout (of the notices' receives), seconds.
    """

    def __init__(self, comm: Communicator, timeout: float) -> None:
        self._comm = comm
        self._timeout = timeout
        self._posted: dict[tuple[int, int], collections.deque] = {}

    def _post(self, peer: int, tag: int) -> Any:
        return self._comm.irecv(_NOTICE, peer, _NOTICE_TAG_BASE + tag, timeout=self._timeout)

    def take(self, peer: int, tag: int) -> Any:
        """The next notice from ``peer`` with ``tag`` (a receive posted earlier
        and not taken yet, or a new one)."""
        queue = self._posted.get((peer, tag))
        if queue:
            return queue.popleft()
        return self._post(peer, tag)

    def heads(self, tag: int) -> dict[int, Any]:
        """The next notice with ``tag`` from every peer, posting one where none is."""
        heads = {}
        for peer in range(self._comm.size):
            if peer == self._comm.rank:
                continue
            queue = self._posted.setdefault((peer, tag), collections.deque())
            if not queue:
                queue.append(self._post(peer, tag))
            heads[peer] = queue[0]
        return heads

    def claim(self, peer: int, tag: int, head: Any) -> bool:
        """Take ``head`` if it is still the next notice from ``peer`` with ``tag``."""
        queue = self._posted.get((peer, tag))
        if queue and queue[0] is head:
            queue.popleft()
            return True
        return False


class CollectivesProcessGroup(dist.ProcessGroup):
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
        self._alltoallv_seq = 0
        self._p2p_seq = 0
        self._monitored_seq = 0
        self._notices = _Notices(comm, self.timeout)

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
        return comms_span(event, _tensors_in(inputs), _tensors_in(outputs), rank=self.rank(), size=self.size(),
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
        _written(written)
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
        """Run ``body`` (which waits) in a thread; complete ``work`` after it."""
        def run() -> None:
            try:
                body()
            except BaseException as exc:
                self._fail(work, exc)
            else:
                self._finish(work, finish)

        threading.Thread(target=run, name=f"collectives-{work._what}", daemon=True).start()
        return work

    # ---------------------------------------------------------- collectives

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """``dist.all_reduce``: every tensor in place (sparse COO tensors: sum)."""
        _check_cpu(tensors)
        opts = opts if opts is not None else dist.AllreduceOptions()
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, opts)
        staged = _Staged()
        bufs = [staged.writable(t) for t in tensors]
        steps = [(lambda b=b: self.comm.iallreduce(as_numpy(b), reduce_op_name(opts.reduceOp, b.dtype)))
                 for b in bufs]
        return self._chain("allreduce", "all_reduce", steps, tensors, staged.finish, opts, tensors, inputs=tensors)

    def _sparse_allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        """Sum of sparse COO tensors: gather every rank's indices and values, add,
        coalesce, copy into the tensor (in the calling thread)."""
        if len(tensors) != 1 or not tensors[0].is_sparse:
            raise BadArgument("sparse all_reduce takes one sparse COO tensor")
        kind = opts.reduceOp.op if hasattr(opts.reduceOp, "op") else opts.reduceOp
        if kind != _RED.SUM:
            raise BadArgument(f"sparse all_reduce supports the sum only (as Gloo does), got {kind}")
        tensor = tensors[0]
        with self._lock:
            work = self._collective_work("sparse allreduce", "sparse_all_reduce", tensors, tensors, tensors)
            try:
                total = self._sparse_sum(tensor)
                _written(tensors)
                with torch.no_grad():
                    tensor.copy_(total)
            except BadArgument as exc:
                work.complete(exc)
                raise
            except BaseException as exc:
                self._fail(work, exc)
                return work
        work.complete()
        return work

    def _sparse_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The coalesced sum over the ranks of the sparse COO ``tensor``."""
        indices = tensor._indices().t().contiguous().to(torch.int64)   # nnz x sparse_dim
        values = tensor._values().contiguous()                          # nnz x dense shape
        nnz, sparse_dim = indices.shape[0], tensor.sparse_dim()
        dense = values.shape[1:]
        per_value = int(np.prod(dense)) if len(dense) else 1
        counts = torch.empty(self.size(), dtype=torch.int64)
        self.comm.allgather(np.array([nnz], np.int64), as_numpy(counts), timeout=self.timeout)
        nnzs = [int(c) for c in counts]
        all_indices = torch.empty((sum(nnzs), sparse_dim), dtype=torch.int64)
        all_values = torch.empty((sum(nnzs), *dense), dtype=values.dtype)
        self.comm.allgatherv(as_numpy(indices), as_numpy(all_indices), [n * sparse_dim for n in nnzs],
                             timeout=self.timeout)
        self.comm.allgatherv(as_numpy(values), as_numpy(all_values), [n * per_value for n in nnzs],
                             timeout=self.timeout)
        return torch.sparse_coo_tensor(all_indices.t(), all_values, tensor.shape).coalesce()

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """``dist.all_reduce_coalesced``: one allreduce per dtype over a flat copy."""
        _check_cpu(tensors)
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault(t.dtype, []).append(t)
        flats = {d: torch.cat([t.detach().reshape(-1) for t in ts]) for d, ts in groups.items()}

        def finish() -> None:
            for d, ts in groups.items():
                offset = 0
                for t in ts:
                    t.copy_(flats[d][offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

        steps = [(lambda f=f: self.comm.iallreduce(as_numpy(f), reduce_op_name(opts.reduceOp, f.dtype)))
                 for f in flats.values()]
        return self._chain("allreduce_coalesced", "all_reduce", steps, tensors, finish, opts, tensors,
                           inputs=tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """``dist.broadcast`` from ``opts.rootRank``."""
        _check_cpu(tensors)
        opts = opts if opts is not None else dist.BroadcastOptions()
        staged = _Staged()
        bufs = [staged.writable(t) for t in tensors]
        steps = [(lambda b=b: self.comm.ibcast(as_numpy(b), int(opts.rootRank))) for b in bufs]
        return self._chain("broadcast", "broadcast", steps, tensors, staged.finish, opts, tensors, inputs=tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """``dist.reduce`` to ``opts.rootRank``."""
        _check_cpu(tensors)
        opts = opts if opts is not None else dist.ReduceOptions()
        staged = _Staged()
        bufs = [staged.writable(t) for t in tensors]
        steps = [(lambda b=b: self.comm.ireduce(as_numpy(b), int(opts.rootRank),
                                                reduce_op_name(opts.reduceOp, b.dtype))) for b in bufs]
        return self._chain("reduce", "reduce", steps, tensors, staged.finish, opts, tensors, inputs=tensors)

    def _gather_into(self, output: torch.Tensor, input: torch.Tensor) -> Callable[[], Any]:
        out = output if output.is_contiguous() else None
        if out is None or out.dtype != input.dtype:
            raise BadArgument("all_gather_into_tensor needs a contiguous output of the input's dtype")
        if out.numel() != input.numel() * self.size():
            raise BadArgument(f"output holds {out.numel()} elements, expected {self.size()} x {input.numel()}")
        src = _Staged.readable(input)
        return lambda: self.comm.iallgather(as_numpy(src), as_numpy(out))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """``dist.all_gather_into_tensor``."""
        _check_cpu([output, input])
        return self._chain("all_gather_into_tensor", "all_gather_into_tensor", [self._gather_into(output, input)],
                           output, opts=opts, written=output, inputs=input)

    all_gather_single = _allgather_base

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> dist.Work:
        """Several ``all_gather_into_tensor`` calls as one Work."""
        _check_cpu(list(outputs) + list(inputs))
        return self._chain("all_gather_into_tensor_coalesced", "all_gather_into_tensor_coalesced",
                           [self._gather_into(o, i) for o, i in zip(outputs, inputs)], outputs,
                           opts=opts, written=outputs, inputs=inputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _gather_lists(self, what: str, per_rank: Sequence[Sequence[torch.Tensor]],
                      inputs: Sequence[torch.Tensor], result: Any, opts: Any) -> dist.Work:
        """Allgather each input into a flat buffer, then copy rank r's block of
        input i into ``per_rank[r][i]``."""
        _check_cpu(list(inputs))
        if len(per_rank) != self.size() or any(len(outs) != len(inputs) for outs in per_rank):
            raise BadArgument(f"{what} needs {self.size()} output lists (one per rank) of "
                              f"{len(inputs)} tensors each, got lists of {[len(o) for o in per_rank]}")
        steps, flats = [], []
        for inp in inputs:
            flat_out = torch.empty(self.size() * inp.numel(), dtype=inp.dtype)
            src = _Staged.readable(inp.detach())
            steps.append(lambda s=src, f=flat_out: self.comm.iallgather(as_numpy(s), as_numpy(f)))
            flats.append((flat_out, inp.numel()))

        def finish() -> None:
            for r, outs in enumerate(per_rank):
                for (flat_out, n), o in zip(flats, outs):
                    o.copy_(flat_out[r * n:(r + 1) * n].view_as(o))

        return self._chain(what, "all_gather", steps, result, finish, opts, per_rank, inputs=list(inputs))

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        """``dist.all_gather``: ``output_tensors[i][r]`` receives rank r's ``input_tensors[i]``."""
        if len(output_tensors) != len(input_tensors):
            raise BadArgument(f"all_gather: {len(output_tensors)} output lists for {len(input_tensors)} inputs")
        for outs in output_tensors:
            if len(outs) != self.size():
                raise BadArgument(f"all_gather needs {self.size()} output tensors, got {len(outs)}")
        per_rank = [[outs[r] for outs in output_tensors] for r in range(self.size())]
        return self._gather_lists("all_gather", per_rank, input_tensors, output_tensors, opts)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> dist.Work:
        """``dist.all_gather_coalesced``: ``output_lists[r][i]`` receives rank r's
        ``inputs[i]`` (as torch and Gloo lay it out)."""
        return self._gather_lists("all_gather_coalesced", output_lists, inputs, output_lists, opts)

    def _reduce_scatter_one(self, output: torch.Tensor, input: torch.Tensor, opts: Any,
                            staged: _Staged) -> Callable[[], Any]:
        if input.numel() != output.numel() * self.size():
            raise BadArgument(f"input holds {input.numel()} elements, expected {self.size()} x {output.numel()}")
        out = staged.writable(output)
        src = _Staged.readable(input)
        op = reduce_op_name(opts.reduceOp, input.dtype)
        return lambda: self.comm.ireduce_scatter(as_numpy(src), as_numpy(out), op)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """``dist.reduce_scatter_tensor``."""
        _check_cpu([output, input])
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        staged = _Staged()
        return self._chain("reduce_scatter_tensor", "reduce_scatter_tensor",
                           [self._reduce_scatter_one(output, input, opts, staged)],
                           output, staged.finish, opts, output, inputs=input)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        """Several ``reduce_scatter_tensor`` calls as one Work."""
        _check_cpu(list(outputs) + list(inputs))
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        staged = _Staged()
        steps = [self._reduce_scatter_one(o, i, opts, staged) for o, i in zip(outputs, inputs)]
        return self._chain("reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced", steps, outputs,
                           staged.finish, opts, outputs, inputs=inputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> dist.Work:
        """``dist.reduce_scatter``: the input lists concatenated, then reduce-scattered."""
        _check_cpu(output_tensors)
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        staged = _Staged()
        steps = []
        for out, ins in zip(output_tensors, input_tensors):
            if len(ins) != self.size():
                raise BadArgument(f"reduce_scatter needs {self.size()} input tensors, got {len(ins)}")
            flat_in = torch.cat([t.detach().reshape(-1) for t in ins])
            steps.append(self._reduce_scatter_one(out, flat_in, opts, staged))
        return self._chain("reduce_scatter", "reduce_scatter", steps, output_tensors, staged.finish, opts,
                           output_tensors, inputs=input_tensors)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> dist.Work:
        """``dist.all_to_all_single`` (splits along dim 0; even splits use alltoall)."""
        _check_cpu([output, input])
        p = self.size()
        row_in = input[0].numel() if input.dim() and input.shape[0] else 0
        row_out = output[0].numel() if output.dim() and output.shape[0] else 0
        staged = _Staged()
        out, src = staged.writable(output), _Staged.readable(input)
        if not output_split_sizes and not input_split_sizes:
            if input.numel() % p or output.numel() != input.numel():
                raise BadArgument(f"all_to_all_single: {input.numel()} elements do not split evenly over {p} ranks")
            return self._chain("all_to_all_single", "all_to_all",
                               [lambda: self.comm.ialltoall(as_numpy(src), as_numpy(out))],
                               output, staged.finish, opts, output, inputs=input)
        in_splits = list(input_split_sizes) or [input.shape[0] // p] * p
        out_splits = list(output_split_sizes) or [output.shape[0] // p] * p
        return self._alltoallv("all_to_all_single", out, src, [s * row_in for s in in_splits],
                               [s * row_out for s in out_splits], staged.finish, output, input,
                               in_splits=in_splits, out_splits=out_splits)

    all_to_all_single = alltoall_base

    def _alltoallv(self, what: str, out: torch.Tensor, src: torch.Tensor, send_counts: list[int],
                   recv_counts: list[int], finish: Callable[[], None] | None, written: Any, inputs: Any,
                   **extra: Any) -> dist.Work:
        """Uneven all-to-all of contiguous ``src`` into ``out``: pairwise
        point-to-point after the queued collectives (a barrier orders it)."""
        _written(written)
        work: CollectivesWork | None = None
        try:
            with self._lock:
                work = self._collective_work(what, "all_to_all", inputs, written, written, **extra)
                self._alltoallv_seq = (self._alltoallv_seq + 1) % TAG_LIMIT
                tag = _ALLTOALLV_TAG_BASE + self._alltoallv_seq
                barrier = self.comm.ibarrier()  # start after what is queued
        except BaseException as exc:
            work = work if work is not None else CollectivesWork(written, what, self.comm.rank)
            self._fail(work, exc)
            return work

        def exchange() -> None:
            barrier.wait()
            self._exchange_blocks(as_numpy(src), as_numpy(out), send_counts, recv_counts, tag)

        return self._in_thread(work, exchange, finish)

    def _exchange_blocks(self, src: np.ndarray, out: np.ndarray, send_counts: list[int],
                         recv_counts: list[int], tag: int) -> None:
        send_off = np.concatenate([[0], np.cumsum(send_counts)]).astype(int)
        recv_off = np.concatenate([[0], np.cumsum(recv_counts)]).astype(int)
        me = self.rank()
        out[recv_off[me]:recv_off[me + 1]] = src[send_off[me]:send_off[me + 1]]
        reqs = []
        for peer in range(self.size()):
            if peer == me:
                continue
            reqs.append(self.comm.irecv(out[recv_off[peer]:recv_off[peer + 1]], peer, tag, timeout=self.timeout))
            reqs.append(self.comm.isend(src[send_off[peer]:send_off[peer + 1]], peer, tag, timeout=self.timeout))
        for r in reqs:
            r.wait()

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        """``dist.all_to_all`` with lists of tensors."""
        _check_cpu(list(output_tensors) + list(input_tensors))
        flat_in = torch.cat([t.detach().reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=flat_in.dtype)
        send_counts = [t.numel() for t in input_tensors]
        recv_counts = [t.numel() for t in output_tensors]

        def scatter_out() -> None:
            offset = 0
            for t in output_tensors:
                t.copy_(flat_out[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

        if len(set(send_counts + recv_counts)) > 1:
            return self._alltoallv("all_to_all", flat_out, flat_in, send_counts, recv_counts, scatter_out,
                                   output_tensors, input_tensors, in_splits=send_counts, out_splits=recv_counts)
        return self._chain("all_to_all", "all_to_all",
                           [lambda: self.comm.ialltoall(as_numpy(flat_in), as_numpy(flat_out))],
                           output_tensors, scatter_out, opts, output_tensors, inputs=input_tensors)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> dist.Work:
        """``dist.gather`` to ``opts.rootRank``."""
        _check_cpu(input_tensors)
        opts = opts if opts is not None else dist.GatherOptions()
        root = int(opts.rootRank)
        inp = _Staged.readable(input_tensors[0])
        is_root = self.rank() == root
        flat_out = torch.empty(self.size() * inp.numel(), dtype=inp.dtype) if is_root else None

        def finish() -> None:
            if is_root:
                n = inp.numel()
                for i, o in enumerate(output_tensors[0]):
                    o.copy_(flat_out[i * n:(i + 1) * n].view_as(o))

        return self._chain("gather", "gather",
                           [lambda: self.comm.igather(as_numpy(inp), None if flat_out is None else as_numpy(flat_out),
                                                      root)],
                           output_tensors, finish, opts, output_tensors, inputs=input_tensors)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> dist.Work:
        """``dist.scatter`` from ``opts.rootRank``."""
        _check_cpu(output_tensors)
        opts = opts if opts is not None else dist.ScatterOptions()
        root = int(opts.rootRank)
        staged = _Staged()
        out = staged.writable(output_tensors[0])
        flat_in = (torch.cat([t.detach().reshape(-1) for t in input_tensors[0]])
                   if self.rank() == root else None)
        return self._chain("scatter", "scatter",
                           [lambda: self.comm.iscatter(None if flat_in is None else as_numpy(flat_in),
                                                       as_numpy(out), root)],
                           output_tensors, staged.finish, opts, output_tensors, inputs=input_tensors)

    def barrier(self, opts: Any = None) -> dist.Work:
        """``dist.barrier``."""
        return self._chain("barrier", "barrier", [lambda: self.comm.ibarrier()], None, opts=opts)

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
            arrive = _MONITORED_TAG_BASE + 2 * self._monitored_seq
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
            shown = _fresh(exc)
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

    # ------------------------------------------------------- point to point

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """``dist.send``/``isend`` to group rank ``dst`` (a notice, then the tensor)."""
        _check_cpu(tensors)
        tag, dst = _user_tag(tag), int(dst)
        src = _Staged.readable(tensors[0])

        def start() -> list[Any]:
            notice = self.comm.isend(_NOTICE, dst, _NOTICE_TAG_BASE + tag, timeout=self.timeout)
            return [notice, self.comm.isend(as_numpy(src), dst, tag, timeout=self.timeout)]

        return self._p2p(f"send to rank {dst}", "send", tensors, start, peer=("Dst Rank", dst))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        """``dist.recv``/``irecv`` from group rank ``src`` (its notice, then the tensor)."""
        _check_cpu(tensors)
        tag, src = _user_tag(tag), int(src)
        staged = _Staged()
        buf = staged.writable(tensors[0])
        _written(tensors)

        def start() -> list[Any]:
            if not 0 <= src < self.size() or src == self.rank():
                raise BadArgument(f"recv: rank {src} is not a peer of rank {self.rank()} "
                                  f"in a group of {self.size()}")
            notice = self._notices.take(src, tag)
            return [notice, self.comm.irecv(as_numpy(buf), src, tag, timeout=self.timeout)]

        return self._p2p(f"recv from rank {src}", "recv", tensors, start, staged.finish, source_rank=src,
                         peer=("Src Rank", src))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        """``dist.recv``/``irecv`` without ``src``: from whichever peer's message
        with ``tag`` comes first (``work._source_rank()`` names it)."""
        _check_cpu(tensors)
        tag = _user_tag(tag)
        staged = _Staged()
        buf = staged.writable(tensors[0])
        _written(tensors)
        with self._lock:
            work = self._p2p_work(f"recv from any source (tag {tag})", "recvAnySource", tensors)

        def receive() -> None:
            work.set_source_rank(self._receive_from_any(as_numpy(buf), tag))

        return self._in_thread(work, receive, staged.finish)

    def _receive_from_any(self, buf: np.ndarray, tag: int) -> int:
        """Receive into ``buf`` the message with ``tag`` of whichever peer's notice
        arrives first; return that peer."""
        deadline = time.monotonic() + self.timeout
        what = f"Timed out: rank {self.rank()}: recv from any source (tag {tag}) after {self.timeout:.3g}s"
        while True:
            with self._lock:
                heads = self._notices.heads(tag)
            wait_until(lambda: any(h.done() for h in heads.values()), deadline, what=what)
            with self._lock:
                for peer, head in heads.items():
                    if head.done() and self._notices.claim(peer, tag, head):
                        payload = self.comm.irecv(buf, peer, tag, timeout=max(deadline - time.monotonic(), 0.01))
                        break
                else:  # a named receive took that notice first
                    continue
            payload.wait()
            return peer

    def _p2p(self, what: str, event: str, tensors: list[torch.Tensor], start: Callable[[], list[Any]],
             finish: Callable[[], None] | None = None, source_rank: int | None = None,
             peer: tuple[str, int] | None = None) -> dist.Work:
        """Point-to-point requests as one Work; a thread waits for them unless they are done already."""
        work: CollectivesWork | None = None
        try:
            with self._lock:
                work = self._p2p_work(what, event, tensors, source_rank, peer)
                requests = start()
        except BadArgument as exc:
            if work is not None:
                work.complete(exc)
            raise
        except BaseException as exc:
            work = work if work is not None else CollectivesWork(tensors, what, self.comm.rank)
            self._fail(work, exc)
            return work
        try:
            done = all(r.done() for r in requests)
        except BaseException as exc:
            self._fail(work, exc)
            return work
        if not done:
            return self._in_thread(work, lambda: [r.wait() for r in requests], finish)
        self._finish(work, finish)
        return work

    # ------------------------------------------------------------- lifetime

    def shutdown(self) -> None:
        """Finish queued work and close the communicator (if this group owns it)."""
        if self._owns_comm:
            self.comm.close()

    def abort(self) -> None:
        """Make every peer's pending and future operations fail at once."""
        self.comm.abort("process group aborted")


def _agree_on_job(store: dist.Store, group_rank: int, timeout: float) -> tuple[str, str]:
    """A job id and secret shared by the group's ranks, published by group rank 0."""
    adapter = StoreAdapter(store)
    if group_rank == 0:
        adapter.set("collectives/job", f"pg-{secrets.token_hex(6)}:{secrets.token_hex(16)}")
    job, secret = adapter.get("collectives/job", timeout).decode().split(":")
    return job, secret


def _create_process_group(store: dist.Store, group_rank: int, group_size: int,
                          timeout: datetime.timedelta) -> CollectivesProcessGroup:
    """The creator registered with ``torch.distributed.Backend.register_backend``."""
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    job, secret = _agree_on_job(store, group_rank, seconds)
    options = {"secret": secret, "store": StoreAdapter(store), **_settings["options"]}
    comm = collectives.init(group_rank, group_size, transport=_settings["transport"], job=job,
                            timeout=seconds, **options)
    return CollectivesProcessGroup(comm, timeout=seconds)


def communicator_of(group: dist.ProcessGroup | None = None) -> Communicator:
    """The Communicator behind a process group of this backend (default: the world group).

    Raises:
        BadArgument: if the group does not use the collectives backend.
    """
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    if isinstance(group, CollectivesProcessGroup):
        return group.comm
    raise BadArgument(f"process group {group!r} does not use the {BACKEND_NAME!r} backend")


def adapter_span(comm: Communicator, collective: str, inputs: Sequence[torch.Tensor],
                 outputs: Sequence[torch.Tensor], seq: int, group: Any = None) -> Span | None:
    """The profiler span of a call that the DDP hooks or the optimizer wrapper
    post on ``comm`` (None when no profiler records); ``group``: the process
    group they serve, whose name, description and ranks the span carries
    when it is this backend's group of ``comm``."""
    if not profiling():
        return None
    if isinstance(group, CollectivesProcessGroup) and group.comm is comm:
        return group._span(collective, inputs, outputs, seq)
    return comms_span(collective, inputs, outputs, rank=comm.rank, size=comm.size, seq=seq,
                      group_desc="collectives communicator")


def _register() -> None:
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create_process_group, devices=["cpu"])


_register()
