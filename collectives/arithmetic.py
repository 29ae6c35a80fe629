"""Small arithmetic the algorithms, transports and cost models share.

* :func:`pow2_floor`: the largest power of two not above n;
* :func:`prefix`: where blocks laid end to end begin (and the end);
* :func:`byte_view`: the bytes of an array, as a flat ``uint8`` array (no copy);
* :func:`parse_bytes`: a size as people write it (``64K``, ``4MiB``, ``1.5G``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["pow2_floor", "prefix", "byte_view", "parse_bytes", "show_bytes"]

_NO_BYTES = np.zeros(0, np.uint8)
_NO_BYTES.flags.writeable = False


def pow2_floor(n: int) -> int:
    """The largest power of two not above ``n`` (1 for n < 2)."""
    return 1 << max(int(n).bit_length() - 1, 0)


def prefix(counts: Sequence[int]) -> list[int]:
    """Offsets of blocks of ``counts`` elements laid end to end: where each
    begins, and last the total (one more entry than ``counts``)."""
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


def byte_view(buf: np.ndarray | None) -> np.ndarray:
    """The bytes of the C-contiguous array ``buf`` as a flat ``uint8`` array
    sharing its memory (an empty one for None or an empty array)."""
    if buf is None or buf.size == 0:
        return _NO_BYTES
    return buf.reshape(-1).view(np.uint8)


_UNITS = {"": 1, "B": 1}
for _i, _letter in enumerate("KMG", 1):
    for _suffix in ("", "B", "I", "IB"):
        _UNITS[_letter + _suffix] = 1 << (10 * _i)


def parse_bytes(text: str) -> int:
    """``"4M"`` -> 4194304: a number of bytes with an optional unit (K, M, G
    are powers of 1024, as KiB, MiB, GiB; a trailing B is optional).

    Raises:
        ValueError: ``text`` is not such a size.
    """
    s = str(text).strip().upper()
    digits = s.rstrip("KMGIB")
    unit = s[len(digits):]
    if unit not in _UNITS or not digits:
        raise ValueError(f"cannot read a size from {text!r} (examples: 512, 64K, 4M, 1G)")
    try:
        return int(float(digits) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"cannot read a size from {text!r} (examples: 512, 64K, 4M, 1G)") from None


def show_bytes(n: int) -> str:
    """``n`` bytes in whole MiB, KiB or bytes, as people write it ("16 MiB", "8 B")."""
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"
