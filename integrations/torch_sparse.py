"""Sparse ``all_reduce`` of the torch backend.

Sparse ``all_reduce`` (sum of COO tensors, as Gloo does): every rank's
indices and values are gathered (an allgather of the counts, two
allgatherv), summed and coalesced, and the result is copied into the
tensor. It runs in the calling thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from collectives.errors import BadArgument

from .torch_tensors import as_numpy, mark_written

__all__ = ["SparseAllreduce"]

_RED = dist.ReduceOp.RedOpType


class SparseAllreduce:
    """The sum of sparse COO tensors over the ranks (a part of
    :class:`~.torch_backend.CollectivesProcessGroup`, whose ``comm``,
    ``timeout``, ``_lock``, ``_collective_work`` and ``_fail`` it uses)."""

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
                mark_written(tensors)
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
