"""What each rank of a shared-memory job says it is doing: call records.

Every rank keeps, in its control page, the signatures of its last two
collective calls (slots by the call number's parity, three words each,
beside its window post counter: ``Q_RECORD`` in :mod:`.layout`, and
``collectives._compiled``), the reason
it refused a call (when it did), and, while it blocks, what it waits for.
Peers read them to check a call before touching each other's memory
(:meth:`CallRecords.verdict`), to notice a peer that went another way
while they wait (:meth:`CallRecords.check_waiting`), and to say who is
where when something times out (:meth:`CallRecords.diagnose`).
"""

from __future__ import annotations

from typing import Sequence

from collectives import signature
from collectives.errors import MismatchedCollective
from collectives.signature import SEQ_MASK, Sig

from .layout import Q_RECORD, Q_REFUSAL_LEN, Q_WAITING, REFUSAL_MAX, REFUSAL_OFFSET

__all__ = ["CallRecords", "WAIT_MESSAGE", "WAIT_WINDOW"]

#: Kinds of wait recorded in ``Q_WAITING``.
WAIT_MESSAGE, WAIT_WINDOW = 1, 2
_SEQ_SHIFT = signature.SEQ_SHIFT
#: Word 0 of a record being written (a real record's is at least 1 << 36).
_WRITING = 1
_HALF = 1 << (signature.SEQ_BITS - 1)


def _seq(w0: int) -> int:
    return (w0 >> _SEQ_SHIFT) & SEQ_MASK


def _after(a: int, b: int) -> bool:
    """Whether call number ``a`` comes after ``b`` (modulo the field's width)."""
    return 0 < ((a - b) & SEQ_MASK) < _HALF


