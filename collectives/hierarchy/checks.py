"""What ranks tell each other at the start of every call: records, summaries, verdicts.

Every call on a hierarchical communicator begins with a *local check*:
the ranks of a host allgather fixed-size records through shared memory
(:data:`RECORD_WORDS` 64-bit words each: the world call's signature, this
rank's refusal and its reason, and up to :data:`INLINE_BYTES` of data that
a small-message algorithm carries along). Every rank of the host then
holds the same records and comes to the same verdict.

A hierarchical call goes on with a *summary* per host (:data:`SUMMARY_WORDS`
words: how many of its ranks refused the call, the first of them and why,
the host's signature, and the bytes of data that follow), which the
drivers of every host exchange directly, so that every rank learns every
host's. A refusal anywhere is :class:`~collectives.errors.BadArgument` on
every rank, in that call, before any data of the call is written; hosts
whose signatures differ are :class:`~collectives.errors.MismatchedCollective`
naming the ranks of each. Verdicts name world ranks and the algorithms by
name, the hierarchical ones included.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import signature
from ..errors import BadArgument, MismatchedCollective
from ..signature import REFUSED, Sig
from .table import names_for

__all__ = ["RECORD_WORDS", "INLINE_BYTES", "SUMMARY_WORDS", "write_record", "record_sig", "record_refusal",
           "inline", "masked", "describe", "mismatch", "Summary", "refusal_error"]

_REASON_BYTES = 256
_HEAD_WORDS = 4 + _REASON_BYTES // 8  # signature (3), reason length (1), reason
#: Bytes of data a record carries for small-message algorithms.
INLINE_BYTES = 4096
#: 64-bit words of one rank's record.
RECORD_WORDS = _HEAD_WORDS + INLINE_BYTES // 8
#: 64-bit words of one host's summary: refused (1), first refusing rank (1),
#: reason length (1), reason, the host's signature (3), data bytes that follow (1).
SUMMARY_WORDS = 3 + _REASON_BYTES // 8 + 4
_FIELDS = ("seq", "collective", "algorithm", "op", "root", "dtype", "count", "counts")


def _put_text(words: np.ndarray, at: int, text: str) -> int:
    data = text.encode("utf-8", "replace")[:_REASON_BYTES]
    words.view(np.uint8)[8 * at:8 * at + len(data)] = np.frombuffer(data, np.uint8)
    return len(data)


def _get_text(words: np.ndarray, at: int, n: int) -> str:
    n = min(int(n), _REASON_BYTES)
    return bytes(words.view(np.uint8)[8 * at:8 * at + n]).decode("utf-8", "replace")


def write_record(rec: np.ndarray, sig: Sig, refusal: str | None) -> None:
    """Fill this rank's record ``rec`` (uint64, RECORD_WORDS) with the call's
    signature and refusal (the inline data is written by its algorithm)."""
    rec[0], rec[1], rec[2] = int(sig[0]) | (REFUSED if refusal is not None else 0), sig[1], sig[2]
    rec[3] = 0 if refusal is None else _put_text(rec, 4, refusal)


def record_sig(rec: np.ndarray) -> Sig:
    """The signature in record ``rec``."""
    return int(rec[0]), int(rec[1]), int(rec[2])


def record_refusal(rec: np.ndarray) -> str | None:
    """Why the rank of record ``rec`` refused the call (None: it did not)."""
    if not int(rec[0]) & REFUSED:
        return None
    return _get_text(rec, 4, rec[3]) or "its arguments are invalid"


def inline(rec: np.ndarray, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` of record ``rec``'s inline data, as uint8."""
    return rec[_HEAD_WORDS:].view(np.uint8)[:nbytes]


def masked(sig: Sig) -> Sig:
    """``sig`` without its refusal mark."""
    return int(sig[0]) & ~REFUSED, int(sig[1]), int(sig[2])


def _fields(sig: Sig) -> dict:
    collective = signature.fields(sig, {})["collective"]
    return signature.fields(sig, names_for(collective))


