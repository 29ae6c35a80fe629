"""The CUDA runtime through cffi (ABI mode; nothing to compile).

What the library needs from a GPU: whether one is usable (and if not, why),
device properties, pinned host memory, copies between host and device on a
stream, and IPC memory handles (a device allocation of one process mapped
into another on the same host, the single-node form of GPUDirect P2P).

``libcudart`` is found the way CUDA installs it: ``COLLECTIVES_CUDART``,
the loader's search path, ``$CUDA_HOME``/``/usr/local/cuda*``, then the
``nvidia-cuda-runtime`` wheel. Every call's return code is checked before
any output is read: with a runtime but no driver, ``cudaGetDeviceCount``
returns cudaErrorInsufficientDriver and leaves the count untouched.
"""

from __future__ import annotations

import ctypes.util
import glob
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from collectives import config
from ..errors import BadArgument, TransportUnavailable
from ..ops import BFLOAT16

__all__ = ["CudaError", "CudaRuntime", "runtime", "probe", "device_pointer", "DevicePointer",
           "PinnedBuffer", "Stream"]

_CDEF = """
typedef int cudaError_t;
typedef void *cudaStream_t;
typedef struct { char reserved[64]; } cudaIpcMemHandle_t;
struct cudaPointerAttributes { int type; int device; void *devicePointer; void *hostPointer;
                               long reserved[8]; char slack[256]; };

const char *cudaGetErrorName(cudaError_t error);
const char *cudaGetErrorString(cudaError_t error);
cudaError_t cudaRuntimeGetVersion(int *runtimeVersion);
cudaError_t cudaDriverGetVersion(int *driverVersion);
cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaDeviceGetAttribute(int *value, int attr, int device);
cudaError_t cudaDeviceGetPCIBusId(char *pciBusId, int len, int device);
cudaError_t cudaMemGetInfo(size_t *free, size_t *total);
cudaError_t cudaMallocHost(void **ptr, size_t size);
cudaError_t cudaFreeHost(void *ptr);
cudaError_t cudaMalloc(void **devPtr, size_t size);
cudaError_t cudaFree(void *devPtr);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, int kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, cudaStream_t stream);
cudaError_t cudaStreamCreate(cudaStream_t *pStream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr);
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *handle, void *devPtr);
cudaError_t cudaIpcOpenMemHandle(void **devPtr, cudaIpcMemHandle_t handle, unsigned int flags);
cudaError_t cudaIpcCloseMemHandle(void *devPtr);
"""

# cudaPointerAttributes: CUDA 13 appends ``long reserved[8]`` to the four fields
# of CUDA 11, and the runtime writes all of it; ``slack`` keeps a later
# runtime's additions inside the allocation too (a struct declared short is a
# heap overflow on every call).

SUCCESS = 0
ERROR_NOT_READY = 600
MEMCPY_HOST_TO_DEVICE = 1
MEMCPY_DEVICE_TO_HOST = 2
MEMCPY_DEVICE_TO_DEVICE = 3
IPC_LAZY_ENABLE_PEER_ACCESS = 1
MEMORY_TYPE_DEVICE = 2
MEMORY_TYPE_MANAGED = 3
#: cudaDeviceAttr values used by :meth:`CudaRuntime.properties`.
ATTRIBUTES = {
    "multiprocessors": 16,
    "pci_bus_id": 33,
    "pci_device_id": 34,
    "compute_capability_major": 75,
    "compute_capability_minor": 76,
    "unified_addressing": 41,
}


class CudaError(RuntimeError):
    """A CUDA runtime call failed; ``code`` and ``name`` say how."""

    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        super().__init__(f"{call} failed: {name} ({code}): {text}")
        self.call, self.code, self.name = call, code, name


def _candidates() -> list[str]:
    """Places libcudart may be, in the order they are tried."""
    found = [config.get("CUDART") or ""]
    found.append(ctypes.util.find_library("cudart") or "")
    homes = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    homes += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for home in filter(None, homes):
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
            found += sorted(glob.glob(os.path.join(home, sub, "libcudart.so*")), reverse=True)
    for path in sys.path:
        found += sorted(glob.glob(os.path.join(path, "nvidia", "cuda_runtime", "lib", "libcudart.so*")),
                        reverse=True)
    seen: list[str] = []
    for f in found:
        if f and f not in seen:
            seen.append(f)
    return seen


