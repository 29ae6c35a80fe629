"""Timelines: every rank's collectives as Chrome trace / Perfetto JSON.

``COLLECTIVES_TRACE=DIR`` (or ``collectives bench --trace DIR``) makes every
rank write ``DIR/rank<r>.json`` when its communicator closes: one complete
event (``"ph": "X"``) per collective, with its sequence number, algorithm,
op, root, dtype, count and bytes, and, inside it, its phases where the
algorithm has them (``waiting`` for peers, ``copying`` into and out of
the shared window or peers' buffers, ``sending``/``receiving`` messages,
``reducing``). Times are microseconds of this host's monotonic
clock; the file also holds one pair of (monotonic, wall) readings so that
ranks of several hosts can be put on one clock.

``collectives trace merge DIR -o timeline.json`` (:func:`merge`) puts the
ranks on one timeline, one track per rank, aligned on a common clock (the
monotonic clock on one host; across hosts, the offsets that make the ends
of the synchronising collectives coincide), and reports each collective's
arrival skew: how long the first rank to arrive waited for the last, and
who that was. Open the result in https://ui.perfetto.dev or
chrome://tracing. A directory of several jobs' timelines (one
subdirectory each, as ``collectives bench --trace`` writes them when it
starts several jobs) is merged job by job (:func:`merge_jobs`).

Tracing records every call and takes the full path of each (prepared calls
are not used while it is on): it costs more, but only when asked for.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator, Sequence

from . import config, signature

__all__ = ["Tracer", "trace_dir", "phase", "merge", "merge_jobs", "jobs", "arrival_skew", "active", "COPYING"]

#: The phase of a shared-window algorithm's copies into and out of the
#: window, or between the ranks' buffers (timed only while tracing).
COPYING = "copying"

#: The tracer of the call running in this thread (phases land in it), or None.
_current = threading.local()


def trace_dir() -> str | None:
    """Where timelines go (``COLLECTIVES_TRACE``), or None when tracing is off."""
    return config.get("TRACE") or None


def active() -> "Tracer | None":
    """The tracer of the call running in this thread, or None."""
    return getattr(_current, "tracer", None)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time a phase of the running call (``waiting``, ``sending``, ...) when tracing."""
    tracer = getattr(_current, "tracer", None)
    if tracer is None:
        yield
        return
    t0 = time.monotonic()
    try:
        yield
    finally:
        tracer.phase(name, t0, time.monotonic())


class Tracer:
    """One rank's timeline.

    Args:
        directory: where ``rank<r>.json`` is written.
        rank, size: the communicator's.
        transport: the transport's name.
    """

    def __init__(self, directory: str, rank: int, size: int, transport: str) -> None:
        self.directory, self.rank, self.size, self.transport = directory, rank, size, transport
        self.events: list[dict] = []
        self._open: dict | None = None

    def begin(self, seq: int, sig: signature.Sig, itemsize: int) -> None:
        """A call starts (its phases go to it until :meth:`end`)."""
        f = signature.fields(sig)
        self._open = {"seq": seq, "collective": f["collective"], "algorithm": f["algorithm"], "op": f["op"],
                      "root": f["root"], "dtype": f["dtype"], "count": f["count"],
                      "bytes": f["count"] * itemsize, "phases": []}
        _current.tracer = self

    def phase(self, name: str, t0: float, t1: float) -> None:
        if self._open is not None:
            self._open["phases"].append((name, t0, t1))

    def end(self, start: float, end: float, state: str) -> None:
        """The call ends (``state``: completed or failed)."""
        _current.tracer = None
        call, self._open = self._open, None
        if call is None:
            return
        phases = call.pop("phases")
        name = call["collective"]
        self.events.append({"name": name, "cat": "collective", "ph": "X", "ts": start * 1e6,
                            "dur": max(0.0, end - start) * 1e6, "pid": self.rank, "tid": 0,
                            "args": {**call, "state": state}})
        for pname, t0, t1 in phases:
            self.events.append({"name": pname, "cat": "phase", "ph": "X", "ts": t0 * 1e6,
                                "dur": max(0.0, t1 - t0) * 1e6, "pid": self.rank, "tid": 0,
                                "args": {"seq": call["seq"]}})

    def write(self) -> str:
        """Write ``rank<r>.json``; returns its path."""
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"rank{self.rank}.json")
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}}]
        doc = {"traceEvents": meta + self.events, "displayTimeUnit": "ms",
               "otherData": {"rank": self.rank, "size": self.size, "host": socket.gethostname(),
                             "pid": os.getpid(), "transport": self.transport,
                             "monotonic": time.monotonic(), "time": time.time()}}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
        return path


#: Collectives whose end is a synchronisation point (every rank leaves once all arrived).
_SYNCHRONISING = {"allreduce", "allgather", "alltoall", "barrier", "reduce_scatter"}


def _has_ranks(directory: str) -> bool:
    return any(n.startswith("rank") and n.endswith(".json") for n in os.listdir(directory))


