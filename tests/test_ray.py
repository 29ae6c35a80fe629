"""Ray actors as ranks: groups formed from the driver or by the actors, every
collective against numpy, a member killed mid-loop on shared memory and on
TCP (the survivors shrink and go on), a new group with a new actor, groups
that cannot form, misuse. What needs no Ray: tests/test_ray_rendezvous.py.

One local Ray instance serves the module. Actors take no CPU of Ray's (so
that four fit on two cores); every Ray call here has a timeout and every
test a hard deadline.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import sys
import time

# Ray's own traffic stays on the loopback interface (read when ray is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

ray = pytest.importorskip("ray", reason="needs Ray: pip install 'collectives[ray]'")

import collectives.integrations.ray as cray  # noqa: E402
from collectives import BadArgument, CollectiveTimeout, PeerLost  # noqa: E402
from collectives.integrations.ray_members import RAY_SLACK  # noqa: E402

# Ray's workers cannot import this file: its actor classes travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TIMEOUT = 10.0      # the groups' timeout, seconds
RAY_CALL = 60.0     # the longest any Ray call of a test may take
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="error")
    yield
    if started:
        ray.shutdown()


def data(rank: int, dtype=np.float64) -> np.ndarray:
    """Rank ``rank``'s 12 elements: grows with the rank everywhere, so that max is rank 2's."""
    return (np.arange(12) * (rank + 1) + rank).astype(dtype)


@ray.remote(num_cpus=0)
class Signal:
    """Events between the driver and the actors: arrivals counted, a release."""

    def __init__(self) -> None:
        self.arrived = 0
        self.changed = asyncio.Condition()
        self.released = asyncio.Event()

    async def arrive(self) -> None:
        async with self.changed:
            self.arrived += 1
            self.changed.notify_all()

    async def wait_arrivals(self, n: int, timeout: float) -> int:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: self.arrived >= n), timeout)
        return self.arrived

    async def release(self) -> None:
        self.released.set()

    async def wait_release(self, timeout: float) -> None:
        await asyncio.wait_for(self.released.wait(), timeout)


@ray.remote(num_cpus=0)
class Worker:
    """A plain Ray actor: no base class, nothing of the library's in it but the calls."""

    def every_collective(self, group: str) -> dict:
        comm = cray.get_communicator(group)
        r = cray.get_rank(group)
        out = {"rank": r, "size": cray.get_collective_group_size(group), "transport": comm.transport.name}
        x = data(r)
        out["allreduce_sum"] = cray.allreduce(x, group_name=group).tolist()
        out["allreduce_max"] = cray.allreduce(data(r, np.float32), op="max", group_name=group).tolist()
        out["allgather"] = cray.allgather(data(r, np.int64)[:4].reshape(2, 2), group_name=group).tolist()
        out["broadcast"] = cray.broadcast(data(r), src_rank=1, group_name=group).tolist()
        out["reduce"] = cray.reduce(data(r, np.int32), dst_rank=2, group_name=group).tolist()
        out["reduce_scatter"] = cray.reduce_scatter(data(r), group_name=group).tolist()
        cray.barrier(group_name=group)
        return out

    def torch_collectives(self, group: str) -> dict:
        import torch

        r = cray.get_rank(group)
        t = torch.from_numpy(data(r, np.float32))
        out = {"allreduce": cray.allreduce(t, group_name=group)}
        out["allgather"] = cray.allgather(torch.from_numpy(data(r, np.float32)[:3]), group_name=group)
        out["reduce_scatter"] = cray.reduce_scatter(torch.from_numpy(data(r, np.float32)), group_name=group)
        return {k: (type(v).__module__.split(".")[0], v.numpy().tolist()) for k, v in out.items()}

    def allreduce_ranks(self, group: str) -> tuple[int, int, list]:
        r = cray.get_rank(group)
        x = np.full(5, r + 1.0)
        cray.allreduce(x, group_name=group)
        return r, cray.get_collective_group_size(group), x.tolist()

    def in_group(self, group: str) -> bool:
        return cray.is_group_initialized(group)

    def join(self, world_size: int, rank: int, group: str) -> tuple[int, int, str]:
        comm = cray.init_collective_group(world_size, rank, group_name=group, timeout=TIMEOUT)
        return comm.rank, comm.size, comm.transport.name

    def try_(self, what: str, *args) -> tuple[str, str]:
        """Run one module function; the error's kind and message (or "ok")."""
        try:
            getattr(cray, what)(*args)
        except Exception as exc:
            return type(exc).__name__, str(exc)
        return "ok", ""

    def wait_release(self, signal, timeout: float) -> None:
        ray.get(signal.wait_release.remote(timeout), timeout=timeout + 5)

    def loop_until_lost(self, group: str, signal, seconds: float) -> dict:
        """Allreduce until a member is lost (or ``seconds`` pass); then shrink and go on."""
        r, want = cray.get_rank(group), float(sum(range(1, cray.get_collective_group_size(group) + 1)))
        x = np.empty(1000, np.float32)
        steps, wrong, deadline = 0, 0, time.monotonic() + seconds
        error = None
        while time.monotonic() < deadline:
            x[:] = r + 1
            try:
                cray.allreduce(x, group_name=group)
            except PeerLost as exc:
                error = (type(exc).__name__, str(exc), time.monotonic())
                break
            wrong += int(np.count_nonzero(x != want))
            steps += 1
            if steps == 5:
                signal.arrive.remote()
        out = {"steps": steps, "wrong": wrong, "error": error}
        if error is None:
            return out
        comm = cray.shrink_collective_group(group, timeout=TIMEOUT)
        sums = []
        for _ in range(3):
            y = np.full(10, comm.rank + 1.0)
            sums.append(float(cray.allreduce(y, group_name=group)[0]))
        out["after"] = {"rank": comm.rank, "size": comm.size, "sums": sums}
        return out


