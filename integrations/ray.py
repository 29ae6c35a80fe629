"""Ray actors as ranks: a communicator among a list of Ray actors.

From the driver::

    import collectives.integrations.ray as cray

    workers = [Worker.remote() for _ in range(4)]      # any Ray actor class
    cray.create_collective_group(workers, group_name="default")

Inside each actor's methods::

    cray.allreduce(grad, op="sum", group_name="default")   # numpy or torch CPU, in place
    comm = cray.get_communicator("default")               # the whole Communicator API

:func:`create_collective_group` runs :func:`init_collective_group` on every
actor through ``__ray_call__``, the method Ray gives every actor class: the
user's class needs no base class and no extra method. Actors may also call
:func:`init_collective_group` themselves, each with its rank and the world
size (as ``ray.util.collective`` allows).

The members meet through a short-lived Ray actor (:mod:`.ray_rendezvous`)
that hands each its rank, the world size, the job id and secret, and every
member's Ray node. On one node they talk through shared memory, otherwise
over TCP with rank 0's node as the master (hierarchical, with shared memory
within each node, where members share a node; see ``docs/hierarchy.md``).
A member that dies is :class:`~collectives.errors.PeerLost` on the others,
who may go on among themselves (:func:`shrink_collective_group`, on shared
memory and over TCP); a group
is left with :func:`destroy_collective_group`, after which its name can
form a new group. Ray is imported only when a function is called:
``pip install 'collectives[ray]'``. How to use it, its limits and costs:
``docs/ray.md``.

Modules: this one (the public calls, and the collectives' short forms);
:mod:`.ray_members` (what runs inside each member: joining, this process's
groups); :mod:`.ray_driver` (forming a group among actors, making them
leave it); :mod:`.ray_rendezvous` (the rendezvous actor and the choice of
transport).
"""

from __future__ import annotations

from typing import Any

from collectives.errors import BadArgument

from .ray_driver import GroupInfo, create_collective_group, forget_created
from .ray_members import (destroy_here, get_collective_group_size, get_communicator, get_rank,
                          init_collective_group, is_group_initialized, ray_module, shrink_collective_group)

__all__ = ["GroupInfo", "create_collective_group", "init_collective_group", "destroy_collective_group",
           "get_communicator", "is_group_initialized", "get_rank", "get_collective_group_size",
           "shrink_collective_group", "allreduce", "allgather", "broadcast", "reduce", "reduce_scatter",
           "barrier"]


def destroy_collective_group(group_name: str = "default", *, timeout: float = 10.0) -> None:
    """Leave ``group_name``: inside a member, close its communicator here;
    in the process that created the group, make every live member leave it.
    Afterwards the name can form a new group. Unknown names are ignored."""
    ray_module()  # an ImportError that says what to install, without Ray
    destroy_here(group_name)
    forget_created(group_name, timeout)


# -------------------------------------------------------------- collectives


def _module_of(x: Any) -> str:
    return type(x).__module__.split(".")[0]


def _empty_like(x: Any, shape: tuple[int, ...]) -> Any:
    """A new array (numpy) or tensor (torch) of ``shape`` with ``x``'s dtype."""
    if _module_of(x) == "torch":
        import torch

        return torch.empty(shape, dtype=x.dtype)
    import numpy as np

    return np.empty(shape, dtype=np.asarray(x).dtype)


def allreduce(tensor: Any, op: str = "sum", group_name: str = "default", *, timeout: float | None = None) -> Any:
    """Reduce ``tensor`` over the group with ``op``, in place; returns it."""
    return get_communicator(group_name).allreduce(tensor, op, timeout=timeout)


def allgather(tensor: Any, out: Any = None, group_name: str = "default", *, timeout: float | None = None) -> Any:
    """Every member's ``tensor`` as row i of ``out`` (made when None: shape ``(size, *tensor.shape)``)."""
    comm = get_communicator(group_name)
    if out is None:
        out = _empty_like(tensor, (comm.size, *tuple(tensor.shape)))
    return comm.allgather(tensor, out, timeout=timeout)


def broadcast(tensor: Any, src_rank: int = 0, group_name: str = "default", *, timeout: float | None = None) -> Any:
    """``src_rank``'s ``tensor`` into every member's ``tensor``; returns it."""
    return get_communicator(group_name).bcast(tensor, src_rank, timeout=timeout)


def reduce(tensor: Any, dst_rank: int = 0, op: str = "sum", group_name: str = "default", *,
           timeout: float | None = None) -> Any:
    """Reduce ``tensor`` over the group into ``dst_rank``'s ``tensor`` (others unchanged); returns it."""
    return get_communicator(group_name).reduce(tensor, dst_rank, op, timeout=timeout)


def reduce_scatter(tensor: Any, out: Any = None, op: str = "sum", group_name: str = "default", *,
                   timeout: float | None = None) -> Any:
    """Reduce ``tensor`` over the group; member i gets block i (of ``size``) in
    ``out`` (made when None: ``tensor.shape[0] // size`` rows, else flat)."""
    comm = get_communicator(group_name)
    if out is None:
        shape = tuple(tensor.shape)
        if shape and shape[0] % comm.size == 0:
            out = _empty_like(tensor, (shape[0] // comm.size, *shape[1:]))
        else:
            count = 1
            for d in shape:
                count *= d
            if count % comm.size:
                raise BadArgument(f"rank {comm.rank}, reduce_scatter: {count} elements do not split into "
                                  f"{comm.size} equal blocks")
            out = _empty_like(tensor, (count // comm.size,))
    return comm.reduce_scatter(tensor, out, op, timeout=timeout)


def barrier(group_name: str = "default", *, timeout: float | None = None) -> None:
    """Wait until every member has entered the barrier."""
    get_communicator(group_name).barrier(timeout=timeout)
