"""The compiled fast path: its kernels give numpy's bits, its fence waits and
wakes as the Python one does, and the collectives agree with and without it."""

from __future__ import annotations

import mmap
import os
import shutil

import numpy as np
import pytest

from collectives import compiled, signature
from harness import run_ranks
from reference import data, expect_equal, reduced

needs_compiled = pytest.mark.skipif(not compiled.built, reason="the C extension is not built here")

NUMPY_OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
             "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
DTYPES = ["float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]


def test_the_extension_is_built_where_a_compiler_is():
    if os.environ.get("COLLECTIVES_COMPILED") == "0":
        pytest.skip("turned off by COLLECTIVES_COMPILED=0")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the pure-Python path is what runs")
    assert compiled.built, "a C compiler is present but collectives._compiled was not built (pip install -e .)"


@needs_compiled
def test_the_recorders_clock_reads_the_monotonic_clock():
    """The flight recorder's clock (through the time-stamp counter where the
    kernel's clock source is it) gives CLOCK_MONOTONIC's seconds: each
    reading lies between time.monotonic() just before and just after it,
    and never goes back, across its anchors (one each millisecond)."""
    import time

    from collectives import _compiled

    last, worst = 0.0, 0.0
    deadline = time.monotonic() + 0.05
    while time.monotonic() < deadline:  # about 50 anchors
        before = time.monotonic()
        t, _ = _compiled.recorder_time()
        after = time.monotonic()
        worst = max(worst, before - t, t - after)
        assert t >= last
        last = t
    assert worst < 5e-6, f"the recorder's clock is {worst * 1e6:.1f} us off the monotonic clock"


def _operands(dtype: np.dtype, p: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype.kind == "f":
        specials = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-30, -1.5, 3.25], dtype)
        out = [rng.standard_normal(n).astype(dtype) * 100 for _ in range(p)]
        for k, a in enumerate(out):
            m = min(n, len(specials))
            a[:m] = np.roll(specials, k)[:m]
        return out
    info = np.iinfo(dtype)
    return [rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True) for _ in range(p)]


@needs_compiled
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(NUMPY_OPS))
def test_kernels_give_numpy_bits(dtype, op):
    dt = np.dtype(dtype)
    codes = compiled.kernel_codes(dt, op)
    if dt.kind == "f" and op in ("band", "bor", "bxor"):
        assert codes is None
        return
    assert codes is not None
    ufunc = NUMPY_OPS[op]
    with np.errstate(all="ignore"):
        for p, n in ((2, 1), (3, 37), (5, 1000), (4, 5003)):
            srcs = _operands(dt, p, n, seed=p * n)
            want = srcs[0].copy()
            for s in srcs[1:]:
                ufunc(want, s, out=want)
            out = np.empty_like(want)
            compiled.reduce_into(out, srcs, codes)
            assert out.tobytes() == want.tobytes(), f"{dtype} {op} p={p}"
            compiled.reduce_into(srcs[0], srcs, codes)  # out is srcs[0]
            assert srcs[0].tobytes() == want.tobytes()


def test_no_kernel_for_half_floats_or_logical_ops():
    assert compiled.kernel_codes(np.dtype(np.float16), "sum") is None
    assert compiled.kernel_codes(np.dtype(np.int32), "land") is None
    assert compiled.kernel_codes(np.dtype(np.bool_), "sum") is None


class _TwoRanks:
    """Two ranks' counters in one mapping (each kind a cache line apart), and
    a compiled Window of each, in one process: the protocol without processes."""

    def __init__(self, spin_ns: int = 0, yield_ns: int = 100_000) -> None:
        self.mm = mmap.mmap(-1, 8192)
        self.words = np.frombuffer(self.mm, np.uint64, 1024)
        self.region = np.frombuffer(self.mm, np.uint8, 4096, 4096)  # two regions of 1 KiB per half
        addr = lambda i: self.words[i:i + 1].ctypes.data  # noqa: E731
        kinds = [[addr(64 * k + 8 * r) for r in range(2)] for k in range(4)]  # epoch, post, done, sleep
        self.windows = [compiled.ext.Window(*kinds, r, spin_ns, yield_ns) for r in range(2)]

    def counter(self, kind: int, rank: int) -> int:
        return int(self.words[64 * kind + 8 * rank])

    def set(self, kind: int, rank: int, value: int) -> None:
        self.words[64 * kind + 8 * rank] = value

    def slot(self, rank: int, offset: int = 0) -> tuple[int, int, int]:
        base = self.region.ctypes.data + 1024 * rank + offset
        return (-1, base, base + 2048)

    def close(self) -> None:
        del self.windows, self.words, self.region
        self.mm.close()


