"""The plugin registry: algorithms by (collective, name), transports by name.

Transports and algorithm modules are found through Python entry points
(groups ``collectives.transports`` and ``collectives.algorithms``), the same
way a third-party plugin is found; the core never imports a concrete
transport by name.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Callable

from .errors import BadArgument, TransportUnavailable

__all__ = [
    "COLLECTIVES",
    "Algorithm",
    "register",
    "algorithm",
    "algorithms_for",
    "all_algorithms",
    "transport_class",
    "transport_names",
    "device_stagers",
]

#: Every collective the library implements, in the order the docs list them.
COLLECTIVES = (
    "bcast", "scatter", "gather", "allgather", "reduce", "allreduce",
    "reduce_scatter", "alltoall", "barrier",
)

TRANSPORT_GROUP = "collectives.transports"
ALGORITHM_GROUP = "collectives.algorithms"


@dataclass(frozen=True)
class Algorithm:
    """A registered algorithm.

    Attributes:
        collective: which collective it implements.
        name: the name users type (``algorithm="ring"``).
        func: the implementation, ``func(ctx, ...)``.
        needs: transport capabilities it requires (e.g. ``{"window"}``).
        description: one line for ``explain`` and docs.
        prepare: optional prepared call, ``prepare(transport, *args)`` with
            the arguments of a first call (after ``ctx``), returning a
            function with the algorithm's own signature for later calls
            whose arrays have the same dtypes and sizes and whose other
            arguments are equal (or None where it does not apply): the work
            that does not depend on the data (views, offsets, checks) done
            once per call signature, as MPI's persistent collectives do.
            Only for blocking calls on contiguous numpy arrays. The function
            may carry ``on_arrays = (go, settle)``: the same work from the
            call's arrays alone (``go(arrays)``, then, when it returned
            something to wait for, ``settle(arrays, late, deadline)``).
        copies_in: whether the algorithm makes an out-of-place call's copy
            in itself (the call's second array into its first, as
            out-of-place allreduce and allgather do), after every rank
            agreed on the call, so that a call a peer refuses or that
            mismatches changes no buffer. ``func`` then also takes
            ``source=`` (the array to copy in; without it the call is in
            place), and ``prepare`` ``copy_in=`` (a
            :class:`~collectives.prepared.CopyIn`): it returns a prepared
            call whose ``on_arrays`` take the call's two arrays and do that
            copy as part of their own work (reading the second array where
            they would have read the copy), or None, and the call then runs
            ``func`` with ``source=``. An algorithm without it gets the copy
            made before it runs.
    """

    collective: str
    name: str
    func: Callable = field(compare=False)
    needs: frozenset[str] = frozenset()
    description: str = ""
    prepare: Callable | None = field(default=None, compare=False)
    copies_in: bool = False


_ALGORITHMS: dict[str, dict[str, Algorithm]] = {c: {} for c in COLLECTIVES}
_loaded = False
_load_lock = threading.RLock()


def register(collective: str, name: str, needs: tuple[str, ...] = (),
             description: str = "", prepare: Callable | None = None,
             copies_in: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: register ``func`` as algorithm ``name`` of ``collective``
    (``prepare`` and ``copies_in``: its prepared call, see :class:`Algorithm`)."""
    if collective not in _ALGORITHMS:
        raise ValueError(f"unknown collective {collective!r}")

    def deco(func: Callable) -> Callable:
        from .signature import algorithm_code

        clash = [n for n in _ALGORITHMS[collective] if n != name and algorithm_code(n) == algorithm_code(name)]
        if clash:  # signatures carry an 8-bit code of the name: two names must not share one
            raise ValueError(f"{collective} algorithm {name!r} has the signature code of {clash[0]!r}; "
                             "choose another name")
        doc = description or (func.__doc__ or "").strip().split("\n")[0]
        _ALGORITHMS[collective][name] = Algorithm(collective, name, func, frozenset(needs), doc,
                                                   prepare, copies_in)
        return func

    return deco


def _load_plugins() -> None:
    global _loaded
    if _loaded:
        return
    with _load_lock:  # threads (the sim's ranks) must not see a half-filled table
        if _loaded:
            return
        eps = entry_points(group=ALGORITHM_GROUP)
        if not any(ep.value == "collectives.algorithms" for ep in eps):
            # Running from a source tree without installed metadata.
            importlib.import_module("collectives.algorithms")
        for ep in eps:
            ep.load()
        _loaded = True


def algorithms_for(collective: str) -> dict[str, Algorithm]:
    """Every algorithm registered for ``collective``, by name."""
    _load_plugins()
    try:
        return _ALGORITHMS[collective]
    except KeyError:
        raise BadArgument(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}") from None


def all_algorithms() -> list[Algorithm]:
    """Every registered algorithm of every collective."""
    _load_plugins()
    return [a for c in COLLECTIVES for a in _ALGORITHMS[c].values()]


def algorithm(collective: str, name: str) -> Algorithm:
    """The algorithm ``name`` of ``collective``; BadArgument if unknown."""
    table = algorithms_for(collective)
    try:
        return table[name]
    except KeyError:
        raise BadArgument(
            f"unknown {collective} algorithm {name!r}; known: {', '.join(sorted(table)) or 'none'}"
        ) from None


DEVICE_GROUP = "collectives.devices"


_device_stagers: list[Callable] | None = None


def device_stagers() -> list[Callable]:
    """Every installed device-memory plugin's ``stage(buf, writable)`` (see
    buffers.flat), found once per process: reading the entry points of every
    installed distribution costs milliseconds."""
    global _device_stagers
    if _device_stagers is None:
        found = []
        for ep in entry_points(group=DEVICE_GROUP):
            try:
                found.append(ep.load())
            except ImportError:
                continue
        _device_stagers = found
    return _device_stagers


def _transport_entry_points() -> dict[str, str]:
    found = {ep.name: ep.value for ep in entry_points(group=TRANSPORT_GROUP)}
    if not found:
        raise TransportUnavailable(
            "no transport plugins are registered: install the package (pip install -e .) "
            "so that its entry points exist")
    return found


def transport_names() -> list[str]:
    """Names of every transport plugin that is registered (available or not)."""
    return sorted(_transport_entry_points())


def transport_class(name: str):
    """Load the transport plugin ``name``; TransportUnavailable if it cannot load."""
    eps = _transport_entry_points()
    if name not in eps:
        raise BadArgument(f"unknown transport {name!r}; registered: {', '.join(sorted(eps))}")
    module, _, attr = eps[name].partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise TransportUnavailable(f"transport {name!r} cannot be loaded: {exc}") from exc
    return getattr(mod, attr)
