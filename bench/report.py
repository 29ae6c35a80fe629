"""Tables, machine-readable results and comparisons of bench runs.

* :func:`table`: an nccl-tests style table, with ratio columns (ours / peer
  time) when peers ran in the same sweep;
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

__all__ = ["merge_repeats", "table", "summary_table", "results_document", "load_schema", "validate", "baseline_table"]

_HEAD = (f"{'size(B)':>11} {'algorithm':>26} {'mode':>8} {'time(us)':>10} {'min(us)':>9} {'max(us)':>9} "
         f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6}")


def _key(row: dict[str, Any]) -> tuple:
    return (row["collective"], row["size"], row["mode"])


def _short(algorithm: str) -> str:
    """An algorithm's name in at most 26 characters (``auto:`` kept: it says what auto chose)."""
    return algorithm if len(algorithm) <= 26 else algorithm[:25] + "~"


def _base(algorithm: str) -> str:
    """"auto:ring" -> "auto" (the choice may change between runs)."""
    return algorithm.split(":", 1)[0]


def table(rows: Sequence[dict[str, Any]], peers: Sequence[str] = ()) -> str:
    """Our rows as a table per collective; for each peer a time column and ours/peer ratio
    (ratio < 1: ours is faster)."""
    ours = [r for r in rows if r["peer"] == "ours"]
    theirs = {(r["peer"],) + _key(r): r for r in rows if r["peer"] != "ours"}
    out = []
    for coll in dict.fromkeys(r["collective"] for r in ours):
        extra = "".join(f" {peer + '(us)':>11} {'ratio':>6}" for peer in peers)
        first = next(r for r in ours if r["collective"] == coll)
        what = f"dtype {first['dtype']}" + (f", op {first['op']}" if first["op"] not in ("", "-", "none", None)
                                             and coll in ("allreduce", "reduce", "reduce_scatter") else "") \
            + (f", root {first['root']}" if first["root"] not in (-1, None) else "")
        out += [f"# {coll} ({what})", "#" + _HEAD[1:] + extra]
        for r in (r for r in ours if r["collective"] == coll):
            line = (f"{r['size']:>11d} {_short(r['algorithm']):>26} {r['mode']:>8} {r['time_us']:>10.2f} "
                    f"{r['time_us_min']:>9.2f} {r['time_us_max']:>9.2f} {r['algbw']:>11.3f} {r['busbw']:>11.3f} "
                    f"{r['wrong']:>6d}")
            for peer in peers:
                t = theirs.get((peer,) + _key(r))
                line += (f" {t['time_us']:>11.2f} {r['time_us'] / t['time_us']:>6.2f}"
                         if t and t["time_us"] > 0 else f" {'-':>11} {'-':>6}")
            out.append(line)
        out.append("")
    return "\n".join(out)


def _summary_block(rows: Sequence[dict[str, Any]], peers: Sequence[str], coll: str, mode: str) -> list[str]:
    mine = [r for r in rows if r["collective"] == coll and r["mode"] == mode]
    ours = [r for r in mine if r["peer"] == "ours"]
    algos = list(dict.fromkeys(_base(r["algorithm"]) for r in ours))
    if len(algos) < 2 and not peers:
        return []
    widths = [max(9, len(a)) for a in algos]
    time_of = {(r["peer"], _base(r["algorithm"]), r["size"]): r["time_us"] for r in mine}
    chosen = {r["size"]: r["algorithm"].split(":", 1)[1] for r in ours if r["algorithm"].startswith("auto:")}
    named = [a for a in algos if a != "auto"]
    ratios = ([f"best/{p}" for p in peers] if named else []) + ([f"auto/{p}" for p in peers] if "auto" in algos else [])
    head = (f"#{'size(B)':>10} " + " ".join(f"{a:>{w}}" for a, w in zip(algos, widths))
            + "".join(f" {p:>10}" for p in peers) + "".join(f" {h:>10}" for h in ratios)
            + ("  auto chose" if chosen else ""))
    out = [f"# {coll} ({mode}): median time (us) per algorithm; ratio = ours / theirs, < 1: ours is faster", head]
    for size in dict.fromkeys(r["size"] for r in ours):
        mine_t = [time_of.get(("ours", a, size)) for a in algos]
        line = f"{size:>11d} " + " ".join(f"{t:>{w}.2f}" if t else f"{'-':>{w}}"
                                          for t, w in zip(mine_t, widths))
        theirs = [time_of.get((p, "native", size)) for p in peers]
        line += "".join(f" {t:>10.2f}" if t else f" {'-':>10}" for t in theirs)
        best = min((t for a, t in zip(algos, mine_t) if t and a != "auto"), default=None)
        auto = time_of.get(("ours", "auto", size))
        for mine_best in ([best] if named else []) + ([auto] if "auto" in algos else []):
            line += "".join(f" {mine_best / t:>10.2f}" if mine_best and t else f" {'-':>10}" for t in theirs)
        out.append(line + (f"  {chosen[size]}" if size in chosen else ""))
    return out + [""]


def summary_table(rows: Sequence[dict[str, Any]], peers: Sequence[str] = ()) -> str:
    """One line per size for each collective and mode: our time per algorithm, each peer's
    time, and ours / peer for the fastest of our algorithms and for ``auto``; empty when
    there is nothing to set side by side."""
    out: list[str] = []
    keys = dict.fromkeys((r["collective"], r["mode"]) for r in rows if r["peer"] == "ours")
    for coll, mode in keys:
        out += _summary_block(rows, peers, coll, mode)
    return "\n".join(out)


def merge_repeats(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows of repeated sweeps merged per (peer, collective, algorithm, size, mode): the median of
    the repeats' medians, the smallest min, the largest max, the sum of wrong results; bandwidths
    follow the merged time. The order is the first run's."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for rows in runs:
        for r in rows:
            groups.setdefault((r["peer"], _base(r["algorithm"])) + _key(r), []).append(r)
    merged = []
    for reps in groups.values():
        times = sorted(r["time_us"] for r in reps)
        mid = len(times) // 2
        t = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
        first = reps[0]
        scale = first["time_us"] / t if t > 0 else 0.0
        merged.append(dict(first, time_us=t, time_us_min=min(r["time_us_min"] for r in reps),
                           time_us_max=max(r["time_us_max"] for r in reps), wrong=sum(r["wrong"] for r in reps),
                           iters=sum(r["iters"] for r in reps), repeats=len(reps),
                           algbw=first["algbw"] * scale, busbw=first["busbw"] * scale))
    return merged


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


def results_document(rows: Sequence[dict[str, Any]], *, p: int, transport: str,
                     args: dict[str, Any]) -> dict[str, Any]:
    """The JSON of a run: host, transport, versions, model parameters, options, rows."""
    return {"schema": "collectives-bench/1", "host": socket.gethostname(), "platform": platform.platform(),
            "cpus": os.cpu_count() or 1, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "p": p,
            "transport": transport, "versions": _versions(), "model": _model(transport),
            "args": args, "results": list(rows)}


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
