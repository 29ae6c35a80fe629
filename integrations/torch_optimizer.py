"""A bucketed, overlapped gradient allreduce around any torch optimizer (no DDP).

:class:`DistributedOptimizer` groups the trainable parameters into buckets
in reverse registration order (gradients become ready roughly in that order
during backward): a small first bucket, then buckets up to a cap, one dtype
per bucket (:mod:`.torch_buckets`). Each bucket is one flat buffer (in the transport's shared memory
when it has some) and the parameters' ``.grad`` are views into it, so
autograd accumulates straight into the buffer and nothing is copied.

A ``register_post_accumulate_grad_hook`` on every parameter counts the
bucket's gradients; once all are in, the bucket's nonblocking allreduce is
posted, so communication overlaps the rest of backward. Buckets are posted
strictly in bucket order, which is the same on every rank. ``step()`` posts
whatever is left (parameters that got no gradient on this rank count as
zero, on every rank alike), waits, and runs the wrapped optimizer.

After a lost rank, :meth:`~DistributedOptimizer.shrink` moves the wrapper
to the survivors' communicator (its pending allreduces on the old one are
waited for within a bound and dropped, its buckets move into the new
communicator's memory) and :meth:`~DistributedOptimizer.broadcast_state`
gives every survivor the same parameters and optimizer state; see
``examples/elastic_torch.py``.

While a torch profiler records, each bucket's allreduce is a span
``collectives:all_reduce`` (see :mod:`.torch_profiling`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from typing import Any, Iterable, Iterator

import numpy as np
import torch

import collectives
from collectives import Communicator, Handle
from collectives.errors import BadArgument, CollectiveError

from .torch_buckets import MiB, Bucket, assign_buckets, make_bucket
from .torch_posting import next_sequence, post_lock
from .torch_profiling import adapter_span
from .torch_tensors import Staged, as_numpy

__all__ = ["DistributedOptimizer"]

log = logging.getLogger("collectives")


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

    Errors of the allreduces (``PeerLost`` when a rank died) are raised by
    ``step``/``synchronize``, or by ``backward`` when a bucket is posted on
    a communicator that is already aborted.
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
        self._buckets = [make_bucket(self.comm, i, ps) for i, ps in
                         enumerate(assign_buckets(params, int(first_bucket_cap_mb * MiB), int(bucket_cap_mb * MiB)))]
        self._slot = {id(p): (b, k) for b in self._buckets for k, p in enumerate(b.params)}
        self._passes = {id(p): 0 for p in params}
        self._next = 0
        self._sync = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._unfinished: list[Handle] = []  # allreduces of rounds that failed, not done yet
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

    def _post(self, bucket: Bucket) -> None:
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
        try:
            self._post_ready()
            for bucket in self._buckets:
                bucket.handle.wait()
                if bucket.span is not None:
                    bucket.span.end()
        finally:
            self._keep_unfinished()
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

    # ---------------------------------------------------- after a lost rank

    def shrink(self, *, timeout: float | None = None) -> Communicator:
        """Go on with the surviving ranks after a failure (``PeerLost``): drop
        the work still pending on the current communicator, shrink it
        (collective over the survivors, see
        :meth:`~collectives.Communicator.shrink`), :meth:`rebind` to the new
        communicator and close the old one. Then call :meth:`broadcast_state`
        and redo the step that failed. Only the wrapper moves: a torch process
        group over the old communicator is not rebuilt.

        Args:
            timeout: bound of the wait for the pending work and of the shrink,
                seconds (default: the communicator's timeout).

        Returns:
            The new communicator (``comm.rank``, ``comm.size``, ``comm.epoch``).

        Raises:
            As :meth:`~collectives.Communicator.shrink`; the wrapper then stays
            on the old communicator.
        """
        old = self.comm
        self._drop_pending(timeout)
        new = old.shrink(timeout=timeout)
        self.rebind(new, timeout=0.0)
        try:
            old.close()
        except CollectiveError as exc:  # the old communicator's last word; it is left behind
            log.info("rank %d: closing the communicator left by the shrink: %s", new.rank, exc)
        return new

    def rebind(self, comm: Communicator, *, timeout: float | None = None) -> None:
        """Continue on ``comm`` (e.g. a shrunk communicator): wait at most
        ``timeout`` seconds (default: the current communicator's timeout) for
        the allreduces still pending on the current communicator, ignoring
        their errors, then move the gradient buffers into ``comm``'s memory
        (the gradients keep their values) and start a new round. The current
        communicator is not closed."""
        self._drop_pending(timeout)
        self.comm = comm
        self._buckets = [make_bucket(comm, b.index, b.params) for b in self._buckets]
        self._slot = {id(p): (b, k) for b in self._buckets for k, p in enumerate(b.params)}
        self._reset_round()

    def broadcast_state(self, root: int = 0) -> None:
        """Make the parameters and the optimizer state those of rank ``root``
        (blocking collectives on the wrapper's communicator): every parameter
        of the wrapped optimizer, in param-group order, each followed by the
        tensors of its optimizer state in key order (non-tensor state is left
        as it is).

        Raises:
            BadArgument: on every rank, before anything changed, when a rank's
                tensors differ from ``root``'s in number, shape or dtype (as
                when the ranks took different numbers of steps).
        """
        tensors = self._state_tensors()
        self._check_same_layout(tensors, root)
        with torch.no_grad():
            for tensor in tensors:
                staged = Staged()
                self.comm.bcast(as_numpy(staged.writable(tensor)), root)
                staged.finish()

    def _state_tensors(self) -> list[torch.Tensor]:
        """The parameters and their optimizer state's tensors, in the order :meth:`broadcast_state` sends them."""
        tensors = []
        for p in _unique(q for g in self.optimizer.param_groups for q in g["params"]):
            tensors.append(p.detach())
            state = self.optimizer.state.get(p, {})
            tensors += [state[key] for key in sorted(state, key=str) if isinstance(state[key], torch.Tensor)]
        return tensors

    def _check_same_layout(self, tensors: list[torch.Tensor], root: int) -> None:
        """Raise BadArgument on every rank unless every rank's ``tensors`` have ``root``'s shapes and dtypes."""
        layout = repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode()
        mine = np.frombuffer(hashlib.sha256(layout).digest()[:8], np.int64).copy()
        roots = mine.copy()
        self.comm.bcast(roots, root)
        same = np.array([int(roots[0] == mine[0])], np.int32)
        self.comm.allreduce(same, op="min")
        if not same[0]:
            differs = "differ" if roots[0] != mine[0] else "match, another rank's differ"
            raise BadArgument(f"rank {self.comm.rank}: broadcast_state: the ranks' parameters and optimizer state "
                              f"differ from rank {root}'s in number, shape or dtype (this rank's {differs})")

    def _keep_unfinished(self) -> None:
        """Remember the allreduces of this round that are still running (after a failure)."""
        self._unfinished += [b.handle for b in self._buckets if b.handle is not None and not b.handle.done()]

    def _drop_pending(self, timeout: float | None) -> None:
        """Wait at most ``timeout`` seconds for every allreduce posted and not
        waited for, ignoring their errors (on an aborted communicator they fail
        at once), end their spans and start a new round."""
        self._keep_unfinished()
        pending, self._unfinished = self._unfinished, []
        deadline = time.monotonic() + (self.comm.timeout if timeout is None else float(timeout))
        for handle in pending:
            try:
                handle.wait(max(deadline - time.monotonic(), 0.0))
            except Exception as exc:  # its communicator's error, or still running: left behind
                log.debug("rank %d: dropped an allreduce of the old communicator: %s", self.comm.rank, exc)
        for bucket in self._buckets:
            if bucket.span is not None:
                bucket.span.end()
        self._reset_round()

    def remove_hooks(self) -> None:
        """Unregister the gradient hooks (the wrapper stops reducing)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, buckets={len(self._buckets)}, "
                f"comm={self.comm!r})")


def _unique(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """``params`` without repeats, in order."""
    seen: set[int] = set()
    unique = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    return unique


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
