"""A bucketed, overlapped gradient allreduce around any torch optimizer (no DDP).

:class:`DistributedOptimizer` groups the trainable parameters into buckets
in reverse registration order (gradients become ready roughly in that order
during backward): a small first bucket, then buckets up to a cap, one dtype
per bucket. Each bucket is one flat buffer (in the transport's shared memory
when it has some) and the parameters' ``.grad`` are views into it, so
autograd accumulates straight into the buffer and nothing is copied.

A ``register_post_accumulate_grad_hook`` on every parameter counts the
bucket's gradients; once all are in, the bucket's nonblocking allreduce is
posted, so communication overlaps the rest of backward. Buckets are posted
strictly in bucket order, which is the same on every rank. ``step()`` posts
whatever is left (parameters that got no gradient on this rank count as
zero, on every rank alike), waits, and runs the wrapped optimizer.

While a torch profiler records, each bucket's allreduce is a span
``collectives:all_reduce`` (see :mod:`.torch_backend`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np
import torch

import collectives
from collectives import Communicator, Handle
from collectives.errors import BadArgument

from .torch_backend import Span, adapter_span, as_numpy, next_sequence, post_lock

__all__ = ["DistributedOptimizer"]

MiB = 1 << 20


@dataclass
class _Bucket:
    """One flat gradient buffer and the parameters whose ``.grad`` views it."""

    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor
    storage: Any = None  # keeps the shared-memory array alive
    views: list[torch.Tensor] = field(default_factory=list)
    waiting: int = 0
    handle: Handle | None = None
    span: Span | None = None

    def view_of(self, slot: int) -> torch.Tensor:
        return self.views[slot]


def _buffer(comm: Communicator, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
    """A zeroed flat tensor of ``numel`` x ``dtype``, in the transport's memory if it has some."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    try:
        raw = comm.zeros(nbytes, np.uint8)
    except Exception:  # a transport without its own memory
        return torch.zeros(numel, dtype=dtype), None
    return torch.from_numpy(raw).view(dtype), raw


def _assign_buckets(params: list[torch.nn.Parameter], first_cap: int, cap: int) -> list[list[torch.nn.Parameter]]:
    """Reverse order, one dtype per bucket; the first bucket of each dtype is capped at ``first_cap``."""
    open_buckets: dict[torch.dtype, list] = {}
    sizes: dict[torch.dtype, int] = {}
    started: set[torch.dtype] = set()
    done: list[list[torch.nn.Parameter]] = []
    for p in reversed(params):
        bucket = open_buckets.setdefault(p.dtype, [])
        bucket.append(p)
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel() * p.element_size()
        limit = cap if p.dtype in started else first_cap
        if sizes[p.dtype] >= limit:
            done.append(bucket)
            started.add(p.dtype)
            open_buckets[p.dtype], sizes[p.dtype] = [], 0
    done.extend(b for b in open_buckets.values() if b)
    return done


