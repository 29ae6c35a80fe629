"""barrier through the shared window: F."""

from __future__ import annotations

from ..model import Params, cost_model


@cost_model("barrier", "shared_window", call=False)
def barrier(p: int, n: int, P: Params) -> float:
    """F."""
    return P.fence if p > 1 else 0.0
