"""Formula of the barrier.

* ``dissemination``: ceil(log2 p) rounds of an empty message to rank + 2^k
  and from rank - 2^k: T = ceil(log2 p) alpha.
"""

from __future__ import annotations

from .model import Params, cost_model, lg


@cost_model("barrier", "dissemination")
def dissemination(p: int, n: int, P: Params) -> float:
    """ceil(log2 p) alpha."""
    return lg(p) * P.msg(0)
