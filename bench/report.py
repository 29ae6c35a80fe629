"""Tables, machine-readable results and comparisons of bench runs.

* :func:`table`: an nccl-tests style table (p50, p99, min, max), with time and
  ratio columns (ours / peer, at p50 and at p99) when peers ran in the same
  sweep, and the ratio to the faster MPI when MPICH and Open MPI both ran;
* :func:`peer_labels` and :func:`mpi_legend`: the column name of each peer
  ("mpich", "openmpi") and the line that names each MPI and its version;
* :func:`merge_repeats`: one row per measurement from several repeats of a sweep;
* :func:`summary_table`: one line per size, a time column per algorithm and
  peer, and ours / peer ratios of the best algorithm and of ``auto``;
* :func:`results_document` and :func:`validate`: the JSON written by
  ``--json`` and its check against ``schema.json`` (no dependency needed);
* :func:`baseline_table`: the change against an earlier run's JSON.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import time
from importlib import resources
from typing import Any, Sequence

__all__ = ["merge_repeats", "table", "summary_table", "results_document", "load_schema", "validate", "baseline_table",
           "peer_labels", "mpi_legend", "uneven_rounds", "MPI_PEERS"]

_HEAD = (f"{'size(B)':>11} {'algorithm':>26} {'mode':>8} {'time(us)':>10} {'p99(us)':>9} {'min(us)':>9} "
         f"{'max(us)':>9} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6}")
#: The peers that are an MPI library (their rows name it in "mpi").
MPI_PEERS = ("mpi", "openmpi")
#: The column of the ratio to the faster of the MPIs (when more than one ran).
FASTER_MPI = "fasterMPI"


def peer_labels(rows: Sequence[dict[str, Any]], peers: Sequence[str]) -> dict[str, str]:
    """Each peer's column name: an MPI peer by its library ("mpich", "openmpi") as its rows
    record it, another by its own name."""
    labels = {}
    for peer in peers:
        lib = next((r.get("mpi") for r in rows if r.get("peer") == peer and r.get("mpi")), None)
        if peer in MPI_PEERS and lib:
            labels[peer] = "openmpi" if lib.startswith("Open MPI") else lib.split()[0].lower()
        else:
            labels[peer] = peer
    return labels


def mpi_legend(rows: Sequence[dict[str, Any]], peers: Sequence[str], commands: dict[str, str] | None = None) -> str:
    """"# mpich = MPICH 5.0.2 (...); openmpi = Open MPI 5.0.11 (...)": which MPI each column is; "" without one."""
    labels = peer_labels(rows, peers)
    parts = []
    for peer in peers:
        lib = next((r.get("mpi") for r in rows if r.get("peer") == peer and r.get("mpi")), None)
        if lib:
            how = (commands or {}).get(peer)
            parts.append(f"{labels[peer]} = {lib}" + (f" ({how})" if how else ""))
    return "# " + "; ".join(parts) if parts else ""


def _mpis(peers: Sequence[str]) -> list[str]:
    """The MPI peers among ``peers`` when there are two or more (then a faster-MPI ratio is shown)."""
    found = [p for p in peers if p in MPI_PEERS]
    return found if len(found) > 1 else []


def _key(row: dict[str, Any]) -> tuple:
    return (row["collective"], row["size"], row["mode"])


def _short(algorithm: str) -> str:
    """An algorithm's name in at most 26 characters (``auto:`` kept: it says what auto chose)."""
    return algorithm if len(algorithm) <= 26 else algorithm[:25] + "~"


def _base(algorithm: str) -> str:
    """"auto:ring" -> "auto" (the choice may change between runs)."""
    return algorithm.split(":", 1)[0]