SLEEP = 3


@needs_compiled
def test_fence_waits_bounded_and_rings_sleepers():
    two = _TwoRanks(yield_ns=200_000)
    w = two.windows[0]
    assert w.fence() is False  # epoch 1; rank 1 never came: the bounded wait gives up
    assert two.counter(0, 0) == 1 and w.epoch == 1
    two.set(0, 1, 2)  # rank 1 arrives at epoch 2, and sleeps
    two.set(SLEEP, 1, 1)
    assert w.fence() is True
    assert two.counter(SLEEP, 1) == 0  # rung: its sleep word cleared (and the futex woken)
    two.set(0, 1, 3)
    two.set(SLEEP, 1, 1)
    assert w.fence() is True and two.counter(SLEEP, 1) == 0
    two.set(SLEEP, 1, 1)
    assert w.fence() is False  # rank 1 is not at 4: it sleeps on something else, left alone
    assert two.counter(SLEEP, 1) == 1 and w.epoch == 4
    two.close()


SIG = signature.make("bcast", "shared_window", None, 0, np.dtype(np.uint8), 16)


@needs_compiled
def test_a_compiled_bcast_waits_for_every_rank_and_checks_their_signatures():
    two = _TwoRanks()
    K = compiled.ext
    n = 16
    root_call = two.windows[0].compile(1, [((0, 0, 0), two.slot(0), n)], [], None, [])
    leaf_call = two.windows[1].compile(1, [], [(two.slot(0), (0, 0, 0), n)], None, [0])
    got = np.zeros(n, np.uint8)
    late = leaf_call.run((got,), 1, SIG)  # the root has not posted: the bounded wait gives up
    assert late == (0, K.K_POST, 1)
    with pytest.raises(RuntimeError):
        leaf_call.run((got,), 1, SIG)  # a run that waits must be resumed (or abandoned) first
    assert root_call.run((np.arange(n, dtype=np.uint8),), 1, SIG) is None  # the leaf posted: done
    assert two.counter(K.K_POST, 0) == 1
    assert leaf_call.resume((got,)) is None
    assert np.array_equal(got, np.arange(n)) and two.counter(K.K_DONE, 1) == 1
    # the root laps the leaf: step 3 writes the half of step 1 only once the leaf is done with it
    assert root_call.run((np.full(n, 7, np.uint8),), 2, SIG) == (1, K.K_POST, 2)  # step 2: waits for the leaf
    assert leaf_call.run((got,), 2, SIG) is None and np.all(got == 7)
    assert root_call.resume((np.full(n, 7, np.uint8),)) is None
    two.set(K.K_DONE, 1, 0)  # pretend the leaf is not done with step 1
    assert root_call.run((np.full(n, 9, np.uint8),), 3, SIG) == (1, K.K_DONE, 1)
    two.set(K.K_DONE, 1, 2)
    assert root_call.resume((np.full(n, 9, np.uint8),)) == (1, K.K_POST, 3)
    assert leaf_call.run((got,), 3, SIG) is None and np.all(got == 9)
    two.close()


