"""The transport's own collectives, offered as the algorithm ``native``.

Registered for every collective with ``needs=("native",)``: the selector and
the benchmarks can then compare, for example, MPI's MPI_Allreduce with ours.
The transport provides the implementation through ``transport.native(name)``
with the same signature as the algorithms.
"""

from __future__ import annotations

from ..registry import COLLECTIVES, register

__all__: list[str] = []


def _delegate(collective: str):
    def native(ctx, *args):
        return ctx.transport.native(collective)(ctx, *args)

    native.__name__ = f"native_{collective}"
    native.__doc__ = f"The transport's own {collective} (e.g. MPI's)."
    return native


for _c in COLLECTIVES:
    register(_c, "native", needs=("native",))(_delegate(_c))
