"""RDMA and GPU availability: detected from return codes, explained, and
device arrays refused clearly where no GPU is usable. Tests that need a
device skip with the reason."""

from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess

import numpy as np
import pytest

import collectives
from collectives import BadArgument, TransportUnavailable
from collectives.devices import cuda
from collectives.environment import LaunchInfo, _choose_transport
from collectives.transports import verbs
from harness import run_ranks

RDMA_OK, RDMA_WHY = verbs.probe()
GPU_OK, GPU_WHY = cuda.probe()


class FakeDeviceArray:
    """An object that says its memory is on a GPU (as CuPy arrays do)."""

    def __init__(self, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (0x10000, False),
                                         "version": 3, "strides": None}


def test_rdma_probe_gives_a_reason():
    if RDMA_OK:
        assert ":" in RDMA_WHY  # device:port
    else:
        assert RDMA_WHY and any(w in RDMA_WHY for w in ("ENOSYS", "not installed", "no RDMA devices",
                                                        "no active port", "could not be loaded", "failed"))


@pytest.mark.skipif(RDMA_OK, reason="an RDMA port is active here")
def test_init_rdma_fails_with_the_reason():
    with pytest.raises(TransportUnavailable) as exc:
        collectives.init(0, 1, transport="rdma", timeout=5)
    assert RDMA_WHY in str(exc.value)


@pytest.mark.skipif(RDMA_OK, reason="an RDMA port is active here")
def test_auto_falls_back_to_tcp_with_a_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="collectives"):
        name = _choose_transport(LaunchInfo(0, 2, "torchrun", "job", all_local=False))
    assert name == "zmq"
    assert any("RDMA is not usable" in r.getMessage() for r in caplog.records)


def test_cuda_probe_reads_no_output_of_a_failed_call():
    if GPU_OK:
        assert "CUDA device" in GPU_WHY
    else:
        assert GPU_WHY
        try:
            rt = cuda.CudaRuntime()
        except TransportUnavailable:
            return  # no libcudart at all: the probe said so
        with pytest.raises(cuda.CudaError) as exc:
            rt.device_count()
        assert exc.value.name in GPU_WHY


@pytest.mark.skipif(GPU_OK, reason="a GPU is usable here")
def test_runtime_raises_the_reason():
    with pytest.raises(TransportUnavailable) as exc:
        cuda.runtime()
    assert str(exc.value) == GPU_WHY


def check_device_array_refused(comm):
    host = np.ones(4, dtype=np.float32)
    try:
        comm.allreduce(FakeDeviceArray(4))
    except BadArgument as exc:
        refused = str(exc)
    else:
        refused = ""
    comm.allreduce(host)  # nothing was sent: the next collective matches on every rank
    return refused, host.tolist()


@pytest.mark.skipif(GPU_OK, reason="a GPU is usable here")
def test_device_arrays_refused_before_anything_is_sent():
    for refused, host in run_ranks(check_device_array_refused, 2, timeout=60, comm_timeout=20):
        assert "device memory" in refused
        assert host == [2.0] * 4


CUDA_HEADERS = sorted(glob.glob("/usr/local/cuda*/include/driver_types.h"), reverse=True)
CC = shutil.which("cc") or shutil.which("gcc")


@pytest.mark.skipif(not CUDA_HEADERS or CC is None, reason="no CUDA headers or no C compiler")
def test_cuda_structs_hold_what_the_runtime_writes(tmp_path):
    """Every struct the runtime fills, against the installed headers: the
    fields where the header has them, and at least the header's size (a
    struct declared short is a heap overflow on every call: CUDA 13 added
    ``long reserved[8]`` to cudaPointerAttributes)."""
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(cuda._CDEF)
    checks = {"struct cudaPointerAttributes": ("type", "device", "devicePointer", "hostPointer"),
              "cudaIpcMemHandle_t": ("reserved",)}
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <driver_types.h>", "int main(void) {"]
    for ctype, fields in checks.items():
        lines.append(f'  printf("sizeof {ctype} %zu\\n", sizeof({ctype}));')
        lines += [f'  printf("offsetof {ctype}.{f} %zu\\n", offsetof({ctype}, {f}));' for f in fields]
    src, exe = tmp_path / "layout.c", tmp_path / "layout"
    src.write_text("\n".join(lines + ["  return 0;", "}"]))
    subprocess.run([CC, f"-I{os.path.dirname(CUDA_HEADERS[0])}", str(src), "-o", str(exe)], check=True,
                   capture_output=True, timeout=60)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=30).stdout
    c = {k: int(v) for k, v in (line.rsplit(" ", 1) for line in out.splitlines())}
    for ctype, fields in checks.items():
        assert ffi.sizeof(ctype) >= c[f"sizeof {ctype}"], ctype
        for f in fields:
            assert ffi.offsetof(ctype, f) == c[f"offsetof {ctype}.{f}"], f"{ctype}.{f}"
    assert ffi.sizeof("cudaIpcMemHandle_t") == c["sizeof cudaIpcMemHandle_t"]


def test_device_pointer_reads_the_cuda_array_interface():
    d = cuda.device_pointer(FakeDeviceArray(6))
    assert (d.ptr, d.nbytes, d.dtype, d.shape) == (0x10000, 24, np.dtype(np.float32), (6,))


needs_gpu = pytest.mark.skipif(not GPU_OK, reason=f"no usable GPU: {GPU_WHY}")


@needs_gpu
def test_pinned_memory_and_copies_round_trip():
    rt = cuda.runtime()
    pinned = cuda.PinnedBuffer(rt, 1 << 20)
    stream = cuda.Stream(rt)
    dev = rt.malloc(1 << 20)
    try:
        pinned.array[:] = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20]
        want = pinned.array.copy()
        rt.memcpy(dev, pinned.array.ctypes.data, 1 << 20, cuda.MEMCPY_HOST_TO_DEVICE, stream)
        stream.synchronize()
        pinned.array[:] = 0
        rt.memcpy(pinned.array.ctypes.data, dev, 1 << 20, cuda.MEMCPY_DEVICE_TO_HOST, stream)
        stream.synchronize()
        assert np.array_equal(pinned.array, want)
        assert len(rt.ipc_handle(dev)) == 64
    finally:
        rt.free(dev)
        stream.close()
        pinned.close()


needs_rdma = pytest.mark.skipif(not RDMA_OK, reason=f"no usable RDMA port: {RDMA_WHY}")


def check_allreduce(comm):
    x = np.arange(1 << 18, dtype=np.float32) + comm.rank
    comm.allreduce(x, algorithm="ring")
    want = sum(np.arange(1 << 18, dtype=np.float32) + r for r in range(comm.size))
    return bool(np.array_equal(x, want))


@needs_rdma
def test_allreduce_over_rdma():
    assert all(run_ranks(check_allreduce, 2, transport="rdma", timeout=120, comm_timeout=30))
