"""Formulas of the scatter algorithms (n bytes in all, p blocks of b = n/p).

* ``linear``: the root posts p-1 sends; its link carries them one after the
  other: T = sum_{i != root} msg(b_i) = (p-1) alpha + (n - b) beta, plus the
  copy of its own block.
* ``binomial``: d = ceil(log2 p) rounds; the root sends each child its
  subtree's blocks, largest first, and every subtree finishes no later than
  the root's last send (Chan et al. 2007): T = d alpha + (n - b_0) beta,
  plus a rotation of n bytes on the root when root != 0 and the copy of
  the rank's block out of the work buffer.
"""

from __future__ import annotations

from .bcast import scatter_time
from .model import Params, cost_model, even_blocks


@cost_model("scatter", "linear")
def linear(p: int, n: int, P: Params) -> float:
    """(p-1) alpha + (n - b) beta: the root's sends one after the other."""
    blocks = even_blocks(n, p, P.itemsize)
    return sum(P.msg(m) for m in blocks[1:])


@cost_model("scatter", "binomial")
def binomial(p: int, n: int, P: Params) -> float:
    """d alpha + (n - b_0) beta + copy(b): bounded by the root's sends."""
    return scatter_time(p, n, P) + P.copy(n / p)