def workers(n: int) -> list:
    return [Worker.remote() for _ in range(n)]


def get(refs):
    return ray.get(refs, timeout=RAY_CALL)


def check_every_collective(results: list[dict], transport: str) -> None:
    everyone = [data(r) for r in range(3)]
    total = sum(everyone)
    for r, out in enumerate(results):
        assert (out["rank"], out["size"], out["transport"]) == (r, 3, transport)
        assert out["allreduce_sum"] == total.tolist()
        assert out["allreduce_max"] == data(2, np.float32).tolist()
        assert out["allgather"] == [data(q, np.int64)[:4].reshape(2, 2).tolist() for q in range(3)]
        assert out["broadcast"] == data(1).tolist()
        assert out["reduce"] == (total.astype(np.int32).tolist() if r == 2 else data(r, np.int32).tolist())
        assert out["reduce_scatter"] == total[4 * r:4 * r + 4].tolist()


def test_every_collective_among_three_actors_on_shared_memory_then_tcp():
    ws = workers(3)
    info = cray.create_collective_group(ws, group_name="all", timeout=TIMEOUT)
    assert (info.name, info.world_size, info.transport) == ("all", 3, "shm")
    check_every_collective(get([w.every_collective.remote("all") for w in ws]), "shm")
    if importlib.util.find_spec("torch") is not None:  # the actors run this interpreter
        torch_results = get([w.torch_collectives.remote("all") for w in ws])
        total32 = sum(data(q, np.float32) for q in range(3))
        for r, out in enumerate(torch_results):
            assert out["allreduce"] == ("torch", total32.tolist())
            assert out["allgather"] == ("torch", [data(q, np.float32)[:3].tolist() for q in range(3)])
            assert out["reduce_scatter"] == ("torch", total32[4 * r:4 * r + 4].tolist())
    with pytest.raises(BadArgument, match="group 'all' exists"):
        cray.create_collective_group(ws, group_name="all")
    cray.destroy_collective_group("all")
    assert get([w.in_group.remote("all") for w in ws]) == [False] * 3
    # The same actors over TCP: rank 0's node and port handed out by the rendezvous.
    info = cray.create_collective_group(ws[::-1], group_name="tcp", backend="zmq", timeout=TIMEOUT)
    assert info.transport == "zmq"
    check_every_collective(get([w.every_collective.remote("tcp") for w in ws[::-1]]), "zmq")
    cray.destroy_collective_group("tcp")


