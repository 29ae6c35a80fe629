"""``collectives calibrate``: measure alpha, beta, gamma and memory bandwidth.

    collectives calibrate [--transport NAME] [-n P] [--out PATH] [--quick] [--stretch-ranks LIST]

starts P local ranks (2 by default; ``mpiexec`` for ``--transport mpi``).
Ranks 0 and 1 run a ping-pong sweep from 0 bytes to 64 MiB; half the best
round trip per size is fitted to ``alpha + n beta`` by least squares,
weighted by 1/t so that small messages count. Where the transport changes
protocol with size, a piecewise fit (up to three pieces, the breakpoints
chosen among the measured sizes) replaces the single line when each piece
cuts the error by a tenth or more (a protocol change, or messages that no
longer fit the caches): the lower pieces go to ``protocol``. Ranks 0 and
1 then send each other 1, 4 and 16 MiB at once: the per-byte time of such
an exchange over a one-way message's is ``exchange`` (1 on a full-duplex
network; near 2 on shared memory, where each rank copies its message in and
its peer's out). Rank 0 also
measures gamma per dtype (seconds per byte of ``np.add(a, b, out=a)`` on 4 MiB), the copy bandwidth
(``np.copyto`` of 64 MiB) and the fence (the shared window's fence where
the transport has one, else a barrier of all ranks).

Then every rank runs a few small collectives (allreduce by recursive
doubling and by reduce + bcast, bcast and reduce by binomial tree, at 8 B
and 4 KiB): their times, less what the fitted model already predicts, are
fitted by least squares to ``call + k overhead``, k being the number of
messages on the algorithm's critical path. ``overhead`` is the CPU cost an
algorithm adds around each message (LogP's o) and ``call`` the fixed cost
of one call. For shared memory, whose ranks share one host by
construction, the profile also records the host's cores (``cores``).

Then the anchors (``anchors``): every algorithm the transport runs, timed
at its smallest size (one float32 per rank), which fixes the algorithm's own
fixed cost in :func:`~.model.predict`, at the pipeline segment (1 MiB: the
largest message sent whole, where the formulas change shape) and at 4 and
16 MiB (:data:`LARGE_ANCHOR_BYTES`); between and beyond them the
prediction scales what the formula adds with size to meet the measurements.

Last, the stretch table (``stretch``): the same probes plus 1 MiB ones run
(and the shared-window allreduce and bcast where the transport has a
window) run at P ranks and, in further jobs, at each count of
``--stretch-ranks`` (on shared memory by default every count above P up
to 8, or 4 per core); at each count the times are fitted to
``a L + b B + f F``, L, B and F being the message-latency, per-byte and
fence terms of the unstretched prediction. Ranks that outnumber the cores
wait for descheduled peers, which multiplies the latency terms far more
than the per-byte ones, and a fence waits for every rank; the measured
factors replace the ``p / cores`` guess. The stretch jobs measure the
anchors at their rank count too.

Profiles are JSON (:meth:`Params.as_dict` plus ``transport``, ``host``,
``ranks`` and the raw sweep), one per transport and host, in
``$XDG_CACHE_HOME/collectives/`` (default ``~/.cache/collectives/``) named
``profile-TRANSPORT-HOST.json``. ``COLLECTIVES_PROFILE`` overrides: a
directory holds the profiles, a ``.json`` path is the one profile used
for every transport. :func:`load_profile` falls back to :data:`DEFAULTS`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from collectives import config
from .model import Params
from .timing import slowest_best, slowest_best_each

__all__ = ["main", "load_profile", "profile_path", "fit_line", "fit_piecewise", "fit_overheads", "DEFAULTS",
           "measure_gamma", "measure_copy_bandwidth", "measure_probes", "measure_anchors", "anchor_sizes",
           "host_cores"]

#: Parameters used when a transport has no profile (seconds, bytes/s).
#: shm: copy through a shared ring, a few microseconds per message;
#: zmq: loopback TCP; mpi: MPICH shared memory; sim: the simulator's defaults.
DEFAULTS: dict[str, Params] = {
    "shm": Params(alpha=4e-6, beta=1 / 4e9, gamma=1 / 2e9, mem_bandwidth=8e9, fence=2e-6),
    "zmq": Params(alpha=40e-6, beta=1 / 1e9, gamma=1 / 2e9, mem_bandwidth=8e9, fence=100e-6),
    "mpi": Params(alpha=2e-6, beta=1 / 5e9, gamma=1 / 2e9, mem_bandwidth=8e9, fence=5e-6),
    "rdma": Params(alpha=3e-6, beta=1 / 10e9, gamma=1 / 2e9, mem_bandwidth=8e9, fence=10e-6),
    "sim": Params(alpha=2e-6, beta=1e-10, gamma=2.5e-10, mem_bandwidth=math.inf, fence=2e-6),
}
GENERIC = Params()
SWEEP_BYTES = [0, 8, 64, 512, 2048, 8192, 32768, 131072, 524288, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
GAMMA_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "collectives"


def profile_path(transport: str, host: str | None = None) -> Path:
    """Where the profile of ``transport`` on ``host`` (default: this host) lives."""
    override = config.get("PROFILE")
    if override and override.endswith(".json"):
        return Path(override)
    folder = Path(override) if override else _cache_dir()
    return folder / f"profile-{transport}-{host or socket.gethostname()}.json"


def load_profile(transport: str, path: str | os.PathLike | None = None) -> Params:
    """The calibrated parameters of ``transport``, or :data:`DEFAULTS` (``source`` says which).

    Args:
        transport: transport name.
        path: a profile file (default: :func:`profile_path`).

    Returns:
        :class:`Params`.
    """
    file = Path(path) if path is not None else profile_path(transport)
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return DEFAULTS.get(transport, GENERIC)
    params = Params.from_dict(data)
    return Params.from_dict({**params.as_dict(), "source": str(file)})


# ----------------------------------------------------------------- fitting


def fit_line(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``t = alpha + n beta`` weighted by 1/t.

    Returns:
        (alpha, beta, relative RMS error); alpha and beta clipped at 0.
    """
    n = np.asarray(sizes, float)
    t = np.asarray(times, float)
    w = 1.0 / np.maximum(t, 1e-12)
    A = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    alpha, beta = max(float(alpha), 0.0), max(float(beta), 0.0)
    err = float(np.sqrt(np.mean(((alpha + beta * n - t) * w) ** 2)))
    return alpha, beta, err