@needs_compiled
def test_a_compiled_call_reads_nothing_when_signatures_disagree():
    two = _TwoRanks()
    K = compiled.ext
    n = 16
    other = signature.make("bcast", "shared_window", None, 0, np.dtype(np.uint8), 32)
    root_call = two.windows[0].compile(1, [((0, 0, 0), two.slot(0), n)], [], None, [])
    leaf_call = two.windows[1].compile(1, [], [(two.slot(0), (0, 0, 0), n)], None, [0])
    got = np.zeros(n, np.uint8)
    assert leaf_call.run((got,), 1, other) == (0, K.K_POST, 1)
    assert root_call.run((np.arange(n, dtype=np.uint8),), 1, SIG) == (1, K.K_VERDICT, 0)
    assert leaf_call.resume((got,)) == (0, K.K_VERDICT, 0)
    assert not got.any()  # nothing read
    assert two.windows[0].verify(1) == 1 and two.windows[1].verify(1) == 0
    # a refusal (the refused bit) stops every rank too, the refuser first
    refused = signature.refused(SIG)
    assert root_call.run((np.arange(n, dtype=np.uint8),), 2, refused) == (1, K.K_POST, 2)
    assert leaf_call.run((got,), 2, SIG) == (0, K.K_VERDICT, 0)
    assert root_call.resume((np.arange(n, dtype=np.uint8),)) == (0, K.K_VERDICT, 0)
    assert not got.any()
    two.close()


def _bcast_in_pieces(two: _TwoRanks, n: int, piece: int) -> tuple:
    """A bcast of ``n`` bytes from rank 0 in pieces of ``piece`` bytes: (root's call, leaf's call)."""
    spans = [(two.slot(r)[1], 1024) for r in range(2)]
    return (two.windows[0].compile(1, [((0, 0, 0), two.slot(0), n)], [], None, [], piece, spans),
            two.windows[1].compile(1, [], [(two.slot(0), (0, 0, 0), n)], None, [0], piece, spans))


