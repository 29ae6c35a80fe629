"""Surviving failures over TCP: the survivors agree on who failed, then
open their new transport through the old one.

The agreement is the shared-memory one (:mod:`collectives.transports.shm.agreement`)
with messages in place of shared words. Agreement ``number`` runs in rounds;
in round r a rank sends every peer its state ``(number, r, collect, view, flag)``, where the view is
the failed ranks it knows of, and waits until every rank outside its view has
sent round r or later, or has died (its connection ended without a goodbye).
If every such rank's view equals its own it sends ``(r, ready)`` and waits
likewise; when all are ready with that view it decides, and sends its
decision. Otherwise (a view differs, or a rank died meanwhile) it goes on to
round r + 1 with the union of the views. A rank that receives a decision of
the agreement adopts it and sends it on.

Each message goes both in-band on the peer's TCP lane (so that what a rank
sent before it closed arrives before its lane's end, which would count it
as failed) and over ZeroMQ (where the lane is off or has failed); a state
older than one already received is ignored.

Why the decision is the same on every survivor although a message sent just
before its sender died may never arrive: a rank decides only when every rank
outside its view has sent ``ready`` with that view in that round, so every
ready rank of that round holds that view; a rank that misses a message goes
on to the next round, where it waits for the decider, who is outside its
view and alive (or dead: then its decision concerns no survivor), and so
meets the decision. This holds for processes that die; a link cut between
two live ranks (each counting the other failed) can split the survivors, as
with any failure detector that can be wrong: the shrink that follows then
fails with an error rather than hanging.

A rank that does not take part within the deadline (stopped, or stuck)
makes the agreement fail with :class:`~collectives.errors.CollectiveTimeout`
on every rank waiting for it (it has not failed: it may wake); a rank that
finds itself in the decided set raises :class:`~collectives.errors.PeerLost`.

The survivors' new transport rendezvouses through the old one
(:class:`SurvivorStore`): its keys travel as messages to every survivor, so
it needs no rank 0 (which may be the one that died) and no new port, and a
survivor that dies before it has joined ends the rendezvous at once.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, NamedTuple


from collectives.errors import BadArgument, CollectiveTimeout, PeerLost

from .wire import HEADER, KIND_AGREE, KIND_DECIDED, KIND_KV, log

__all__ = ["Agreement", "SurvivorStore"]

_COLLECT, _READY = 0, 1
#: Decisions of a peer kept (a peer is at most one agreement ahead of a survivor).
_KEEP_DECISIONS = 4


class _State(NamedTuple):
    number: int
    round: int
    phase: int
    view: frozenset
    flag: bool


def _view_bytes(view: set[int] | frozenset, size: int) -> bytes:
    mask = bytearray((size + 7) // 8)
    for r in view:
        mask[r // 8] |= 1 << (r % 8)
    return bytes(mask)


def _view_of(body: memoryview | bytes, size: int) -> frozenset:
    return frozenset(r for r in range(size) if r // 8 < len(body) and body[r // 8] >> (r % 8) & 1)


class Agreement:
    """``agree``, ``failed_peers`` and ``reopen_options`` (a part of
    :class:`~.transport.ZmqTransport`; it keeps ``_ended``, ``_agree_states``,
    ``_decisions`` and ``_kv``)."""

    def failed_peers(self, closed_too: bool = True) -> set[int]:
        """Peers that will take no further part: their connection ended without
        a goodbye (the process died, or the link is gone), or (with
        ``closed_too``) after one."""
        if self._closed:
            return set()
        return {p for p, bye in self._ended.items() if closed_too or not bye}

    def reopen_options(self, survivors: list[int]) -> dict[str, Any]:
        """Options for opening the survivors' transport: a rendezvous through
        this one (see :class:`SurvivorStore`)."""
        store = SurvivorStore(self, survivors)
        return {"store": store, "survivor_watch": store.check}

    def agree(self, number: int, failed: set[int], flag: bool, deadline: float) -> tuple[set[int], bool]:
        """Agreement ``number`` among the survivors (see the module docstring):
        the failed ranks and the AND of the survivors' flags, the same on
        every survivor."""
        if self._closed:
            raise BadArgument(f"rank {self.rank}: the TCP transport is closed")
        view = (set(failed) | self.failed_peers()) - {self.rank}
        rnd = 0
        while True:
            rnd += 1
            self._send_state(number, rnd, _COLLECT, view, flag)
            decided, peers = self._gather_states(number, rnd, _COLLECT, view, deadline)
            if decided is not None:
                return self._adopt(number, decided)
            merged_view = set(view).union(*(p.view for p in peers.values()))
            merged_flag = flag and all(p.flag for p in peers.values())
            if merged_view != view or any(p.view != view for p in peers.values()):
                if self.rank in merged_view:
                    raise PeerLost(f"rank {self.rank}: the other ranks count this rank as failed", self.rank)
                view, flag = merged_view - {self.rank}, merged_flag
                continue
            self._send_state(number, rnd, _READY, view, flag)
            decided, peers = self._gather_states(number, rnd, _READY, view, deadline)
            if decided is not None:
                return self._adopt(number, decided)
            if all(p.view == view and p.phase == _READY and p.round == rnd for p in peers.values()):
                flag = flag and all(p.flag for p in peers.values())
                self._send_decision(number, view, flag)
                return set(view), flag
            view = set(view).union(*(p.view for p in peers.values())) - {self.rank}

    # -- the messages ----------------------------------------------------------

    def _send_state(self, number: int, rnd: int, phase: int, view: set[int], flag: bool) -> None:
        self._tell_all(HEADER.pack(KIND_AGREE, number, (rnd << 1) | phase, int(flag), 0, 0, 0)
                       + _view_bytes(view, self.size))

    def _send_decision(self, number: int, view: set[int], flag: bool) -> None:
        self._note_decision(self.rank, number, frozenset(view), flag)
        self._tell_all(HEADER.pack(KIND_DECIDED, number, 0, int(flag), 0, 0, 0) + _view_bytes(view, self.size))

    def _tell_all(self, frame: bytes, peers: list[int] | None = None) -> None:
        """Send a message of the transport's own to ``peers`` (default: every
        peer) in-band on their lanes and over ZeroMQ."""
        peers = [p for p in range(self.size) if p != self.rank] if peers is None else peers
        if self._lanes is not None:
            for peer in peers:
                self._lanes.send_control(peer, frame)
        self._send_frame(frame, peers)

    def _lane_control(self, peer: int, payload: bytes) -> None:
        """A message of the transport's own that came in-band on ``peer``'s lane."""
        if len(payload) < HEADER.size:
            return
        kind, tag, total, offset = HEADER.unpack_from(payload)[:4]
        if KIND_AGREE <= kind <= KIND_KV:
            self._on_agreement(peer, kind, tag, total, offset, memoryview(payload)[HEADER.size:])

    def _adopt(self, number: int, decided: _State) -> tuple[set[int], bool]:
        """Take a peer's decision as this rank's (and pass it on)."""
        if self.rank in decided.view:
            raise PeerLost(f"rank {self.rank}: the other ranks decided that this rank failed", self.rank)
        self._send_decision(number, set(decided.view), decided.flag)
        return set(decided.view), decided.flag

    def _on_agreement(self, peer: int, kind: int, tag: int, total: int, flags: int, body: memoryview) -> None:
        """A state, decision or rendezvous key from ``peer`` (called by progress)."""
        if kind == KIND_KV:
            key = bytes(body[:total]).decode(errors="replace")
            self._kv[key] = bytes(body[total:])
        elif kind == KIND_AGREE:
            state = _State(tag, total >> 1, total & 1, _view_of(body, self.size), bool(flags))
            last = self._agree_states.get(peer)
            if last is None or (state.number, state.round, state.phase) > (last.number, last.round, last.phase):
                self._agree_states[peer] = state
        else:
            self._note_decision(peer, tag, _view_of(body, self.size), bool(flags))
        with self._cv:
            self._cv.notify_all()

    def _note_decision(self, peer: int, number: int, view: frozenset, flag: bool) -> None:
        kept = self._decisions.setdefault(peer, {})
        kept[number] = _State(number, 0, _READY, view, flag)
        for old in sorted(kept)[:-_KEEP_DECISIONS]:
            del kept[old]

    def _gather_states(self, number: int, rnd: int, phase: int, view: set[int],
                       deadline: float) -> tuple[_State | None, dict[int, _State]]:
        """Wait until every rank outside ``view`` has sent (``rnd``, ``phase``) or
        later; a rank that died before that joins ``view``. Returns a decision
        received (None if none) and each awaited rank's state."""
        got: dict[int, _State] = {}
        waiting = [r for r in range(self.size) if r != self.rank and r not in view]
        found: list[_State] = []

        def look() -> bool:
            for r in list(waiting):
                decided = self._decisions.get(r, {}).get(number)
                if decided is not None:
                    found.append(decided)
                    return True
                st = self._agree_states.get(r)
                if st is not None and st.number == number and (st.round, st.phase) >= (rnd, phase):
                    got[r] = st
                    waiting.remove(r)
                elif r in self._ended:  # gone before sending this round: failed
                    view.add(r)
                    waiting.remove(r)
            return not waiting

        if not self._drive_until(look, deadline):
            names = ", ".join(self._name(r) for r in waiting)
            raise CollectiveTimeout(f"rank {self.rank}: {names} did not take part in agreement #{number} "
                                    "among the survivors in time (stopped or stuck; not counted as failed)")
        return (found[0] if found else None), got