def _fit_pieces(sizes: Sequence[float], times: Sequence[float], cuts: Sequence[int]) -> tuple[list, float]:
    """Lines fitted on the pieces ``sizes[cuts[i]:cuts[i+1]]``; (pieces, overall error)."""
    bounds = [0, *cuts, len(sizes)]
    pieces, sq = [], 0.0
    for lo, hi in zip(bounds, bounds[1:]):
        a, b, e = fit_line(sizes[lo:hi], times[lo:hi])
        pieces.append((int(sizes[hi - 1]), a, b))
        sq += e * e * (hi - lo)
    return pieces, math.sqrt(sq / len(sizes))


def fit_piecewise(sizes: Sequence[float], times: Sequence[float], max_pieces: int = 3,
                  min_points: int = 3) -> dict[str, Any]:
    """A line per size range: one more piece (split at measured sizes) each time
    it cuts the error by a tenth, up to ``max_pieces`` of at least ``min_points``.

    Returns:
        ``{"alpha", "beta", "protocol", "error"}``: the last piece's line, and
        the lower pieces as ``protocol`` ``[(up_to_bytes, alpha, beta), ...]``.
    """
    n = len(sizes)
    pieces, err = _fit_pieces(sizes, times, [])
    for count in range(2, max_pieces + 1):
        best = None
        for cuts in itertools.combinations(range(min_points, n - min_points + 1), count - 1):
            if any(b - a < min_points for a, b in zip(cuts, cuts[1:])):
                continue
            cand = _fit_pieces(sizes, times, cuts)
            if best is None or cand[1] < best[1]:
                best = cand
        if best is None or best[1] >= 0.9 * err:
            break
        pieces, err = best
    *lower, (_, alpha, beta) = pieces
    return {"alpha": alpha, "beta": beta, "protocol": lower, "error": err}


