"""``collectives calibrate``: measure alpha, beta, gamma and memory bandwidth.

    collectives calibrate [--transport NAME] [-n P] [--out PATH] [--quick]

starts P local ranks (2 by default; ``mpiexec`` for ``--transport mpi``).
Ranks 0 and 1 run a ping-pong sweep from 0 bytes to 4 MiB; half the best
round trip per size is fitted to ``alpha + n beta`` by least squares,
weighted by 1/t so that small messages count. Where the transport changes
protocol with size, a two-piece fit (the breakpoint chosen among the
measured sizes) replaces the single line when it cuts the error by half:
the lower piece goes to ``protocol``. Rank 0 also measures gamma per dtype
(seconds per byte of ``np.add(a, b, out=a)`` on 4 MiB), the copy bandwidth
(``np.copyto`` of 64 MiB) and the fence (a barrier of all ranks).

Profiles are JSON (:meth:`Params.as_dict` plus ``transport``, ``host``,
``ranks`` and the raw sweep), one per transport and host, in
``$XDG_CACHE_HOME/collectives/`` (default ``~/.cache/collectives/``) named
``profile-TRANSPORT-HOST.json``. ``COLLECTIVES_PROFILE`` overrides: a
directory holds the profiles, a ``.json`` path is the one profile used
for every transport. :func:`load_profile` falls back to :data:`DEFAULTS`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .model import Params

__all__ = ["main", "load_profile", "profile_path", "fit_line", "fit_piecewise", "DEFAULTS",
           "measure_gamma", "measure_copy_bandwidth"]

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
SWEEP_BYTES = [0, 8, 64, 512, 2048, 8192, 32768, 131072, 524288, 1 << 20, 4 << 20]
GAMMA_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "collectives"


def profile_path(transport: str, host: str | None = None) -> Path:
    """Where the profile of ``transport`` on ``host`` (default: this host) lives."""
    override = os.environ.get("COLLECTIVES_PROFILE")
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


def fit_piecewise(sizes: Sequence[float], times: Sequence[float]) -> dict[str, Any]:
    """One line, or two pieces split at a measured size when that halves the error.

    Returns:
        ``{"alpha", "beta", "protocol", "error"}`` (protocol: [(bound, alpha, beta)] or []).
    """
    alpha, beta, err = fit_line(sizes, times)
    best = {"alpha": alpha, "beta": beta, "protocol": [], "error": err}
    for k in range(3, len(sizes) - 2):
        a1, b1, e1 = fit_line(sizes[:k], times[:k])
        a2, b2, e2 = fit_line(sizes[k:], times[k:])
        e = math.sqrt((e1 ** 2 * k + e2 ** 2 * (len(sizes) - k)) / len(sizes))
        if e < best["error"] / 2 and e < err / 2:
            best = {"alpha": a2, "beta": b2, "protocol": [(int(sizes[k - 1]), a1, b1)], "error": e}
    return best


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


def _pingpong(comm, sizes: Sequence[int], quick: bool) -> list[float]:
    """Half the best round trip per size (ranks 0 and 1; other ranks skip)."""
    out = []
    for n in sizes:
        buf = np.zeros(n, np.uint8)
        reps = 3 if quick else (30 if n <= 65536 else 8)
        best = math.inf
        for _ in range(reps + 1):
            comm.barrier()
            t0 = time.perf_counter()
            if comm.rank == 0:
                comm.send(buf, 1)
                comm.recv(buf, 1)
            elif comm.rank == 1:
                comm.recv(buf, 0)
                comm.send(buf, 0)
            best = min(best, time.perf_counter() - t0)
        out.append(best / 2)
    return out


def rank_main(out: str | None, quick: bool) -> int:
    """What every rank of the calibration job runs."""
    import collectives

    comm = collectives.init()
    sizes = SWEEP_BYTES[:8] if quick else SWEEP_BYTES
    times = _pingpong(comm, sizes, quick) if comm.size > 1 else []
    comm.barrier()
    fence = _best(comm.barrier, 5 if quick else 50)
    name = comm.transport.name
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
    path = Path(out) if out else profile_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**params.as_dict(), "transport": name, "host": socket.gethostname(), "ranks": comm.size,
            "fit_error": fit["error"], "sweep": {"bytes": list(sizes), "seconds": times},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    data.pop("source", None)
    path.write_text(json.dumps(data, indent=2))
    print(f"{name}: alpha={params.alpha * 1e6:.2f} us, beta={params.beta * 1e9:.4f} ns/B "
          f"({1e-9 / max(params.beta, 1e-30):.2f} GB/s), gamma(float32)={params.gamma * 1e9:.3f} ns/B, "
          f"copy {params.mem_bandwidth / 1e9:.2f} GB/s, fence {fence * 1e6:.2f} us, "
          f"{len(params.protocol) + 1} piece(s), fit error {fit['error']:.1%}\nprofile: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``collectives calibrate [--transport NAME] [-n P] [--out PATH] [--quick]``."""
    ap = argparse.ArgumentParser(prog="collectives calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="shm", help="transport to calibrate (default: shm)")
    ap.add_argument("-n", "--nprocs", type=int, default=2, help="ranks (default 2; ranks 0 and 1 ping-pong)")
    ap.add_argument("--out", default=None, help="profile path (default: the user cache directory)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    ap.add_argument("--timeout", type=float, default=300.0, help="stop after this many seconds")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.rank_main:
        return rank_main(ns.out, ns.quick)
    cmd = [sys.executable, "-m", "collectives.cost_models.calibrate", "--rank-main"]
    cmd += (["--out", ns.out] if ns.out else []) + (["--quick"] if ns.quick else [])
    if ns.transport == "mpi":
        try:
            return subprocess.run(["mpiexec", "-n", str(ns.nprocs), *cmd], timeout=ns.timeout).returncode
        except subprocess.TimeoutExpired:
            return 124
    from collectives.launcher import launch

    return launch(cmd, ns.nprocs, transport=ns.transport, prefix=False, timeout=ns.timeout)


if __name__ == "__main__":
    sys.exit(main())
