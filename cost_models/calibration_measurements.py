"""What the ranks of ``collectives calibrate`` measure.

Ranks 0 and 1: the ping-pong sweep (:func:`pingpong`) and the exchange
(:func:`exchange`); rank 0 alone: gamma per dtype and the copy bandwidth;
every rank: the latency probe (:func:`latency_probe`), the fence, the small collectives (:data:`PROBES`), and the
anchors, every algorithm at :func:`anchor_sizes`
(:func:`rank_count_measurements`). Each time is the best of a few tries;
those of more than one rank are timed from a common start, on the slowest
rank (:mod:`.timing`).
"""

from __future__ import annotations

import functools
import math
import time
from typing import Sequence

import numpy as np

from .timing import slowest_best, slowest_best_each

__all__ = ["SWEEP_BYTES", "GAMMA_DTYPES", "PROBES", "PROBE_BYTES", "STRETCH_BYTES", "ANCHORED",
           "LARGE_ANCHOR_BYTES", "WINDOW_PROBES", "EXCHANGE_BYTES", "best_time", "measure_gamma",
           "measure_copy_bandwidth", "window_fence", "measure_probes", "anchor_sizes", "measure_anchors",
           "window_probes", "pingpong", "latency_probe", "LatencyLog", "exchange", "rank_count_measurements"]

