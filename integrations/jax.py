"""JAX integration: allreduce of a gradient pytree between steps, or inside ``jit``.

:func:`allreduce_tree` flattens the pytree's leaves into one flat buffer per
dtype (in buckets of up to ``bucket_cap_mb``), posts a nonblocking
allreduce per bucket, and rebuilds the pytree from the reduced buffers.
Reading a leaf is a zero-copy view (``np.asarray`` of a CPU JAX array);
every leaf starts 64-byte aligned in its bucket, so on the CPU
``jax.device_put`` of the result shares the buffer instead of copying it.

:func:`allreduce_tree_in_jit` is the same reduction inside a jitted
function: an XLA FFI custom call that reduces XLA's own buffers in place
(:mod:`.jax_ffi`), or, where that cannot be built,
``jax.experimental.io_callback(..., ordered=True)``. Either carries an
ordered effect: never removed as dead code, kept in order, so every rank
makes the same calls. It cannot be differentiated (no JVP/VJP rule) or
vmapped; call it on gradients, after ``jax.grad``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import collectives
from collectives import Communicator, Handle, config

from . import jax_ffi

__all__ = ["allreduce_tree", "allreduce_tree_in_jit", "default_communicator"]

ALIGN = 64
MiB = 1 << 20
_default: list[Communicator] = []


def default_communicator() -> Communicator:
    """The communicator used when none is given (:func:`collectives.init`, made once)."""
    if not _default:
        _default.append(collectives.init())
    return _default[0]


def _aligned_empty(nbytes: int) -> np.ndarray:
    """A uint8 buffer of ``nbytes`` whose start is 64-byte aligned."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes]


def _pad(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class _Bucket:
    """Leaves of one dtype packed into one aligned flat buffer."""

    def __init__(self, dtype: np.dtype, leaves: list[tuple[int, np.ndarray]]) -> None:
        self.dtype = dtype
        self.slots: list[tuple[int, int, tuple[int, ...]]] = []  # (leaf index, byte offset, shape)
        offset = 0
        for index, arr in leaves:
            self.slots.append((index, offset, arr.shape))
            offset += _pad(arr.nbytes)
        self.raw = _aligned_empty(max(offset, ALIGN))
        used = 0
        for (index, off, shape), (_, arr) in zip(self.slots, leaves):
            self.raw[used:off] = 0  # the gaps between leaves reduce as zeros
            self._leaf(off, shape)[...] = arr
            used = off + arr.nbytes
        # Exactly the leaves' extent, no trailing padding: ranks whose leaves
        # differ in size then differ in count, which the call's signature check names.
        self.flat = self.raw[:used].view(dtype)

    def _leaf(self, offset: int, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        return self.raw[offset:offset + count * self.dtype.itemsize].view(self.dtype).reshape(shape)

    def leaves(self) -> list[tuple[int, np.ndarray]]:
        return [(index, self._leaf(off, shape)) for index, off, shape in self.slots]


def _buckets(arrays: list[np.ndarray], cap: int) -> list[_Bucket]:
    by_dtype: dict[np.dtype, list[list[tuple[int, np.ndarray]]]] = {}
    sizes: dict[np.dtype, int] = {}
    for i, arr in enumerate(arrays):
        groups = by_dtype.setdefault(arr.dtype, [[]])
        if groups[-1] and sizes[arr.dtype] + arr.nbytes > cap:
            groups.append([])
            sizes[arr.dtype] = 0
        groups[-1].append((i, arr))
        sizes[arr.dtype] = sizes.get(arr.dtype, 0) + _pad(arr.nbytes)
    return [_Bucket(dtype, group) for dtype, groups in by_dtype.items() for group in groups]


def _reduce_host(arrays: list[np.ndarray], comm: Communicator, op: str, cap: int) -> list[np.ndarray]:
    """Allreduce host arrays, one nonblocking allreduce per bucket; returns reduced arrays."""
    buckets = _buckets([np.asarray(a) for a in arrays], cap)
    handles: list[Handle] = [comm.iallreduce(b.flat, op) for b in buckets]
    out: list[np.ndarray] = [None] * len(arrays)  # type: ignore[list-item]
    for bucket, handle in zip(buckets, handles):
        handle.wait()
        for index, leaf in bucket.leaves():
            out[index] = leaf
    return out


def _in_place(dtypes: list[np.dtype], comm: Communicator, op: str, cap: int) -> Any:
    """``host(outputs)`` that allreduces flat buffers of ``dtypes`` in place:
    an array alone in its dtype by itself (a blocking call: the prepared fast
    path), several of one dtype packed in buckets of at most ``cap`` bytes."""
    by_dtype: dict[np.dtype, list[int]] = {}
    for i, d in enumerate(dtypes):
        by_dtype.setdefault(d, []).append(i)
    alone = [(idx[0], d) for d, idx in by_dtype.items() if len(idx) == 1]
    packed = [(idx, d) for d, idx in by_dtype.items() if len(idx) > 1]
    allreduce, frombuffer = comm.allreduce, np.frombuffer

    def host(outputs: tuple) -> None:
        for i, d in alone:
            allreduce(frombuffer(outputs[i], d), op)
        for idx, d in packed:
            group = [frombuffer(outputs[i], d) for i in idx]
            for reduced, target in zip(_reduce_host(group, comm, op, cap), group):
                target[...] = reduced.reshape(-1)
    return host


def allreduce_tree(tree: Any, comm: Communicator | None = None, *, op: str = "avg",
                   bucket_cap_mb: float = 25.0) -> Any:
    """Allreduce every leaf of a pytree of JAX (or numpy) arrays over the ranks.

    Args:
        tree: a pytree of arrays (e.g. the gradients from ``jax.grad``).
        comm: the communicator (default: :func:`default_communicator`).
        op: ``"avg"`` (default), ``"sum"``, ``"max"``, ... (see :mod:`collectives.ops`).
        bucket_cap_mb: largest bucket in MiB (one allreduce per bucket).

    Returns:
        A pytree of the same structure with the reduced values as JAX arrays.
    """
    comm = comm if comm is not None else default_communicator()
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    reduced = _reduce_host(leaves, comm, op, int(bucket_cap_mb * MiB))
    return jax.tree_util.tree_unflatten(treedef, [jax.device_put(a) for a in reduced])


def allreduce_tree_in_jit(tree: Any, comm: Communicator | None = None, *, op: str = "avg",
                          bucket_cap_mb: float = 25.0) -> Any:
    """:func:`allreduce_tree` usable inside ``jax.jit`` (an XLA FFI call, else an ordered ``io_callback``).

    Not differentiable and not vmappable: apply it to gradients.

    Args:
        tree: a pytree of arrays.
        comm: the communicator (default: :func:`default_communicator`).
        op: the reduction.
        bucket_cap_mb: largest bucket in MiB.

    Returns:
        The reduced pytree.
    """
    comm = comm if comm is not None else default_communicator()
    cap = int(bucket_cap_mb * MiB)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if config.get("JAX_FFI") and jax_ffi.available()[0]:
        reduced = jax_ffi.call(_in_place([np.dtype(x.dtype) for x in leaves], comm, op, cap), leaves)
        return jax.tree_util.tree_unflatten(treedef, list(reduced))

    from jax.experimental import io_callback

    shapes = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]

    def host(*arrays: np.ndarray) -> list[np.ndarray]:
        return _reduce_host(list(arrays), comm, op, cap)

    reduced = io_callback(host, shapes, *leaves, ordered=True)
    return jax.tree_util.tree_unflatten(treedef, list(reduced))
