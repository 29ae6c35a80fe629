"""A ``torch.distributed`` backend named ``"collectives"``.

After ``import collectives.integrations.torch``,
``torch.distributed.init_process_group(backend="collectives")`` builds a
:class:`CollectivesProcessGroup`: a Python subclass of
``torch.distributed.ProcessGroup`` whose collectives run on a
:class:`~collectives.Communicator`. Every collective is posted to the
communicator's FIFO lane (its nonblocking form), so every rank runs them in
call order, and returns a ``Work`` made from a ``torch.futures.Future``
whose value is the list of output tensors. ``send``/``recv`` go straight to
the transport with their own tags.

The ranks of a group agree on a job id through the store torch hands to the
backend (under torchrun, the agent's store on MASTER_PORT), so ``new_group``
works the same way. The transport is chosen as :func:`collectives.init`
chooses it (``COLLECTIVES_TRANSPORT`` overrides), or by :func:`configure`.
"""

from __future__ import annotations

import datetime
import secrets
import threading
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

import collectives
from collectives import Communicator
from collectives.errors import BadArgument

__all__ = ["BACKEND_NAME", "CollectivesProcessGroup", "configure", "communicator_of",
           "reduce_op_name", "StoreAdapter", "post_lock", "as_numpy"]

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


def _completed(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _work(fut: Future) -> dist.Work:
    return torch._C._distributed_c10d._create_work_from_future(fut)


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

    def _post(self, start: Callable[[], Any], result: Any, finish: Callable[[], None] | None = None) -> dist.Work:
        """Post one nonblocking collective; its Work completes with ``result``."""
        fut: Future = Future()

        def done(handle: Any) -> None:
            err = handle.exception()
            if err is None and finish is not None:
                try:
                    finish()
                except BaseException as exc:  # delivered to the waiter
                    err = exc
            if err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(result)

        with self._lock:
            handle = start()
        handle.add_done_callback(done)
        return _work(fut)

    def _chain(self, steps: Sequence[Callable[[], Any]], result: Any,
               finish: Callable[[], None] | None = None, opts: Any = None) -> dist.Work:
        """Post several nonblocking collectives back to back; one Work for all.
        When ``opts`` says the call is blocking (``asyncOp`` false), they run
        in this thread if nothing else is pending."""
        if not steps:
            if finish is not None:
                finish()
            return _work(_completed(result))
        eager = getattr(opts, "asyncOp", True) is False
        with self._lock:
            if eager:
                with self.comm.eager():
                    handles = [s() for s in steps]
            else:
                handles = [s() for s in steps]
        return self._post(lambda: handles[-1], result, finish)

    # ---------------------------------------------------------- collectives

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """``dist.all_reduce``: every tensor in place."""
        _check_cpu(tensors)
        opts = opts if opts is not None else dist.AllreduceOptions()
        staged = _Staged()
        bufs = [staged.writable(t) for t in tensors]
        steps = [(lambda b=b: self.comm.iallreduce(as_numpy(b), reduce_op_name(opts.reduceOp, b.dtype)))
                 for b in bufs]
        return self._chain(steps, tensors, staged.finish, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """``dist.all_reduce_coalesced``: one allreduce per dtype over a flat copy."""
        _check_cpu(tensors)
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault(t.dtype, []).append(t)
        flats = {d: torch.cat([t.reshape(-1) for t in ts]) for d, ts in groups.items()}

        def finish() -> None:
            for d, ts in groups.items():
                offset = 0
                for t in ts:
                    t.copy_(flats[d][offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

        steps = [(lambda f=f: self.comm.iallreduce(as_numpy(f), reduce_op_name(opts.reduceOp, f.dtype)))
                 for f in flats.values()]
        return self._chain(steps, tensors, finish, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """``dist.broadcast`` from ``opts.rootRank``."""
        _check_cpu(tensors)
        opts = opts if opts is not None else dist.BroadcastOptions()
        staged = _Staged()
        bufs = [staged.writable(t) for t in tensors]
        steps = [(lambda b=b: self.comm.ibcast(as_numpy(b), int(opts.rootRank))) for b in bufs]
        return self._chain(steps, tensors, staged.finish, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """``dist.reduce`` to ``opts.rootRank``."""
        _check_cpu(tensors)
        opts = opts if opts is not None else dist.ReduceOptions()
        staged = _Staged()
        bufs = [staged.writable(t) for t in tensors]
        steps = [(lambda b=b: self.comm.ireduce(as_numpy(b), int(opts.rootRank),
                                                reduce_op_name(opts.reduceOp, b.dtype))) for b in bufs]
        return self._chain(steps, tensors, staged.finish, opts)

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
        return self._chain([self._gather_into(output, input)], output)

    all_gather_single = _allgather_base

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> dist.Work:
        """Several ``all_gather_into_tensor`` calls as one Work."""
        _check_cpu(list(outputs) + list(inputs))
        return self._chain([self._gather_into(o, i) for o, i in zip(outputs, inputs)], outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        """``dist.all_gather``: into a flat buffer, then copied into the output lists."""
        _check_cpu(input_tensors)
        steps, copies = [], []
        for outs, inp in zip(output_tensors, input_tensors):
            if len(outs) != self.size():
                raise BadArgument(f"all_gather needs {self.size()} output tensors, got {len(outs)}")
            flat_out = torch.empty(self.size() * inp.numel(), dtype=inp.dtype)
            src = _Staged.readable(inp)
            steps.append(lambda s=src, f=flat_out: self.comm.iallgather(as_numpy(s), as_numpy(f)))
            copies.append((outs, flat_out, inp.numel()))

        def finish() -> None:
            for outs, flat_out, n in copies:
                for i, o in enumerate(outs):
                    o.copy_(flat_out[i * n:(i + 1) * n].view_as(o))

        return self._chain(steps, output_tensors, finish)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> dist.Work:
        """``dist.all_gather_coalesced``."""
        return self.allgather(output_lists, inputs, opts)

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
        return self._chain([self._reduce_scatter_one(output, input, opts, staged)], output, staged.finish, opts)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        """Several ``reduce_scatter_tensor`` calls as one Work."""
        _check_cpu(list(outputs) + list(inputs))
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        staged = _Staged()
        steps = [self._reduce_scatter_one(o, i, opts, staged) for o, i in zip(outputs, inputs)]
        return self._chain(steps, outputs, staged.finish, opts)

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
            flat_in = torch.cat([t.reshape(-1) for t in ins])
            steps.append(self._reduce_scatter_one(out, flat_in, opts, staged))
        return self._chain(steps, output_tensors, staged.finish, opts)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> dist.Work:
        """``dist.all_to_all_single`` (splits along dim 0; even splits use alltoall)."""
        _check_cpu([output, input])
        p = self.size()
        row_in = input[0].numel() if input.dim() and input.shape[0] else 0
        row_out = output[0].numel() if output.dim() and output.shape[0] else 0
        if not output_split_sizes and not input_split_sizes:
            if input.numel() % p or output.numel() != input.numel():
                raise BadArgument(f"all_to_all_single: {input.numel()} elements do not split evenly over {p} ranks")
            staged = _Staged()
            out, src = staged.writable(output), _Staged.readable(input)
            return self._chain([lambda: self.comm.ialltoall(as_numpy(src), as_numpy(out))], output, staged.finish, opts)
        in_splits = list(input_split_sizes) or [input.shape[0] // p] * p
        out_splits = list(output_split_sizes) or [output.shape[0] // p] * p
        return self._alltoallv(output, input, [s * row_in for s in in_splits],
                               [s * row_out for s in out_splits])

    all_to_all_single = alltoall_base

    def _alltoallv(self, output: torch.Tensor, input: torch.Tensor, send_counts: list[int],
                   recv_counts: list[int]) -> dist.Work:
        """Uneven all-to-all: pairwise point-to-point after the queued collectives."""
        staged = _Staged()
        out, src = staged.writable(output), _Staged.readable(input)
        with self._lock:
            self._alltoallv_seq = (self._alltoallv_seq + 1) % _ALLTOALLV_TAG_BASE
            tag = _ALLTOALLV_TAG_BASE + self._alltoallv_seq
            barrier = self.comm.ibarrier()  # start after what is queued
        fut: Future = Future()

        def exchange(_: Any) -> None:
            try:
                barrier.wait()
                self._exchange_blocks(as_numpy(src), as_numpy(out), send_counts, recv_counts, tag)
                staged.finish()
            except BaseException as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(output)

        threading.Thread(target=exchange, args=(None,), daemon=True).start()
        return _work(fut)

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
        flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=flat_in.dtype)
        send_counts = [t.numel() for t in input_tensors]
        recv_counts = [t.numel() for t in output_tensors]

        work = (self._alltoallv(flat_out, flat_in, send_counts, recv_counts)
                if len(set(send_counts + recv_counts)) > 1
                else self._chain([lambda: self.comm.ialltoall(as_numpy(flat_in), as_numpy(flat_out))], flat_out))

        def scatter_out(fut: Future) -> list[torch.Tensor]:
            fut.value()
            offset = 0
            for t in output_tensors:
                t.copy_(flat_out[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            return output_tensors

        return _work(work.get_future().then(scatter_out))

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

        return self._chain([lambda: self.comm.igather(as_numpy(inp), None if flat_out is None else as_numpy(flat_out), root)],
                           output_tensors, finish, opts)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> dist.Work:
        """``dist.scatter`` from ``opts.rootRank``."""
        _check_cpu(output_tensors)
        opts = opts if opts is not None else dist.ScatterOptions()
        root = int(opts.rootRank)
        staged = _Staged()
        out = staged.writable(output_tensors[0])
        flat_in = (torch.cat([t.reshape(-1) for t in input_tensors[0]])
                   if self.rank() == root else None)
        return self._chain([lambda: self.comm.iscatter(None if flat_in is None else as_numpy(flat_in), as_numpy(out), root)],
                           output_tensors, staged.finish, opts)

    def barrier(self, opts: Any = None) -> dist.Work:
        """``dist.barrier``."""
        return self._chain([lambda: self.comm.ibarrier()], None, opts=opts)

    # ------------------------------------------------------- point to point

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """``dist.send``/``isend`` to group rank ``dst``."""
        _check_cpu(tensors)
        src = _Staged.readable(tensors[0])
        return self._p2p(lambda: self.comm.isend(as_numpy(src), int(dst), int(tag), timeout=self.timeout), tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        """``dist.recv``/``irecv`` from group rank ``src``."""
        _check_cpu(tensors)
        staged = _Staged()
        buf = staged.writable(tensors[0])
        return self._p2p(lambda: self.comm.irecv(as_numpy(buf), int(src), int(tag), timeout=self.timeout),
                         tensors, staged.finish)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        raise BadArgument("the collectives backend cannot receive from any source; name the sender")

    def _p2p(self, start: Callable[[], Any], result: Any, finish: Callable[[], None] | None = None) -> dist.Work:
        """A point-to-point request completed by a waiter thread (its Work is a future)."""
        with self._lock:
            request = start()
        fut: Future = Future()

        def wait() -> None:
            try:
                request.wait()
                if finish is not None:
                    finish()
            except BaseException as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        if request.done():
            wait()
        else:
            threading.Thread(target=wait, daemon=True).start()
        return _work(fut)

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
