"""The gradient buckets of :class:`~.torch_optimizer.DistributedOptimizer`.

Trainable parameters are grouped in reverse registration order (gradients
become ready roughly in that order during backward): a small first bucket,
then buckets up to a cap, one dtype per bucket. Each bucket is one flat
buffer (in the transport's shared memory when it has some) and the
parameters' ``.grad`` are views into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from collectives import Communicator, Handle

from .torch_profiling import Span

__all__ = ["MiB", "Bucket", "assign_buckets", "make_bucket"]

MiB = 1 << 20


@dataclass
class Bucket:
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


def assign_buckets(params: list[torch.nn.Parameter], first_cap: int, cap: int) -> list[list[torch.nn.Parameter]]:
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


def make_bucket(comm: Communicator, index: int, params: list[torch.nn.Parameter]) -> Bucket:
    """Bucket ``index`` of ``params``, in ``comm``'s memory: each ``p.grad`` becomes
    a view of the flat buffer, keeping its value (zero where it had none)."""
    offsets = np.concatenate([[0], np.cumsum([p.numel() for p in params])]).tolist()
    flat, storage = _buffer(comm, offsets[-1], params[0].dtype)
    bucket = Bucket(index, params, offsets, flat, storage)
    for k, p in enumerate(params):
        view = flat[offsets[k]:offsets[k + 1]].view_as(p)
        if p.grad is not None:
            view.copy_(p.grad)
        p.grad = view
        bucket.views.append(view)
    return bucket
