"""What runs inside each member of a Ray collective group: joining a group,
and this process's groups by name (see :mod:`collectives.integrations.ray`).

Also the small Ray helpers the driver's side shares: importing Ray lazily,
the rendezvous actor class, ending actors and calls that are no longer wanted.
"""

from __future__ import annotations

import threading
from typing import Any

from collectives.communicator import Communicator
from collectives.errors import BadArgument, CollectiveError, CollectiveTimeout

from . import ray_rendezvous as rdv

__all__ = ["ray_module", "rendezvous_actor", "end_actor", "cancel", "check_backend", "init_collective_group",
           "set_up_by_driver", "forget", "destroy_here", "get_communicator", "is_group_initialized", "get_rank",
           "get_collective_group_size", "shrink_collective_group", "RAY_SLACK"]

#: Seconds added to a member's own waits for Ray's round trips.
RAY_SLACK = 5.0

_groups: dict[str, Communicator] = {}       # this process's groups, by name
_lock = threading.Lock()
_store_class: list[Any] = []


def ray_module() -> Any:
    """The ``ray`` module, or an ImportError that says what to install."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("collectives.integrations.ray needs Ray: pip install 'collectives[ray]' "
                          "(or pip install 'ray>=2.9')") from exc
    return ray


def rendezvous_actor() -> Any:
    """The Ray actor class of :class:`~.ray_rendezvous.Rendezvous` (made once)."""
    if not _store_class:
        _store_class.append(ray_module().remote(num_cpus=0, max_restarts=0)(rdv.Rendezvous))
    return _store_class[0]


def end_actor(actor: Any) -> None:
    """Kill a Ray actor; nothing if it is gone already."""
    try:
        ray_module().kill(actor, no_restart=True)
    except Exception:  # already dead, or Ray is shutting down
        pass


def cancel(ref: Any) -> None:
    """Cancel a Ray call that is no longer wanted (a running one may finish all the same)."""
    try:
        ray_module().cancel(ref)
    except Exception:
        pass


def check_backend(backend: str) -> str:
    """``backend`` if it is one of :data:`~.ray_rendezvous.BACKENDS`, else BadArgument."""
    if backend not in rdv.BACKENDS:
        raise BadArgument(f"backend must be one of {', '.join(rdv.BACKENDS)}, got {backend!r}")
    return backend


def _join(store: Any, rank: int, world_size: int, backend: str, group_name: str,
          timeout: float) -> Communicator:
    """Take part in a group's rendezvous, open its transport, register its
    communicator. On failure the rendezvous ends, so that the others fail at once."""
    try:
        comm = _form(store, rank, world_size, backend, group_name, timeout)
    except BaseException:
        end_actor(store)
        raise
    with _lock:
        _groups[group_name] = comm
    try:
        if ray_module().get(store.done.remote(rank), timeout=RAY_SLACK):
            end_actor(store)
    except Exception:  # its creator ended it first: the group is formed all the same
        pass
    return comm


def _form(store: Any, rank: int, world_size: int, backend: str, group_name: str,
          timeout: float) -> Communicator:
    """The rendezvous, then the transport: this member's new communicator."""
    import collectives

    ray = ray_module()
    with _lock:
        if group_name in _groups:
            c = _groups[group_name]
            raise BadArgument(f"rank {rank}: this actor is already rank {c.rank} of {c.size} in group "
                              f"{group_name!r}; destroy_collective_group({group_name!r}) first")
    try:
        answer = ray.get(store.join.remote(rdv.whereabouts(rank), world_size, timeout), timeout=timeout + RAY_SLACK)
    except ray.exceptions.GetTimeoutError as exc:
        raise CollectiveTimeout(f"rank {rank}: the rendezvous of group {group_name!r} did not answer within "
                                f"{timeout + RAY_SLACK:.3g} s") from exc
    except ray.exceptions.RayActorError as exc:
        raise rdv.RendezvousAbandoned(f"rank {rank}: the rendezvous of group {group_name!r} ended before every "
                                      "rank joined (another member failed, or its creator gave up)") from exc
    if "error" in answer:
        raise rdv.roster_error(group_name, rank, answer)
    name, options = rdv.transport_for(backend, answer["members"], rank, group_name)
    return collectives.init(rank, world_size, transport=name, job=answer["job"], timeout=timeout,
                            secret=answer["secret"], **options)


