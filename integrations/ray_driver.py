"""The driver's side of a Ray collective group: forming it among actors,
and making them leave it (see :mod:`collectives.integrations.ray`)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from collectives.errors import BadArgument, CollectiveError, CollectiveTimeout, PeerLost

from . import ray_rendezvous as rdv
from .ray_members import (RAY_SLACK, cancel, check_backend, end_actor, forget, ray_module, rendezvous_actor,
                          set_up_by_driver)

__all__ = ["GroupInfo", "create_collective_group", "forget_on", "forget_created", "FAILURE_GRACE"]

#: Seconds the driver waits for the other members once one has failed to join.
FAILURE_GRACE = 1.0

_created: dict[str, list[Any]] = {}         # groups this process created: their actors
_lock = threading.Lock()


@dataclass(frozen=True)
class GroupInfo:
    """A group as its creator sees it."""

    name: str
    world_size: int
    transport: str       # "shm" or "zmq"
    job: str


def _check_members(actors: Sequence[Any], group_name: str, ranks: Sequence[int] | None,
                   timeout: float) -> list[int]:
    """The rank of each actor; BadArgument for anything wrong, before any actor is asked."""
    ray = ray_module()
    if not actors:
        raise BadArgument("create_collective_group needs at least one actor")
    odd = [i for i, a in enumerate(actors) if not isinstance(a, ray.actor.ActorHandle)]
    if odd:
        raise BadArgument(f"actors[{odd[0]}] is a {type(actors[odd[0]]).__name__}, not a Ray actor handle")
    handles = list(actors)  # handles compare equal when they name one actor
    for i, a in enumerate(handles):
        if handles.index(a) != i:
            raise BadArgument(f"actors[{i}] is the same actor as actors[{handles.index(a)}]")
    n = len(actors)
    ranks = list(range(n)) if ranks is None else [int(r) for r in ranks]
    if sorted(ranks) != list(range(n)):
        raise BadArgument(f"ranks must hold 0..{n - 1} once each, one per actor; got {ranks}")
    if not timeout > 0:
        raise BadArgument(f"timeout must be positive, got {timeout!r}")
    with _lock:
        if group_name in _created:
            raise BadArgument(f"group {group_name!r} exists; destroy_collective_group({group_name!r}) first")
    return ranks


def _wait_all(refs: list[Any], ranks: list[int], store: Any, deadline: float) -> dict[int, Any]:
    """Each rank's outcome (its result or its exception); after the first
    failure the others get :data:`FAILURE_GRACE` seconds, then are given up."""
    ray = ray_module()
    rank_of = {ref: r for ref, r in zip(refs, ranks)}
    outcomes: dict[int, Any] = {}
    pending = list(refs)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            try:
                outcome = ray.get(ref)
                outcome = outcome.get("error", outcome)
            except Exception as exc:
                outcome = exc
            outcomes[rank_of[ref]] = outcome
            if isinstance(outcome, BaseException):
                if deadline > time.monotonic() + FAILURE_GRACE:
                    end_actor(store)
                    deadline = time.monotonic() + FAILURE_GRACE
    for ref in pending:
        cancel(ref)
        outcomes[rank_of[ref]] = CollectiveTimeout(
            f"rank {rank_of[ref]}: still forming the group when the others had failed or were done (an actor "
            "runs one method at a time: one busy in another method starts this only when that returns)")
    return outcomes


def _cause(exc: BaseException) -> BaseException:
    """The member's own exception inside Ray's wrapper."""
    return getattr(exc, "cause", None) or exc


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _creation_error(group_name: str, failures: dict[int, BaseException]) -> CollectiveError:
    """One error for a group that did not form: the kind of the first cause
    (a consequence such as an abandoned rendezvous comes last), every rank's outcome."""
    ray = ray_module()

    def primary(item: tuple[int, BaseException]) -> tuple[int, int]:
        rank, exc = item
        return (isinstance(_cause(exc), rdv.RendezvousAbandoned), rank)

    lines, kind, peer = [], None, None
    for rank, exc in sorted(failures.items(), key=primary):
        cause = _cause(exc)
        if isinstance(exc, ray.exceptions.RayActorError):
            text, k = f"rank {rank}: its actor died ({_first_line(exc)})", PeerLost
        elif isinstance(cause, CollectiveError):
            text, k = _first_line(cause), type(cause)
        else:  # not the library's: say what it is and where
            text, k = f"rank {rank}: {type(cause).__name__}: {_first_line(cause)}", PeerLost
        lines.append(text)
        if kind is None:
            kind, peer = k, rank
    if issubclass(kind, rdv.RendezvousAbandoned) or not issubclass(kind, CollectiveError):
        kind = PeerLost
    err = kind(f"create_collective_group({group_name!r}) failed: " + "; ".join(lines))
    err.origin = peer
    return err


def create_collective_group(actors: Sequence[Any], group_name: str = "default", backend: str = "auto",
                            timeout: float = 60.0, *, ranks: Sequence[int] | None = None) -> GroupInfo:
    """Form group ``group_name`` among Ray ``actors`` (from the driver).

    Every actor runs :func:`init_collective_group` through ``__ray_call__``;
    this returns when every one of them is a member, or raises.

    Args:
        actors: Ray actor handles; ``actors[i]`` gets rank ``ranks[i]`` (default i).
        group_name: the group's name in every actor.
        backend: ``"auto"``, ``"shm"`` or ``"zmq"`` (see :func:`init_collective_group`).
        timeout: seconds each step may wait (the rendezvous, opening the
            transport); the default timeout of the group's collectives.

    Returns:
        A :class:`GroupInfo`.

    Raises:
        BadArgument: bad arguments (nothing is started), or the group exists.
        CollectiveTimeout, PeerLost: a member did not join or failed; the
            message gives every failed rank's reason; the members that had
            joined leave the group again.
    """
    check_backend(backend)
    ranks = _check_members(actors, group_name, ranks, timeout)
    timeout = float(timeout)
    job, secret = rdv.new_job()
    store = rendezvous_actor().remote(group_name, len(actors), job, secret)
    refs = [a.__ray_call__.remote(set_up_by_driver, store, r, len(actors), backend, group_name, timeout)
            for a, r in zip(actors, ranks)]
    try:
        outcomes = _wait_all(refs, ranks, store, time.monotonic() + 2 * timeout + RAY_SLACK)
    finally:
        end_actor(store)
    failures = {r: o for r, o in outcomes.items() if isinstance(o, BaseException)}
    if failures:
        joined = [a for a, r in zip(actors, ranks) if r not in failures]
        forget_on(joined, group_name, timeout)
        raise _creation_error(group_name, failures)
    with _lock:
        _created[group_name] = list(actors)
    return GroupInfo(group_name, len(actors), outcomes[ranks[0]]["transport"], job)


def forget_on(actors: list[Any], group_name: str, timeout: float) -> None:
    """Make each live actor leave ``group_name``; dead or stuck ones are skipped."""
    ray = ray_module()
    refs = [a.__ray_call__.remote(forget, group_name) for a in actors]
    ready, stuck = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:  # a dead actor has left every group
            pass
    for ref in stuck:
        cancel(ref)


def forget_created(group_name: str, timeout: float) -> None:
    """If this process created ``group_name``: make every live member leave it."""
    with _lock:
        actors = _created.pop(group_name, None)
    if actors is not None and ray_module().is_initialized():
        forget_on(actors, group_name, timeout)
