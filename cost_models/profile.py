"""Calibration profiles: where they live, loading and saving them.

A profile is what ``collectives calibrate`` measured for one transport on
one host: JSON (:meth:`Params.as_dict` plus ``transport``, ``host``,
``ranks`` and the raw sweep), one per transport and host, in
``$XDG_CACHE_HOME/collectives/`` (default ``~/.cache/collectives/``) named
``profile-TRANSPORT-HOST.json``. ``COLLECTIVES_PROFILE`` overrides: a
directory holds the profiles, a ``.json`` path is the one profile used
for every transport. :func:`load_profile` falls back to :data:`DEFAULTS`.

The selector loads a profile at run time; the calibration command
(:mod:`.calibrate`) writes one.
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path
from typing import Any

from collectives import config

from .model import Params

__all__ = ["DEFAULTS", "GENERIC", "profile_path", "find_profile", "read_profile", "load_profile", "save_profile",
           "host_cores", "UNSTEADY_SPREAD", "unsteady"]

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
#: Parameters of a transport that has neither a profile nor an entry in :data:`DEFAULTS`.
GENERIC = Params()
#: A profile whose latency probes (``latency_probes``: the time of one
#: 8-byte allreduce, taken before each step of a calibration job and at its
#: end) differ by more than this factor within one job was measured while
#: the host changed state.
UNSTEADY_SPREAD = 1.5


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


def find_profile(transport: str) -> Path | None:
    """This host's calibration profile of ``transport``, or None where there is none."""
    file = profile_path(transport)
    return file if file.is_file() else None


def load_profile(transport: str, path: str | os.PathLike | None = None) -> Params:
    """The calibrated parameters of ``transport``, or :data:`DEFAULTS` (``source`` says which).

    Args:
        transport: transport name.
        path: a profile file (default: :func:`profile_path`).

    Returns:
        :class:`Params`.
    """
    file = Path(path) if path is not None else profile_path(transport)
    data = read_profile(file, str(file))
    if data is None:
        return DEFAULTS.get(transport, GENERIC)
    return Params.from_dict(data)


def read_profile(file: Path, source: str) -> dict[str, Any] | None:
    """The profile at ``file`` (None where it cannot be read), without the
    anchors of algorithms whose code changed since they were measured
    (:func:`~.digests.drop_stale_anchors`); ``source`` is where it came
    from, with a word on any anchors dropped."""
    from .digests import drop_stale_anchors

    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    data, stale = drop_stale_anchors(data)
    if stale:
        shown = ", ".join(stale[:4]) + (f" and {len(stale) - 4} more" if len(stale) > 4 else "")
        source += (f"; without the measured times of {len(stale)} algorithm(s) whose code changed since "
                   f"(or that carry no digest): {shown}; `collectives calibrate` measures them again")
    note = unsteady(data)
    if note:
        source += f"; {note}"
    data["source"] = source
    return data


def unsteady(data: dict[str, Any]) -> str:
    """A word on a profile measured while the host changed state, else '':
    within one calibration job (probes of other rank counts are not
    compared, as more ranks share the cores), two ``latency_probes``
    (each ``[ranks, when, seconds]``) differ by more than :data:`UNSTEADY_SPREAD`."""
    jobs: dict[int, list[tuple[str, float]]] = {}
    for t in data.get("latency_probes", ()):
        if isinstance(t, (list, tuple)) and len(t) == 3 and float(t[2]) > 0:
            jobs.setdefault(int(t[0]), []).append((str(t[1]), float(t[2])))
    worst = None
    for p, probes in sorted(jobs.items()):
        low, high = min(probes, key=lambda t: t[1]), max(probes, key=lambda t: t[1])
        if high[1] > UNSTEADY_SPREAD * low[1] and (worst is None or high[1] / low[1] > worst[0]):
            worst = (high[1] / low[1], p, low, high)
    if worst is None:
        return ""
    _, p, (low_at, low), (high_at, high) = worst
    return (f"measured while the host changed state: in the {p}-rank job an 8-byte allreduce took "
            f"{low * 1e6:.2f} us {low_at} and {high * 1e6:.2f} us {high_at}; its times mix both states, "
            f"so calibrate again when the host is steady")


def save_profile(path: Path, data: dict[str, Any]) -> None:
    """Write the profile ``data`` (JSON) to ``path``, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def host_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