class CudaRuntime:
    """libcudart loaded through cffi, with every call's status checked."""

    def __init__(self, path: str | None = None) -> None:
        import cffi

        self.ffi = cffi.FFI()
        self.ffi.cdef(_CDEF)
        errors = []
        self.lib = None
        for cand in [path] if path else _candidates():
            try:
                self.lib = self.ffi.dlopen(cand)
                self.path = cand
                break
            except OSError as exc:
                errors.append(f"{cand}: {exc}")
        if self.lib is None:
            raise TransportUnavailable(
                "the CUDA runtime (libcudart) was not found; install CUDA or the "
                "nvidia-cuda-runtime wheel, or set COLLECTIVES_CUDART" + (f" ({errors[-1]})" if errors else ""))

    def error(self, call: str, code: int) -> CudaError:
        name = self.ffi.string(self.lib.cudaGetErrorName(code)).decode()
        text = self.ffi.string(self.lib.cudaGetErrorString(code)).decode()
        return CudaError(call, code, name, text)

    def check(self, call: str, code: int) -> None:
        """Raise :class:`CudaError` unless ``code`` is cudaSuccess."""
        if code != SUCCESS:
            raise self.error(call, code)

    def _int_out(self, call: str, fn, *args) -> int:
        out = self.ffi.new("int *")
        self.check(call, fn(out, *args))
        return int(out[0])

    def runtime_version(self) -> int:
        return self._int_out("cudaRuntimeGetVersion", self.lib.cudaRuntimeGetVersion)

    def driver_version(self) -> int:
        """0 when no driver is installed."""
        return self._int_out("cudaDriverGetVersion", self.lib.cudaDriverGetVersion)

    def device_count(self) -> int:
        """Number of usable devices; raises CudaError (e.g. insufficient driver)."""
        return self._int_out("cudaGetDeviceCount", self.lib.cudaGetDeviceCount)

    def set_device(self, device: int) -> None:
        self.check("cudaSetDevice", self.lib.cudaSetDevice(device))

    def current_device(self) -> int:
        return self._int_out("cudaGetDevice", self.lib.cudaGetDevice)

    def synchronize_device(self) -> None:
        """Wait for all work queued on the current device, on every stream."""
        self.check("cudaDeviceSynchronize", self.lib.cudaDeviceSynchronize())

    def synchronize_stream(self, stream: int) -> None:
        """Wait for the work queued on ``stream`` (a handle as an integer; 1 is
        the legacy default stream, 2 the per-thread one)."""
        handle = self.ffi.cast("cudaStream_t", stream)
        self.check("cudaStreamSynchronize", self.lib.cudaStreamSynchronize(handle))

    def properties(self, device: int) -> dict[str, Any]:
        """Compute capability, multiprocessors, PCI bus id and memory of ``device``."""
        props = {k: self._int_out("cudaDeviceGetAttribute", self.lib.cudaDeviceGetAttribute, a, device)
                 for k, a in ATTRIBUTES.items()}
        bus = self.ffi.new("char[32]")
        self.check("cudaDeviceGetPCIBusId", self.lib.cudaDeviceGetPCIBusId(bus, 32, device))
        props["pci_bus"] = self.ffi.string(bus).decode()
        self.set_device(device)
        free, total = self.ffi.new("size_t *"), self.ffi.new("size_t *")
        self.check("cudaMemGetInfo", self.lib.cudaMemGetInfo(free, total))
        props["memory_free"], props["memory_total"] = int(free[0]), int(total[0])
        return props

    def pointer_device(self, ptr: int) -> int | None:
        """The device that owns ``ptr``, or None for host memory."""
        attrs = self.ffi.new("struct cudaPointerAttributes *")
        code = self.lib.cudaPointerGetAttributes(attrs, self.ffi.cast("void *", ptr))
        self.check("cudaPointerGetAttributes", code)
        return int(attrs.device) if attrs.type in (MEMORY_TYPE_DEVICE, MEMORY_TYPE_MANAGED) else None

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int, stream: "Stream | None" = None) -> None:
        """Copy ``nbytes`` (asynchronously when ``stream`` is given)."""
        d, s = self.ffi.cast("void *", dst), self.ffi.cast("void *", src)
        if stream is None:
            self.check("cudaMemcpy", self.lib.cudaMemcpy(d, s, nbytes, kind))
        else:
            self.check("cudaMemcpyAsync", self.lib.cudaMemcpyAsync(d, s, nbytes, kind, stream.handle))

    def malloc(self, nbytes: int) -> int:
        out = self.ffi.new("void **")
        self.check("cudaMalloc", self.lib.cudaMalloc(out, max(nbytes, 1)))
        return int(self.ffi.cast("uintptr_t", out[0]))

    def free(self, ptr: int) -> None:
        self.check("cudaFree", self.lib.cudaFree(self.ffi.cast("void *", ptr)))

    def ipc_handle(self, ptr: int) -> bytes:
        """The 64-byte IPC handle of a device allocation (cudaMalloc base pointer)."""
        handle = self.ffi.new("cudaIpcMemHandle_t *")
        self.check("cudaIpcGetMemHandle", self.lib.cudaIpcGetMemHandle(handle, self.ffi.cast("void *", ptr)))
        return bytes(self.ffi.buffer(handle))

    def ipc_open(self, handle: bytes) -> int:
        """Map another process's allocation; returns the local device pointer."""
        if len(handle) != 64:
            raise BadArgument(f"a CUDA IPC handle has 64 bytes, got {len(handle)}")
        h = self.ffi.new("cudaIpcMemHandle_t *")
        self.ffi.memmove(h, handle, 64)
        out = self.ffi.new("void **")
        self.check("cudaIpcOpenMemHandle", self.lib.cudaIpcOpenMemHandle(out, h[0], IPC_LAZY_ENABLE_PEER_ACCESS))
        return int(self.ffi.cast("uintptr_t", out[0]))

    def ipc_close(self, ptr: int) -> None:
        self.check("cudaIpcCloseMemHandle", self.lib.cudaIpcCloseMemHandle(self.ffi.cast("void *", ptr)))