# --------------------------------------------------------------- measuring


def _best(fn, repeats: int) -> float:
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
        out[name] = _best(lambda: np.add(a, b, out=a), repeats) / a.nbytes
    return out


def measure_copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Bytes per second of ``np.copyto`` of ``nbytes``."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    return nbytes / _best(lambda: np.copyto(dst, src), repeats)


def _window_fence(comm, rounds: int, runs: int = 10) -> float | None:
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
#: the last is the direct path's (and, over TCP, that of buffers that no
#: longer fit the cache).
LARGE_ANCHOR_BYTES = (4 << 20, 16 << 20)


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


def fit_stretch(probes: Sequence[tuple[str, str, int, float]], params: Params,
                p: int) -> tuple[float, float, float, float]:
    """Least-squares ``(message latency, message bytes, fence, local)`` factors at ``p`` ranks.

    Each probe time is modelled as ``a L + b B + f F + c C`` with ``(L, B, F, C)``
    the terms of its unstretched prediction
    (:func:`~collectives.cost_models.model.split_terms`); residuals are
    relative, so that microsecond and millisecond probes weigh alike. A
    factor that comes out non-positive, or whose terms no probe has, is
    dropped and set to the mean of the others.
    """
    from .model import split_terms

    t = np.array([probe[3] for probe in probes], dtype=float)
    if not len(t) or p < 2:
        return 1.0, 1.0, 1.0, 1.0
    A = np.array([split_terms(c, a, p, n, params) for c, a, n, _ in probes], dtype=float) / t[:, None]
    y = np.ones_like(t)
    keep = [j for j in range(4) if A[:, j].any()]
    while keep:
        coef, *_ = np.linalg.lstsq(A[:, keep], y, rcond=None)
        bad = [j for j, c in zip(keep, coef) if c <= 0]
        if not bad:
            break
        keep.remove(bad[0])
    factors = dict(zip(keep, coef)) if keep else {}
    fill = float(np.mean(list(factors.values()))) if factors else 1.0
    return tuple(float(factors.get(j, fill)) for j in range(4))  # type: ignore[return-value]


def fit_overheads(probes: Sequence[tuple[str, str, int, float]], params: Params, p: int) -> tuple[float, float]:
    """Least-squares ``(overhead, call)`` from probe times (both clipped at 0).

    Each probe's residual ``t - predict(o=0, call=0)`` is modelled as
    ``call + k o`` with ``k`` the derivative of the prediction in ``o``.
    """
    from .model import predict

    if p < 2 or not probes:
        return 0.0, 0.0
    base = replace(params, overhead=0.0, call=0.0, cores=0)
    unit = replace(base, overhead=1e-6)
    rows, rhs = [], []
    for collective, algorithm, nbytes, t in probes:
        t0 = predict(collective, algorithm, p, nbytes, base)
        k = (predict(collective, algorithm, p, nbytes, unit) - t0) / 1e-6
        rows.append([1.0, k])
        rhs.append(t - t0)
    (call, overhead), *_ = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)
    if overhead < 0:
        overhead, call = 0.0, float(np.median(rhs))
    if call < 0:
        call = 0.0
        ks = np.array([r[1] for r in rows])
        overhead = max(float(np.dot(ks, rhs) / max(np.dot(ks, ks), 1e-30)), 0.0)
    return float(overhead), float(call)


def host_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _pingpong(comm, sizes: Sequence[int], quick: bool) -> list[float]:
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


#: Sizes of the exchange probe (a rank sends and receives at once), where the bytes dominate.
EXCHANGE_BYTES = (1 << 20, 4 << 20, 16 << 20)


def _exchange(comm, sizes: Sequence[int], quick: bool) -> list[float]:
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


def fit_exchange(sizes: Sequence[int], seconds: Sequence[float], params: Params) -> float:
    """The exchange factor (:attr:`~.model.Params.exchange`): the median over
    ``sizes`` of the measured exchange's per-byte time over a one-way
    message's, kept within [1, 4]."""
    ratios = [(t - params.msg(0)) / (params.msg(n) - params.msg(0))
              for n, t in zip(sizes, seconds) if params.msg(n) > params.msg(0)]
    return float(min(max(np.median(ratios), 1.0), 4.0)) if ratios else 1.0