class CallRecords:
    """The call records of every rank of one job.

    Args:
        rank: this rank.
        qs: every rank's control page as 8-byte words.
        pages: every rank's control page as bytes (for the refusal reasons).
        pids: every rank's process id.
    """

    def __init__(self, rank: int, qs: Sequence[memoryview], pages: Sequence[memoryview],
                 pids: Sequence[int]) -> None:
        self.rank = rank
        self._qs = list(qs)
        self._pages = list(pages)
        self._pids = list(pids)

    # ---------------------------------------------------------- this rank

    def publish(self, seq: int, sig: Sig, refusal: str | None = None) -> None:
        """Write this rank's record of call ``seq`` (its word 0 last)."""
        q = self._qs[self.rank]
        if refusal is not None:  # in the record's slot: a peer still judging the call before reads it there
            data = refusal.encode("utf-8", "replace")[:REFUSAL_MAX]
            at = REFUSAL_OFFSET + REFUSAL_MAX * (seq & 1)
            self._pages[self.rank][at:at + len(data)] = data
            q[Q_REFUSAL_LEN + (seq & 1)] = len(data)
        base = Q_RECORD + 3 * (seq & 1)
        q[base] = _WRITING  # word 0 marked first and set last: readers see a record whole (see record())
        q[base + 1], q[base + 2] = sig[1], sig[2]
        q[base] = (sig[0] & ~(SEQ_MASK << _SEQ_SHIFT)) | ((seq & SEQ_MASK) << _SEQ_SHIFT)

    def current(self, rank: int | None = None) -> tuple[int, Sig] | None:
        """(seq, signature) of ``rank``'s latest call (default this rank's),
        or None before its first."""
        r = self.rank if rank is None else rank
        recs = [rec for rec in (self.record(r, 0), self.record(r, 1)) if rec and rec[0]]
        if not recs:
            return None
        best = recs[0]
        if len(recs) == 2 and _after(_seq(recs[1][0]), _seq(best[0])):
            best = recs[1]
        return _seq(best[0]), best

    def waiting(self, kind: int, peer: int) -> None:
        """Say that this rank blocks waiting for ``peer`` (kind 0: no longer)."""
        self._qs[self.rank][Q_WAITING] = 0 if kind == 0 else (kind << 32) | (peer + 1)

    # ------------------------------------------------------------- verdicts

    def record(self, rank: int, seq: int) -> Sig | None:
        """``rank``'s record in the slot of call ``seq`` (whatever call it
        holds; ``(0, 0, 0)`` if none yet), or None while it is being rewritten
        (the rank has moved on)."""
        q = self._qs[rank]
        base = Q_RECORD + 3 * (seq & 1)
        a, w1, w2, b = q[base], q[base + 1], q[base + 2], q[base]
        return (a, w1, w2) if a != _WRITING and a == b else None

    def verify(self, seq: int) -> int:
        """-1 when every rank's record of call ``seq`` agrees with this rank's
        (a rank already past the call verified it), else the first rank that
        does not or that refused (as ``collectives._compiled``'s verify)."""
        mine = self.record(self.rank, seq)
        if mine[0] & signature.REFUSED:
            return self.rank
        s = seq & SEQ_MASK
        for r in range(len(self._qs)):
            if r == self.rank:
                continue
            rec = self.record(r, seq)
            if rec is None:
                continue  # being rewritten: it has moved on, past this call
            if not rec[0]:
                return r  # it never posted a record in this slot
            if _seq(rec[0]) == s:
                if rec != mine:
                    return r
            elif not _after(_seq(rec[0]), s):
                return r
        return -1

    def refusal(self, rank: int, seq: int) -> str:
        """``rank``'s reason for refusing call ``seq`` (as its record in that slot says it did)."""
        n = min(int(self._qs[rank][Q_REFUSAL_LEN + (seq & 1)]), REFUSAL_MAX)
        at = REFUSAL_OFFSET + REFUSAL_MAX * (seq & 1)
        return bytes(self._pages[rank][at:at + n]).decode("utf-8", "replace")

    def verdict(self, seq: int, arrived_only: bool = False) -> Exception:
        """The error of call ``seq`` once every rank posted and some record
        disagrees (every rank that reads the same records says the same).
        ``arrived_only``: found before every rank posted (a peer's record
        disagreed while this rank waited): the ranks whose record is not
        yet of this call are named as not arrived, not by their last
        call's record."""
        mine = self.record(self.rank, seq)
        s = seq & SEQ_MASK
        sigs: list[Sig] = []
        ranks, late = [], []
        for r in range(len(self._qs)):
            rec = self.record(r, seq)
            # a rank already past the call verified it agreed: count it as agreeing
            past = rec is None or (r != self.rank and _after(_seq(rec[0]), s))
            if not past and arrived_only and r != self.rank and _seq(rec[0]) != s:
                late.append(r)  # (its record is of an earlier call, or none)
                continue
            ranks.append(r)
            sigs.append(mine if past else rec)
        reasons = {r: self.refusal(r, seq) for r, sg in zip(ranks, sigs) if sg[0] & signature.REFUSED}
        err = signature.check_all(sigs, self.rank, reasons, ranks)
        if err is None:  # records changed under us: say what we can
            err = MismatchedCollective(f"call #{s}: ranks disagree about the call")
        if late and err.args:
            err.args = (f"{err.args[0]} ({'ranks' if len(late) > 1 else 'rank'} "
                        f"{', '.join(map(str, late))} not in the call yet)",) + tuple(err.args[1:])
        return err

    def check_waiting(self, peers: Sequence[int], still_waiting) -> Exception | None:
        """While this rank waits in its current call for ``peers``: the error
        when one of them already posted a disagreeing record of this call, or
        has moved past it while ``still_waiting(peer)`` (asked after reading
        the peer's record: everything a peer did in a call is visible before
        its next call's record), else None."""
        now = self.current()
        if now is None:
            return None
        seq, mine = now
        for r in peers:
            theirs = self.current(r)
            if theirs is None:
                continue
            their_seq, sig = theirs
            if their_seq == seq:
                if sig != mine:
                    return self.verdict(seq, arrived_only=True)
            elif _after(their_seq, seq) and still_waiting(r):
                return MismatchedCollective(
                    f"call #{seq}: rank {self.rank} waits for rank {r} in {signature.describe(mine)}, "
                    f"but rank {r} has moved on to {signature.describe(sig)} (it skipped or added a "
                    "call, or ran another algorithm)")
        return None

    def diagnose(self, waited_for: int | None = None) -> str:
        """Where every rank is, for a timeout's message: which ranks have not
        arrived at this rank's current call and where each one is."""
        now = self.current()
        if now is None:
            return "no collective call has started"
        seq, mine = now
        late, here = [], []
        for r in range(len(self._qs)):
            if r == self.rank:
                continue
            theirs = self.current(r)
            where = "has made no collective call" if theirs is None else f"is in {signature.describe(theirs[1])}"
            if theirs is None or _after(seq, theirs[0]):
                late.append(f"rank {r} (pid {self._pids[r]}) {where}")
            else:
                here.append(f"rank {r}{self._waiting_text(r)}")
        parts = []
        if late:
            parts.append(f"{'ranks have' if len(late) > 1 else 'a rank has'} not arrived at call #{seq}: "
                         + "; ".join(late))
        if here:
            parts.append("in the call: " + ", ".join(here))
        if waited_for is not None and not late:
            parts.append(f"rank {waited_for} arrived but did not do what rank {self.rank} waits for")
        return "; ".join(parts)

    def _waiting_text(self, r: int) -> str:
        w = int(self._qs[r][Q_WAITING])
        if not w:
            return ""
        kind, peer = w >> 32, (w & 0xFFFFFFFF) - 1
        what = "a message from " if kind == WAIT_MESSAGE else ""
        return f" (waiting for {what}rank {peer})"
