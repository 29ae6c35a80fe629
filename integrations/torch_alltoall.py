"""All-to-all of the torch backend: even (the communicator's alltoall) and
uneven (its alltoallv), each one collective call, queued like every other."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from collectives.errors import BadArgument

from .torch_tensors import Staged, as_numpy, check_cpu

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
        """Uneven all-to-all of contiguous ``src`` into ``out`` (the communicator's alltoallv)."""
        return self._chain(what, "all_to_all",
                           [lambda: self.comm.ialltoallv(as_numpy(src), send_counts, as_numpy(out), recv_counts)],
                           written, finish, None, written, inputs=inputs, **extra)

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