def rank_main(out: str | None, quick: bool) -> int:
    """What every rank of the calibration job runs."""
    import collectives

    comm = collectives.init()
    sizes = SWEEP_BYTES[:8] if quick else SWEEP_BYTES
    times = _pingpong(comm, sizes, quick) if comm.size > 1 else []
    exchanges = _exchange(comm, EXCHANGE_BYTES, quick) if comm.size > 1 else []
    comm.barrier()
    fence = _window_fence(comm, 20 if quick else 50)
    if fence is None:
        fence = _best(comm.barrier, 5 if quick else 50)
    probes = measure_probes(comm, 3 if quick else 20) if comm.size > 1 else []
    extra, anchors = rank_count_measurements(comm, quick) if comm.size > 1 else ([], [])
    name, p, cores = comm.transport.name, comm.size, comm.transport.cores or host_cores()
    comm.close()
    if comm.rank != 0:
        return 0
    fit = fit_piecewise(sizes, times) if times else {"alpha": DEFAULTS.get(name, GENERIC).alpha,
                                                     "beta": DEFAULTS.get(name, GENERIC).beta,
                                                     "protocol": [], "error": 0.0}
    gammas = measure_gamma(1 << 20 if quick else 4 << 20)
    params = Params(alpha=fit["alpha"], beta=fit["beta"], gamma=gammas.get("float32", GENERIC.gamma),
                    gamma_by_dtype=gammas, mem_bandwidth=measure_copy_bandwidth(16 << 20 if quick else 64 << 20),
                    fence=fence, protocol=tuple(tuple(t) for t in fit["protocol"]))
    params = replace(params, exchange=fit_exchange(EXCHANGE_BYTES, exchanges, params))
    overhead, call = fit_overheads(probes, params, p)
    params = replace(params, overhead=overhead, call=call, cores=cores if name == "shm" else 0)
    if p > 1:
        params = replace(params, stretch=((p, *fit_stretch(probes + extra, params, p)),),
                         anchors=tuple(anchors))
    path = Path(out) if out else profile_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**params.as_dict(), "transport": name, "host": socket.gethostname(), "ranks": comm.size,
            "fit_error": fit["error"], "sweep": {"bytes": list(sizes), "seconds": times},
            "probes": [list(t) for t in probes + extra],
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    data.pop("source", None)
    path.write_text(json.dumps(data, indent=2))
    print(f"{name}: alpha={params.alpha * 1e6:.2f} us, beta={params.beta * 1e9:.4f} ns/B "
          f"({1e-9 / max(params.beta, 1e-30):.2f} GB/s), gamma(float32)={params.gamma * 1e9:.3f} ns/B, "
          f"copy {params.mem_bandwidth / 1e9:.2f} GB/s, fence {fence * 1e6:.2f} us, "
          f"exchange x{params.exchange:.2f}, "
          f"overhead {overhead * 1e6:.2f} us/msg, call {call * 1e6:.2f} us, "
          f"{len(params.protocol) + 1} piece(s), fit error {fit['error']:.1%}\nprofile: {path}")
    return 0


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


def stretch_main(out: str, quick: bool) -> int:
    """What every rank of a stretch job runs: the probes at this rank count;
    rank 0 writes them to ``out`` (JSON)."""
    import collectives

    comm = collectives.init()
    probes = measure_probes(comm, 3 if quick else 10)
    extra, anchors = rank_count_measurements(comm, quick)
    probes += extra
    comm.close()
    if comm.rank == 0:
        Path(out).write_text(json.dumps({"probes": probes, "anchors": anchors}))
    return 0


def _ran(launch_job, p: int, out: str, tries: int) -> bool:
    """Run a stretch job until it succeeds, at most ``tries`` times (one
    failed start, such as a rendezvous that timed out, should not cost a
    rank count its factors)."""
    for attempt in range(tries):
        if launch_job(p, out) == 0 and os.path.exists(out):
            return True
        if attempt + 1 < tries:
            print(f"calibrate: the {p}-rank stretch job failed; trying again", file=sys.stderr)
    return False


