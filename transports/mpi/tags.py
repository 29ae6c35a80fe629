"""Tags and the calls they belong to.

Collective calls use odd tags (``2 * seq + 1``), point-to-point messages
even ones (see :mod:`collectives.signature`).
"""

from __future__ import annotations

from collectives.signature import SEQ_MASK, seq_of_tag

__all__ = ["call_of", "before"]

#: The first half of the sequence-number space lies after a given call.
_HALF_SEQ = (SEQ_MASK + 1) >> 1


def call_of(tag: int) -> str:
    """``call #N`` for a collective tag, the point-to-point tag otherwise."""
    return f"call #{seq_of_tag(tag) & SEQ_MASK}" if tag & 1 else f"a point-to-point message (tag {tag >> 1})"


def before(theirs: int, mine: int) -> bool:
    """Whether collective tag ``theirs`` (-1: none) belongs to a call before ``mine``'s."""
    if theirs < 0:
        return True
    return 0 < (seq_of_tag(mine) - seq_of_tag(theirs)) & SEQ_MASK < _HALF_SEQ
