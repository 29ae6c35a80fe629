"""All-to-all of the torch backend, even (one collective) and uneven (pairwise messages).

An uneven all-to-all is pairwise point-to-point on tags of its own
(``2**26`` + call number), started after the collectives queued before it
(a barrier orders it), in a thread.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from collectives.errors import BadArgument

from .torch_p2p import ALLTOALLV_TAG_BASE, TAG_LIMIT
from .torch_tensors import Staged, as_numpy, check_cpu, mark_written
from .torch_work import CollectivesWork

__all__ = ["AllToAll"]


class AllToAll:
    """The process group's ``alltoall_base`` and ``alltoall`` (a part of
    :class:`~.torch_backend.CollectivesProcessGroup`, whose ``comm``,
    ``timeout``, ``_lock``, ``_chain``, ``_collective_work``, ``_fail`` and
    ``_in_thread`` they use)."""

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> dist.Work:
        """``dist.all_to_all_single`` (splits along dim 0; even splits use alltoall)."""
        check_cpu([output, input])
        p = self.size()
        row_in = input[0].numel() if input.dim() and input.shape[0] else 0
        row_out = output[0].numel() if output.dim() and output.shape[0] else 0
        staged = Staged()
        out, src = staged.writable(output), Staged.readable(input)
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
        mark_written(written)
        work: CollectivesWork | None = None
        try:
            with self._lock:
                work = self._collective_work(what, "all_to_all", inputs, written, written, **extra)
                self._alltoallv_seq = (self._alltoallv_seq + 1) % TAG_LIMIT
                tag = ALLTOALLV_TAG_BASE + self._alltoallv_seq
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
        check_cpu(list(output_tensors) + list(input_tensors))
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