def test_killed_actor_survivors_shrink_then_a_new_group_with_a_new_actor():
    ws = workers(3)
    cray.create_collective_group(ws, group_name="loop", timeout=TIMEOUT)
    signal = Signal.remote()
    loops = [w.loop_until_lost.remote("loop", signal, 60.0) for w in ws]
    get(signal.wait_arrivals.remote(3, RAY_CALL - 5))  # every member is in its loop
    killed_at = time.monotonic()
    ray.kill(ws[2])
    survivors = get(loops[:2])
    with pytest.raises(ray.exceptions.RayActorError):
        get(loops[2])
    for r, out in enumerate(survivors):
        kind, message, failed_at = out["error"]
        assert kind == "PeerLost", out
        assert "rank 2" in message and "allreduce" in message, message
        assert failed_at - killed_at < TIMEOUT + 3, (r, failed_at - killed_at)
        assert out["steps"] >= 5 and out["wrong"] == 0, out
        assert out["after"] == {"rank": r, "size": 2, "sums": [3.0, 3.0, 3.0]}, out
    # The shrunk group goes on under its name; a newcomer forms a new group with the survivors.
    newcomer = Worker.remote()
    assert get([w.allreduce_ranks.remote("loop") for w in ws[:2]]) == [(0, 2, [3.0] * 5), (1, 2, [3.0] * 5)]
    cray.create_collective_group([ws[0], ws[1], newcomer], group_name="fresh", timeout=TIMEOUT)
    assert get([w.allreduce_ranks.remote("fresh") for w in (ws[0], ws[1], newcomer)]) == [
        (r, 3, [6.0] * 5) for r in range(3)]
    # The old name, once destroyed (its dead member skipped), forms a new group too.
    cray.destroy_collective_group("loop", timeout=TIMEOUT)
    assert get([w.in_group.remote("loop") for w in ws[:2]]) == [False, False]
    cray.create_collective_group([newcomer, ws[1], ws[0]], group_name="loop", timeout=TIMEOUT)
    assert get([w.allreduce_ranks.remote("loop") for w in (newcomer, ws[1], ws[0])]) == [
        (r, 3, [6.0] * 5) for r in range(3)]
    cray.destroy_collective_group("loop")
    cray.destroy_collective_group("fresh")


def test_group_with_a_busy_actor_fails_on_every_rank_and_the_name_stays_free():
    ws = workers(3)
    signal = Signal.remote()
    get([w.in_group.remote("late") for w in ws])  # started
    busy = ws[2].wait_release.remote(signal, RAY_CALL)
    timeout = 3.0
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout) as info:
        cray.create_collective_group(ws, group_name="late", timeout=timeout)
    elapsed = time.monotonic() - t0
    message = str(info.value)
    # the driver gives up on its members at 2 x timeout + RAY_SLACK (Ray's own calls are slow on a busy machine)
    assert elapsed < 2 * timeout + RAY_SLACK + 2, elapsed
    assert "create_collective_group('late')" in message, message
    # the others name rank 2 as missing, or (a loaded machine starts Ray's rendezvous actor late)
    # say the rendezvous did not answer in time; either way rank 2 is named as still forming
    assert "rank(s) [2] of 3 did not join" in message or "did not answer within" in message, message
    assert "rank 2: still forming the group" in message, message
    get(signal.release.remote())
    get(busy)
    assert get([w.in_group.remote("late") for w in ws]) == [False] * 3  # every rank's outcome
    cray.create_collective_group(ws, group_name="late", timeout=TIMEOUT)
    assert get([w.allreduce_ranks.remote("late") for w in ws]) == [(r, 3, [6.0] * 5) for r in range(3)]
    cray.destroy_collective_group("late")


