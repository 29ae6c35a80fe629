"""``collectives trace analyze DIR``: which rank is at fault, from every rank's flight record.

Reads every ``rank<r>.json`` the flight recorder wrote (see
:mod:`collectives.flight_recorder`) under DIR (or under DIR's one job
directory), finds the first call where the ranks differ and says, for it:
which ranks reached it and which did not, where each one is, and any
disagreement in collective, algorithm, size, dtype, op or root. It names
the culprit of the usual faults:

* a dead rank (no record, and the survivors lost it: PeerLost);
* a hung rank (no record, and the survivors timed out waiting for it:
  it is stopped or stuck, and could not write one);
* a rank that arrived late (past the others' timeout), or did not arrive;
* a rank that skipped a call (its call #n is the others' #n+1) or added one;
* a rank that made a different call (a field differs; where the
  collective differs and nothing after it tells which, it skipped the
  others' call or made its own instead).

Queued nonblocking calls (``scheduled``) are not reached yet: they are
shown where a rank is, not compared.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["load", "analyze", "report"]

_FIELDS = ("collective", "algorithm", "op", "root", "dtype", "count", "counts_digest")


def load(directory: str) -> list[dict]:
    """Every rank's dump under ``directory`` (or its single subdirectory)."""
    def ranks_in(d: str) -> list[str]:
        return sorted(n for n in os.listdir(d) if n.startswith("rank") and n.endswith(".json"))

    names = ranks_in(directory)
    if not names:
        subs = [os.path.join(directory, n) for n in os.listdir(directory)
                if os.path.isdir(os.path.join(directory, n))]
        subs = [s for s in subs if ranks_in(s)]
        if len(subs) != 1:
            raise FileNotFoundError(f"no flight records (rank*.json) in {directory}"
                                    + (f" (several jobs: {', '.join(subs)})" if subs else ""))
        directory, names = subs[0], ranks_in(subs[0])
    dumps = []
    for n in names:
        with open(os.path.join(directory, n)) as f:
            dumps.append(json.load(f))
    return sorted(dumps, key=lambda d: d["rank"])


def _key(rec: dict) -> tuple:
    return tuple(rec.get(k) for k in _FIELDS)


def _what(rec: dict | None) -> str:
    if rec is None:
        return "no record"
    parts = [f"{rec['collective']} #{rec['seq']} ({rec['algorithm']})"]
    if rec.get("dtype"):
        parts.append(f"{rec['dtype']} x {rec['count']}")
    if rec.get("op"):
        parts.append(rec["op"])
    if rec.get("root") is not None:
        parts.append(f"root {rec['root']}")
    return " ".join(parts)


def analyze(dumps: list[dict]) -> dict[str, Any]:
    """The verdict: ``{"seq", "kind", "culprit", "lines"}`` (kind: dead, hung,
    late, skipped, added, mismatch, or none)."""
    size = max(d["size"] for d in dumps)
    have = {d["rank"]: d for d in dumps}
    missing = [r for r in range(size) if r not in have]
    calls = {r: {rec["seq"]: rec for rec in d["records"] if "collective" in rec and rec.get("state") != "scheduled"}
             for r, d in have.items()}
    last = {r: max(c) if c else 0 for r, c in calls.items()}
    lines: list[str] = []
    first_common = max((min(c) for c in calls.values() if c), default=1)
    top = max(last.values(), default=0)
    # 1. the first call whose records differ between the ranks that have one
    for seq in range(first_common, top + 1):
        recs = {r: c.get(seq) for r, c in calls.items()}
        present = {r: rec for r, rec in recs.items() if rec is not None}
        keys = {r: _key(rec) for r, rec in present.items()}
        if len(set(keys.values())) > 1:
            return _disagreement(seq, present, calls, lines)
        if len(present) < len(calls) or any(rec["state"] != "completed" for rec in present.values()):
            return _stalled(seq, present, calls, have, missing, lines)
    if missing:
        return _stalled(top, {r: c[top] for r, c in calls.items() if top in c}, calls, have, missing, lines)
    if not any(calls.values()):
        lines.append("no rank recorded a call")
        return {"seq": None, "kind": "none", "culprit": None, "lines": lines}
    lines.append(f"every rank's record agrees up to call #{top}; no rank is at fault in it")
    return {"seq": None, "kind": "none", "culprit": None, "lines": lines}


