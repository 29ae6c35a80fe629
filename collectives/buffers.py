"""Turning user buffers into numpy views without copying.

Accepted: numpy arrays, objects with ``__dlpack__`` (torch CPU tensors, JAX
arrays, CuPy is rejected until a device transport is present), objects with
``__array__`` and anything exposing the buffer protocol. The result is a
C-contiguous numpy view of the same memory, flattened to one dimension.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from .errors import BadArgument, TransportUnavailable
from .ops import BFLOAT16, SUPPORTED_SET, check_dtype

__all__ = ["as_array", "flat", "is_device_array", "element_count"]

_DLPACK_CPU = 1


def _torch_tensor(buf: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(buf, torch.Tensor)


def is_device_array(buf: Any) -> bool:
    """True for arrays whose memory is on a GPU (CUDA array interface or DLPack device)."""
    if _torch_tensor(buf):  # the cheap test first: the generic one costs microseconds per call
        return buf.device.type != "cpu"
    if hasattr(buf, "__cuda_array_interface__"):
        return True
    dev = getattr(buf, "__dlpack_device__", None)
    if dev is not None:
        try:
            return int(dev()[0]) != _DLPACK_CPU
        except Exception:
            return False
    return False


def _from_torch(buf: Any) -> np.ndarray:
    import torch

    t = buf.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def _view(buf: Any) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf
    if is_device_array(buf):
        raise BadArgument(
            f"{type(buf).__name__} lives in device memory, and no device-capable transport "
            "is in use (no usable GPU): copy it to the host or use a device transport")
    if _torch_tensor(buf):
        return _from_torch(buf)
    if hasattr(buf, "__dlpack__"):
        try:
            return np.from_dlpack(buf)
        except (BufferError, TypeError, RuntimeError):
            pass  # fall back to __array__ / buffer protocol
    if hasattr(buf, "__array__"):
        return np.asarray(buf)
    try:
        return np.asarray(memoryview(buf))
    except TypeError:
        raise BadArgument(
            f"{type(buf).__name__} is not a buffer: pass a numpy array, a tensor, or an "
            "object with __array__, __dlpack__ or the buffer protocol") from None


def as_array(buf: Any, *, writable: bool, what: str = "buffer") -> np.ndarray:
    """A C-contiguous numpy view of ``buf`` (zero-copy).

    Args:
        buf: the user's buffer.
        writable: raise if the memory is read-only (results land in it).
        what: the argument's name, for error messages.

    Raises:
        BadArgument: not a buffer, not contiguous, read-only, or unsupported dtype.
    """
    if writable and isinstance(buf, np.generic):
        raise BadArgument(f"{what} is a numpy scalar ({buf.dtype}), which cannot hold the result; "
                          "pass an array, e.g. np.array([x])")
    arr = _view(buf)
    if not arr.flags.c_contiguous:
        raise BadArgument(f"{what} is not contiguous (shape {arr.shape}, strides {arr.strides}); "
                          "pass a contiguous array, e.g. np.ascontiguousarray(x)")
    if writable and not arr.flags.writeable:
        raise BadArgument(f"{what} is read-only, but the result is written into it")
    check_dtype(arr.dtype)
    return arr


def _stage_device(buf: Any, writable: bool, what: str, stages: list) -> np.ndarray:
    """A host copy of a device array through an installed device plugin."""
    from .registry import device_stagers

    reasons = []
    for stage in device_stagers():
        try:
            host, finish = stage(buf, writable)
        except TransportUnavailable as exc:
            reasons.append(str(exc))
            continue
        try:
            check_dtype(host.dtype)
        except BaseException:
            finish(False)
            raise
        stages.append(finish)
        return host.reshape(-1)
    why = "; ".join(reasons) or "no device plugin is installed"
    raise BadArgument(f"{what} ({type(buf).__name__}) lives in device memory, and no GPU is usable: {why}")


def flat(buf: Any, *, writable: bool, what: str = "buffer", stages: list | None = None) -> np.ndarray:
    """:func:`as_array` flattened to one dimension (still a view).

    With ``stages`` (a list), device arrays are accepted: the result is a
    host copy and its finish is appended to ``stages``, to be called once
    the collective is over: ``finish(True)`` copies the result back,
    ``finish(False)`` (a failed call) only frees the host copy.
    """
    if type(buf) is np.ndarray and buf.ndim == 1:  # the common case: as_array's checks, cheaper
        flags = buf.flags
        if flags.c_contiguous and (flags.writeable or not writable) and buf.dtype in SUPPORTED_SET:
            return buf
    if stages is not None and is_device_array(buf):
        return _stage_device(buf, writable, what, stages)
    return as_array(buf, writable=writable, what=what).reshape(-1)


def element_count(buf: Any) -> int:
    """Number of elements of ``buf`` (host or device) without copying it."""
    if type(buf) is np.ndarray:
        return buf.size
    if _torch_tensor(buf):  # (a CUDA tensor that requires grad has no array interface)
        return buf.numel()
    iface = getattr(buf, "__cuda_array_interface__", None)
    if iface is not None:
        return math.prod(int(d) for d in iface["shape"])
    shape = getattr(buf, "shape", None)
    if shape is not None and not isinstance(buf, (bytes, bytearray, memoryview)):
        return math.prod(int(d) for d in shape)
    return flat(buf, writable=False).size
