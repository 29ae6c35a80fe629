"""Profiler spans of the torch adapters' calls.

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
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any, Sequence

import torch
from torch._C._profiler import _RecordFunctionFast

from collectives import Communicator

from .torch import BACKEND_NAME

__all__ = ["profiling", "Span", "comms_span", "adapter_span"]

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


def adapter_span(comm: Communicator, collective: str, inputs: Sequence[torch.Tensor],
                 outputs: Sequence[torch.Tensor], seq: int, group: Any = None) -> Span | None:
    """The profiler span of a call that the DDP hooks or the optimizer wrapper
    post on ``comm`` (None when no profiler records); ``group``: the process
    group they serve, whose name, description and ranks the span carries
    when it is this backend's group of ``comm``."""
    if not profiling():
        return None
    from .torch_backend import CollectivesProcessGroup  # it imports this module

    if isinstance(group, CollectivesProcessGroup) and group.comm is comm:
        return group._span(collective, inputs, outputs, seq)
    return comms_span(collective, inputs, outputs, rank=comm.rank, size=comm.size, seq=seq,
                      group_desc="collectives communicator")
