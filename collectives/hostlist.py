"""Slurm's host lists, expanded: ``node[01-04,07]`` is node01 to node04 and node07.

The syntax (what ``scontrol show hostnames`` takes): host names separated by
commas; a name may hold bracketed groups of numbers and ranges
(``[1-3,5]``); a range keeps the width of its lower bound (``[08-10]`` is
08, 09, 10; ``[8-10]`` is 8, 9, 10); a name with several groups stands for
every combination, the first group varying slowest
(``gpu-a[1-2]-b[3,5]`` is gpu-a1-b3, gpu-a1-b5, gpu-a2-b3, gpu-a2-b5).
Empty names are skipped (``a,,b`` is a, b). Anything else (an unbalanced or
nested bracket, an empty group, a range that is not two numbers in order)
raises :class:`~collectives.errors.BadArgument` naming the list.
"""

from __future__ import annotations

import itertools

from .errors import BadArgument

__all__ = ["expand", "first_host", "MAX_HOSTS"]

#: the most host names one list may stand for (a guard against ``n[0-999999999]``)
MAX_HOSTS = 1 << 20


def expand(hostlist: str) -> list[str]:
    """Every host name of a Slurm host list, in its order.

    Raises:
        BadArgument: ``hostlist`` is not a valid host list.
    """
    hosts: list[str] = []
    for item in _split_names(hostlist):
        parts = [[text] if not group else _group(group, hostlist) for text, group in _segments(item, hostlist)]
        count = 1
        for p in parts:
            count *= len(p)
        if len(hosts) + count > MAX_HOSTS:
            raise BadArgument(f"host list {hostlist!r} stands for more than {MAX_HOSTS} hosts")
        hosts.extend("".join(combo) for combo in itertools.product(*parts))
    return hosts


def first_host(hostlist: str) -> str:
    """The first host name of a Slurm host list (where rank 0 runs under srun's
    block and cyclic distributions).

    Raises:
        BadArgument: ``hostlist`` is not a valid host list, or names no host.
    """
    for item in _split_names(hostlist):
        parts = [[text] if not group else _group(group, hostlist)[:1] for text, group in _segments(item, hostlist)]
        return "".join(p[0] for p in parts)
    raise BadArgument(f"host list {hostlist!r} names no host")


def _split_names(hostlist: str) -> list[str]:
    """The names of ``hostlist``: split at commas outside brackets, blanks
    stripped, empty names dropped."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise BadArgument(f"invalid host list {hostlist!r}: nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise BadArgument(f"invalid host list {hostlist!r}: ']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            names.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise BadArgument(f"invalid host list {hostlist!r}: '[' without ']'")
    names.append(hostlist[start:])
    return [n.strip() for n in names if n.strip()]


def _segments(name: str, hostlist: str) -> list[tuple[str, str]]:
    """``name`` as (text, "") and ("", group body) pieces, in order."""
    pieces, rest = [], name
    while "[" in rest:
        text, _, rest = rest.partition("[")
        body, _, rest = rest.partition("]")
        if text:
            pieces.append((text, ""))
        if not body.strip():
            raise BadArgument(f"invalid host list {hostlist!r}: empty brackets in {name!r}")
        pieces.append(("", body))
    if rest:
        pieces.append((rest, ""))
    return pieces


def _group(body: str, hostlist: str) -> list[str]:
    """The numbers of one bracketed group, e.g. ``01-03,07`` -> 01, 02, 03, 07."""
    out: list[str] = []
    for span in body.split(","):
        span = span.strip()
        low, dash, high = span.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise BadArgument(f"invalid host list {hostlist!r}: {span!r} is not a number or a range "
                              "of two numbers")
        lo, hi = int(low), int(high) if dash else int(low)
        if hi < lo:
            raise BadArgument(f"invalid host list {hostlist!r}: range {span!r} ends before it starts")
        if hi - lo + 1 > MAX_HOSTS:
            raise BadArgument(f"host list {hostlist!r} stands for more than {MAX_HOSTS} hosts")
        out.extend(f"{n:0{len(low)}d}" for n in range(lo, hi + 1))
    return out
