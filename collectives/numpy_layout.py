"""Whether the C extensions read numpy's arrays right.

Both extensions read an array's data pointer, dimensions, dtype and flags
where numpy's C API keeps them (``collectives/_numpy_head.h``), without
numpy's headers. Each object that does so offers ``head(array)``; this
checks it against numpy before the object is used.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["reads_numpy_right"]


def reads_numpy_right(reader: Any) -> bool:
    """Whether ``reader.head(a)`` (``(data, nd, size, dtype, flags)``) sees
    what numpy says of a plain, a read-only and a strided array; any other
    layout turns the object off."""
    plain = np.arange(7, dtype=np.float32)
    frozen = np.arange(3, dtype=np.int64)
    frozen.flags.writeable = False
    strided = np.arange(14, dtype=np.float64)[::2]
    for a in (plain, frozen, strided):
        data, nd, size, dtype, flags = reader.head(a)
        if (data, nd, size) != (a.ctypes.data, 1, a.size) or dtype is not a.dtype:
            return False
        if bool(flags & 0x1) != a.flags.c_contiguous or bool(flags & 0x400) != a.flags.writeable:
            return False
    return True
