"""barrier algorithms (``f(ctx)``).

* ``dissemination``: ceil(log2 p) rounds of zero-byte messages to rank + 2^k
  and from rank - 2^k: ceil(log2 p) alpha.
"""

from __future__ import annotations

import numpy as np

from ..context import CallContext
from ..registry import register

__all__ = ["dissemination"]

_EMPTY = np.empty(0, dtype=np.uint8)


@register("barrier", "dissemination", description="dissemination: ceil(log p) rounds of empty messages")
def dissemination(ctx: CallContext) -> None:
    """Round k: signal rank + 2^k, wait for rank - 2^k."""
    p, r = ctx.size, ctx.rank
    dist = 1
    while dist < p:
        ctx.sendrecv(_EMPTY, (r + dist) % p, np.empty(0, dtype=np.uint8), (r - dist) % p)
        dist <<= 1
