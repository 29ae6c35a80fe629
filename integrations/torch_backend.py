"""A ``torch.distributed`` backend named ``"collectives"``.

After ``import collectives.integrations.torch``,
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
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import secrets
import threading
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version
from torch.futures import Future

import collectives
from collectives import Communicator
from collectives.errors import BadArgument, CollectiveTimeout

__all__ = ["BACKEND_NAME", "CollectivesProcessGroup", "CollectivesWork", "configure", "communicator_of",
           "reduce_op_name", "StoreAdapter", "post_lock", "as_numpy", "Outcome", "for_torch"]

BACKEND_NAME = "collectives"
_ALLTOALLV_TAG_BASE = 1 << 26
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

_locks: "weakref.WeakKeyDictionary[Communicator, threading.Lock]" = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def post_lock(comm: Communicator) -> threading.Lock:
    """The lock held while posting to ``comm``, shared by every adapter of it, so
    that calls from several threads (autograd, hooks, the main loop) take their
    sequence numbers one at a time."""
    with _locks_guard:
        lock = _locks.get(comm)
        if lock is None:
            lock = _locks[comm] = threading.Lock()
        return lock


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


def for_torch(exc: BaseException) -> BaseException:
    """``exc`` as the backend reports it: a timeout (this rank's, or a peer's
    that reached it through an abort) as a copy whose message starts with
    ``Timed out`` (the words torch's users and tests look for); any other
    error as it is."""
    if not isinstance(exc, CollectiveTimeout) or not exc.args or "Timed out" in str(exc.args[0]):
        return exc
    shown = _fresh(exc)
    shown.args = (f"Timed out: {exc.args[0]}",) + tuple(exc.args[1:])
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
        source_rank: the sender, for a receive.
    """

    def __init__(self, result: Any, what: str, rank: int, source_rank: int | None = None) -> None:
        super().__init__()
        self._result = result
        self._what = what
        self._rank = rank
        self._source_rank = source_rank
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
        """The sender of a receive."""
        if self._source_rank is None:
            raise BadArgument(f"{self._what}: source_rank is defined for receives only")
        return self._source_rank

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
        self._alltoallv_seq = 0

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

    def __repr__(self) -> str:
        return f"CollectivesProcessGroup(rank={self.comm.rank}, size={self.comm.size}, comm={self.comm!r})"

    # ----------------------------------------------------------- machinery

    def _new_work(self, what: str, result: Any, source_rank: int | None = None) -> CollectivesWork:
        return CollectivesWork(result, what, self.comm.rank, source_rank)

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

    def _chain(self, what: str, steps: Sequence[Callable[[], Any]], result: Any,
               finish: Callable[[], None] | None = None, opts: Any = None, written: Any = ()) -> CollectivesWork:
        """Post several nonblocking collectives back to back; one Work for all.

        Args:
            what: the call, for messages.
            steps: each posts one collective and returns its handle.
            result: the Work's value.
            finish: copies results into the caller's tensors once all succeeded.
            opts: the call's options; when they say it blocks (``asyncOp``
                false), the steps run in this thread if nothing else is pending.
            written: the caller's tensors the call writes in place.

        Raises:
            BadArgument: the call's arguments were refused (before anything
                was sent). Every other error fails the returned Work.
        """
        work = self._new_work(what, result)
        _written(written)
        blocking = getattr(opts, "asyncOp", True) is False
        try:
            with self._lock, (self.comm.eager() if blocking else contextlib.nullcontext()):
                handles = [s() for s in steps]
        except BadArgument:
            raise
        except BaseException as exc:  # e.g. the communicator broke earlier
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
        """``dist.all_reduce``: every tensor in place."""
        _check_cpu(tensors)
        opts = opts if opts is not None else dist.AllreduceOptions()
        staged = _Staged()
        bufs = [staged.writable(t) for t in tensors]
        steps = [(lambda b=b: self.comm.iallreduce(as_numpy(b), reduce_op_name(opts.reduceOp, b.dtype)))
                 for b in bufs]
        return self._chain("allreduce", steps, tensors, staged.finish, opts, tensors)

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
        return self._chain("allreduce_coalesced", steps, tensors, finish, opts, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """``dist.broadcast`` from ``opts.rootRank``."""
        _check_cpu(tensors)
        opts = opts if opts is not None else dist.BroadcastOptions()
        staged = _Staged()
        bufs = [staged.writable(t) for t in tensors]
        steps = [(lambda b=b: self.comm.ibcast(as_numpy(b), int(opts.rootRank))) for b in bufs]
        return self._chain("broadcast", steps, tensors, staged.finish, opts, tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """``dist.reduce`` to ``opts.rootRank``."""
        _check_cpu(tensors)
        opts = opts if opts is not None else dist.ReduceOptions()
        staged = _Staged()
        bufs = [staged.writable(t) for t in tensors]
        steps = [(lambda b=b: self.comm.ireduce(as_numpy(b), int(opts.rootRank),
                                                reduce_op_name(opts.reduceOp, b.dtype))) for b in bufs]
        return self._chain("reduce", steps, tensors, staged.finish, opts, tensors)

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
        return self._chain("all_gather_into_tensor", [self._gather_into(output, input)], output,
                           opts=opts, written=output)

    all_gather_single = _allgather_base

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> dist.Work:
        """Several ``all_gather_into_tensor`` calls as one Work."""
        _check_cpu(list(outputs) + list(inputs))
        return self._chain("all_gather_into_tensor_coalesced",
                           [self._gather_into(o, i) for o, i in zip(outputs, inputs)], outputs,
                           opts=opts, written=outputs)

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

        return self._chain(what, steps, result, finish, opts, per_rank)

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
        return self._chain("reduce_scatter_tensor", [self._reduce_scatter_one(output, input, opts, staged)],
                           output, staged.finish, opts, output)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        """Several ``reduce_scatter_tensor`` calls as one Work."""
        _check_cpu(list(outputs) + list(inputs))
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        staged = _Staged()
        steps = [self._reduce_scatter_one(o, i, opts, staged) for o, i in zip(outputs, inputs)]
        return self._chain("reduce_scatter_tensor_coalesced", steps, outputs, staged.finish, opts, outputs)

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
        return self._chain("reduce_scatter", steps, output_tensors, staged.finish, opts, output_tensors)

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
            return self._chain("all_to_all_single", [lambda: self.comm.ialltoall(as_numpy(src), as_numpy(out))],
                               output, staged.finish, opts, output)
        in_splits = list(input_split_sizes) or [input.shape[0] // p] * p
        out_splits = list(output_split_sizes) or [output.shape[0] // p] * p
        work = self._new_work("all_to_all_single", output)
        return self._alltoallv(work, out, src, [s * row_in for s in in_splits],
                               [s * row_out for s in out_splits], staged.finish, output)

    all_to_all_single = alltoall_base

    def _alltoallv(self, work: CollectivesWork, out: torch.Tensor, src: torch.Tensor, send_counts: list[int],
                   recv_counts: list[int], finish: Callable[[], None] | None, written: Any) -> dist.Work:
        """Uneven all-to-all of contiguous ``src`` into ``out``: pairwise
        point-to-point after the queued collectives (a barrier orders it)."""
        _written(written)
        try:
            with self._lock:
                self._alltoallv_seq = (self._alltoallv_seq + 1) % _ALLTOALLV_TAG_BASE
                tag = _ALLTOALLV_TAG_BASE + self._alltoallv_seq
                barrier = self.comm.ibarrier()  # start after what is queued
        except BaseException as exc:
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
            work = self._new_work("all_to_all", output_tensors)
            return self._alltoallv(work, flat_out, flat_in, send_counts, recv_counts, scatter_out, output_tensors)
        return self._chain("all_to_all", [lambda: self.comm.ialltoall(as_numpy(flat_in), as_numpy(flat_out))],
                           output_tensors, scatter_out, opts, output_tensors)

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

        return self._chain("gather", [lambda: self.comm.igather(as_numpy(inp), None if flat_out is None
                                                                  else as_numpy(flat_out), root)],
                           output_tensors, finish, opts, output_tensors)

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
        return self._chain("scatter", [lambda: self.comm.iscatter(None if flat_in is None else as_numpy(flat_in),
                                                                  as_numpy(out), root)],
                           output_tensors, staged.finish, opts, output_tensors)

    def barrier(self, opts: Any = None) -> dist.Work:
        """``dist.barrier``."""
        return self._chain("barrier", [lambda: self.comm.ibarrier()], None, opts=opts)

    # ------------------------------------------------------- point to point

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """``dist.send``/``isend`` to group rank ``dst``."""
        _check_cpu(tensors)
        src = _Staged.readable(tensors[0])
        return self._p2p(self._new_work(f"send to rank {dst}", tensors),
                         lambda: self.comm.isend(as_numpy(src), int(dst), int(tag), timeout=self.timeout))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        """``dist.recv``/``irecv`` from group rank ``src``."""
        _check_cpu(tensors)
        staged = _Staged()
        buf = staged.writable(tensors[0])
        _written(tensors)
        return self._p2p(self._new_work(f"recv from rank {src}", tensors, int(src)),
                         lambda: self.comm.irecv(as_numpy(buf), int(src), int(tag), timeout=self.timeout),
                         staged.finish)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        raise BadArgument("the collectives backend cannot receive from any source; name the sender")

    def _p2p(self, work: CollectivesWork, start: Callable[[], Any],
             finish: Callable[[], None] | None = None) -> dist.Work:
        """A point-to-point request; a thread waits for it unless it is done already."""
        try:
            with self._lock:
                request = start()
        except BadArgument:
            raise
        except BaseException as exc:
            self._fail(work, exc)
            return work
        if not request.done():
            return self._in_thread(work, request.wait, finish)
        try:
            request.wait()
        except BaseException as exc:
            self._fail(work, exc)
        else:
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


def _register() -> None:
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create_process_group, devices=["cpu"])


_register()