def table(rows: Sequence[dict[str, Any]], peers: Sequence[str] = (), labels: dict[str, str] | None = None) -> str:
    """Our rows as a table per collective: p50 (time), p99, min and max; for each peer its p50 and
    ours/peer at p50, its p99 and ours/peer at p99 (ratio < 1: ours is faster); with two MPIs,
    ours / the faster of them (p50)."""
    labels = labels or {}
    ours = [r for r in rows if r["peer"] == "ours"]
    theirs = {(r["peer"],) + _key(r): r for r in rows if r["peer"] != "ours"}
    mpis = _mpis(peers)
    out = []
    for coll in dict.fromkeys(r["collective"] for r in ours):
        extra = "".join(f" {labels.get(peer, peer) + '(us)':>11} {'ratio':>6} {labels.get(peer, peer) + '-p99':>11}"
                        f" {'ratio':>6}" for peer in peers)
        extra += f" {FASTER_MPI:>10}" if mpis else ""
        first = next(r for r in ours if r["collective"] == coll)
        what = f"dtype {first['dtype']}" + (f", op {first['op']}" if first["op"] not in ("", "-", "none", None)
                                             and coll in ("allreduce", "reduce", "reduce_scatter") else "") \
            + (f", root {first['root']}" if first["root"] not in (-1, None) else "")
        out += [f"# {coll} ({what})", "#" + _HEAD[1:] + extra]
        for r in (r for r in ours if r["collective"] == coll):
            p99 = r.get("time_us_p99")
            line = (f"{r['size']:>11d} {_short(r['algorithm']):>26} {r['mode']:>8} {r['time_us']:>10.2f} "
                    + (f"{p99:>9.2f} " if p99 is not None else f"{'-':>9} ")
                    + f"{r['time_us_min']:>9.2f} {r['time_us_max']:>9.2f} {r['algbw']:>11.3f} {r['busbw']:>11.3f} "
                    f"{r['wrong']:>6d}")
            for peer in peers:
                t = theirs.get((peer,) + _key(r))
                line += (f" {t['time_us']:>11.2f} {r['time_us'] / t['time_us']:>6.2f}"
                         if t and t["time_us"] > 0 else f" {'-':>11} {'-':>6}")
                t99 = t.get("time_us_p99") if t else None
                line += (f" {t99:>11.2f} {p99 / t99:>6.2f}" if t99 and p99 is not None
                         else f" {'-':>11} {'-':>6}")
            if mpis:
                best = min((theirs[(m,) + _key(r)]["time_us"] for m in mpis if (m,) + _key(r) in theirs), default=0)
                line += f" {r['time_us'] / best:>10.2f}" if best > 0 else f" {'-':>10}"
            out.append(line)
        out.append("")
    return "\n".join(out)


def _summary_block(rows: Sequence[dict[str, Any]], peers: Sequence[str], coll: str, mode: str,
                   labels: dict[str, str] | None = None) -> list[str]:
    labels = labels or {}
    mine = [r for r in rows if r["collective"] == coll and r["mode"] == mode]
    ours = [r for r in mine if r["peer"] == "ours"]
    algos = list(dict.fromkeys(_base(r["algorithm"]) for r in ours))
    if len(algos) < 2 and not peers:
        return []
    widths = [max(9, len(a)) for a in algos]
    time_of = {(r["peer"], _base(r["algorithm"]), r["size"]): r["time_us"] for r in mine}
    chosen = {r["size"]: r["algorithm"].split(":", 1)[1] for r in ours if r["algorithm"].startswith("auto:")}
    named = [a for a in algos if a != "auto"]
    mpis = _mpis(peers)
    cols = [labels.get(p, p) for p in peers] + ([FASTER_MPI] if mpis else [])
    ratios = ([f"best/{c}" for c in cols] if named else []) + ([f"auto/{c}" for c in cols] if "auto" in algos else [])
    rw = [max(10, len(h)) for h in ratios]
    head = (f"#{'size(B)':>10} " + " ".join(f"{a:>{w}}" for a, w in zip(algos, widths))
            + "".join(f" {labels.get(p, p):>10}" for p in peers) + "".join(f" {h:>{w}}" for h, w in zip(ratios, rw))
            + (f" {'faster':>8}" if mpis else "") + ("  auto chose" if chosen else ""))
    out = [f"# {coll} ({mode}): median time (us) per algorithm; ratio = ours / theirs, < 1: ours is faster"
           + (f"; {FASTER_MPI} = the faster of {' and '.join(labels.get(p, p) for p in mpis)} at that size"
              if mpis else ""), head]
    to_faster: list[tuple[int, float]] = []
    for size in dict.fromkeys(r["size"] for r in ours):
        mine_t = [time_of.get(("ours", a, size)) for a in algos]
        line = f"{size:>11d} " + " ".join(f"{t:>{w}.2f}" if t else f"{'-':>{w}}"
                                          for t, w in zip(mine_t, widths))
        theirs = [time_of.get((p, "native", size)) for p in peers]
        line += "".join(f" {t:>10.2f}" if t else f" {'-':>10}" for t in theirs)
        faster = min(((time_of[(p, "native", size)], p) for p in mpis if time_of.get((p, "native", size))),
                     default=(None, None))
        against = theirs + ([faster[0]] if mpis else [])
        best = min((t for a, t in zip(algos, mine_t) if t and a != "auto"), default=None)
        auto = time_of.get(("ours", "auto", size))
        cells = []
        for mine_best in ([best] if named else []) + ([auto] if "auto" in algos else []):
            cells += [mine_best / t if mine_best and t else None for t in against]
        line += "".join(f" {c:>{w}.2f}" if c is not None else f" {'-':>{w}}" for c, w in zip(cells, rw))
        if mpis:
            line += f" {labels.get(faster[1], faster[1]) if faster[1] else '-':>8}"
            mine_vs = auto if "auto" in algos else best
            if mine_vs and faster[0]:
                to_faster.append((size, mine_vs / faster[0]))
        out.append(line + (f"  {chosen[size]}" if size in chosen else ""))
    if to_faster:
        worst = max(to_faster, key=lambda x: x[1])
        gmean = math.exp(sum(math.log(r) for _, r in to_faster) / len(to_faster))
        who = "auto" if "auto" in algos else "our fastest algorithm"
        out.append(f"# {coll} ({mode}): {who} / the faster MPI: worst {worst[1]:.2f} at {worst[0]} B, geometric mean "
                   f"{gmean:.2f} over {len(to_faster)} sizes; slower than both MPIs at "
                   f"{sum(1 for _, r in to_faster if r > 1)} of them")
    return out + [""]