def init_collective_group(world_size: int, rank: int, backend: str = "auto", group_name: str = "default",
                          timeout: float = 60.0) -> Communicator:
    """Join group ``group_name`` as ``rank`` of ``world_size`` (inside a Ray actor).

    Every member calls it at about the same time; the first to arrive
    starts the group's rendezvous. :func:`~.ray_driver.create_collective_group` does the
    same for every actor from the driver.

    Args:
        world_size: the number of members.
        rank: this actor's rank, 0 to world_size - 1, each taken once.
        backend: ``"auto"`` (shared memory on one node, else TCP), ``"shm"`` or ``"zmq"``.
        group_name: the group's name in this actor.
        timeout: seconds each step of forming the group may wait; also the
            default timeout of every collective of the group.

    Returns:
        The group's :class:`~collectives.Communicator`.

    Raises:
        BadArgument: bad arguments, a rank taken twice, world sizes that
            disagree, or this actor already in ``group_name``.
        CollectiveTimeout: some rank did not join in time (named).
        PeerLost: the rendezvous ended because another member failed.
    """
    check_backend(backend)
    if not 0 <= int(rank) < int(world_size):
        raise BadArgument(f"rank {rank} is not in a world of {world_size} ranks")
    job, secret = rdv.new_job()
    store = rendezvous_actor().options(name=rdv.store_name(group_name), get_if_exists=True).remote(
        group_name, int(world_size), job, secret)
    return _join(store, int(rank), int(world_size), backend, group_name, float(timeout))


def set_up_by_driver(actor_self: Any, store: Any, rank: int, world_size: int, backend: str, group_name: str,
                      timeout: float) -> dict[str, Any]:
    """Run on each actor by :func:`~.ray_driver.create_collective_group` (through ``__ray_call__``).
    A failure comes back as a value: a call the driver gave up on ends quietly."""
    try:
        comm = _join(store, rank, world_size, backend, group_name, timeout)
    except CollectiveError as exc:
        return {"error": exc}
    return {"rank": comm.rank, "transport": comm.transport.name}


def forget(actor_self: Any, group_name: str) -> bool:
    """Run on each actor by :func:`~.ray_driver.forget_on`: close and forget the group."""
    return destroy_here(group_name)


def destroy_here(group_name: str) -> bool:
    """Close and forget this process's ``group_name``; False if it is in no such group."""
    with _lock:
        comm = _groups.pop(group_name, None)
    if comm is None:
        return False
    try:
        comm.close()
    except CollectiveError:  # an aborted group closes all the same
        pass
    return True


def get_communicator(group_name: str = "default") -> Communicator:
    """The :class:`~collectives.Communicator` of ``group_name`` in this actor.

    Raises:
        BadArgument: this actor is in no group of that name (the message names those it is in).
    """
    with _lock:
        comm = _groups.get(group_name)
        known = sorted(_groups)
    if comm is None:
        raise BadArgument(f"this process is in no collective group named {group_name!r} (its groups: "
                          f"{known or 'none'}); the driver forms groups with create_collective_group")
    return comm


def is_group_initialized(group_name: str = "default") -> bool:
    """Whether this actor is a member of ``group_name``."""
    with _lock:
        return group_name in _groups


def get_rank(group_name: str = "default") -> int:
    """This actor's rank in ``group_name``."""
    return get_communicator(group_name).rank


def get_collective_group_size(group_name: str = "default") -> int:
    """The number of members of ``group_name``."""
    return get_communicator(group_name).size


def shrink_collective_group(group_name: str = "default", *, timeout: float | None = None) -> Communicator:
    """After a member died: the survivors agree on who is left and go on as
    ``group_name`` with ranks 0..q-1 (collective over the survivors; see
    :meth:`~collectives.Communicator.shrink`). Returns the new communicator.

    Shared memory and TCP both shrink; a hierarchical group (several nodes,
    members sharing one) shrinks to a flat TCP group.

    Raises:
        CollectiveTimeout, PeerLost: as :meth:`~collectives.Communicator.agree`;
            and what opening the survivors' transport raises.
    """
    old = get_communicator(group_name)
    new = old.shrink(timeout=timeout)
    with _lock:
        _groups[group_name] = new
    try:
        old.close()
    except CollectiveError:
        pass
    return new