class DistributedOptimizer:
    """Averages gradients over the ranks, overlapped with backward, then steps ``optimizer``.

    Args:
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        named_parameters: the parameters in registration order (default: the
            optimizer's, in param-group order); names are only for messages.
        comm: the communicator (default: the one behind torch's default group
            when it uses the collectives backend, else :func:`collectives.init`).
        bucket_cap_mb: cap of every bucket but the first, MiB (like DDP's 25).
        first_bucket_cap_mb: cap of the first bucket, MiB (small, so that
            communication starts early).
        backward_passes_per_step: gradients are accumulated over this many
            backward passes before they are reduced.
        overlap: post each bucket as soon as it is ready (False: all at ``step``).
        op: ``"avg"`` (default) or ``"sum"``.

    Parameters that take no gradient (``requires_grad=False``) are left
    alone. ``zero_grad`` zeroes the buffers (gradients stay views, never
    None). Give learning-rate schedulers ``opt.optimizer``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None, *,
                 comm: Communicator | None = None, bucket_cap_mb: float = 25.0,
                 first_bucket_cap_mb: float = 1.0, backward_passes_per_step: int = 1,
                 overlap: bool = True, op: str = "avg") -> None:
        if backward_passes_per_step < 1:
            raise BadArgument(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self.optimizer = optimizer
        self.comm = comm if comm is not None else _default_comm()
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.overlap = overlap
        self.op = op
        params = self._trainable(optimizer, named_parameters)
        self._buckets = [self._make_bucket(i, ps) for i, ps in
                         enumerate(_assign_buckets(params, int(first_bucket_cap_mb * MiB), int(bucket_cap_mb * MiB)))]
        self._slot = {id(p): (b, k) for b in self._buckets for k, p in enumerate(b.params)}
        self._passes = {id(p): 0 for p in params}
        self._next = 0
        self._sync = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._reset_round()

    # --------------------------------------------------------------- setup

    @staticmethod
    def _trainable(optimizer: torch.optim.Optimizer, named: Any) -> list[torch.nn.Parameter]:
        if named is not None:
            candidates = [p for _, p in named]
        else:
            candidates = [p for g in optimizer.param_groups for p in g["params"]]
        seen: set[int] = set()
        params = []
        for p in candidates:
            if p.requires_grad and id(p) not in seen:
                if p.device.type != "cpu":
                    raise BadArgument(f"DistributedOptimizer takes CPU parameters, got one on {p.device}")
                seen.add(id(p))
                params.append(p)
        return params

    def _make_bucket(self, index: int, params: list[torch.nn.Parameter]) -> _Bucket:
        offsets = np.concatenate([[0], np.cumsum([p.numel() for p in params])]).tolist()
        flat, storage = _buffer(self.comm, offsets[-1], params[0].dtype)
        bucket = _Bucket(index, params, offsets, flat, storage)
        for k, p in enumerate(params):
            view = flat[offsets[k]:offsets[k + 1]].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            bucket.views.append(view)
        return bucket

    def _reset_round(self) -> None:
        for b in self._buckets:
            b.waiting, b.handle, b.span = len(b.params), None, None
        for k in self._passes:
            self._passes[k] = 0
        self._next = 0

    # ----------------------------------------------------------- the hooks

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        bucket, k = self._slot[id(p)]
        view = bucket.view_of(k)
        if not _is_view(p, view):
            self._adopt(p, view)
        if not self._sync:
            return
        self._passes[id(p)] += 1
        if self._passes[id(p)] < self.backward_passes_per_step:
            return
        if bucket.handle is not None or self._passes[id(p)] > self.backward_passes_per_step:
            raise BadArgument("gradients were computed more often than backward_passes_per_step "
                              f"({self.backward_passes_per_step}) before step(); call step() or use no_sync()")
        bucket.waiting -= 1
        if bucket.waiting == 0 and self.overlap:
            self._post_ready()

    @staticmethod
    def _adopt(p: torch.nn.Parameter, view: torch.Tensor) -> None:
        """Make ``p.grad`` the bucket view again (after someone set it to a new tensor)."""
        if p.grad is None:
            view.zero_()
        else:
            view.copy_(p.grad)
        p.grad = view

    def _post(self, bucket: _Bucket) -> None:
        with post_lock(self.comm):
            bucket.span = adapter_span(self.comm, "all_reduce", [bucket.flat], [bucket.flat],
                                       next_sequence(self.comm), _default_group())
            bucket.handle = self.comm.iallreduce(as_numpy(bucket.flat), self.op)
        if bucket.span is not None:
            span = bucket.span
            bucket.handle.add_done_callback(lambda handle: span.end())

    def _post_ready(self) -> None:
        """Post the ready buckets in bucket order (the same order on every rank)."""
        while self._next < len(self._buckets) and self._buckets[self._next].waiting == 0:
            self._post(self._buckets[self._next])
            self._next += 1

    # ---------------------------------------------------------- public API

    def synchronize(self) -> None:
        """Post every bucket not yet posted and wait for all of them.

        Gradients missing on this rank (parameter unused in this step) count as zero.
        """
        for bucket in self._buckets[self._next:]:
            for k, p in enumerate(bucket.params):
                if not _is_view(p, bucket.views[k]):
                    self._adopt(p, bucket.views[k])
            bucket.waiting = 0
        self._post_ready()
        try:
            for bucket in self._buckets:
                bucket.handle.wait()
                if bucket.span is not None:
                    bucket.span.end()
        finally:
            self._reset_round()

    def step(self, closure: Any = None) -> Any:
        """Average the gradients over the ranks, then step the wrapped optimizer."""
        self.synchronize()
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers (gradients stay views into them; ``set_to_none`` is ignored)."""
        for bucket in self._buckets:
            if bucket.handle is not None and not bucket.handle.done():
                bucket.handle.wait()
            bucket.flat.zero_()
            for k, p in enumerate(bucket.params):
                p.grad = bucket.views[k]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally in this context; the next backward outside it reduces them."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    @property
    def bucket_sizes(self) -> list[int]:
        """Number of elements of each bucket, in bucket order."""
        return [b.flat.numel() for b in self._buckets]

    def remove_hooks(self) -> None:
        """Unregister the gradient hooks (the wrapper stops reducing)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, buckets={len(self._buckets)}, "
                f"comm={self.comm!r})")


def _is_view(p: torch.nn.Parameter, view: torch.Tensor) -> bool:
    return p.grad is not None and p.grad.data_ptr() == view.data_ptr()


def _default_group() -> Any:
    """torch's default process group, if there is one (for profiler events)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_group()
    return None


def _default_comm() -> Communicator:
    import torch.distributed as dist

    from .torch_backend import CollectivesProcessGroup

    if dist.is_available() and dist.is_initialized():
        group = dist.distributed_c10d._get_default_group()
        if isinstance(group, CollectivesProcessGroup):
            return group.comm
    return collectives.init()
