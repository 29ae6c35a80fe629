"""The parts of the Ray integration that need no Ray: the rendezvous's
roster logic (run as a plain asyncio object, as the Ray actor runs it), the
transport every member derives from the roster, and the message that says
what to install when Ray is absent. These run whether Ray is installed or
not (tests/test_ray.py skips without it)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from collectives import BadArgument
from collectives.integrations.ray_rendezvous import Rendezvous, transport_for

pytestmark = pytest.mark.timeout(120)


def test_rendezvous_refuses_a_second_process_for_a_rank_and_a_world_size_that_disagrees():
    async def scenario():
        store = Rendezvous("g", 2, "job", "secret")
        me = {"rank": 1, "node": "n" * 20, "host": "127.0.0.1", "pid": 11, "port": 0}
        first = asyncio.create_task(store.join(me, 2, 30.0))
        await asyncio.sleep(0)  # the first join runs up to its wait for rank 0
        twice = await store.join({**me, "pid": 12}, 2, 30.0)
        sizes = await store.join({**me, "rank": 0}, 3, 30.0)
        outside = await store.join({**me, "rank": 2}, 2, 30.0)
        last = await store.join({**me, "rank": 0, "pid": 13}, 2, 30.0)
        return twice, sizes, outside, last, await asyncio.wait_for(first, 5), await store.done(0), await store.done(1)

    twice, sizes, outside, last, first, done0, done1 = asyncio.run(scenario())
    assert twice["error"] == "BadArgument" and "rank 1 joined twice (process 11" in twice["message"], twice
    assert sizes["error"] == "BadArgument" and "3 ranks, the group was started with 2" in sizes["message"], sizes
    assert outside["error"] == "BadArgument" and "rank 2 is not in a world of 2" in outside["message"], outside
    assert last["job"] == "job" and [m["pid"] for m in last["members"]] == [13, 11]
    assert first == last and first["secret"] == "secret"
    assert (done0, done1) == (False, True)


def test_rendezvous_names_the_ranks_that_did_not_join():
    me = {"rank": 1, "node": "n" * 20, "host": "127.0.0.1", "pid": 11, "port": 0}
    t0 = time.monotonic()
    answer = asyncio.run(Rendezvous("g", 3, "job", "secret").join(me, 3, 0.2))
    assert time.monotonic() - t0 < 0.2 + 3
    assert answer["error"] == "CollectiveTimeout" and answer["missing"] == [0, 2], answer
    assert "group 'g': rank(s) [0, 2] of 3 did not join within 0.2 s" in answer["message"]


def test_without_ray_the_functions_say_what_to_install():
    code = ("import sys; sys.modules['ray'] = None\n"
            "import collectives.integrations.ray as cray\n"
            "try:\n    cray.create_collective_group([])\n"
            "except ImportError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'collectives[ray]'" in out.stdout, out.stdout


def test_every_member_derives_the_same_transport_from_the_roster():
    one = [{"rank": r, "node": "a" * 20, "host": "10.0.0.1", "pid": 10 + r, "port": 5000 if r == 0 else 0}
           for r in range(3)]
    assert [transport_for("auto", one, r, "g") for r in range(3)] == [("shm", {})] * 3
    assert transport_for("zmq", one, 1, "g") == ("zmq", {"master_addr": "10.0.0.1", "master_port": 5000,
                                                          "addr": "10.0.0.1"})
    two = [{**m, "node": ("a" if m["rank"] < 2 else "b") * 20, "host": "10.0.0.1" if m["rank"] < 2 else "10.0.0.2"}
           for m in one]
    assert transport_for("auto", two, 2, "g") == ("zmq", {"master_addr": "10.0.0.1", "master_port": 5000,
                                                          "addr": "10.0.0.2"})
    with pytest.raises(BadArgument, match=r"backend 'shm' needs every member on one node; ranks by node: "
                                          r"\{'aaaaaaaaaaaa': \[0, 1\], 'bbbbbbbbbbbb': \[2\]\}"):
        transport_for("shm", two, 0, "g")