@needs_compiled
def test_a_call_in_pieces_reads_each_piece_once_its_writer_has_filled_it():
    two = _TwoRanks()
    K = compiled.ext
    n, piece = 1024, 256
    sig = signature.make("bcast", "shared_window", None, 0, np.dtype(np.uint8), n)
    root_call, leaf_call = _bcast_in_pieces(two, n, piece)
    sent, got = np.arange(n, dtype=np.uint8), np.zeros(n, np.uint8)
    assert leaf_call.run((got,), 1, sig) == (0, K.K_POST, 1)  # the root has not started: nothing to verify
    assert root_call.run((sent,), 1, sig) is None
    progress = 64 + 7  # rank 0's progress word: beside its post counter
    assert int(two.words[progress]) == (1 << 20) | (n // 64)
    # replay the root half way: its record and 4 lines (one piece) written, not posted
    two.set(K.K_POST, 0, 0)
    two.words[progress] = (1 << 20) | 4
    assert leaf_call.resume((got,)) == (0, K.K_POST, 1)
    assert np.array_equal(got[:piece], sent[:piece]) and not got[piece:].any()
    two.words[progress] = (1 << 20) | 9  # 2 pieces and a line of the third: the third waits
    assert leaf_call.resume((got,)) == (0, K.K_POST, 1)
    assert np.array_equal(got[:2 * piece], sent[:2 * piece]) and not got[2 * piece:].any()
    two.words[progress] = (2 << 20) | 16  # another step's count says nothing of this one
    assert leaf_call.resume((got,)) == (0, K.K_POST, 1) and not got[2 * piece:].any()
    two.set(K.K_POST, 0, 1)  # the post says everything is filled
    assert leaf_call.resume((got,)) is None
    assert np.array_equal(got, sent) and two.counter(K.K_DONE, 1) == 1
    two.close()


@needs_compiled
def test_a_call_in_pieces_reads_nothing_when_signatures_disagree():
    two = _TwoRanks()
    K = compiled.ext
    n, piece = 1024, 256
    sig = signature.make("bcast", "shared_window", None, 0, np.dtype(np.uint8), n)
    other = signature.make("bcast", "shared_window", None, 0, np.dtype(np.uint8), n + 1)
    root_call, leaf_call = _bcast_in_pieces(two, n, piece)
    got = np.zeros(n, np.uint8)
    assert leaf_call.run((got,), 1, other) == (0, K.K_POST, 1)
    assert root_call.run((np.arange(n, dtype=np.uint8),), 1, sig) == (1, K.K_VERDICT, 0)
    assert leaf_call.resume((got,)) == (0, K.K_VERDICT, 0)
    assert not got.any()  # every piece was filled, none read
    two.close()


@needs_compiled
def test_a_call_runs_whole_where_its_copies_cannot_be_counted_in_order():
    """Copies before the post into another rank's region, or out of order in
    its own: the call runs whole (and still right)."""
    two = _TwoRanks()
    spans = [(two.slot(r)[1], 1024) for r in range(2)]
    sig = signature.make("bcast", "shared_window", None, 0, np.dtype(np.uint8), 512)
    backwards = [((0, 256, 0), two.slot(0, 256), 256), ((0, 0, 0), two.slot(0), 256)]
    root_call = two.windows[0].compile(1, backwards, [], None, [], 128, spans)
    leaf_call = two.windows[1].compile(1, [], [(two.slot(0), (0, 0, 0), 512)], None, [0], 128, spans)
    got, sent = np.zeros(512, np.uint8), np.arange(512, dtype=np.uint8)
    assert leaf_call.run((got,), 1, sig) == (0, compiled.ext.K_POST, 1)
    assert root_call.run((sent,), 1, sig) is None
    assert int(two.words[64 + 7]) == 0  # no progress published: it ran whole
    assert leaf_call.resume((got,)) is None and np.array_equal(got, sent)
    with pytest.raises(ValueError):
        two.windows[0].compile(1, backwards, [], None, [], 128, spans[:1])  # a span per rank
    two.close()


@needs_compiled
def test_a_step_waits_until_its_half_is_free():
    two = _TwoRanks()
    K = compiled.ext
    w = two.windows[0]
    assert w.step() is None and w.step() is None  # steps 1 and 2: nothing to wait for
    assert two.counter(K.K_DONE, 0) == 1
    assert w.step() == (1, K.K_DONE, 1)  # step 3 reuses step 1's half: rank 1 is not done with it
    two.set(K.K_DONE, 1, 1)
    assert w.turn == 3 and two.counter(K.K_DONE, 0) == 2
    two.close()


@needs_compiled
def test_reduce_into_refuses_mismatched_buffers():
    codes = compiled.kernel_codes(np.dtype(np.float32), "sum")
    a, b = np.zeros(8, np.float32), np.zeros(8, np.float32)
    with pytest.raises(ValueError):
        compiled.reduce_into(a, [a, np.zeros(7, np.float32)], codes)
    frozen = np.zeros(8, np.float32)
    frozen.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        compiled.reduce_into(frozen, [a, b], codes)
    with pytest.raises(ValueError):
        compiled.reduce_into(a, [a], codes)


@needs_compiled
def test_window_rejects_bad_arguments():
    with pytest.raises(ValueError):
        compiled.ext.Window([1, 2], [3, 4], [5, 6], [7], 0, 0, 0)
    with pytest.raises(ValueError):
        compiled.ext.Window([1, 2], [3, 4], [5, 6], [7, 8], 2, 0, 0)


def allreduce_cases(comm) -> list[str]:
    p, r, failures = comm.size, comm.rank, []
    for dtype, op, n in (("float32", "sum", 2), ("float64", "min", 300), ("int16", "prod", 1000),
                         ("uint8", "bor", 4096), ("int64", "max", 7), ("float16", "sum", 100)):
        buf = np.empty(n, dtype=np.dtype(dtype))
        for salt in range(3):
            buf[...] = data(r, n, dtype, op, salt)
            comm.allreduce(buf, op)
            expect_equal(failures, f"{dtype} {op} n={n} round {salt}", buf, reduced(p, n, dtype, op, salt))
    for algo in ("shared_window",):  # the fence of the other window collectives
        for n in (5, 100_000):
            got = np.zeros(n * p, np.int32)
            comm.allgather(np.full(n, r, np.int32), got, algorithm=algo)
            if not np.array_equal(got, np.repeat(np.arange(p, dtype=np.int32), n)):
                failures.append(f"allgather {algo} n={n}")
    return failures


@pytest.mark.parametrize("compiled_on", ["1", "0"])
@pytest.mark.parametrize("p", [2, 3, 5])
def test_window_collectives_with_and_without_the_compiled_path(monkeypatch, compiled_on, p):
    if compiled_on == "1" and not compiled.built:
        pytest.skip("the C extension is not built here")
    monkeypatch.setenv("COLLECTIVES_COMPILED", compiled_on)
    assert run_ranks(allreduce_cases, p, timeout=90) == [[]] * p


@pytest.fixture(params=[True, False], ids=["rep_movsb", "memcpy"])
def copy_instruction(request):
    """Each copy test with the large copies' rep movsb on (where the processor
    has it) and off, restored after."""
    compiled.ext.set_rep_movsb(request.param)
    yield request.param
    compiled.ext.set_rep_movsb(compiled.rep_movsb)


@needs_compiled
@pytest.mark.parametrize("n", [0, 1, 63, 64, 1023, 1024, 1025, 4095, 4096, 4097, 65536 + 17, (1 << 20) + 3])
def test_copy_gives_the_bytes_at_every_distance_within_a_page(n, copy_instruction):
    rng = np.random.default_rng(n)
    arena = np.zeros(2 * n + 6 * 4096, np.uint8)
    page = (-arena.ctypes.data) % 4096
    for src_at, ahead in [(0, 0), (0, 1), (0, 16), (5, 31), (0, 63), (0, 64), (100, 2048)]:
        arena[:] = 0
        src = arena[page + src_at:page + src_at + n]
        src[:] = rng.integers(0, 256, n, dtype=np.uint8)
        want = src.copy()
        start = page + src_at + ((n + 4095) // 4096 + 1) * 4096 + ahead  # the same place in a page, plus ahead
        dst = arena[start:start + n]
        compiled.copy(dst, src)
        assert np.array_equal(dst, want) and np.array_equal(src, want), (src_at, ahead)


@needs_compiled
def test_copy_handles_overlap_other_dtypes_and_mismatches(copy_instruction):
    a = np.arange(5000, dtype=np.uint8)
    want = a[:4000].copy()
    compiled.copy(a[16:4016], a[:4000])  # overlapping, 16 bytes ahead: memmove's semantics
    assert np.array_equal(a[16:4016], want)
    big = np.random.default_rng(3).integers(0, 256, 1 << 17, dtype=np.uint8)
    for shift in (1, 64, 4096, -1, -64, -4096):  # large overlapping copies, either way: never a forward string copy
        b = big.copy()
        lo, n = 8192, len(big) - 16384
        want = b[lo:lo + n].copy()
        compiled.copy(b[lo + shift:lo + shift + n], b[lo:lo + n])
        assert np.array_equal(b[lo + shift:lo + shift + n], want), shift
    ml_dtypes = pytest.importorskip("ml_dtypes")
    b = np.arange(100, dtype=ml_dtypes.bfloat16)
    out = np.zeros_like(b)
    compiled.copy(out, b)  # no buffer format: numpy's copy
    assert np.array_equal(out, b)
    f = np.zeros(10, np.float32)
    compiled.copy(f, np.arange(10, dtype=np.int32))  # dtypes differ: numpy's casting copy, not raw bytes
    assert f.tolist() == list(range(10))
    with pytest.raises(ValueError):
        compiled.copy(np.zeros(3), np.zeros(4))


@needs_compiled
@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8"])
def test_reduce_into_also_streams_the_result_into_copies(dtype):
    """The copies get the result's bits at any place in a cache line, any
    length (whole chunks, a partial first chunk, a tail), and one or two copies."""
    codes = compiled.kernel_codes(np.dtype(dtype), "sum")
    item = np.dtype(dtype).itemsize
    rng = np.random.default_rng(7)
    raw = [np.zeros(40000 * item + 256, np.uint8) for _ in range(5)]
    for count in (1, 17, 2048, 8192 // item + 3, 39000):
        for place in (0, 8, 16, 48):
            a, b, c1, c2, out = (r[place:place + count * item].view(dtype) for r in raw)
            a[:] = rng.integers(0, 100, count)
            b[:] = rng.integers(0, 100, count)
            want = a + b
            for copies in ([c1], [c1, c2]):
                for c in copies:
                    c[:] = 0
                compiled.reduce_into(out, [a, b], codes, copies)
                assert np.array_equal(out, want)
                for c in copies:
                    assert np.array_equal(c, want), (count, place, len(copies))
    with pytest.raises(ValueError):
        compiled.reduce_into(out, [a, b], codes, [np.zeros(3, dtype)])
