"""barrier through the shared window: one arrival (every rank posts and
waits for every post), one compiled call where the window has them."""

from __future__ import annotations

from ...registry import register
from .compiled_calls import no_arrays, compile_call, prepared_from, run_prepared
from .state import window_state

__all__ = ["barrier"]


def _prepare(transport):
    """One compiled call: post, wait for every rank's post."""
    window, _ = window_state(transport.window, transport.size)
    if transport.size == 1:
        return None
    return prepared_from(compile_call(window, 0, [], [], None, []), no_arrays)


@register("barrier", "shared_window", needs=("window",), prepare=_prepare,
          description="every rank posts to the shared window and waits for every post")
def barrier(ctx) -> None:
    if ctx.size == 1:
        return
    if run_prepared(ctx, _prepare, ("barrier",)):
        return
    window = ctx.transport.window
    window.step(ctx.deadline)
    window.fence(ctx.deadline)  # the call's arrival