def summary_table(rows: Sequence[dict[str, Any]], peers: Sequence[str] = (), labels: dict[str, str] | None = None) -> str:
    """One line per size for each collective and mode: our time per algorithm, each peer's
    time, and ours / peer for the fastest of our algorithms and for ``auto``; with two MPIs
    also ours / the faster of them at that size (and which it was), and a closing line with the
    worst and the geometric mean of that ratio; empty when there is nothing to set side by side.
    ``labels``: column names of the peers (default: their names)."""
    out: list[str] = []
    keys = dict.fromkeys((r["collective"], r["mode"]) for r in rows if r["peer"] == "ours")
    for coll, mode in keys:
        out += _summary_block(rows, peers, coll, mode, labels)
    return "\n".join(out)


def _median(values: Sequence[float]) -> float:
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def merge_repeats(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows of repeated sweeps merged per (peer, collective, algorithm, size, mode): the median of
    the repeats' medians (and of their p99s), the smallest min, the largest max, the sum of wrong
    results; bandwidths follow the merged time; ``rounds_us`` and ``rounds_p99_us`` keep each
    round's p50 and p99, so that one slow round stays visible; ``huge_pages`` is False where
    one round's buffers were not all in huge pages. The order is the first run's."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for rows in runs:
        for r in rows:
            groups.setdefault((r["peer"], _base(r["algorithm"])) + _key(r), []).append(r)
    merged = []
    for reps in groups.values():
        t = _median([r["time_us"] for r in reps])
        first = reps[0]
        scale = first["time_us"] / t if t > 0 else 0.0
        extra: dict[str, Any] = {"rounds_us": [r["time_us"] for r in reps]}
        p99s = [r["time_us_p99"] for r in reps if r.get("time_us_p99") is not None]
        if p99s:
            extra.update(time_us_p99=_median(p99s), rounds_p99_us=p99s)
        huge = [r.get("huge_pages") for r in reps]  # False where one round's buffers were not all in huge pages
        extra["huge_pages"] = False if False in huge else None if None in huge else True
        merged.append(dict(first, time_us=t, time_us_min=min(r["time_us_min"] for r in reps),
                           time_us_max=max(r["time_us_max"] for r in reps), wrong=sum(r["wrong"] for r in reps),
                           iters=sum(r["iters"] for r in reps), repeats=len(reps),
                           algbw=first["algbw"] * scale, busbw=first["busbw"] * scale, **extra))
    return merged


def uneven_rounds(rows: Sequence[dict[str, Any]], factor: float = 2.0) -> list[str]:
    """Lines naming each merged row whose slowest round's p50 was over ``factor`` times its fastest's
    (a round stuck in a slow mode, which the median over rounds would hide)."""
    out = []
    for r in rows:
        rounds = r.get("rounds_us") or []
        if len(rounds) > 1 and min(rounds) > 0 and max(rounds) > factor * min(rounds):
            out.append(f"# uneven rounds: {r['peer']} {r['collective']} {r['algorithm']} {r['mode']} {r['size']} B: "
                       "p50 per round " + ", ".join(f"{x:.2f}" for x in rounds) + " us")
    return out


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for mod in ("collectives", "numpy", "zmq", "mpi4py", "torch"):
        try:
            m = __import__(mod)
            found[mod] = str(getattr(m, "__version__", "?"))
        except ImportError:
            continue
    return found


def _model(transport: str) -> dict[str, Any] | None:
    try:
        from collectives.cost_models.profile import load_profile
    except ImportError:
        return None
    try:
        prof = load_profile(transport)
    except Exception:
        return None
    if prof is None:
        return None
    return prof if isinstance(prof, dict) else {k: v for k, v in vars(prof).items() if not k.startswith("_")}


def results_document(rows: Sequence[dict[str, Any]], *, p: int, transport: str, args: dict[str, Any],
                     peers: dict[str, dict[str, Any]] | None = None,
                     background_load: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON of a run: host, transport, versions, model parameters, options, the peers (each
    one's MPI library and launch command), the background load, rows (each naming its MPI)."""
    doc = {"schema": "collectives-bench/1", "host": socket.gethostname(), "platform": platform.platform(),
           "cpus": os.cpu_count() or 1, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "p": p,
           "transport": transport, "versions": _versions(), "model": _model(transport),
           "args": args, "results": list(rows)}
    if peers is not None:
        doc["peers"] = peers
    if background_load is not None:
        doc["background_load"] = background_load
    return doc


def load_schema() -> dict[str, Any]:
    """bench/schema.json (package data)."""
    return json.loads(resources.files("collectives.bench").joinpath("schema.json").read_text())


_TYPES = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float),
          "boolean": bool, "null": type(None)}


def validate(doc: Any, schema: dict[str, Any] | None = None, path: str = "$") -> list[str]:
    """Errors of ``doc`` against the JSON-schema subset used by schema.json
    (type, required, properties, items, enum, minimum); empty when valid."""
    schema = load_schema() if schema is None else schema
    errors: list[str] = []
    types = schema.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        ok = any(isinstance(doc, _TYPES[t]) and not (t in ("integer", "number") and isinstance(doc, bool))
                 for t in names)
        if not ok:
            return [f"{path}: expected {types}, got {type(doc).__name__}"]
    if "enum" in schema and doc not in schema["enum"]:
        errors.append(f"{path}: {doc!r} not in {schema['enum']}")
    if "minimum" in schema and isinstance(doc, (int, float)) and doc < schema["minimum"]:
        errors.append(f"{path}: {doc} < {schema['minimum']}")
    if isinstance(doc, dict):
        errors += [f"{path}: missing {k!r}" for k in schema.get("required", []) if k not in doc]
        for k, sub in schema.get("properties", {}).items():
            if k in doc:
                errors += validate(doc[k], sub, f"{path}.{k}")
    if isinstance(doc, list) and "items" in schema:
        for i, item in enumerate(doc):
            errors += validate(item, schema["items"], f"{path}[{i}]")
    return errors


def baseline_table(rows: Sequence[dict[str, Any]], old: dict[str, Any], *, p: int | None = None,
                   transport: str | None = None) -> str:
    """Per row, the old and new median time and the change (negative: faster now), then the
    geometric mean of new / old over the matched rows; notes a different world size or transport."""
    before = {(r["peer"], _base(r["algorithm"])) + _key(r): r for r in old.get("results", [])}
    lines = [f"# change against the baseline ({old.get('host', '?')}, {old.get('time', '?')})"]
    for what, new_value in (("p", p), ("transport", transport)):
        if new_value is not None and old.get(what) not in (None, new_value):
            lines.append(f"# note: the baseline ran with {what} = {old[what]}, this run with {new_value}")
    lines.append(f"# {'peer':>5} {'collective':>14} {'algorithm':>38} {'mode':>8} {'size(B)':>11} "
                 f"{'old(us)':>10} {'new(us)':>10} {'change':>8}")
    log_ratios = []
    for r in rows:
        b = before.get((r["peer"], _base(r["algorithm"])) + _key(r))
        if b is None or b["time_us"] <= 0 or r["time_us"] <= 0:
            continue
        log_ratios.append(math.log(r["time_us"] / b["time_us"]))
        change = (r["time_us"] - b["time_us"]) / b["time_us"] * 100
        lines.append(f"  {r['peer']:>5} {r['collective']:>14} {r['algorithm']:>38} {r['mode']:>8} "
                     f"{r['size']:>11d} {b['time_us']:>10.2f} {r['time_us']:>10.2f} {change:>+7.1f}%")
    if log_ratios:
        mean = math.exp(sum(log_ratios) / len(log_ratios))
        lines.append(f"# {len(log_ratios)} rows matched; geometric mean of new / old time: {mean:.3f}")
    else:
        lines.append("# no row of this run matches the baseline (collective, algorithm, size, mode)")
    return "\n".join(lines)
