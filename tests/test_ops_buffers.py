"""Reduction ops and buffer views, in one process (no communication)."""

from __future__ import annotations

import numpy as np
import pytest

from collectives import BadArgument, get_op
from collectives.buffers import as_array, flat
from collectives.ops import BFLOAT16, OPS, SUPPORTED_DTYPES


def test_every_op_by_name_and_alias():
    for name in OPS:
        assert get_op(name).name == name
        assert get_op(name.upper()).name == name
    assert get_op("MPI_SUM").name == "sum"
    assert get_op("mean").name == "avg"
    with pytest.raises(BadArgument, match="unknown reduction op"):
        get_op("median")


@pytest.mark.parametrize("op,dtype", [("band", np.float32), ("avg", np.int32), ("min", np.complex64),
                                      ("bxor", BFLOAT16)])
def test_op_rejects_invalid_dtype(op, dtype):
    with pytest.raises(BadArgument, match="not valid for dtype"):
        get_op(op).check(np.dtype(dtype))


def test_reduce_in_place_on_views():
    a = np.arange(10, dtype=np.int32)
    b = np.ones(10, dtype=np.int32)
    get_op("sum").reduce(a[2:5], b[2:5])
    assert a.tolist() == [0, 1, 3, 4, 5, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("dtype,start", [(np.float16, 2048), (BFLOAT16, 256)])
def test_low_precision_sum_accumulates_in_float32(dtype, start):
    # start + 1 + 1 rounds back to start at each step in the low precision,
    # but is start + 2 (representable) when accumulated in float32.
    big = np.full(4, start, dtype)
    ones = np.ones(4, dtype)
    out = np.empty(4, dtype)
    get_op("sum").reduce_many(out, [big, ones, ones])
    assert np.all(out.astype(np.float32) == start + 2)


def test_avg_finalize():
    x = np.array([3.0, 6.0], np.float32)
    get_op("avg").finalize(x, 3)
    assert x.tolist() == [1.0, 2.0]


def test_views_are_zero_copy():
    a = np.zeros((4, 5), np.float64)
    v = flat(a, writable=True)
    v[3] = 7
    assert a[0, 3] == 7
    ba = bytearray(8)
    flat(ba, writable=True)[0] = 5
    assert ba[0] == 5


def test_object_with_array_interface():
    class Wrapper:
        def __init__(self):
            self.data = np.ones(3, np.int32)

        def __array__(self, dtype=None, copy=None):
            return self.data

    w = Wrapper()
    flat(w, writable=True)[1] = 9
    assert w.data[1] == 9


def test_rejects_non_contiguous_and_read_only():
    a = np.zeros((4, 4))
    with pytest.raises(BadArgument, match="not contiguous"):
        as_array(a[:, 1], writable=True)
    ro = np.zeros(3)
    ro.flags.writeable = False
    with pytest.raises(BadArgument, match="read-only"):
        as_array(ro, writable=True)
    as_array(ro, writable=False)
    with pytest.raises(BadArgument, match="unsupported dtype"):
        as_array(np.array(["a"]), writable=False)
    with pytest.raises(BadArgument, match="not a buffer"):
        as_array(object(), writable=False)


def test_torch_tensors_are_zero_copy():
    torch = pytest.importorskip("torch")
    t = torch.zeros(6)
    flat(t, writable=True)[2] = 4
    assert t[2].item() == 4
    b = torch.zeros(4, dtype=torch.bfloat16)
    v = flat(b, writable=True)
    assert v.dtype == BFLOAT16
    v[1] = 3
    assert b[1].item() == 3


def test_supported_dtypes_include_bfloat16_and_float16():
    assert BFLOAT16 in SUPPORTED_DTYPES and np.dtype(np.float16) in SUPPORTED_DTYPES