def jobs(directory: str) -> list[tuple[str, str]]:
    """(name, directory) of every job's timelines under ``directory``:
    ``directory`` itself when it holds ``rank*.json`` (name ``""``), else
    each subdirectory that does, by name."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no such directory: {directory}")
    if _has_ranks(directory):
        return [("", directory)]
    found = [(n, os.path.join(directory, n)) for n in sorted(os.listdir(directory))
             if os.path.isdir(os.path.join(directory, n)) and _has_ranks(os.path.join(directory, n))]
    if not found:
        raise FileNotFoundError(f"no rank*.json timelines in {directory} or its subdirectories")
    return found


def _load(directory: str) -> list[dict]:
    found = jobs(directory)
    if len(found) > 1:
        raise ValueError(f"{directory} holds several jobs' timelines ({', '.join(n for n, _ in found)}): "
                         "merge one of them, or all with merge_jobs")
    directory = found[0][1]
    docs = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                docs.append(json.load(f))
    return sorted(docs, key=lambda d: d["otherData"]["rank"])


def _calls(doc: dict) -> dict[int, dict]:
    return {e["args"]["seq"]: e for e in doc["traceEvents"] if e.get("cat") == "collective"}


def _offsets(docs: list[dict]) -> list[float]:
    """Microseconds to add to each rank's times to put them on rank 0's clock:
    one offset per host (its ranks share a monotonic clock), the median over
    its ranks' synchronising calls of how much earlier their ends are than
    rank 0's."""
    hosts = [d["otherData"]["host"] for d in docs]
    if len(set(hosts)) == 1:
        return [0.0] * len(docs)  # one monotonic clock
    base = _calls(docs[0])
    diffs: dict[str, list[float]] = defaultdict(list)
    for d, host in zip(docs, hosts):
        diffs[host] += [(base[s]["ts"] + base[s]["dur"]) - (e["ts"] + e["dur"]) for s, e in _calls(d).items()
                        if s in base and e["name"] in _SYNCHRONISING]
    b = docs[0]["otherData"]
    per_host = {hosts[0]: 0.0}
    for d, host in zip(docs, hosts):
        if host in per_host:
            continue
        if diffs[host]:
            per_host[host] = statistics.median(diffs[host])
        else:  # wall clocks as a last resort
            o = d["otherData"]
            per_host[host] = ((o["time"] - o["monotonic"]) - (b["time"] - b["monotonic"])) * 1e6
    return [per_host[h] for h in hosts]


def arrival_skew(docs: list[dict], offsets: Sequence[float] | None = None) -> list[dict]:
    """Per collective call: how long the first rank to arrive waited for the
    last (microseconds), and which rank came last."""
    offsets = offsets if offsets is not None else _offsets(docs)
    by_seq: dict[int, dict[int, dict]] = defaultdict(dict)
    for d, off in zip(docs, offsets):
        for seq, e in _calls(d).items():
            by_seq[seq][d["otherData"]["rank"]] = {**e, "ts": e["ts"] + off}
    out = []
    for seq in sorted(by_seq):
        ranks = by_seq[seq]
        if len(ranks) < 2:
            continue
        first = min(ranks, key=lambda r: ranks[r]["ts"])
        last = max(ranks, key=lambda r: ranks[r]["ts"])
        any_event = next(iter(ranks.values()))
        out.append({"seq": seq, "collective": any_event["name"], "skew_us": ranks[last]["ts"] - ranks[first]["ts"],
                    "first": first, "last": last})
    return out


def merge(directory: str, out: str) -> dict:
    """Merge every rank's timeline in ``directory`` into ``out`` (one track per
    rank, one clock); returns a summary with the arrival skews."""
    docs = _load(directory)
    offsets = _offsets(docs)
    events = []
    for d, off in zip(docs, offsets):
        for e in d["traceEvents"]:
            events.append({**e, "ts": e["ts"] + off} if "ts" in e else e)
    skews = arrival_skew(docs, offsets)
    with open(out, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {"ranks": len(docs), "offsets_us": offsets}}, f)
    late = defaultdict(int)
    for s in skews:
        late[s["last"]] += 1
    return {"ranks": len(docs), "calls": len(skews), "offsets_us": offsets, "skews": skews,
            "last_most_often": max(late, key=late.get) if late else None}


def merge_jobs(directory: str, out: str) -> list[tuple[str, str, dict]]:
    """Merge every job's timelines under ``directory`` (see :func:`jobs`):
    one job into ``out``; several, each into ``out``'s name with ``-<job>``
    before its extension. Returns (job, file written, :func:`merge`'s
    summary) of each."""
    found = jobs(directory)
    if len(found) == 1:
        return [(found[0][0], out, merge(found[0][1], out))]
    stem, ext = os.path.splitext(out)
    done = []
    for name, where in found:
        path = f"{stem}-{name}{ext or '.json'}"
        done.append((name, path, merge(where, path)))
    return done
