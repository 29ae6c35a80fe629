"""DDP communication hooks that allreduce gradient buckets with our library.

``model.register_comm_hook(HookState(), allreduce_hook)`` makes
``DistributedDataParallel`` hand each gradient bucket to
:meth:`~collectives.Communicator.iallreduce`; the bucket's future completes
from the communicator's worker thread, so communication overlaps the rest of
backward. (The bfloat16 hook is not called ``bf16_compress_hook``: DDP
refuses hooks of that name without CUDA.) DDP itself may run on any backend (Gloo included): only the
bucket allreduce goes through the hook's communicator.

``fp16_compress_hook`` and ``bfloat16_compress_hook`` send the bucket as
float16/bfloat16 (half the bytes; sums accumulate in float32) and write the
average back in the bucket's own dtype.

While a torch profiler records, each bucket's allreduce is a span
``collectives:all_reduce`` (see :mod:`.torch_profiling`).
"""

# No ``from __future__ import annotations`` here: DDP checks the hooks'
# annotations against the real classes.
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.futures import Future

import collectives
from collectives import Communicator

from .torch_backend import CollectivesProcessGroup
from .torch_posting import next_sequence, post_lock
from .torch_profiling import adapter_span
from .torch_tensors import as_numpy
from .torch_work import Outcome, for_torch

__all__ = ["HookState", "allreduce_hook", "fp16_compress_hook", "bfloat16_compress_hook"]


class HookState:
    """What the hooks need: the communicator the buckets are reduced on.

    Args:
        comm: a communicator; by default the one behind ``process_group``
            when it uses the collectives backend, else a new one from
            :func:`collectives.init` (created on first use).
        process_group: the group DDP uses (default: the world group).
    """

    def __init__(self, comm: Optional[Communicator] = None,
                 process_group: Optional[dist.ProcessGroup] = None) -> None:
        self._comm = comm
        self.process_group = process_group

    @property
    def comm(self) -> Communicator:
        """The communicator (resolved on first use)."""
        if self._comm is None:
            group = self.process_group
            if group is None and dist.is_initialized():
                group = dist.distributed_c10d._get_default_group()
            if isinstance(group, CollectivesProcessGroup):
                self._comm = group.comm
            else:
                self._comm = collectives.init()
        return self._comm


def _resolve(state: Any) -> Communicator:
    if isinstance(state, Communicator):
        return state
    if isinstance(state, HookState):
        return state.comm
    if state is None:
        return HookState().comm
    raise TypeError(f"hook state must be a HookState or a Communicator, got {type(state).__name__}")


def _group_of(state: Any) -> Any:
    """The process group a hook state serves (for profiler events)."""
    group = state.process_group if isinstance(state, HookState) else None
    if group is None and dist.is_initialized():
        group = dist.distributed_c10d._get_default_group()
    return group


def _allreduce_future(comm: Communicator, wire: torch.Tensor, result: torch.Tensor, group: Any = None) -> Future:
    """Sum ``wire`` over ranks; the future's value is ``result`` (``wire`` copied in
    when they differ), set from the communicator's worker thread. When the
    allreduce fails the future fails, so DDP's backward raises on this rank."""
    outcome = Outcome()
    span = None

    def done(handle: Any) -> None:
        if span is not None:
            span.end()
        err = handle.exception()
        if err is None and wire is not result:
            try:
                with torch.no_grad():
                    result.copy_(wire)
            except BaseException as exc:
                err = exc
        if err is not None:
            outcome.set_exception(for_torch(err))
        else:
            outcome.set_result(result)

    with post_lock(comm):
        span = adapter_span(comm, "all_reduce", [wire], [wire], next_sequence(comm), group)
        handle = comm.iallreduce(as_numpy(wire), "sum")
    handle.add_done_callback(done)
    return outcome.future


def allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a DDP gradient bucket over the ranks with our allreduce.

    Args:
        state: a :class:`HookState` or a :class:`~collectives.Communicator`.
        bucket: the bucket DDP hands to the hook.

    Returns:
        A future whose value is the averaged bucket tensor.
    """
    comm = _resolve(state)
    buf = bucket.buffer()
    buf.div_(comm.size)
    return _allreduce_future(comm, buf, buf, _group_of(state))


def _compress_hook(state: Any, bucket: dist.GradBucket, dtype: torch.dtype) -> Future:
    comm = _resolve(state)
    buf = bucket.buffer()
    wire = buf.to(dtype).div_(comm.size)
    return _allreduce_future(comm, wire, buf, _group_of(state))


def fp16_compress_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Like :func:`allreduce_hook`, sending the bucket as float16."""
    return _compress_hook(state, bucket, torch.float16)


def bfloat16_compress_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Like :func:`allreduce_hook`, sending the bucket as bfloat16."""
    return _compress_hook(state, bucket, torch.bfloat16)