class Stream:
    """A CUDA stream (copies on it overlap with host work)."""

    def __init__(self, rt: CudaRuntime) -> None:
        self.rt = rt
        out = rt.ffi.new("cudaStream_t *")
        rt.check("cudaStreamCreate", rt.lib.cudaStreamCreate(out))
        self.handle = out[0]

    def synchronize(self) -> None:
        self.rt.check("cudaStreamSynchronize", self.rt.lib.cudaStreamSynchronize(self.handle))

    def done(self) -> bool:
        code = self.rt.lib.cudaStreamQuery(self.handle)
        if code == ERROR_NOT_READY:
            return False
        self.rt.check("cudaStreamQuery", code)
        return True

    def close(self) -> None:
        if self.handle is not None:
            self.rt.check("cudaStreamDestroy", self.rt.lib.cudaStreamDestroy(self.handle))
            self.handle = None


class PinnedBuffer:
    """Page-locked host memory (fast DMA to and from the device) as a uint8 array."""

    def __init__(self, rt: CudaRuntime, nbytes: int) -> None:
        self.rt = rt
        out = rt.ffi.new("void **")
        rt.check("cudaMallocHost", rt.lib.cudaMallocHost(out, max(nbytes, 1)))
        self.ptr = out[0]
        self.array = np.frombuffer(rt.ffi.buffer(self.ptr, max(nbytes, 1)), dtype=np.uint8)[:nbytes]

    def close(self) -> None:
        if self.ptr is not None:
            self.array = None
            self.rt.check("cudaFreeHost", self.rt.lib.cudaFreeHost(self.ptr))
            self.ptr = None


