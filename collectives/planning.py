"""Planning one collective call: validate, choose the algorithm, sign.

A :class:`Planner` turns a collective's arguments into a :class:`Plan`: the
algorithm, its arguments (flat numpy views of the user's buffers), the
result to return and the call's signature (:mod:`collectives.signature`).

Arguments are checked in two stages. Mistakes found before the algorithm
is known (an unknown op or algorithm, a root out of range, something that
is not a buffer) raise :class:`~collectives.errors.BadArgument` at once:
nothing is sent, and they are the same on every rank of a correct program.
Mistakes found after it (a read-only or wrongly sized buffer, a root's
buffer that cannot hold the result) make a *refusing* plan
(``Plan.refusal``): the call still takes part in the collective so that
every rank raises BadArgument in that same call, naming this rank and why
(see the communicator's execution).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from . import signature
from .buffers import flat
from .errors import BadArgument
from .ops import Op, get_op
from .registry import Algorithm, algorithm as lookup_algorithm
from .signature import Sig

__all__ = ["Plan", "Planner", "ROOTED"]

#: Collectives whose root alone holds some argument (a gather's receive
#: buffer, a scatter's send buffer, a reduce's result buffer).
ROOTED = frozenset({"scatter", "gather", "reduce"})


#: The v-counts of an alltoallv's signature: the same on every rank, apart from an alltoall's.
ALLTOALLV_COUNTS = (-1,)

class Plan:
    """A validated call.

    Attributes:
        collective: the collective.
        algo: the algorithm.
        args: the algorithm's arguments (after ``ctx``); None when refused.
        result: what the call returns.
        finalize: run after the algorithm (``avg``'s division), or None.
        write_backs: staged device buffers' finishes (``finish(True)`` copies the
            result back, ``finish(False)`` only frees the host copy).
        sig: the call's signature, without its sequence number.
        root: the root of a rooted collective, else None.
        refusal: why this rank refuses the call (None: it does not).
        copy_in: an out-of-place call's ``(place, source)``: ``source`` is
            copied into ``place`` (in the algorithm's first array) before the
            algorithm runs, or, by an algorithm that ``copies_in``
            (:class:`~collectives.registry.Algorithm`), once every rank
            agreed on the call (:func:`~collectives.execution.run_algorithm`);
            None where there is nothing to copy.
    """

    __slots__ = ("collective", "algo", "args", "result", "finalize", "write_backs", "sig", "root", "refusal",
                 "copy_in")

    def __init__(self, collective: str, algo: Algorithm, args: tuple | None, result: Any, sig: Sig,
                 finalize: Callable[[], None] | None = None, root: int | None = None,
                 refusal: str | None = None) -> None:
        self.collective, self.algo, self.args, self.result = collective, algo, args, result
        self.finalize, self.sig, self.root, self.refusal = finalize, sig, root, refusal
        self.write_backs: list[Callable[[bool], None]] = []
        self.copy_in: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def itemsize(self) -> int:
        """Bytes per element of the call's data (0 for a barrier)."""
        return signature.itemsize_of(self.sig)

    @property
    def empty(self) -> bool:
        """Whether the call moves no data (a barrier aside): it then only
        checks, as a barrier, that every rank makes the same call."""
        return self.sig[1] == 0 and self.collective != "barrier"


def _even(counts: Sequence[int]) -> Sequence[int] | None:
    """The counts as a signature takes them: None when they are all equal
    (so that scatter and scatterv with equal counts agree)."""
    return None if len(set(counts)) <= 1 else counts


class Planner:
    """Makes the plans of one communicator's calls.

    Args:
        rank, size: the communicator's rank and size.
        transport: its transport (capabilities, ``wrap_op``).
        choose: ``choose(collective, nbytes, dtype) -> name`` for ``"auto"``.
    """

    def __init__(self, rank: int, size: int, transport: Any, choose: Callable[[str, int, np.dtype], str]) -> None:
        self.rank, self.size, self.transport = rank, size, transport
        self.choose = choose
        self.capabilities = frozenset(transport.capabilities)
        self.stages: list[Callable[[bool], None]] = []
        self._ok_dtypes: set[np.dtype] = set()
        self._algorithms: dict[tuple[str, str], Algorithm] = {}
        self._ops: dict[tuple[str, np.dtype], Op] = {}

    # ------------------------------------------------------------ helpers

    def flat(self, buf: Any, *, writable: bool, what: str) -> np.ndarray:
        """A flat host view of ``buf``; device arrays are staged (see buffers.flat)."""
        if type(buf) is np.ndarray and buf.ndim == 1 and buf.dtype in self._ok_dtypes:
            flags = buf.flags  # the hot path: a contiguous 1-D numpy array
            if flags.c_contiguous and (flags.writeable or not writable):
                return buf
        arr = flat(buf, writable=writable, what=what, stages=self.stages)
        self._ok_dtypes.add(arr.dtype)
        return arr

    def written(self, buf: Any, what: str) -> tuple[np.ndarray, str | None]:
        """A flat view of ``buf``, which the call writes, and why it cannot be
        written (None when it can). Raises BadArgument only when ``buf`` is
        no buffer at all."""
        try:
            return self.flat(buf, writable=True, what=what), None
        except BadArgument as exc:
            return self.flat(buf, writable=False, what=what), str(exc)

    def check_rank(self, r: Any, what: str) -> int:
        if type(r) is int and 0 <= r < self.size:  # the common case, before the general checks
            return r
        if not isinstance(r, (int, np.integer)) or isinstance(r, bool) or not 0 <= r < self.size:
            raise BadArgument(f"{what} {r!r} out of range for {self.size} ranks")
        return int(r)

    def pick(self, collective: str, name: str, nbytes: int, dtype: np.dtype) -> Algorithm:
        """The algorithm ``name`` (or the selector's choice for ``"auto"``)."""
        if not isinstance(name, str):
            raise BadArgument(f"algorithm must be a name, got {name!r}")
        if name == "auto":
            name = self.choose(collective, nbytes, dtype)
        algo = self._algorithms.get((collective, name))
        if algo is not None:
            return algo
        algo = lookup_algorithm(collective, name)
        if not algo.needs <= self.capabilities:
            raise BadArgument(
                f"{collective} algorithm {name!r} needs {', '.join(sorted(algo.needs))}, "
                f"which transport {self.transport.name!r} does not offer")
        self._algorithms[(collective, name)] = algo
        return algo

    def op(self, op: Any, dtype: np.dtype) -> Op:
        """The reduction op for ``dtype`` (checked), as the transport wants it."""
        key = (op, dtype) if isinstance(op, str) else None
        o = self._ops.get(key) if key is not None else None
        if o is None:
            o = get_op(op)
            o.check(dtype)
            wrap = getattr(self.transport, "wrap_op", None)  # e.g. the sim charges reductions
            if wrap is not None:
                o = wrap(o)
            if key is not None:
                self._ops[key] = o
        return o

    def counts(self, counts: Sequence[int]) -> tuple[list[int], list[int]]:
        try:
            counts = [int(c) for c in counts]
        except (TypeError, ValueError):
            raise BadArgument(f"counts must be {self.size} non-negative integers, got {counts!r}") from None
        if len(counts) != self.size or any(c < 0 for c in counts):
            raise BadArgument(f"counts must be {self.size} non-negative integers, got {counts}")
        displs = [0] * self.size
        for i in range(1, self.size):
            displs[i] = displs[i - 1] + counts[i - 1]
        return counts, displs

    def even_counts(self, total: int, what: str) -> list[int]:
        if total % self.size:
            raise BadArgument(f"{what} holds {total} elements, not a multiple of {self.size} ranks")
        return [total // self.size] * self.size

    @staticmethod
    def _sig(collective: str, algo: Algorithm, op: str | None, root: int | None, dtype: np.dtype | None,
             count: int, counts: Sequence[int] | None = None) -> Sig:
        return signature.make(collective, algo.name, op, root, dtype, count, counts)

    def _refused(self, collective: str, algo: Algorithm, sig: Sig, result: Any, reason: str,
                 root: int | None = None) -> Plan:
        return Plan(collective, algo, None, result, signature.refused(sig), root=root, refusal=reason)

    # ----------------------------------------------------------- planners

    def bcast(self, buf: Any, root: Any, algorithm: str) -> Plan:
        root = self.check_rank(root, "root")
        arr, why = self.written(buf, "buf")
        algo = self.pick("bcast", algorithm, arr.nbytes, arr.dtype)
        sig = self._sig("bcast", algo, None, root, arr.dtype, arr.size)
        if why is not None:
            return self._refused("bcast", algo, sig, buf, why, root)
        return Plan("bcast", algo, (arr, root), buf, sig, root=root)

    def reduce(self, buf: Any, root: Any, op: Any, algorithm: str) -> Plan:
        root = self.check_rank(root, "root")
        if self.rank == root:
            arr, why = self.written(buf, "buf")
        else:
            arr, why = self.flat(buf, writable=False, what="buf"), None
        o = self.op(op, arr.dtype)
        algo = self.pick("reduce", algorithm, arr.nbytes, arr.dtype)
        sig = self._sig("reduce", algo, o.name, root, arr.dtype, arr.size)
        if why is not None:
            return self._refused("reduce", algo, sig, buf, f"on the root: {why}", root)
        fin = (lambda: o.finalize(arr, self.size)) if o.name == "avg" and self.rank == root else None
        return Plan("reduce", algo, (arr, root, o), buf, sig, fin, root)

    def allreduce(self, buf: Any, op: Any, algorithm: str, out: Any) -> Plan:
        if out is None:
            src, why = self.written(buf, "buf")
            arr = src
        else:
            src = self.flat(buf, writable=False, what="buf")
            arr, why = self.written(out, "out")
        o = self.op(op, src.dtype)
        algo = self.pick("allreduce", algorithm, src.nbytes, src.dtype)
        sig = self._sig("allreduce", algo, o.name, None, src.dtype, src.size)
        result = buf if out is None else out
        if out is not None and (arr.shape != src.shape or arr.dtype != src.dtype):
            return self._refused("allreduce", algo, sig, result,
                                 f"out has {arr.size} x {arr.dtype}, buf {src.size} x {src.dtype}")
        if why is not None:
            return self._refused("allreduce", algo, sig, result, why)
        if src is not arr and np.may_share_memory(src, arr):  # peers may read buf while out is written:
            src = arr if src.ctypes.data == arr.ctypes.data else src.copy()  # the same memory is in place
        fin = (lambda: o.finalize(arr, self.size)) if o.name == "avg" else None
        plan = Plan("allreduce", algo, (arr, o), result, sig, fin)
        if src is not arr:
            plan.copy_in = (arr, src)
        return plan

    def scatterv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], root: Any, algorithm: str,
                 v: bool = True) -> Plan:
        root = self.check_rank(root, "root")
        counts, _ = self.counts(counts)
        recv, why = self.written(recvbuf, "recvbuf")
        algo = self.pick("scatter", algorithm, sum(counts) * recv.itemsize, recv.dtype)
        sig = self._sig("scatter", algo, None, root, recv.dtype, sum(counts), _even(counts) if v else None)
        send = None
        if recv.size != counts[self.rank]:
            return self._refused("scatter", algo, sig, recvbuf,
                                 f"recvbuf holds {recv.size} elements, counts[{self.rank}] is {counts[self.rank]}", root)
        if why is not None:
            return self._refused("scatter", algo, sig, recvbuf, why, root)
        if self.rank == root:
            send, why = self._root_buffer(sendbuf, "sendbuf", False, recv, "recvbuf", sum(counts))
            if why is not None:
                return self._refused("scatter", algo, sig, recvbuf, why, root)
        return Plan("scatter", algo, (send, recv, root, counts), recvbuf, sig, root=root)

    def _root_buffer(self, buf: Any, what: str, writable: bool, other: np.ndarray, other_what: str,
                     total: int) -> tuple[np.ndarray | None, str | None]:
        """The root's flat ``buf`` (a scatter's sendbuf, a gather's recvbuf),
        checked against the rank's ``other`` buffer's dtype and ``total``
        elements: (the array, None), or (None, why the root refuses the call)."""
        try:
            arr = self.flat(buf, writable=writable, what=what)
        except BadArgument as exc:
            return None, f"on the root: {exc}"
        if arr.dtype != other.dtype:
            return None, f"{what} on the root has dtype {arr.dtype}, {other_what} {other.dtype}"
        if arr.size != total:
            return None, f"{what} on the root holds {arr.size} elements, expected {total}"
        return arr, None

    def gatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], root: Any, algorithm: str,
                v: bool = True) -> Plan:
        root = self.check_rank(root, "root")
        counts, _ = self.counts(counts)
        send = self.flat(sendbuf, writable=False, what="sendbuf")
        algo = self.pick("gather", algorithm, sum(counts) * send.itemsize, send.dtype)
        sig = self._sig("gather", algo, None, root, send.dtype, sum(counts), _even(counts) if v else None)
        result = recvbuf if self.rank == root else None
        if send.size != counts[self.rank]:
            return self._refused("gather", algo, sig, result,
                                 f"sendbuf holds {send.size} elements, counts[{self.rank}] is {counts[self.rank]}", root)
        recv = None
        if self.rank == root:
            recv, why = self._root_buffer(recvbuf, "recvbuf", True, send, "sendbuf", sum(counts))
            if why is not None:
                return self._refused("gather", algo, sig, result, why, root)
        return Plan("gather", algo, (send, recv, root, counts), result, sig, root=root)

    def allgatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int], algorithm: str,
                   v: bool = True) -> Plan:
        counts, displs = self.counts(counts)
        recv, why = self.written(recvbuf, "recvbuf")
        algo = self.pick("allgather", algorithm, recv.nbytes, recv.dtype)
        sig = self._sig("allgather", algo, None, None, recv.dtype, sum(counts), _even(counts) if v else None)
        if recv.size != sum(counts):
            return self._refused("allgather", algo, sig, recvbuf,
                                 f"recvbuf holds {recv.size} elements, expected {sum(counts)}")
        if why is not None:
            return self._refused("allgather", algo, sig, recvbuf, why)
        mine = recv[displs[self.rank]:displs[self.rank] + counts[self.rank]]
        send = mine
        if sendbuf is not None:
            try:
                send = self.flat(sendbuf, writable=False, what="sendbuf")
            except BadArgument as exc:
                return self._refused("allgather", algo, sig, recvbuf, str(exc))
            if send.dtype != recv.dtype:
                return self._refused("allgather", algo, sig, recvbuf,
                                     f"sendbuf has dtype {send.dtype}, recvbuf has {recv.dtype}")
            if send.size != counts[self.rank]:
                return self._refused("allgather", algo, sig, recvbuf,
                                     f"sendbuf holds {send.size} elements, counts[{self.rank}] is {counts[self.rank]}")
            if np.may_share_memory(send, recv):  # peers may read sendbuf while recvbuf is written:
                send = mine if send.ctypes.data == mine.ctypes.data else send.copy()  # its own block is in place
        plan = Plan("allgather", algo, (recv, counts), recvbuf, sig)
        if send is not mine and send.size:
            plan.copy_in = (mine, send)
        return plan

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: Any, algorithm: str,
                       counts: Sequence[int] | None = None) -> Plan:
        send = self.flat(sendbuf, writable=False, what="sendbuf")
        recv, why = self.written(recvbuf, "recvbuf")
        o = self.op(op, send.dtype)
        v = counts is not None
        if counts is None:
            if send.size % self.size:
                raise BadArgument(f"sendbuf holds {send.size} elements, not a multiple of {self.size} ranks")
            counts = [send.size // self.size] * self.size
        counts, _ = self.counts(counts)
        algo = self.pick("reduce_scatter", algorithm, sum(counts) * send.itemsize, send.dtype)
        sig = self._sig("reduce_scatter", algo, o.name, None, send.dtype, sum(counts),
                        _even(counts) if v else None)
        if recv.dtype != send.dtype:
            return self._refused("reduce_scatter", algo, sig, recvbuf,
                                 f"sendbuf has dtype {send.dtype}, recvbuf has {recv.dtype}")
        if send.size != sum(counts) or recv.size != counts[self.rank]:
            return self._refused("reduce_scatter", algo, sig, recvbuf,
                                 f"sendbuf/recvbuf sizes {send.size}/{recv.size} do not match counts {counts}")
        if why is not None:
            return self._refused("reduce_scatter", algo, sig, recvbuf, why)
        fin = (lambda: o.finalize(recv, self.size)) if o.name == "avg" else None
        return Plan("reduce_scatter", algo, (send, recv, counts, o), recvbuf, sig, fin)

    def alltoall(self, sendbuf: Any, recvbuf: Any, algorithm: str) -> Plan:
        send = self.flat(sendbuf, writable=False, what="sendbuf")
        recv, why = self.written(recvbuf, "recvbuf")
        self.even_counts(send.size, "sendbuf")
        algo = self.pick("alltoall", algorithm, send.nbytes, send.dtype)
        sig = self._sig("alltoall", algo, None, None, send.dtype, send.size)
        if send.dtype != recv.dtype:
            return self._refused("alltoall", algo, sig, recvbuf,
                                 f"sendbuf has dtype {send.dtype}, recvbuf has {recv.dtype}")
        if send.size != recv.size:
            return self._refused("alltoall", algo, sig, recvbuf,
                                 f"sendbuf holds {send.size} elements, recvbuf {recv.size}")
        if why is not None:
            return self._refused("alltoall", algo, sig, recvbuf, why)
        if np.shares_memory(send, recv):
            return self._refused("alltoall", algo, sig, recvbuf, "sendbuf and recvbuf overlap")
        return Plan("alltoall", algo, (send, recv), recvbuf, sig)

    def alltoallv(self, sendbuf: Any, sendcounts: Sequence[int], recvbuf: Any, recvcounts: Sequence[int],
                  algorithm: str) -> Plan:
        """Uneven blocks: ``pairwise`` only. The signature leaves the counts
        out (each rank's differ: its count is the number of ranks); each
        message's length is checked against its receive, so counts two ranks
        disagree on are an error."""
        send = self.flat(sendbuf, writable=False, what="sendbuf")
        recv, why = self.written(recvbuf, "recvbuf")
        sendcounts, _ = self.counts(sendcounts)
        recvcounts, _ = self.counts(recvcounts)
        if algorithm not in ("auto", "pairwise"):
            raise BadArgument(f"alltoallv runs the pairwise algorithm only, not {algorithm!r}")
        algo = self.pick("alltoall", "pairwise", send.nbytes, send.dtype)
        sig = self._sig("alltoall", algo, None, None, send.dtype, self.size, ALLTOALLV_COUNTS)  # never "empty"
        problem = why
        if send.dtype != recv.dtype:
            problem = f"sendbuf has dtype {send.dtype}, recvbuf has {recv.dtype}"
        elif send.size != sum(sendcounts):
            problem = f"sendbuf holds {send.size} elements, the sendcounts add up to {sum(sendcounts)}"
        elif recv.size != sum(recvcounts):
            problem = f"recvbuf holds {recv.size} elements, the recvcounts add up to {sum(recvcounts)}"
        elif sendcounts[self.rank] != recvcounts[self.rank]:
            problem = (f"this rank sends itself {sendcounts[self.rank]} elements but receives "
                       f"{recvcounts[self.rank]} from itself")
        elif np.shares_memory(send, recv):
            problem = "sendbuf and recvbuf overlap"
        if problem is not None:
            return self._refused("alltoall", algo, sig, recvbuf, problem)
        return Plan("alltoall", algo, (send, recv, sendcounts, recvcounts), recvbuf, sig)

    def barrier(self, algorithm: str) -> Plan:
        algo = self.pick("barrier", algorithm, 0, np.dtype(np.uint8))
        return Plan("barrier", algo, (), None, self._sig("barrier", algo, None, None, None, 0))
