"""Collectives on arrays in GPU memory (torch CUDA tensors, CuPy arrays),
staged through pinned host memory by the CUDA device plugin, on real
processes and a real GPU. Without a usable GPU every test skips with the
reason.

Each test starts one job whose ranks run this file as a script
(``python test_gpu_staging.py CHECK ...``); every rank prints one
``RESULT`` line with the checks that failed. The test process itself never
touches CUDA (its probe runs in a child), so that the suite's forked ranks
elsewhere stay free of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

import pytest

from launched import clean_env, collectives_run, run_checked

HERE = os.path.abspath(__file__)
DEADLINE = 150
GUARD = 16  # elements past every buffer that no call may write

# ---------------------------------------------------------------------- rank side


def _guarded(torch, n, dtype, fill):
    """A CUDA tensor of ``n`` elements (a view at the start of a larger one)
    and the whole, whose last GUARD elements hold -7."""
    whole = torch.full((n + GUARD,), -7, dtype=dtype, device="cuda")
    view = whole[:n]
    view.copy_(fill.to(dtype=dtype, device="cuda"))
    return view, whole


def _guard_ok(torch, whole):
    return bool((whole[-GUARD:].double() == -7).all())


def _ramp(torch, rank, n):
    """Values unique per rank and position that float32 holds exactly."""
    return (torch.arange(n, dtype=torch.float64) % 4093) + 10000 * rank


def check_collectives(comm, torch):
    """Every collective with device buffers in and out, values and guards checked."""
    fails = []
    p, r, n = comm.size, comm.rank, 3 * 4096 + 5
    f32 = torch.float32

    def expect(name, got, want, whole=None):
        if not torch.equal(got.double().cpu(), want.double()):
            bad = (got.double().cpu() != want.double()).nonzero()
            fails.append(f"{name}: {len(bad)} wrong elements, first at {bad[0].tolist()}")
        if whole is not None and not _guard_ok(torch, whole):
            fails.append(f"{name}: wrote past the buffer")

    everyone = [_ramp(torch, q, n) for q in range(p)]
    x, whole = _guarded(torch, n, f32, everyone[r])
    comm.allreduce(x)
    expect("allreduce", x, sum(everyone), whole)

    x, whole = _guarded(torch, n, f32, everyone[r])
    out, out_whole = _guarded(torch, n, f32, torch.zeros(n))
    comm.allreduce(x, out=out)
    expect("allreduce out", out, sum(everyone), out_whole)
    expect("allreduce out (input kept)", x, everyone[r], whole)

    root = p - 1
    x, whole = _guarded(torch, n, f32, everyone[r])
    comm.bcast(x, root=root)
    expect("bcast", x, everyone[root], whole)

    x, whole = _guarded(torch, n, f32, everyone[r])
    comm.reduce(x, root=0)
    expect("reduce", x, sum(everyone) if r == 0 else everyone[r], whole)

    x, whole = _guarded(torch, n, f32, everyone[r])
    recv, recv_whole = _guarded(torch, p * n, f32, torch.zeros(p * n))
    comm.allgather(x, recv)
    expect("allgather", recv, torch.cat(everyone), recv_whole)
    expect("allgather (input kept)", x, everyone[r], whole)

    host = everyone[r].to(f32).numpy()  # a host send buffer into a device receive buffer
    recv, recv_whole = _guarded(torch, p * n, f32, torch.zeros(p * n))
    comm.allgather(host, recv)
    expect("allgather host to device", recv, torch.cat(everyone), recv_whole)

    recv, recv_whole = _guarded(torch, p * n, f32, torch.zeros(p * n))
    comm.gather(x, recv if r == 0 else None, root=0)
    if r == 0:
        expect("gather", recv, torch.cat(everyone), recv_whole)

    blocks = torch.cat([everyone[r] + q for q in range(p)])
    send, send_whole = _guarded(torch, p * n, f32, blocks)
    out, out_whole = _guarded(torch, n, f32, torch.zeros(n))
    comm.scatter(send if r == root else None, out, root=root)
    expect("scatter", out, everyone[root] + r, out_whole)

    comm.reduce_scatter(send, out)
    expect("reduce_scatter", out, sum(everyone) + p * r, out_whole)

    recv, recv_whole = _guarded(torch, p * n, f32, torch.zeros(p * n))
    comm.alltoall(send, recv)
    expect("alltoall", recv, torch.cat([everyone[q] + r for q in range(p)]), recv_whole)
    expect("alltoall (input kept)", send, blocks, send_whole)

    x, whole = _guarded(torch, n, f32, everyone[r])  # nonblocking: staged now, written back at the wait
    recv, recv_whole = _guarded(torch, p * n, f32, torch.zeros(p * n))
    handles = [comm.iallreduce(x), comm.iallgather(everyone[r].to(f32).cuda(), recv)]
    for h in handles:
        h.wait()
    expect("iallreduce", x, sum(everyone), whole)
    expect("iallgather", recv, torch.cat(everyone), recv_whole)

    try:  # CuPy arrays (their interface names their producer's stream)
        import cupy
    except ImportError:
        return fails
    c = cupy.asarray(everyone[r].numpy().astype("float32"))
    comm.allreduce(c)
    if not (cupy.asnumpy(c) == sum(everyone).numpy().astype("float32")).all():
        fails.append("allreduce of a CuPy array: wrong values")
    return fails


def check_dtypes(comm, torch):
    """bfloat16, float16, float64, int64 and a tensor that requires grad."""
    fails = []
    p, r, n = comm.size, comm.rank, 1000
    for dtype in (torch.bfloat16, torch.float16, torch.float64, torch.int64):
        x = (torch.arange(n, device="cuda") % 8 + r).to(dtype)
        comm.allreduce(x)
        want = sum((torch.arange(n) % 8 + q) for q in range(p)).to(dtype)
        if not torch.equal(x.cpu(), want):
            fails.append(f"allreduce of {dtype}: wrong values")
    w = torch.full((n,), float(r + 1), device="cuda", requires_grad=True)
    comm.allreduce(w)
    if not bool((w.detach().cpu() == p * (p + 1) / 2).all()):
        fails.append("allreduce of a tensor that requires grad: wrong values")
    return fails


def _busy(torch, stream):
    """Queue about 50-100 ms of matrix products on ``stream``."""
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        b = a
        for _ in range(40):
            b = b @ a * 1e-3
    return b


def check_ordering(comm, torch):
    """The copy out waits for the work that wrote the array, on a side stream
    too; the result is in the array when the call returns."""
    fails = []
    p, r, n = comm.size, comm.rank, 1 << 20
    want = p * (p + 1) / 2
    for rounds in range(3):
        side = torch.cuda.Stream()
        x = torch.zeros(n, device="cuda")
        torch.cuda.synchronize()
        keep = _busy(torch, side)
        with torch.cuda.stream(side):
            x.fill_(r + 1)  # queued behind the products: not done yet when the call starts
            comm.allreduce(x)
            got = x.clone()  # on the side stream, after the call
        torch.cuda.synchronize()
        del keep
        if not bool((got == want).all()):
            fails.append(f"round {rounds}: read before the side stream's write was done "
                         f"({int((got != want).sum())} of {n} wrong)")
    try:
        import cupy
    except ImportError:
        return fails
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        a = cupy.random.rand(4096, 4096, dtype=cupy.float32)
        for _ in range(20):
            a = a @ a * 1e-3
        c = cupy.full(n, r + 1, dtype=cupy.float32)
        comm.allreduce(c)  # its interface names stream s
    if not (cupy.asnumpy(c) == want).all():
        fails.append("CuPy on a non-blocking stream: read before the write was done")
    return fails


def check_failures(comm, torch):
    """A mismatch leaves every device array as it was (no write-back) and
    every rank raises; a bad device array on one rank is refused before
    anything is sent, and the next call matches."""
    import collectives

    fails = []
    p, r = comm.size, comm.rank
    if r == 1:  # only rank 1 calls with a bad array: it raises, its peers wait for its next call
        try:
            comm.allreduce(torch.full((4,), 1.0, device="cuda")[::2])
            fails.append("a non-contiguous device array was taken")
        except collectives.BadArgument as exc:
            if "not contiguous" not in str(exc) or not str(exc).startswith("rank 1"):
                fails.append(f"the refusal does not say why or who: {exc}")
    z = torch.full((4,), float(r + 1), device="cuda")
    comm.allreduce(z)  # nothing was sent: this call matches on every rank
    if not bool((z.cpu() == p * (p + 1) / 2).all()):
        fails.append(f"the call after a refusal got {z.cpu().tolist()}")

    n = 1000 + (7 if r == 1 else 0)  # rank 1 disagrees about the size
    x = torch.full((n,), float(r + 1), device="cuda")
    started = time.monotonic()
    try:
        comm.allreduce(x, timeout=10)
        fails.append("a mismatched allreduce completed")
    except collectives.CollectiveError as exc:
        took = time.monotonic() - started
        if type(exc).__name__ != "MismatchedCollective" or f"rank {r}" not in str(exc):
            fails.append(f"mismatch raised {type(exc).__name__}: {exc}")
        if took > 12:
            fails.append(f"the mismatch took {took:.1f} s")
    if not bool((x.cpu() == r + 1).all()):
        fails.append("a failed call wrote into the device array")
    return fails


CHECKS = {"collectives": check_collectives, "dtypes": check_dtypes, "ordering": check_ordering,
          "failures": check_failures}


def main(names):
    import torch

    import collectives

    comm = collectives.init(timeout=30)
    failures = []
    for name in names:
        try:
            failures += CHECKS[name](comm, torch)
        except Exception:
            failures.append(f"{name} raised:\n{traceback.format_exc()}")
    print("RESULT " + json.dumps({"rank": comm.rank, "failures": failures}), flush=True)
    os._exit(0)  # the mismatch check leaves the communicator aborted


if __name__ == "__main__":
    main(sys.argv[1:])

# ---------------------------------------------------------------------- test side


def _gpu() -> tuple[bool, str]:
    """Whether a GPU and torch's CUDA are usable, asked of a child process."""
    code = ("import json; from collectives.devices import cuda; ok, why = cuda.probe()\n"
            "try:\n import torch; t = torch.cuda.is_available()\nexcept ImportError:\n t = False\n"
            "print(json.dumps([ok and t, why if not ok else ('torch has no CUDA' if not t else why)]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=clean_env())
    try:
        ok, why = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False, f"the probe failed: {res.stderr[-300:]}"
    return bool(ok), why


@pytest.fixture(scope="module")
def gpu():
    ok, why = _gpu()
    if not ok:
        pytest.skip(f"no usable GPU: {why}")


def _run(p, *checks, env=None):
    run_checked(collectives_run(p, HERE, *checks, deadline=DEADLINE), p, DEADLINE, {**clean_env(), **(env or {})})


def test_collectives_on_device_buffers(gpu):
    _run(2, "collectives", "dtypes")


def test_collectives_on_device_buffers_three_ranks(gpu):
    _run(3, "collectives")


def test_pinned_memory_kept_or_not(gpu):
    """With no pinned memory kept, every staged buffer is allocated at its
    size and freed after its call; with little kept, some are reused."""
    _run(2, "collectives", env={"COLLECTIVES_CUDA_PINNED_CACHE_BYTES": "0"})
    _run(2, "collectives", env={"COLLECTIVES_CUDA_PINNED_CACHE_BYTES": "256K"})


def test_copy_out_waits_for_the_producer(gpu):
    _run(2, "ordering")


def test_failures_leave_device_buffers_alone(gpu):
    _run(2, "failures")
