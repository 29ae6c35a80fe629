"""The torch backend's collectives over the communicator's nonblocking calls.

Each call stages its tensors (contiguous stand-ins, flat copies), posts one
or more nonblocking collectives through the group's ``_chain`` and copies
the results back once all succeeded. All-to-all, sparse ``all_reduce`` and
``monitored_barrier`` have modules of their own.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from collectives.errors import BadArgument

from .torch_tensors import Staged, as_numpy, check_cpu, reduce_op_name

__all__ = ["Collectives"]


class Collectives:
    """The process group's collectives but all-to-all (a part of
    :class:`~.torch_backend.CollectivesProcessGroup`, whose ``comm``, ``_chain``
    and ``_sparse_allreduce`` they use)."""

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """``dist.all_reduce``: every tensor in place (sparse COO tensors: sum)."""
        check_cpu(tensors)
        opts = opts if opts is not None else dist.AllreduceOptions()
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, opts)
        staged = Staged()
        bufs = [staged.writable(t) for t in tensors]
        steps = [(lambda b=b: self.comm.iallreduce(as_numpy(b), reduce_op_name(opts.reduceOp, b.dtype)))
                 for b in bufs]
        return self._chain("allreduce", "all_reduce", steps, tensors, staged.finish, opts, tensors, inputs=tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """``dist.all_reduce_coalesced``: one allreduce per dtype over a flat copy."""
        check_cpu(tensors)
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
        return self._chain("allreduce_coalesced", "all_reduce", steps, tensors, finish, opts, tensors,
                           inputs=tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """``dist.broadcast`` from ``opts.rootRank``."""
        check_cpu(tensors)
        opts = opts if opts is not None else dist.BroadcastOptions()
        staged = Staged()
        bufs = [staged.writable(t) for t in tensors]
        steps = [(lambda b=b: self.comm.ibcast(as_numpy(b), int(opts.rootRank))) for b in bufs]
        return self._chain("broadcast", "broadcast", steps, tensors, staged.finish, opts, tensors, inputs=tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """``dist.reduce`` to ``opts.rootRank``."""
        check_cpu(tensors)
        opts = opts if opts is not None else dist.ReduceOptions()
        staged = Staged()
        bufs = [staged.writable(t) for t in tensors]
        steps = [(lambda b=b: self.comm.ireduce(as_numpy(b), int(opts.rootRank),
                                                reduce_op_name(opts.reduceOp, b.dtype))) for b in bufs]
        return self._chain("reduce", "reduce", steps, tensors, staged.finish, opts, tensors, inputs=tensors)

    def _gather_into(self, output: torch.Tensor, input: torch.Tensor) -> Callable[[], Any]:
        out = output if output.is_contiguous() else None
        if out is None or out.dtype != input.dtype:
            raise BadArgument("all_gather_into_tensor needs a contiguous output of the input's dtype")
        if out.numel() != input.numel() * self.size():
            raise BadArgument(f"output holds {out.numel()} elements, expected {self.size()} x {input.numel()}")
        src = Staged.readable(input)
        return lambda: self.comm.iallgather(as_numpy(src), as_numpy(out))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """``dist.all_gather_into_tensor``."""
        check_cpu([output, input])
        return self._chain("all_gather_into_tensor", "all_gather_into_tensor", [self._gather_into(output, input)],
                           output, opts=opts, written=output, inputs=input)

    all_gather_single = _allgather_base

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> dist.Work:
        """Several ``all_gather_into_tensor`` calls as one Work."""
        check_cpu(list(outputs) + list(inputs))
        return self._chain("all_gather_into_tensor_coalesced", "all_gather_into_tensor_coalesced",
                           [self._gather_into(o, i) for o, i in zip(outputs, inputs)], outputs,
                           opts=opts, written=outputs, inputs=inputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _gather_lists(self, what: str, per_rank: Sequence[Sequence[torch.Tensor]],
                      inputs: Sequence[torch.Tensor], result: Any, opts: Any) -> dist.Work:
        """Allgather each input into a flat buffer, then copy rank r's block of
        input i into ``per_rank[r][i]``."""
        check_cpu(list(inputs))
        if len(per_rank) != self.size() or any(len(outs) != len(inputs) for outs in per_rank):
            raise BadArgument(f"{what} needs {self.size()} output lists (one per rank) of "
                              f"{len(inputs)} tensors each, got lists of {[len(o) for o in per_rank]}")
        steps, flats = [], []
        for inp in inputs:
            flat_out = torch.empty(self.size() * inp.numel(), dtype=inp.dtype)
            src = Staged.readable(inp.detach())
            steps.append(lambda s=src, f=flat_out: self.comm.iallgather(as_numpy(s), as_numpy(f)))
            flats.append((flat_out, inp.numel()))

        def finish() -> None:
            for r, outs in enumerate(per_rank):
                for (flat_out, n), o in zip(flats, outs):
                    o.copy_(flat_out[r * n:(r + 1) * n].view_as(o))

        return self._chain(what, "all_gather", steps, result, finish, opts, per_rank, inputs=list(inputs))

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
                            staged: Staged) -> Callable[[], Any]:
        if input.numel() != output.numel() * self.size():
            raise BadArgument(f"input holds {input.numel()} elements, expected {self.size()} x {output.numel()}")
        out = staged.writable(output)
        src = Staged.readable(input)
        op = reduce_op_name(opts.reduceOp, input.dtype)
        return lambda: self.comm.ireduce_scatter(as_numpy(src), as_numpy(out), op)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """``dist.reduce_scatter_tensor``."""
        check_cpu([output, input])
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        staged = Staged()
        return self._chain("reduce_scatter_tensor", "reduce_scatter_tensor",
                           [self._reduce_scatter_one(output, input, opts, staged)],
                           output, staged.finish, opts, output, inputs=input)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        """Several ``reduce_scatter_tensor`` calls as one Work."""
        check_cpu(list(outputs) + list(inputs))
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        staged = Staged()
        steps = [self._reduce_scatter_one(o, i, opts, staged) for o, i in zip(outputs, inputs)]
        return self._chain("reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced", steps, outputs,
                           staged.finish, opts, outputs, inputs=inputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> dist.Work:
        """``dist.reduce_scatter``: the input lists concatenated, then reduce-scattered."""
        check_cpu(output_tensors)
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        staged = Staged()
        steps = []
        for out, ins in zip(output_tensors, input_tensors):
            if len(ins) != self.size():
                raise BadArgument(f"reduce_scatter needs {self.size()} input tensors, got {len(ins)}")
            flat_in = torch.cat([t.detach().reshape(-1) for t in ins])
            steps.append(self._reduce_scatter_one(out, flat_in, opts, staged))
        return self._chain("reduce_scatter", "reduce_scatter", steps, output_tensors, staged.finish, opts,
                           output_tensors, inputs=input_tensors)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> dist.Work:
        """``dist.gather`` to ``opts.rootRank``."""
        check_cpu(input_tensors)
        opts = opts if opts is not None else dist.GatherOptions()
        root = int(opts.rootRank)
        inp = Staged.readable(input_tensors[0])
        is_root = self.rank() == root
        flat_out = torch.empty(self.size() * inp.numel(), dtype=inp.dtype) if is_root else None

        def finish() -> None:
            if is_root:
                n = inp.numel()
                for i, o in enumerate(output_tensors[0]):
                    o.copy_(flat_out[i * n:(i + 1) * n].view_as(o))

        return self._chain("gather", "gather",
                           [lambda: self.comm.igather(as_numpy(inp), None if flat_out is None else as_numpy(flat_out),
                                                      root)],
                           output_tensors, finish, opts, output_tensors, inputs=input_tensors)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> dist.Work:
        """``dist.scatter`` from ``opts.rootRank``."""
        check_cpu(output_tensors)
        opts = opts if opts is not None else dist.ScatterOptions()
        root = int(opts.rootRank)
        staged = Staged()
        out = staged.writable(output_tensors[0])
        flat_in = (torch.cat([t.detach().reshape(-1) for t in input_tensors[0]])
                   if self.rank() == root else None)
        return self._chain("scatter", "scatter",
                           [lambda: self.comm.iscatter(None if flat_in is None else as_numpy(flat_in),
                                                       as_numpy(out), root)],
                           output_tensors, staged.finish, opts, output_tensors, inputs=input_tensors)

    def barrier(self, opts: Any = None) -> dist.Work:
        """``dist.barrier``."""
        return self._chain("barrier", "barrier", [lambda: self.comm.ibarrier()], None, opts=opts)
