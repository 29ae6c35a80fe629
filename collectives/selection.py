"""Choosing an algorithm for ``algorithm="auto"``.

A selector maps (collective, bytes, p, dtype, transport capabilities) to an
algorithm name. :class:`RuleSelector` is the default: a size-and-p rule in
the spirit of MPICH's, kept in this one place so that a cost-model selector
can replace it (``Communicator(selector=...)``). Decisions are cached per
(collective, size bucket, p, capabilities), so the choice costs one dict
lookup on the hot path.

The rule, where no shared window is offered (sizes are the whole message in
bytes; "pow2" means p is a power of two):

==============  ===========================================================
allreduce       recursive_doubling up to 2 KiB or when count < p,
                rabenseifner up to 8 MiB, ring above
bcast           binomial below 12 KiB or p < 8; pow2 and below 512 KiB:
                scatter_recursive_doubling_allgather; else scatter_ring_allgather
allgather       (total bytes) pow2 and below 512 KiB: recursive_doubling;
                below 80 KiB: bruck; else ring
reduce          binomial up to 2 KiB, rabenseifner above
reduce_scatter  recursive_halving below 512 KiB (total), ring above
scatter/gather  binomial
alltoall        bruck for blocks up to 256 B when p >= 8, pairwise otherwise
barrier         dissemination
==============  ===========================================================

With a shared window (shared memory), ``shared_window`` is chosen for
every collective: a copy through memory and a fence beat any number of
messages on one host.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .errors import BadArgument
from .registry import algorithms_for

__all__ = ["Selector", "RuleSelector", "size_bucket", "bucket_floor"]

KIB = 1024


class Selector(Protocol):
    """Anything with ``choose``."""

    def choose(self, collective: str, nbytes: int, p: int, dtype: np.dtype,
               capabilities: frozenset[str]) -> str:
        """Name of the algorithm to run."""
        ...


def size_bucket(nbytes: int) -> int:
    """Bucket of a size: a quarter of an octave (sizes below 8 bytes each
    their own). Decisions are cached per bucket and made on its least size
    (:func:`bucket_floor`), at most 25% below any size in it."""
    if nbytes < 8:
        return nbytes
    k = nbytes.bit_length()
    return 4 * k + ((nbytes >> (k - 3)) & 3)


def bucket_floor(bucket: int) -> int:
    """The least size of a :func:`size_bucket` bucket."""
    if bucket < 8:
        return bucket
    k, quarter = divmod(bucket, 4)
    return (4 + quarter) << (k - 3)


def _pow2(p: int) -> bool:
    return p & (p - 1) == 0


WINDOW_COLLECTIVES = frozenset({"allreduce", "reduce_scatter", "allgather", "bcast", "reduce", "gather",
                                "scatter", "alltoall", "barrier"})


def rule(collective: str, nbytes: int, p: int, itemsize: int, capabilities: frozenset[str]) -> str:
    """The default size-and-p rule (see the module docstring)."""
    if "window" in capabilities and collective in WINDOW_COLLECTIVES:
        return "shared_window"
    if collective == "allreduce":
        if nbytes <= 2 * KIB or nbytes // max(itemsize, 1) < p:
            return "recursive_doubling"
        return "rabenseifner" if nbytes <= 8192 * KIB else "ring"
    if collective == "bcast":
        if nbytes < 12 * KIB or p < 8:
            return "binomial"
        if _pow2(p) and nbytes < 512 * KIB:
            return "scatter_recursive_doubling_allgather"
        return "scatter_ring_allgather"
    if collective == "allgather":
        if _pow2(p) and nbytes < 512 * KIB:
            return "recursive_doubling"
        return "bruck" if nbytes < 80 * KIB else "ring"
    if collective == "reduce":
        return "binomial" if nbytes <= 2 * KIB else "rabenseifner"
    if collective == "reduce_scatter":
        return "recursive_halving" if nbytes < 512 * KIB else "ring"
    if collective in ("scatter", "gather"):
        return "binomial"
    if collective == "alltoall":
        return "bruck" if p >= 8 and nbytes // p <= 256 else "pairwise"
    return "dissemination"


class RuleSelector:
    """The default selector: :func:`rule`, restricted to what the transport can run.

    ``nbytes`` must be the same on every rank (the whole message; for the
    v-variants the total), so that every rank picks the same algorithm.
    """

    def __init__(self) -> None:
        self._cache: dict[tuple, str] = {}

    def choose(self, collective: str, nbytes: int, p: int, dtype: np.dtype,
               capabilities: frozenset[str]) -> str:
        key = (collective, size_bucket(nbytes), p, dtype.itemsize, capabilities)
        name = self._cache.get(key)
        if name is None:
            # Decide on the bucket's lower bound, never on the exact size, so
            # that every rank makes the same choice whatever it ran before.
            name = rule(collective, bucket_floor(key[1]), p, dtype.itemsize, capabilities)
            table = algorithms_for(collective)
            if name not in table or not table[name].needs <= capabilities:
                runnable = [a.name for a in table.values() if a.needs <= capabilities]
                if not runnable:
                    raise BadArgument(f"no {collective} algorithm can run on a transport offering "
                                      f"{sorted(capabilities) or 'no capabilities'}")
                name = runnable[0]
            self._cache[key] = name
        return name
