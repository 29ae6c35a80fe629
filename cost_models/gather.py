"""Formulas of the gather algorithms (n bytes in all, p blocks of b = n/p).

* ``linear``: p-1 messages into the root's one incoming link:
  T = (p-1) alpha + (n - b) beta.
* ``binomial``: the root receives its children's subtrees, smallest first;
  a child's subtree is complete before the root's link is free for it, so
  T = sum_k msg(2^k b) over the children = d alpha + (n - b) beta, plus the
  copy of the rank's own block and a rotation on the root when root != 0.
"""

from __future__ import annotations

from .bcast import scatter_time
from .model import Params, cost_model, even_blocks


@cost_model("gather", "linear")
def linear(p: int, n: int, P: Params) -> float:
    """(p-1) alpha + (n - b) beta: the root's incoming link, one message at a time."""
    return sum(P.msg(m) for m in even_blocks(n, p, P.itemsize)[1:])


@cost_model("gather", "binomial")
def binomial(p: int, n: int, P: Params) -> float:
    """d alpha + (n - b) beta + copy(b): the mirror image of the binomial scatter."""
    return scatter_time(p, n, P) + P.copy(n / p)