@dataclass(frozen=True)
class DevicePointer:
    """Where a device array's data is: pointer, bytes, dtype, shape, and the
    stream its producer named (``__cuda_array_interface__`` version 3):
    ``producer_stream`` is that stream's handle, None when the producer said
    no wait is needed, and ``named_stream`` is False when it said nothing
    (version 2, as torch tensors do), so that every stream must be waited for."""

    ptr: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]
    readonly: bool
    producer_stream: int | None = None
    named_stream: bool = False


def _interface(buf: Any) -> tuple[dict, np.dtype | None]:
    """``buf.__cuda_array_interface__``, and the dtype where its typestr does
    not say it (torch's bfloat16 is ``<V2``). Torch tensors are read detached
    (a tensor that requires grad has no interface of its own)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        t = buf.detach()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).__cuda_array_interface__, np.dtype(BFLOAT16)
        try:
            return t.__cuda_array_interface__, None
        except KeyError:  # a dtype torch has no typestr for (float8, ...)
            raise BadArgument(f"device tensors of {t.dtype} are not supported") from None
    try:
        iface = buf.__cuda_array_interface__
    except AttributeError:
        raise BadArgument(f"{type(buf).__name__} has no __cuda_array_interface__") from None
    except Exception as exc:
        raise BadArgument(f"{type(buf).__name__}'s __cuda_array_interface__ failed: {exc}") from None
    return iface, None


def device_pointer(buf: Any) -> DevicePointer:
    """Describe a device array from ``__cuda_array_interface__`` (CuPy, torch
    CUDA tensors, Numba). Raises BadArgument for non-contiguous arrays."""
    iface, dtype = _interface(buf)
    dtype = np.dtype(iface["typestr"]) if dtype is None else dtype
    shape = tuple(int(s) for s in iface["shape"])
    strides = iface.get("strides")
    if strides is not None:
        expect, step = [], dtype.itemsize
        for s in reversed(shape):
            expect.insert(0, step)
            step *= s
        if tuple(strides) != tuple(expect) and int(np.prod(shape, dtype=np.int64)) > 1:
            raise BadArgument("device array is not contiguous; pass a contiguous array")
    ptr, readonly = iface["data"]
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    named = int(iface.get("version", 0)) >= 3 and "stream" in iface
    stream = iface.get("stream") if named else None
    return DevicePointer(int(ptr), nbytes, dtype, shape, bool(readonly),
                         None if stream is None else int(stream), named)


_runtime: CudaRuntime | None = None
_probe: tuple[bool, str] | None = None
_lock = threading.Lock()


def probe() -> tuple[bool, str]:
    """(True, description) when a GPU is usable, else (False, why not).

    Never reads an output of a failed call: a missing library, a runtime
    without a driver (cudaErrorInsufficientDriver) and zero devices are
    each reported as such.
    """
    global _runtime, _probe
    with _lock:
        if _probe is not None:
            return _probe
        try:
            rt = CudaRuntime()
        except TransportUnavailable as exc:
            _probe = (False, str(exc))
            return _probe
        try:
            count = rt.device_count()
        except CudaError as exc:
            driver = ""
            try:
                driver = f"; driver version {rt.driver_version()}"
            except CudaError:
                pass
            _probe = (False, f"CUDA runtime {rt.path} is present but no GPU is usable: {exc}{driver}")
            return _probe
        if count == 0:
            _probe = (False, "the CUDA runtime reports no devices")
            return _probe
        _runtime = rt
        _probe = (True, f"{count} CUDA device(s) through {rt.path}")
        return _probe


def runtime() -> CudaRuntime:
    """The loaded runtime; raises TransportUnavailable (with the reason) when no GPU is usable."""
    ok, why = probe()
    if not ok:
        raise TransportUnavailable(why)
    assert _runtime is not None
    return _runtime


class _OnDevice:
    """Make ``device`` current for a block, and restore the caller's after."""

    def __init__(self, rt: CudaRuntime, device: int | None) -> None:
        self.rt, self.device, self.before = rt, device, None

    def __enter__(self) -> None:
        if self.device is not None:
            before = self.rt.current_device()
            if before != self.device:
                self.rt.set_device(self.device)
                self.before = before

    def __exit__(self, *exc: Any) -> None:
        if self.before is not None:
            self.rt.set_device(self.before)