def add_stretch(path: Path, ranks: Sequence[int], launch_job) -> None:
    """Measure the probes at each rank count of ``ranks`` (``launch_job(p,
    out) -> status`` runs one stretch job) and add the fitted factors to the
    profile at ``path``."""
    data = json.loads(path.read_text())
    params = Params.from_dict(data)
    table = {int(t[0]): tuple(t[1:]) for t in params.stretch}
    anchors = [t for t in data.get("anchors", ()) if int(t[2]) not in ranks]
    with tempfile.TemporaryDirectory() as tmp:
        for p in ranks:
            out = os.path.join(tmp, f"probes-{p}.json")
            if not _ran(launch_job, p, out, tries=2):
                print(f"calibrate: the {p}-rank stretch job failed twice; no factors for {p} ranks",
                      file=sys.stderr)
                continue
            job = json.loads(Path(out).read_text())
            probes = [tuple(t) for t in job["probes"]]
            table[p] = fit_stretch(probes, replace(params, stretch=(), anchors=()), p)
            anchors += job["anchors"]
    data["stretch"] = [[p, *table[p]] for p in sorted(table)]
    data["anchors"] = anchors
    path.write_text(json.dumps(data, indent=2))
    print("stretch (ranks: message latency x, message bytes x, fence x, local x): "
          + ", ".join(f"{p}: {a:.2f}, {b:.2f}, {f:.2f}, {c:.2f}" for p, (a, b, f, c) in sorted(table.items())))


def default_stretch_ranks(transport: str, nprocs: int) -> list[int]:
    """Rank counts measured for the stretch table: on shared memory every
    count above the main job's up to 8 (or 4 per core), elsewhere none."""
    if transport != "shm":
        return []
    return list(range(nprocs + 1, max(8, 4 * host_cores()) + 1))


def main(argv: Sequence[str] | None = None) -> int:
    """``collectives calibrate [--transport NAME] [-n P] [--out PATH] [--quick]``."""
    ap = argparse.ArgumentParser(prog="collectives calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="shm", help="transport to calibrate (default: shm)")
    ap.add_argument("-n", "--nprocs", type=int, default=2, help="ranks (default 2; ranks 0 and 1 ping-pong)")
    ap.add_argument("--out", default=None, help="profile path (default: the user cache directory)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    ap.add_argument("--timeout", type=float, default=300.0, help="stop after this many seconds")
    ap.add_argument("--stretch-ranks", default=None,
                    help="comma list of rank counts whose stretch factors are measured "
                         "(default on shm: every count above -n up to 8; 'none' to skip)")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stretch-main", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.rank_main:
        return rank_main(ns.out, ns.quick)
    if ns.stretch_main:
        return stretch_main(ns.out, ns.quick)
    module = [sys.executable, "-m", "collectives.cost_models.calibrate"]
    flags = ["--quick"] if ns.quick else []

    def run_job(p: int, mode: str, out: str | None) -> int:
        cmd = [*module, mode, *(["--out", out] if out else []), *flags]
        if ns.transport == "mpi":
            try:
                return subprocess.run(["mpiexec", "-n", str(p), *cmd], timeout=ns.timeout).returncode
            except subprocess.TimeoutExpired:
                return 124
        from collectives.launcher import launch

        return launch(cmd, p, transport=ns.transport, prefix=False, timeout=ns.timeout)

    status = run_job(ns.nprocs, "--rank-main", ns.out)
    if ns.stretch_ranks is None:
        ranks = default_stretch_ranks(ns.transport, ns.nprocs)
    elif ns.stretch_ranks.strip().lower() in ("", "none"):
        ranks = []
    else:
        ranks = [int(x) for x in ns.stretch_ranks.split(",") if x.strip()]
    if status == 0 and ranks:
        add_stretch(Path(ns.out) if ns.out else profile_path(ns.transport), ranks,
                    lambda p, out: run_job(p, "--stretch-main", out))
    return status


if __name__ == "__main__":
    sys.exit(main())