#: Message sizes of the ping-pong sweep (bytes).
SWEEP_BYTES = [0, 8, 64, 512, 2048, 8192, 32768, 131072, 524288, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
#: The dtypes whose reduction cost (gamma) is measured.
GAMMA_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")


def best_time(fn, repeats: int) -> float:
    """The least of ``repeats`` timings of ``fn()`` on this rank alone, seconds."""
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_gamma(nbytes: int = 4 << 20, repeats: int = 5) -> dict[str, float]:
    """Seconds per byte of an in-place ``np.add`` per dtype (bytes of the output)."""
    from collectives.ops import BFLOAT16

    out = {}
    for name in GAMMA_DTYPES:
        dt = BFLOAT16 if name == "bfloat16" else np.dtype(name)
        if dt is None:
            continue
        a = np.ones(nbytes // dt.itemsize, dt)
        b = np.ones_like(a)
        out[name] = best_time(lambda: np.add(a, b, out=a), repeats) / a.nbytes
    return out


def measure_copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Bytes per second of ``np.copyto`` of ``nbytes``."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    return nbytes / best_time(lambda: np.copyto(dst, src), repeats)


def window_fence(comm, rounds: int, runs: int = 10) -> float | None:
    """Seconds of the shared window's fence (the best of ``runs`` means over
    ``rounds`` fences, slowest rank), or None without a window."""
    window = getattr(comm.transport, "window", None) if "window" in comm.transport.capabilities else None
    if window is None:
        return None

    def fences() -> None:
        for _ in range(rounds):
            window.fence(time.monotonic() + comm.timeout)

    return slowest_best(comm, fences, runs) / rounds


#: Small collectives whose times calibrate ``overhead`` and ``call``.
PROBES = (("allreduce", "recursive_doubling"), ("allreduce", "mst"), ("bcast", "binomial"),
          ("reduce", "binomial"))
PROBE_BYTES = (8, 4096)


def _run_probe(comm, collective: str, algorithm: str, count: int):
    buf = np.ones(count, np.float32)
    if collective == "allreduce":
        return lambda: comm.allreduce(buf, algorithm=algorithm)
    if collective == "bcast":
        return lambda: comm.bcast(buf, 0, algorithm=algorithm)
    return lambda: comm.reduce(buf, 0, algorithm=algorithm)


#: Probe sizes where the per-byte terms dominate (for the stretch factors).
STRETCH_BYTES = (1 << 20, 16 << 20)


def measure_probes(comm, repeats: int, sizes: Sequence[int] = PROBE_BYTES,
                   pairs: Sequence[tuple[str, str]] = PROBES) -> list[tuple[str, str, int, float]]:
    """(collective, algorithm, bytes, seconds) of every probe (``pairs`` x ``sizes``) on every rank."""
    out = []
    for collective, algorithm in pairs:
        for nbytes in sizes:
            call = _run_probe(comm, collective, algorithm, nbytes // 4)
            out.append((collective, algorithm, nbytes, slowest_best(comm, call, repeats)))
    return out


#: Collectives whose algorithms get an anchor (their time at the smallest size).
ANCHORED = ("bcast", "scatter", "gather", "allgather", "reduce", "allreduce", "reduce_scatter", "alltoall",
            "barrier")


#: The large sizes at which every algorithm is measured too (bytes per
#: rank): one where the shared window's largest collectives switch to
#: reading peers' buffers directly, one past it, so that the scale beyond
#: is the direct path's (and, over TCP, that of buffers that no longer fit
#: the cache), and 64 MiB, where some algorithms grow faster than their
#: formulas (an exchange of whole vectors, a tree's large sends).
LARGE_ANCHOR_BYTES = (4 << 20, 16 << 20, 64 << 20)


def anchor_sizes(p: int, large: Sequence[int] = LARGE_ANCHOR_BYTES) -> list[int]:
    """Element counts (float32) at which every algorithm is measured: one
    element per rank; and, with ``large``, the pipeline segment (the largest
    message the point-to-point algorithms send whole: the formulas change
    shape there) and the ``large`` sizes."""
    from collectives.context import SEGMENT_BYTES

    counts = [p]
    for nbytes in ((SEGMENT_BYTES, *large) if large else ()):
        counts.append(max(nbytes // 4 // p * p, p))
    return counts


def measure_anchors(comm, repeats: int,
                    large: Sequence[int] = LARGE_ANCHOR_BYTES) -> list[tuple[str, str, int, int, float]]:
    """``(collective, algorithm, p, bytes, seconds)`` of every algorithm the
    transport runs (``native`` aside) at :func:`anchor_sizes`, each the best
    of ``repeats`` at every size (the best of fewer tries would be slower
    on a noisy host, and bias the large sizes) (:attr:`~.model.Params.anchors`)."""
    from collectives.registry import algorithms_for

    from .timing import collective_call

    caps = frozenset(comm.transport.capabilities)
    dtype, p = np.dtype(np.float32), comm.size
    out = []
    for collective in ANCHORED:
        counts = [0] if collective == "barrier" else anchor_sizes(p, large)
        for count in counts:
            call = collective_call(comm, collective, count, dtype)
            calls = {name: functools.partial(call, name) for name, algo in algorithms_for(collective).items()
                     if algo.needs <= caps and name != "native"}
            for name, seconds in slowest_best_each(comm, calls, repeats).items():
                out.append((collective, name, p, count * dtype.itemsize, seconds))
    return out


#: Shared-window collectives, probed for the fence's stretch where the transport has a window.
WINDOW_PROBES = (("allreduce", "shared_window"), ("bcast", "shared_window"))


def window_probes(comm) -> tuple[tuple[str, str], ...]:
    """:data:`WINDOW_PROBES` where the transport offers a window, else none."""
    return WINDOW_PROBES if "window" in comm.transport.capabilities else ()


def pingpong(comm, sizes: Sequence[int], quick: bool) -> list[float]:
    """Half the best round trip per size between ranks 0 and 1 (other ranks
    skip), each timed from a common start (:func:`~.timing.slowest_best`)."""
    out = []
    for n in sizes:
        buf = np.zeros(n, np.uint8)
        reps = 3 if quick else (30 if n <= 65536 else 8 if n <= 4 << 20 else 3)

        def round_trip() -> None:
            if comm.rank == 0:
                comm.send(buf, 1)
                comm.recv(buf, 1)
            elif comm.rank == 1:
                comm.recv(buf, 0)
                comm.send(buf, 0)

        out.append(slowest_best(comm, round_trip, reps) / 2)
    return out


def latency_probe(comm, calls: int = 20, repeats: int = 30) -> float:
    """One 8-byte allreduce's time (``auto``'s; on shared memory the window's
    compiled call, whose time follows a cache line's trip between cores):
    the best of ``repeats`` tries of ``calls`` in a row on every rank, timed
    on the slowest. The calibration's check that the host stayed in one state."""
    x = np.zeros(2, np.float32)

    def calls_in_a_row() -> None:
        for _ in range(calls):
            comm.allreduce(x)

    return slowest_best(comm, calls_in_a_row, repeats) / calls


class LatencyLog:
    """A calibration job's latency probes (:func:`latency_probe`), each kept
    as ``[ranks, when, seconds]`` for the profile's ``latency_probes``."""

    def __init__(self, comm) -> None:
        self.comm = comm
        self.rows: list[list] = []

    def probe(self, when: str) -> None:
        """Take one probe (every rank calls it; none at 1 rank)."""
        if self.comm.size > 1:
            self.rows.append([self.comm.size, when, latency_probe(self.comm)])


#: Sizes of the exchange probe (a rank sends and receives at once), where the bytes dominate.
EXCHANGE_BYTES = (1 << 20, 4 << 20, 16 << 20)


def exchange(comm, sizes: Sequence[int], quick: bool) -> list[float]:
    """The best time per size of ranks 0 and 1 sending each other ``n``
    bytes at once (other ranks skip), timed from a common start."""
    out = []
    for n in sizes:
        send, recv = np.zeros(n, np.uint8), np.zeros(n, np.uint8)

        def both_ways() -> None:
            if comm.rank < 2:
                other = 1 - comm.rank
                s, r = comm.isend(send, other), comm.irecv(recv, other)
                s.wait()
                r.wait()

        out.append(slowest_best(comm, both_ways, 2 if quick else 5))
    return out


def rank_count_measurements(comm, quick: bool) -> tuple[list, list]:
    """What every job measures at its rank count besides the point-to-point
    probes at :data:`PROBE_BYTES`: the window probes at those sizes and
    every probe at :data:`STRETCH_BYTES` (for the stretch fit), and the
    anchors, in two passes around the probes whose best counts (this
    machine's speed drifts, at times by half, over a few seconds).
    Returns (probes, anchors)."""
    large = () if quick else LARGE_ANCHOR_BYTES
    first = measure_anchors(comm, 3 if quick else 5, large)
    windowed = measure_probes(comm, 3 if quick else 10, PROBE_BYTES, window_probes(comm))
    heavy = measure_probes(comm, 2 if quick else 5, STRETCH_BYTES, PROBES + window_probes(comm))
    second = measure_anchors(comm, 3 if quick else 5, large)
    anchors = [a[:4] + (min(a[4], b[4]),) for a, b in zip(first, second)]  # the same order in both
    return windowed + heavy, anchors