def _wait_for_producer(rt: CudaRuntime, d: DevicePointer) -> None:
    """Order the copy out after the work that wrote the array: its producer's
    stream where it named one, else every stream of the device."""
    if not d.named_stream:
        rt.synchronize_device()
    elif d.producer_stream is not None:
        rt.synchronize_stream(d.producer_stream)


class _PinnedPool:
    """Pinned host buffers kept for reuse, and one copy stream per device.

    ``cudaMallocHost`` costs about 0.7 ms per MiB (44 ms for 64 MiB on an
    H200 host), and creating a stream costs too: paid on every call, they
    were most of a staged collective's time. Buffers are kept by capacity
    (powers of two, at least 64 KiB) up to ``COLLECTIVES_CUDA_PINNED_CACHE_BYTES``
    in all (a larger one is allocated at its size and freed after its call);
    a buffer is handed to one caller at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[PinnedBuffer]] = {}
        self._kept = 0
        self._streams: dict[int | None, Stream] = {}

    @staticmethod
    def capacity(nbytes: int) -> int:
        return max(1 << 16, 1 << max(0, nbytes - 1).bit_length())

    def take(self, rt: CudaRuntime, nbytes: int) -> PinnedBuffer:
        cap = self.capacity(nbytes)
        if cap > config.get("CUDA_PINNED_CACHE_BYTES"):
            return PinnedBuffer(rt, nbytes)  # never kept: no more than it needs
        with self._lock:
            kept = self._free.get(cap)
            if kept:
                self._kept -= cap
                return kept.pop()
        return PinnedBuffer(rt, cap)

    def give(self, buf: PinnedBuffer) -> None:
        cap = len(buf.array)
        with self._lock:
            if cap == self.capacity(cap) and self._kept + cap <= config.get("CUDA_PINNED_CACHE_BYTES"):
                self._free.setdefault(cap, []).append(buf)
                self._kept += cap
                return
        buf.close()

    def stream(self, rt: CudaRuntime, device: int | None) -> Stream:
        """This device's copy stream (every use ends with its synchronization)."""
        with self._lock:
            found = self._streams.get(device)
            if found is None:
                found = self._streams[device] = Stream(rt)
            return found


_pool = _PinnedPool()


def stage(buf: Any, writable: bool) -> tuple[np.ndarray, Callable[[bool], None]]:
    """A host copy of device array ``buf`` in pinned memory, and its finish.

    Returns ``(host, finish)``: ``host`` is a 1-D numpy array holding the
    device data, copied once the work that wrote it is done (see
    :func:`_wait_for_producer`). ``finish(True)`` copies ``host`` back to
    the device when ``writable`` (results), and waits for that copy;
    ``finish(False)`` (a failed call) leaves the device array as it was.
    Either returns the pinned memory to the pool. Raises
    TransportUnavailable when no GPU is usable, BadArgument for an array
    that cannot be staged.
    """
    rt = runtime()
    d = device_pointer(buf)
    if writable and d.readonly:
        raise BadArgument("device array is read-only, but the result is written into it")
    device = rt.pointer_device(d.ptr) if d.nbytes else None
    with _OnDevice(rt, device):
        stream = _pool.stream(rt, device)
        pinned = _pool.take(rt, d.nbytes)
        try:
            if d.nbytes:
                _wait_for_producer(rt, d)
                rt.memcpy(pinned.array.ctypes.data, d.ptr, d.nbytes, MEMCPY_DEVICE_TO_HOST, stream)
                stream.synchronize()
        except BaseException:
            _pool.give(pinned)
            raise
    host = pinned.array[:d.nbytes].view(d.dtype)

    def finish(commit: bool = True) -> None:
        try:
            if commit and writable and d.nbytes:
                with _OnDevice(rt, device):
                    rt.memcpy(d.ptr, pinned.array.ctypes.data, d.nbytes, MEMCPY_HOST_TO_DEVICE, stream)
                    stream.synchronize()
        finally:
            _pool.give(pinned)

    return host, finish