def test_group_with_a_dead_actor_fails_at_once_on_every_rank():
    ws = workers(3)
    get([w.in_group.remote("dead") for w in ws])  # started
    ray.kill(ws[2])
    # ray.kill returns before the actor is gone: a call made at once may still run (seen on a busy
    # machine); wait, with a deadline, until calls to it fail
    deadline = time.monotonic() + 30
    while True:
        try:
            get(ws[2].in_group.remote("dead"))
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the killed actor still answers after 30 s"
    t0 = time.monotonic()
    with pytest.raises(PeerLost) as info:
        cray.create_collective_group(ws, group_name="dead", timeout=TIMEOUT)
    elapsed = time.monotonic() - t0
    message = str(info.value)
    assert elapsed < 3 + 2, elapsed  # far within the timeout: the others are told at once
    assert message.startswith("create_collective_group('dead') failed: rank 2: its actor died"), message
    assert info.value.origin == 2
    for r in (0, 1):
        assert f"rank {r}: " in message, message
    assert get([w.in_group.remote("dead") for w in ws[:2]]) == [False, False]


def test_actors_form_a_group_themselves_and_misuse_is_refused():
    ws = workers(2)
    assert get([w.join.remote(2, r, "own") for r, w in enumerate(ws)]) == [(0, 2, "shm"), (1, 2, "shm")]
    assert get([w.allreduce_ranks.remote("own") for w in ws]) == [(0, 2, [3.0] * 5), (1, 2, [3.0] * 5)]
    kind, message = get(ws[0].try_.remote("init_collective_group", 2, 0, "auto", "own"))
    assert kind == "BadArgument" and "already rank 0 of 2 in group 'own'" in message, message
    kind, message = get(ws[0].try_.remote("allreduce", np.ones(2), "sum", "nope"))
    assert kind == "BadArgument" and "'nope'" in message and "['own']" in message, message
    kind, message = get(ws[1].try_.remote("init_collective_group", 2, 5, "auto", "other"))
    assert kind == "BadArgument" and "rank 5 is not in a world of 2" in message, message
    kind, message = get(ws[1].try_.remote("init_collective_group", 2, 1, "nccl", "other"))
    assert kind == "BadArgument" and "backend" in message, message
    get([w.try_.remote("destroy_collective_group", "own") for w in ws])
    assert get([w.in_group.remote("own") for w in ws]) == [False, False]


def test_driver_misuse_is_refused_before_any_actor_is_asked():
    w = Worker.remote()
    cases = [
        (([],), "at least one actor"),
        (([w, w],), "actors[1] is the same actor as actors[0]"),
        (([w, "x"],), "actors[1] is a str, not a Ray actor handle"),
        (([w],), "backend must be one of auto, shm, zmq", {"backend": "nccl"}),
        (([w],), "ranks must hold 0..0 once each", {"ranks": [1]}),
        (([w],), "timeout must be positive", {"timeout": 0}),
    ]
    for args, match, *kw in cases:
        t0 = time.monotonic()
        with pytest.raises(BadArgument, match=re.escape(match)):
            cray.create_collective_group(*args, **(kw[0] if kw else {}))
        assert time.monotonic() - t0 < 3
    assert get(w.in_group.remote("default")) is False
    with pytest.raises(BadArgument, match="no collective group named 'default'"):
        cray.get_communicator()


def test_killed_actor_over_tcp_survivors_shrink():
    ws = workers(3)
    cray.create_collective_group(ws, group_name="tloop", backend="zmq", timeout=TIMEOUT)
    signal = Signal.remote()
    loops = [w.loop_until_lost.remote("tloop", signal, 60.0) for w in ws]
    get(signal.wait_arrivals.remote(3, RAY_CALL - 5))  # every member is in its loop
    killed_at = time.monotonic()
    ray.kill(ws[2])
    survivors = get(loops[:2])
    with pytest.raises(ray.exceptions.RayActorError):
        get(loops[2])
    for r, out in enumerate(survivors):
        kind, message, failed_at = out["error"]
        assert kind == "PeerLost", out
        assert "rank 2" in message, message
        assert failed_at - killed_at < TIMEOUT + 3, (r, failed_at - killed_at)
        assert out["steps"] >= 5 and out["wrong"] == 0, out
        assert out["after"] == {"rank": r, "size": 2, "sums": [3.0, 3.0, 3.0]}, out
    assert get([w.in_group.remote("tloop") for w in ws[:2]]) == [True, True]
    cray.destroy_collective_group("tloop", timeout=TIMEOUT)
    assert get([w.in_group.remote("tloop") for w in ws[:2]]) == [False, False]