class SurvivorStore:
    """The survivors' rendezvous, carried by the old transport: a key set on
    one survivor is sent to every other survivor; reading a key waits for it
    while driving the old transport. A survivor that dies (its connection
    ends without a goodbye) before the key arrives makes it raise
    :class:`PeerLost` (the shrink then agrees again); one that closes the old
    transport, having joined the new one, does not."""

    def __init__(self, transport: Any, survivors: list[int]) -> None:
        self._t = transport
        self._peers = [r for r in survivors if r != transport.rank]
        self._timeout = transport.timeout

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout.total_seconds()

    def set(self, key: str, value: bytes) -> None:
        self._t._kv[key] = bytes(value)
        raw = key.encode()
        self._t._tell_all(HEADER.pack(KIND_KV, 0, len(raw), 0, 0, 0, 0) + raw + bytes(value), self._peers)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        t = self._t
        deadline = time.monotonic() + (self._timeout if timeout is None else timeout)
        gone: list[int] = []

        def ready() -> bool:
            gone[:] = [p for p in self._peers if t._ended.get(p) is False]  # died (a close says goodbye)
            return key in t._kv or bool(gone)

        t._drive_until(ready, deadline)
        if key in t._kv:
            return t._kv[key]
        if gone:
            log.info("rank %d: %s left before the survivors' rendezvous ended", t.rank, t._name(gone[0]))
            raise PeerLost(f"rank {t.rank}: {t._name(gone[0])} died before it joined the survivors' transport",
                           gone[0])
        raise CollectiveTimeout(f"rank {t.rank}: rendezvous of the survivors: key {key!r} not set in time")

    def check(self) -> None:
        """Raise :class:`PeerLost` if a survivor has died (called while the new
        transport waits to connect)."""
        t = self._t
        t._progress_nowait()
        for p in self._peers:
            if t._ended.get(p) is False:
                raise PeerLost(f"rank {t.rank}: {t._name(p)} died before it joined the survivors' transport", p)

    def close(self) -> None:
        pass