def _disagreement(seq: int, present: dict, calls: dict, lines: list[str]) -> dict:
    groups: dict[tuple, list[int]] = {}
    for r, rec in present.items():
        groups.setdefault(_key(rec), []).append(r)
    sizes = sorted(len(g) for g in groups.values())
    odd = min(groups.values(), key=len)
    # the culprit: the one rank against all the others (no one when the split is even, as 1 against 1)
    culprit = odd[0] if len(odd) == 1 and (len(sizes) == 1 or sizes[1] > 1) else None
    majority = max(groups.values(), key=len) if culprit is not None else next(g for g in groups.values()
                                                                                if g is not odd)
    ref = present[majority[0]]
    lines.append(f"call #{seq}: the ranks made different calls")
    for key, ranks in groups.items():
        lines.append(f"  ranks {ranks}: {_what(present[ranks[0]])}")
    kind = "mismatch"
    if culprit is None:
        a, b = present[odd[0]], ref
        diffs = [k for k in _FIELDS if a.get(k) != b.get(k)]
        lines.append(f"no single rank differs from the others; they differ in {', '.join(diffs)}")
    if culprit is not None:
        mine = calls[culprit]
        theirs = calls[majority[0]]
        if seq + 1 in theirs and _key(mine[seq]) == _key(theirs[seq + 1]):
            kind = "skipped"
            lines.append(f"rank {culprit} skipped {_what(ref)}: its call #{seq} is the others' #{seq + 1}")
        elif seq + 1 in mine and _key(mine[seq + 1]) == _key(theirs[seq]):
            kind = "added"
            lines.append(f"rank {culprit} added a call: {_what(mine[seq])}, which the others did not make")
        else:
            diffs = [k for k in _FIELDS if mine[seq].get(k) != ref.get(k)]
            lines.append(f"rank {culprit} differs in {', '.join(diffs)}: " + "; ".join(
                f"{k} {mine[seq].get(k)} where the others have {ref.get(k)}" for k in diffs))
            if "collective" in diffs:  # nothing after it says which: both readings
                lines.append(f"rank {culprit} skipped {_what(ref)} or called {_what(mine[seq])} instead")
    for r, rec in present.items():
        if rec.get("error"):
            lines.append(f"  rank {r} raised: {rec['error'][:300]}")
            break
    return {"seq": seq, "kind": kind, "culprit": culprit, "lines": lines}


def _stalled(seq: int, present: dict, calls: dict, have: dict, missing: list[int], lines: list[str]) -> dict:
    reached = sorted(present)
    lines.append(f"call #{seq} ({_what(next(iter(present.values()), None))}): reached by ranks {reached}")
    culprit, kind = None, "late"
    if missing:
        culprit, kind = missing[0], _missing_kind(have)
        if kind == "dead":
            lines.append(f"ranks {missing} left no flight record: dead (the survivors lost them: PeerLost)")
        elif kind == "hung":
            lines.append(f"ranks {missing} left no flight record: hung (no record: stopped or stuck; "
                         "the survivors timed out waiting)")
        else:
            lines.append(f"ranks {missing} left no flight record: dead, or stopped (a live rank writes one "
                         "when a call fails)")
    behind = [r for r, c in calls.items() if seq not in c]
    for r in behind:
        where = calls[r].get(max(calls[r])) if calls[r] else None
        queued = _queued(have[r])
        lines.append(f"rank {r} did not reach it: its last call is {_what(where)} ({where and where['state']})"
                     + (f"; queued: {queued}" if queued else ""))
        if culprit is None:
            culprit, kind = r, "late"
    if culprit is None and len(present) > 1:  # everyone got there: who came last, and by how much
        starts = {r: _wall(have[r], rec["start"]) for r, rec in present.items() if rec.get("start") is not None}
        if starts:
            late_rank = max(starts, key=starts.get)
            first = min(starts.values())
            gap = starts[late_rank] - first
            timeout = present[late_rank].get("timeout") or 0
            culprit = late_rank
            lines.append(f"rank {late_rank} arrived last, {gap:.3g} s after the first"
                         + (f" (the timeout is {timeout:.3g} s)" if timeout else ""))
    for r, rec in sorted(present.items()):
        lines.append(f"  rank {r}: {rec['state']}" + (f": {rec['error'][:300]}" if rec.get("error") else ""))
    return {"seq": seq, "kind": kind, "culprit": culprit, "lines": lines}


def _errors(dump: dict) -> list[str]:
    """A surviving rank's errors: its failed calls' and its dump's reason."""
    found = [rec["error"] for rec in dump["records"] if rec.get("error")]
    return found + ([dump["reason"]] if dump.get("reason") else [])


def _missing_kind(have: dict) -> str:
    """Why ranks left no record, from the survivors' errors: ``dead`` when one
    lost a peer (PeerLost), ``hung`` when they timed out waiting
    (CollectiveTimeout), else ``dead`` (dead, or stopped: no error says)."""
    errors = [e for d in have.values() for e in _errors(d)]
    if any(e.startswith("PeerLost") for e in errors):
        return "dead"
    if any(e.startswith("CollectiveTimeout") for e in errors):
        return "hung"
    return "dead"


def _queued(dump: dict) -> str:
    """A rank's queued (not started) nonblocking calls, in words."""
    queued = [rec for rec in dump["records"] if rec.get("state") == "scheduled"]
    return ", ".join(_what(rec) if "collective" in rec else f"#{rec['seq']}" for rec in queued[:5]) + (
        f" and {len(queued) - 5} more" if len(queued) > 5 else "")


def _wall(dump: dict, monotonic: float) -> float:
    """A rank's monotonic reading on the wall clock (to compare hosts)."""
    return dump["time"] - dump["monotonic"] + monotonic


def report(directory: str) -> str:
    """The analysis of ``directory`` as text."""
    verdict = analyze(load(directory))
    head = (f"culprit: rank {verdict['culprit']} ({verdict['kind']}, call #{verdict['seq']})"
            if verdict["culprit"] is not None else f"verdict: {verdict['kind']}")
    return "\n".join([head] + verdict["lines"])