def describe(sig: Sig) -> str:
    """``sig`` in words, hierarchical algorithms named (as :func:`collectives.signature.describe`)."""
    f = _fields(masked(sig))
    what = f"{f['dtype']} x {f['count']}" if f["dtype"] else f"{f['count']} elements"
    detail = what if f["collective"] != "barrier" else ""
    if f["op"]:
        detail = f"{f['op']} of {what}"
    if f["root"] is not None:
        detail += f" to/from root {f['root']}"
    return f"{f['collective']} #{f['seq']} ({f['algorithm']})" + (": " + detail if detail else "")


def _value(name: str, v: object) -> str:
    if name == "counts":
        if not v:
            return "no v-counts"
        counts = signature.counts_of(v)
        return f"counts {list(counts)}" if counts is not None else f"counts (digest {v:#x})"
    if name == "seq":
        return f"call #{v}"
    return "none" if v is None else str(v)


def _groups(values: Sequence[tuple[Sequence[int], str]]) -> str:
    """``rank 3 has a, ranks 0, 1, 2 have b``: the ranks of each value, fewest first."""
    by: dict[str, list[int]] = {}
    for ranks, v in values:
        by.setdefault(v, []).extend(ranks)
    ordered = sorted(by.items(), key=lambda kv: (len(kv[1]), min(kv[1])))
    return ", ".join((f"rank {rs[0]} has" if len(rs) == 1 else "ranks " + ", ".join(map(str, sorted(rs))) + " have")
                     + f" {v}" for v, rs in ordered)


def mismatch(groups: Sequence[tuple[Sequence[int], Sig]]) -> MismatchedCollective | None:
    """The error of world ranks whose signatures differ (``groups``: the
    ranks that share each signature); None when they all agree."""
    decoded = [(ranks, _fields(masked(sig))) for ranks, sig in groups]
    differ = [k for k in _FIELDS if len({str(f[k]) for _, f in decoded}) > 1]
    if not differ:
        return None
    first = decoded[0][1]
    head = f"{first['collective']} #{first['seq']}" if "collective" not in differ else f"call #{first['seq']}"
    if set(differ) <= {"dtype", "count"}:
        said = _groups([(ranks, f"{f['dtype']} x {f['count']}") for ranks, f in decoded])
    else:
        said = "ranks disagree: " + "; ".join(
            f"{k}: " + _groups([(ranks, _value(k, f[k])) for ranks, f in decoded]) for k in differ)
    return MismatchedCollective(f"{head}: {said}")


class Summary:
    """One host's summary (see the module docstring), over ``words`` (uint64, SUMMARY_WORDS)."""

    def __init__(self, words: np.ndarray) -> None:
        self.words = words

    def fill(self, refusals: Sequence[tuple[int, str]], sig: Sig, nbytes: int) -> "Summary":
        """Write the host's refusals ((world rank, reason), lowest rank first), signature and data bytes."""
        w = self.words
        w[0] = len(refusals)
        w[1] = refusals[0][0] if refusals else 0
        w[2] = _put_text(w, 3, refusals[0][1]) if refusals else 0
        at = 3 + _REASON_BYTES // 8
        w[at], w[at + 1], w[at + 2] = masked(sig)
        w[at + 3] = nbytes
        return self

    @property
    def refused(self) -> int:
        """How many of the host's ranks refused the call."""
        return int(self.words[0])

    @property
    def first(self) -> tuple[int, str]:
        """(world rank, reason) of the host's first refusing rank."""
        return int(self.words[1]), _get_text(self.words, 3, self.words[2])

    @property
    def sig(self) -> Sig:
        """The host's signature (refusal mark cleared)."""
        at = 3 + _REASON_BYTES // 8
        return int(self.words[at]), int(self.words[at + 1]), int(self.words[at + 2])

    @property
    def nbytes(self) -> int:
        """Bytes of data the host sends after its summary."""
        return int(self.words[3 + _REASON_BYTES // 8 + 3])


def refusal_error(sig: Sig, refusals: Sequence[tuple[int, str]], count: int) -> BadArgument:
    """Every rank's error of a call refused by ``count`` ranks, the first of them in ``refusals``."""
    f = _fields(masked(sig))
    rank, why = min(refusals)
    more = f" (and {count - 1} other rank{'s' if count > 2 else ''})" if count > 1 else ""
    return BadArgument(f"{f['collective']} #{f['seq']}: rank {rank} refused it: {why}{more}")
