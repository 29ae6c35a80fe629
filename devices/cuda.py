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
from typing import Any

import numpy as np

from collectives import config
from ..errors import BadArgument, TransportUnavailable

__all__ = ["CudaError", "CudaRuntime", "runtime", "probe", "device_pointer", "DevicePointer",
           "PinnedBuffer", "Stream"]

_CDEF = """
typedef int cudaError_t;
typedef void *cudaStream_t;
typedef struct { char reserved[64]; } cudaIpcMemHandle_t;
struct cudaPointerAttributes { int type; int device; void *devicePointer; void *hostPointer; };

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
    """Where a device array's data is: pointer, bytes, dtype, shape, device."""

    ptr: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]
    readonly: bool


def device_pointer(buf: Any) -> DevicePointer:
    """Describe a device array from ``__cuda_array_interface__`` (CuPy, torch
    CUDA tensors, Numba). Raises BadArgument for non-contiguous arrays."""
    iface = getattr(buf, "__cuda_array_interface__", None)
    if iface is None:
        raise BadArgument(f"{type(buf).__name__} has no __cuda_array_interface__")
    dtype = np.dtype(iface["typestr"])
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
    return DevicePointer(int(ptr), nbytes, dtype, shape, bool(readonly))


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


def stage(buf: Any, writable: bool) -> tuple[np.ndarray, Any]:
    """A host copy of device array ``buf`` in pinned memory, and its write-back.

    Returns ``(host, write_back)``: ``host`` is a 1-D numpy array holding the
    device data (copied on a stream); ``write_back()`` copies ``host`` back
    to the device when ``writable`` (results), then frees the pinned memory.
    Raises TransportUnavailable when no GPU is usable.
    """
    rt = runtime()
    d = device_pointer(buf)
    if writable and d.readonly:
        raise BadArgument("device array is read-only, but the result is written into it")
    pinned = PinnedBuffer(rt, d.nbytes)
    stream = Stream(rt)
    if d.nbytes:
        rt.memcpy(pinned.array.ctypes.data, d.ptr, d.nbytes, MEMCPY_DEVICE_TO_HOST, stream)
        stream.synchronize()
    host = pinned.array.view(d.dtype)

    def write_back() -> None:
        try:
            if writable and d.nbytes:
                rt.memcpy(d.ptr, pinned.array.ctypes.data, d.nbytes, MEMCPY_HOST_TO_DEVICE, stream)
                stream.synchronize()
        finally:
            stream.close()
            pinned.close()

    return host, write_back
