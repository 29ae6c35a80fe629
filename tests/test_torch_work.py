"""The torch backend's Work (``collectives.integrations.torch_work``), in
this process: its event and future are made only when asked for, so every
order of completing, waiting and asking for the future must give the same
answers, from any thread."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from collectives import CollectiveTimeout, MismatchedCollective  # noqa: E402
from collectives.integrations.torch_work import CollectivesWork  # noqa: E402


def _work():
    return CollectivesWork([torch.ones(3)], "recv from rank 1", 0, 1)


@pytest.mark.parametrize("future_first", [True, False], ids=["future, then complete", "complete, then future"])
def test_the_future_completes_with_the_outputs_whenever_it_is_asked_for(future_first):
    work = _work()
    assert not work.is_completed() and not work.is_success()
    fut = work.get_future() if future_first else None
    work.complete()
    fut = fut if fut is not None else work.get_future()
    assert work.is_completed() and work.is_success() and work.wait() is True
    assert fut.done() and torch.equal(fut.wait()[0], torch.ones(3))
    assert work.get_future() is fut  # one future per Work
    work.complete(RuntimeError("late"))  # ignored: a Work completes once
    assert work.is_success() and work.exception() is None


@pytest.mark.parametrize("future_first", [True, False], ids=["future, then fail", "fail, then future"])
def test_the_future_fails_with_the_error_whenever_it_is_asked_for(future_first):
    work = _work()
    fut = work.get_future() if future_first else None
    work.complete(MismatchedCollective("rank 0: expected 12 bytes from rank 1, got 10"))
    fut = fut if fut is not None else work.get_future()
    assert work.is_completed() and not work.is_success()
    with pytest.raises(MismatchedCollective, match="expected 12 bytes"):
        work.wait()
    with pytest.raises(RuntimeError, match="expected 12 bytes"):
        fut.wait()


def test_a_wait_with_a_timeout_raises_and_a_later_wait_sees_another_thread_complete_it():
    work = _work()
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="recv from rank 1 did not complete"):
        work.wait(0.05)
    assert 0.04 < time.monotonic() - start < 5
    waiting = threading.Event()
    outcome = []

    def waiter():
        waiting.set()
        outcome.append(work.wait(10))
    thread = threading.Thread(target=waiter)
    thread.start()
    assert waiting.wait(5)
    work.complete()
    thread.join(10)
    assert outcome == [True] and work.get_future().done()


def test_many_threads_racing_to_complete_wait_and_ask_agree():
    for _ in range(50):
        work = _work()
        go = threading.Barrier(4)
        seen = []

        def complete():
            go.wait(5)
            work.complete()

        def wait():
            go.wait(5)
            seen.append(work.wait(10))

        def future():
            go.wait(5)
            seen.append(work.get_future().wait() is not None)
        threads = [threading.Thread(target=f) for f in (complete, wait, future, wait)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert seen == [True, True, True] and work.is_success()
