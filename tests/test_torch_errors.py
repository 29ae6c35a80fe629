"""Errors and in-place writes through the ``collectives`` torch.distributed backend.

Each test forks real ranks (``harness.run_ranks``); every rank joins a torch
process group of the backend (``init_process_group(backend="collectives")``
on a TCP store of its own) and returns what it saw. Failure tests check every
rank's outcome, how long it took and what the message names:

* a peer that never enters ``all_reduce``/``barrier`` (it blocks on a pipe
  until the others are done): ``wait()`` raises "Timed out", the Work says
  it failed, its future fails, a blocking call raises, and a later call fails
  at once with the first reason;
* a peer killed with SIGKILL between two iterations of an ``all_reduce``
  loop, or of DDP training: the survivors raise, naming the lost rank;

and ``all_gather_coalesced``'s output layout and autograd's view of the
tensors a call overwrites are compared with Gloo; every call's outputs
(and a receive's tensor) have their version counters bumped.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import re
import select
import signal
import time

import pytest

from collectives.launcher import free_port
from harness import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")

OP_TIMEOUT = 2.0      # the process group's timeout (seconds)
SLACK = 4.0           # what a busy machine may add to it
DEADLINE = 60.0       # hard deadline of each run


# ---------------------------------------------------------------------- rank side


def _join(comm, port: int, timeout: float = OP_TIMEOUT):
    """This rank in a torch process group of the collectives backend."""
    import torch
    import torch.distributed as dist

    import collectives.integrations.torch  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dist.init_process_group(backend="collectives", init_method=f"tcp://127.0.0.1:{port}",
                            rank=comm.rank, world_size=comm.size,
                            timeout=datetime.timedelta(seconds=timeout))
    return torch, dist


def _leave(dist) -> None:
    dist.destroy_process_group()


def _error(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)}


def _attempt(call) -> dict:
    """Run ``call``: its error (type, message) or ``returned``, and the time it took."""
    t0 = time.monotonic()
    try:
        call()
        seen = {"type": "returned", "message": ""}
    except Exception as exc:
        seen = _error(exc)
    seen["elapsed"] = time.monotonic() - t0
    return seen


def _signal_done(fd: int) -> None:
    os.write(fd, b"x")


def _wait_for(fd: int, count: int, timeout: float) -> int:
    """Read ``count`` bytes from the pipe ``fd`` (fewer if ``timeout`` passes first)."""
    got, deadline = 0, time.monotonic() + timeout
    while got < count:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        got += len(os.read(fd, count - got))
    return got


def _collective(torch, dist, name: str, async_op: bool):
    if name == "barrier":
        return dist.barrier(async_op=async_op)
    return dist.all_reduce(torch.ones(4), async_op=async_op)


def absent_peer(comm, port: int, name: str, style: str, absent: int, pipe: tuple[int, int]):
    """Every rank but ``absent`` calls collective ``name``; ``absent`` blocks on
    the pipe until the others have seen the outcome."""
    torch, dist = _join(comm, port)
    read_fd, write_fd = pipe
    try:
        if comm.rank == absent:
            return {"absent": True, "signalled": _wait_for(read_fd, comm.size - 1, DEADLINE)}
        seen: dict = {}
        try:
            if style == "async":
                work = _collective(torch, dist, name, async_op=True)
                seen["short wait"] = _attempt(lambda: work.wait(datetime.timedelta(seconds=0.2)))
                seen["completed early"] = work.is_completed()
                seen["wait"] = _attempt(work.wait)
                seen["completed"] = work.is_completed()
                seen["success"] = work.is_success()
                seen["exception"] = repr(work.exception())
                seen["future"] = _attempt(work.get_future().wait)
            else:
                seen["blocking"] = _attempt(lambda: _collective(torch, dist, name, async_op=False))
            seen["later"] = _attempt(lambda: dist.all_reduce(torch.ones(2)))
        finally:
            _signal_done(write_fd)
        return seen
    finally:
        _leave(dist)


def killed_in_loop(comm, port: int, victim: int, at: int, pipe: tuple[int, int]):
    """All ranks run an all_reduce loop; ``victim`` SIGKILLs itself once the
    others have finished iteration ``at - 1``. The survivors run on and must
    raise at iteration ``at``, with correct sums before it."""
    torch, dist = _join(comm, port)
    read_fd, write_fd = pipe
    p, r = comm.size, comm.rank
    try:
        for i in range(at + 3):
            if i == at and r == victim:
                _wait_for(read_fd, p - 1, DEADLINE)
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.monotonic()
            x = torch.full((1000,), float(r + i))
            try:
                dist.all_reduce(x)
            except Exception as exc:
                return {"iteration": i, "elapsed": time.monotonic() - t0, **_error(exc)}
            want = float(sum(k + i for k in range(p)))
            if not bool((x == want).all()):
                return {"iteration": i, "type": "wrong sum", "message": f"got {x[:3].tolist()}, want {want}"}
            if i == at - 1:
                _signal_done(write_fd)
        return {"iteration": None, "type": "returned", "message": "every all_reduce returned"}
    finally:
        _leave(dist)


def _register_hook(model, hook: str | None) -> None:
    if hook == "torch allreduce_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook == "collectives allreduce_hook":
        import collectives.integrations.torch as ct

        model.register_comm_hook(ct.HookState(), ct.allreduce_hook)


def ddp_killed(comm, port: int, victim: int, at: int, pipe: tuple[int, int], hook: str | None):
    """DDP training on the backend (with ``hook`` as its comm hook); ``victim``
    SIGKILLs itself after the others finished step ``at - 1``; the
    survivors' step ``at`` must raise."""
    torch, dist = _join(comm, port)
    from torch.nn.parallel import DistributedDataParallel as DDP

    read_fd, write_fd = pipe
    r = comm.rank
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)),
                bucket_cap_mb=0.0001)
    _register_hook(model, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(at + 3):
            if step == at and r == victim:
                _wait_for(read_fd, comm.size - 1, DEADLINE)
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.monotonic()
            x, y = torch.randn(4, 8), torch.randn(4, 2)
            try:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            except Exception as exc:
                return {"step": step, "elapsed": time.monotonic() - t0, **_error(exc)}
            if step == at - 1:
                _signal_done(write_fd)
        return {"step": None, "type": "returned", "message": "every step returned"}
    finally:
        _leave(dist)


def gather_coalesced_layout(comm, port: int):
    """all_gather_coalesced on the backend and on Gloo, inputs of different sizes."""
    torch, dist = _join(comm, port, timeout=20)
    p, r = comm.size, comm.rank
    sizes = [3, 1, 4]
    try:
        gloo = dist.new_group(backend="gloo")
        results = {}
        for name, group in (("collectives", None), ("gloo", gloo)):
            inputs = [torch.arange(float(n)) + 100 * r + 10 * i for i, n in enumerate(sizes)]
            outputs = [[torch.full((n,), -1.0) for n in sizes] for _ in range(p)]
            dist.all_gather_coalesced(outputs, inputs, group=group)
            results[name] = [[t.tolist() for t in per_rank] for per_rank in outputs]
        results["expected"] = [[(torch.arange(float(n)) + 100 * k + 10 * i).tolist() for i, n in enumerate(sizes)]
                               for k in range(p)]
        return results
    finally:
        _leave(dist)


def _overwrite_saved(torch, dist, collective: str, group, p: int) -> dict:
    """Save a tensor for backward, let ``collective`` overwrite it in place,
    run backward: torch's in-place error, or the gradient it computed."""
    x = torch.ones(2 * p if collective == "all_gather_into_tensor" else 2, requires_grad=True)
    saved = torch.full(x.shape, 2.0)
    loss = (x * saved).sum()  # saves ``saved`` for the gradient of x
    if collective == "all_reduce":
        dist.all_reduce(saved, group=group)
    elif collective == "all_gather_into_tensor":
        dist.all_gather_into_tensor(saved, torch.ones(2), group=group)
    elif collective == "reduce_scatter_tensor":
        dist.reduce_scatter_tensor(saved, torch.ones(2 * p), group=group)
    try:
        loss.backward()
    except RuntimeError as exc:
        return _error(exc)
    return {"type": "returned", "message": f"gradient {x.grad.tolist()}"}


def saved_tensor_overwritten(comm, port: int):
    """A tensor saved for backward, then overwritten by a collective: on each
    backend, what backward does."""
    torch, dist = _join(comm, port, timeout=20)
    try:
        gloo = dist.new_group(backend="gloo")
        return {f"{backend} {collective}": _overwrite_saved(torch, dist, collective, group, comm.size)
                for backend, group in (("collectives", None), ("gloo", gloo))
                for collective in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")}
    finally:
        _leave(dist)


def _bumps(torch, dist, r: int, p: int) -> dict:
    """Each call's output tensors: did their version counters move?"""
    def one(fn, *outputs):
        before = [t._version for t in outputs]
        fn()
        return all(t._version > v for t, v in zip(outputs, before))

    t2, per_rank, pairs = torch.zeros(2), [torch.zeros(2) for _ in range(p)], [torch.zeros(2), torch.zeros(3)]
    lists = [[torch.zeros(2), torch.zeros(3)] for _ in range(p)]
    sendbuf, recvbuf = torch.arange(2.0 * p), torch.zeros(2 * p)
    peer = (r + 1) % p if r % 2 == 0 else (r - 1) % p
    sent = torch.full((2,), float(r))
    p2p = ((lambda: dist.send(sent, peer)) if r % 2 == 0 else (lambda: dist.recv(t2, peer)))
    return {
        "all_reduce": one(lambda: dist.all_reduce(t2), t2),
        "all_reduce_coalesced": one(lambda: dist.all_reduce_coalesced(pairs), *pairs),
        "broadcast": one(lambda: dist.broadcast(t2, 0), t2),
        "reduce": one(lambda: dist.reduce(t2, 0), t2),
        "all_gather": one(lambda: dist.all_gather(per_rank, torch.ones(2)), *per_rank),
        "all_gather_coalesced": one(lambda: dist.all_gather_coalesced(lists, [torch.ones(2), torch.ones(3)]),
                                    *[t for ts in lists for t in ts]),
        "all_gather_into_tensor": one(lambda: dist.all_gather_into_tensor(recvbuf, t2), recvbuf),
        "reduce_scatter_tensor": one(lambda: dist.reduce_scatter_tensor(t2, sendbuf), t2),
        "reduce_scatter": one(lambda: dist.reduce_scatter(t2, list(sendbuf.split(2))), t2),
        "all_to_all_single": one(lambda: dist.all_to_all_single(recvbuf, sendbuf), recvbuf),
        "all_to_all": one(lambda: dist.all_to_all(per_rank, list(sendbuf.split(2))), *per_rank),
        "gather": one(lambda: dist.gather(t2, per_rank if r == 0 else None, dst=0), *(per_rank if r == 0 else [])),
        "scatter": one(lambda: dist.scatter(t2, list(sendbuf.split(2)) if r == 0 else None, src=0), t2),
        "recv": one(p2p, *([t2] if r % 2 else [])),
    }


def outputs_marked_written(comm, port: int):
    """Every collective's outputs (and recv's) have their version counters bumped."""
    torch, dist = _join(comm, port, timeout=20)
    try:
        return _bumps(torch, dist, comm.rank, comm.size)
    finally:
        _leave(dist)


# ---------------------------------------------------------------------- test side


def _run(fn, p: int, *args, transport: str = "shm"):
    return run_ranks(fn, p, free_port(), *args, transport=transport, timeout=DEADLINE, expect_errors=True)


def _close(pipe) -> None:
    for fd in pipe:
        os.close(fd)


def _assert_timed_out(rank: int, what: str, seen: dict, bound: float) -> None:
    assert seen["type"] in ("CollectiveTimeout", "PeerLost"), f"rank {rank} {what}: {seen}"
    assert "Timed out" in seen["message"], f"rank {rank} {what}: {seen}"
    assert seen["elapsed"] < bound, f"rank {rank} {what} took {seen['elapsed']:.1f}s: {seen}"


def _assert_fails_at_once(rank: int, seen: dict, first: dict) -> None:
    """A call after a failure raises at once, naming the call that failed first."""
    assert seen["type"] != "returned", f"rank {rank}: the call after the failure returned"
    assert seen["elapsed"] < 1.0, f"rank {rank}: the call after the failure took {seen['elapsed']:.1f}s"
    call = re.search(r"(allreduce|barrier) #\d+", first["message"])
    assert call, f"rank {rank}: the failure does not name its call: {first}"
    assert "Timed out" in seen["message"] and call.group(0) in seen["message"], \
        f"rank {rank}: the call after the failure raised {seen}, the failure was {first}"


@pytest.mark.parametrize("name,style,transport", [
    ("all_reduce", "async", "shm"),
    ("all_reduce", "blocking", "shm"),
    ("barrier", "async", "shm"),
    ("barrier", "blocking", "shm"),
    ("all_reduce", "async", "zmq"),
])
def test_absent_peer_times_out(name, style, transport):
    p, absent = 3, 1
    pipe = os.pipe()
    try:
        outcomes = _run(absent_peer, p, name, style, absent, pipe, transport=transport)
    finally:
        _close(pipe)
    bound = OP_TIMEOUT + SLACK
    for o in outcomes:
        assert o.ok, str(o)
        if o.rank == absent:
            assert o.value == {"absent": True, "signalled": p - 1}, f"rank {o.rank}: {o.value}"
            continue
        seen = o.value
        if style == "async":
            short = seen["short wait"]
            assert short["type"] == "CollectiveTimeout" and "Timed out" in short["message"], f"rank {o.rank}: {short}"
            assert short["elapsed"] < 0.2 + SLACK / 2 and seen["completed early"] is False, f"rank {o.rank}: {seen}"
            _assert_timed_out(o.rank, "wait()", seen["wait"], bound)
            assert seen["completed"] is True and seen["success"] is False, f"rank {o.rank}: {seen}"
            assert "Timed out" in seen["exception"], f"rank {o.rank}: {seen}"
            fut = seen["future"]
            assert fut["type"] == "RuntimeError" and "Timed out" in fut["message"], f"rank {o.rank}: {fut}"
            assert fut["elapsed"] < 1.0, f"rank {o.rank}: the failed future took {fut['elapsed']:.1f}s"
            first = seen["wait"]
        else:
            _assert_timed_out(o.rank, "blocking call", seen["blocking"], bound)
            first = seen["blocking"]
        _assert_fails_at_once(o.rank, seen["later"], first)


def _assert_killed(o) -> None:
    """The victim died (the harness may see its pipe close before its exit
    code is known, hence no check of the code itself)."""
    assert not o.ok and o.error_type == "ProcessDied", str(o)


def _assert_names_lost_rank(o, seen: dict, victim: int) -> None:
    assert seen["type"] in ("PeerLost", "CollectiveTimeout", "RuntimeError"), f"rank {o.rank}: {seen}"
    assert f"rank {victim}" in seen["message"], f"rank {o.rank}: the error does not name rank {victim}: {seen}"
    assert seen["elapsed"] < OP_TIMEOUT + SLACK, f"rank {o.rank} took {seen['elapsed']:.1f}s: {seen}"


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_peer_killed_in_all_reduce_loop(transport):
    p, victim, at = 3, 2, 3
    pipe = os.pipe()
    try:
        outcomes = _run(killed_in_loop, p, victim, at, pipe, transport=transport)
    finally:
        _close(pipe)
    for o in outcomes:
        if o.rank == victim:
            _assert_killed(o)
            continue
        assert o.ok, str(o)
        seen = o.value
        assert seen["iteration"] == at, f"rank {o.rank}: {seen}"
        _assert_names_lost_rank(o, seen, victim)


@pytest.mark.parametrize("hook", [None, "torch allreduce_hook", "collectives allreduce_hook"])
def test_ddp_with_killed_rank_raises_on_survivors(hook):
    p, victim, at = 3, 0, 2
    pipe = os.pipe()
    try:
        outcomes = _run(ddp_killed, p, victim, at, pipe, hook)
    finally:
        _close(pipe)
    for o in outcomes:
        if o.rank == victim:
            _assert_killed(o)
            continue
        assert o.ok, str(o)
        seen = o.value
        assert seen["step"] == at, f"rank {o.rank}: {seen}"
        _assert_names_lost_rank(o, seen, victim)


def test_all_gather_coalesced_layout_matches_gloo():
    for o in _run(gather_coalesced_layout, 3):
        assert o.ok, str(o)
        got = o.value
        assert got["gloo"] == got["expected"], f"rank {o.rank}: gloo {got['gloo']}"
        assert got["collectives"] == got["gloo"], f"rank {o.rank}: collectives {got['collectives']}, gloo {got['gloo']}"


def test_saved_tensor_overwritten_by_a_collective_fails_backward():
    """Torch's in-place error where Gloo gives it too (its outputs written
    through a copy), and for all_reduce as well: Gloo in torch 2.13 does not
    bump an all_reduce's tensor, and backward silently uses the new values."""
    p = 3
    for o in _run(saved_tensor_overwritten, p):
        assert o.ok, str(o)
        flagged = [k for k, seen in o.value.items()
                   if seen["type"] == "RuntimeError" and "modified by an inplace operation" in seen["message"]]
        for collective in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            assert f"gloo {collective}" in flagged, f"rank {o.rank}: {o.value}"
        for collective in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
            assert f"collectives {collective}" in flagged, f"rank {o.rank}: {o.value}"


def test_every_output_is_marked_written():
    for o in _run(outputs_marked_written, 2):
        assert o.ok, str(o)
        unmarked = [name for name, bumped in o.value.items() if not bumped]
        assert not unmarked, f"rank {o.rank}: outputs of {unmarked} keep their version"
