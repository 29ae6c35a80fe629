"""Cutting vectors into blocks (one per rank) and blocks into pieces that
fit one half of the window."""

from __future__ import annotations

from .state import WindowState
from .tuning import PIECE_BYTES

__all__ = ["blocks", "displs", "piece_elems", "striped", "striped_cached", "one_piece"]


def blocks(count: int, p: int) -> list[int]:
    """Split ``count`` elements into p nearly equal blocks."""
    base, extra = divmod(count, p)
    return [base + (1 if r < extra else 0) for r in range(p)]


def displs(counts: list[int]) -> list[int]:
    """Where each block starts: the sums of the counts before it."""
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def piece_elems(half: int, p: int, itemsize: int) -> int:
    """Elements per block per piece so that p sub-blocks fit one half."""
    budget = min(half, PIECE_BYTES)
    return max(1, budget // (p * itemsize))


def striped(counts: list[int], step: int):
    """Pieces over p blocks at once: piece k holds elements [k*step, (k+1)*step)
    of every block. Yields, per piece, a list of (start in the vector, length,
    element offset within the half) per rank, and the elements it holds."""
    starts = displs(counts)
    npieces = max(-(-c // step) for c in counts) if counts else 0
    for k in range(npieces):
        parts, off = [], 0
        for c, d in zip(counts, starts):
            lo = min(k * step, c)
            n = min(step, c - lo)
            parts.append((d + lo, n, off))
            off += n
        yield parts, off


def striped_cached(st: WindowState, counts: list[int], step: int) -> list:
    """:func:`striped` as a list, computed once per (counts, step)."""
    key = ("striped", tuple(counts), step)
    got = st.cache.get(key)
    if got is None:
        got = st.remember(key, list(striped(counts, step)))
    return got


def one_piece(st: WindowState, counts: list[int], step: int) -> list | None:
    """The parts of the only piece when ``counts`` fit one piece of ``step``, else None."""
    pieces = striped_cached(st, counts, step)
    return pieces[0][0] if len(pieces) == 1 else None
