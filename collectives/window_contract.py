"""The shared-window contract: what a transport's window offers the window algorithms.

A transport that declares the capability ``"window"`` returns a
:class:`SharedWindow` from :attr:`~collectives.transport.Transport.window`;
the ``shared_window`` algorithms (:mod:`collectives.algorithms.window`) run
on nothing else. Shared memory implements it
(:class:`collectives.transports.shm.ShmWindow`); a CUDA-IPC or RDMA window
implements the same slots. Optional slots come with a feature name in
:attr:`SharedWindow.features`; the algorithms test ``name in
window.features`` and never probe for attributes.

Terms
=====

Region
    Every rank owns ``capacity`` bytes that every rank of the window can
    read and write (:meth:`SharedWindow.region`). The algorithms lay their
    regions out themselves (a metadata block, then two halves used on
    alternate steps, see :mod:`collectives.algorithms.window.state`).

Step
    The window counts steps through the regions: :attr:`SharedWindow.turn`
    is the number of steps this rank has taken. An algorithm takes a step
    (:meth:`SharedWindow.step`, which returns its number k) before it writes
    data for other ranks into its region, and it writes step k's data where
    step k - 2's was (the half of parity ``(k - 1) % 2``). A rank is *done*
    with step k once it has finished reading what other ranks wrote for it;
    ``step`` returns k only when every rank is done with step k - 2.
    (Algorithms synchronise at least once in every step, after their writes
    and before their reads, and read a step's data before their next step's
    synchronisation; a window whose fences alone then order the halves, as
    the shared-memory window's Python fences do, may return at once.)

Post
    A rank posts step k when its writes of step k are complete and visible:
    a per-rank counter set to k that every rank can read. Compiled calls
    (below) synchronise by posts alone; :meth:`SharedWindow.arrive` posts.

Signature record
    Every collective call carries a signature (:mod:`collectives.signature`:
    three words holding the sequence number, the collective, the algorithm,
    the op, the root, the dtype and the counts). When a call starts, the
    transport's ``begin_call(seq, sig, refusal)`` publishes this rank's
    record of it beside its post counter (in slots by the parity of the
    call number, so a rank may be one call ahead), then calls
    :meth:`SharedWindow.arm`. Verifying call ``seq`` means: every rank's
    record of ``seq`` equals this rank's (a rank whose record is of a later
    call has verified this one already, and counts as agreeing); a record
    marked refused (the call's root refused its own arguments) fails it.
    Records are read only after their rank's post of the step, so a rank
    never reads or writes a peer's memory for a call the peer did not make.

Arrival
    The first synchronisation of call ``seq`` (:meth:`SharedWindow.arrive`):
    post the current step (taking one first when the call has taken none
    since :meth:`SharedWindow.arm`), wait for every rank's post of it, and
    verify every rank's record. After :meth:`SharedWindow.arm`, the call's
    first :meth:`SharedWindow.fence` *is* its arrival, so an algorithm
    needs no code of its own to check its peers.

Fence
    A barrier of every rank of the window: every write any rank made before
    its fence is visible to every rank after its fence.

Compiled call (feature ``"compiled_calls"``)
    A collective's one-step case as data, run in one call without the
    interpreter: copies before the post, the post (with the call's record),
    a wait for every rank's post of the step and the verification of every
    record, copies after it and at most one reduction, then done with the
    step. The same compiled call runs every repeated call of one signature.

Every wait takes a ``deadline`` (``time.monotonic()`` seconds) and raises
:class:`~collectives.errors.CollectiveTimeout` past it, naming the ranks
waited for; a peer that died, closed or aborted raises
:class:`~collectives.errors.PeerLost` (or the error its abort carries, see
:func:`~collectives.errors.from_abort`); a disagreement of the records
raises :class:`~collectives.errors.MismatchedCollective` (or
:class:`~collectives.errors.BadArgument` for a refused call) on every rank
alike, before any data of a peer is read.

Features
========

``"compiled_calls"``: :meth:`~SharedWindow.compile` and :meth:`~SharedWindow.settle`.
``"pool"``: every rank maps every rank's shared allocation pool, where
    :meth:`~collectives.transport.Transport.alloc` places user buffers:
    :meth:`~SharedWindow.allocation`, :meth:`~SharedWindow.locate`,
    :meth:`~SharedWindow.shared_part`, :meth:`~SharedWindow.map_in`.
``"adoption"``: :meth:`~SharedWindow.shared_part` with ``adopt=True`` may
    move a private buffer used again and again into the pool, in place
    (implies ``"pool"``).
``"direct_access"``: :meth:`~SharedWindow.read` and
    :meth:`~SharedWindow.write` of any rank's private memory.
``"huge_pages"``: :meth:`~SharedWindow.huge_pages` tells whether a buffer
    lies in huge pages (direct access to other pages may be slow).

``"compiled_calls"``, ``"pool"`` and ``"direct_access"`` decide which path
every rank takes, so they must be the same on every rank; ``"adoption"``
and ``"huge_pages"`` may differ (what they find is published to the peers).
"""

from __future__ import annotations

import abc
from typing import Any, Protocol

import numpy as np

__all__ = ["SharedWindow", "CompiledCall", "FEATURES", "COMPILED_CALLS", "POOL", "ADOPTION", "DIRECT_ACCESS",
           "HUGE_PAGES", "CMA_NEVER", "describe_cma_from"]

COMPILED_CALLS = "compiled_calls"
POOL = "pool"
ADOPTION = "adoption"
DIRECT_ACCESS = "direct_access"
HUGE_PAGES = "huge_pages"
#: Every feature a window may declare.
FEATURES = frozenset({COMPILED_CALLS, POOL, ADOPTION, DIRECT_ACCESS, HUGE_PAGES})
#: :attr:`SharedWindow.cma_from` where a read of a peer's memory beat the
#: window's copies at no size.
CMA_NEVER = 1 << 62


def describe_cma_from(cma_from: int) -> str:
    """:attr:`SharedWindow.cma_from` in words (for logs and ``explain``)."""
    if not cma_from:
        return "cross-memory reads faster than the window's copies"
    if cma_from >= CMA_NEVER:
        return "cross-memory reads slower than the window's copies"
    return f"cross-memory reads faster than the window's copies from {cma_from} B"


class CompiledCall(Protocol):
    """A call compiled by :meth:`SharedWindow.compile` (feature ``"compiled_calls"``)."""

    def run(self, arrays: tuple, seq: int, sig: tuple[int, int, int]) -> Any:
        """Take the next step for call ``seq`` whose signature is ``sig`` (its
        three words, without the sequence number) on the call's ``arrays``:
        the window's turn goes up by one; this rank is then done with every
        earlier step; the call writes its ``before`` copies (once every rank
        is done with step k - 2, if they land in the window), writes this
        rank's record of ``seq`` from ``sig``, posts the step, waits for
        every rank's post, verifies every record, does its ``after`` copies
        and its reduction, and is done with the step.

        Returns:
            None when all of that is done; otherwise a token saying what is
            still to wait for (or why the run stopped), to hand to
            :meth:`SharedWindow.settle` with the same arrays. Raises only
            for arrays it cannot use (TypeError, ValueError).
        """
        ...

    def resume(self, arrays: tuple) -> Any:
        """Go on after the wait a token asked for; returns as :meth:`run`."""
        ...

    def abandon(self) -> None:
        """Forget a run that failed while it waited (a timeout, a lost peer)."""
        ...


class SharedWindow(abc.ABC):
    """Memory of every rank mapped into every rank, with the synchronisation
    the window algorithms need (see the module docstring for the terms).

    Attributes:
        features: the optional slots this window offers (names from
            :data:`FEATURES`), fixed when the window is made (a released
            window may drop some).
        capacity: bytes of each rank's region.
        cores: cores the window's ranks share between them (0: not known,
            each rank taken to have one of its own); algorithms scale
            their switch points with the ranks per core.
        cma_from: bytes from which one read of a peer's private memory (the
            ``direct_access`` feature) beats two copies through the window
            (the same on every rank; 0: at every size); algorithms take
            their direct compiled calls by it.
        size: the ranks that share the window (one region each).
        kept: a dict the window algorithms keep what they make for this
            window in (:mod:`collectives.algorithms.window.state`: views
            of its regions, compiled calls); a window empties it when it
            is released, so that none of it outlives the window's memory.
    """

    features: frozenset[str] = frozenset()
    capacity: int
    cores: int = 0
    cma_from: int = 0
    size: int = 1
    kept: dict

    # ------------------------------------------------------------- regions

    @abc.abstractmethod
    def region(self, rank: int) -> np.ndarray:
        """A uint8 array over ``rank``'s region (``capacity`` bytes), the same
        memory on every rank (writes become visible to other ranks at their
        next synchronisation with the writer)."""

    # ------------------------------------------------------- synchronisation

    @property
    @abc.abstractmethod
    def turn(self) -> int:
        """Steps this rank has taken (plans' steps included); the same on
        every rank between calls."""

    @abc.abstractmethod
    def step(self, deadline: float) -> int:
        """Take the next step; returns its number k >= 1, once every rank is
        done with step k - 2 (so what this rank wrote for step k - 2 may be
        overwritten now).

        Raises:
            CollectiveTimeout, PeerLost, or a peer's abort, while it waits.
        """

    @abc.abstractmethod
    def arm(self, seq: int) -> None:
        """Call ``seq`` started on this rank and its record is published: its
        first :meth:`fence` is its arrival (:meth:`arrive`). Never blocks,
        never raises."""

    @abc.abstractmethod
    def arrive(self, seq: int, deadline: float) -> None:
        """The first synchronisation of call ``seq``: post the current step
        (taking one first if the call has taken none since :meth:`arm`),
        wait until every rank posted it, and verify every rank's record of
        ``seq`` before anything of a peer is read. Also what a call that
        moves no data, or that this rank refuses, does to meet its peers.

        Raises:
            MismatchedCollective: the records disagree (every rank raises alike).
            BadArgument: a rank refused the call.
            CollectiveTimeout, PeerLost, or the error of a peer's abort.
        """

    @abc.abstractmethod
    def fence(self, deadline: float) -> None:
        """Barrier of every rank: every write any rank made before its fence
        is visible to every rank after its fence. The first fence after
        :meth:`arm` is :meth:`arrive` instead.

        Raises:
            BadArgument: the window's transport is closed.
            CollectiveTimeout, PeerLost, or the error of a peer's abort (and,
            as an arrival, what :meth:`arrive` raises).
        """

    # ------------------------------------------------ feature "compiled_calls"

    def compile(self, narrays: int, before: list, after: list, reduce: tuple | None,
                sources: list[int], piece: int = 0, then: tuple | None = None,
                direct: tuple | None = None) -> CompiledCall:
        """A collective's one-step case (or two-step, with ``then``) as a
        :class:`CompiledCall` (feature ``"compiled_calls"``).

        Args:
            narrays: how many arrays each run passes (at most 4; an array
                no copy uses may be None).
            before: copies ``(src, dst, nbytes)`` made before the post.
            after: copies made once every rank posted and every record agrees.
            reduce: None, or ``(dst, srcs, count, dtype code, op code)``
                (codes of :func:`collectives.compiled.kernel_codes`): ``dst =
                srcs[0] op srcs[1] ...`` over ``count`` elements, in rank
                order, after the ``after`` copies.
            sources: the ranks whose regions ``after`` and ``reduce`` read.
            piece: when above 0, run in pieces of this many bytes: the
                record is posted first, each rank publishes how far it has
                filled its region as it copies, and once every record
                agrees a reader copies or reduces each piece as soon as its
                writer has filled it, rather than after the writer's last
                copy. A window may run a call whole instead; ranks may
                differ in this and still agree.
            then: None, or ``(before, after[, wait])`` of a second step
                through the other half, taken once the first is done: copies
                before its post, and copies after every rank's post (with
                ``wait`` false, it neither waits for the posts nor copies
                after). A call of two steps runs whole (``piece`` does not
                apply).
            direct: None, or ``(readers, shared)`` of a direct call (feature
                ``"direct_access"`` too): before its post, each rank
                publishes where its arrays ``shared`` (indices) are; once
                every rank posted and every record agrees, ``after`` copies
                may read peers' published arrays straight from their
                memory, or write them, each only inside the array as its
                rank published it (a write looks at the abort inbox before
                each MiB); the run ends once every rank in ``readers``
                (those that read or write this rank's arrays) is done with
                the step. One step, never in pieces. ``(readers, shared,
                copies_in)``: with a fallback on the window, source by
                source: each rank also publishes whether its arrays lie in
                huge pages; one whose do not makes the copies ``copies_in``
                (from its arrays into its region) before its post instead
                of waiting for its readers, and they take what they would
                read from it from the window: every ``after`` copy that
                reads a peer then names its place in the window fourth,
                ``(src, dst, nbytes, window place)``. ``(readers, shared,
                copies_in, pool_first)`` (``copies_in`` may be None: no
                fallback; ``pool_first`` None: no pools): with feature
                ``"pool"`` too, an array outside huge pages that lies in
                its rank's pool (from
                :meth:`~collectives.transport.Transport.alloc`, or a
                buffer the pool adopts, see :meth:`shared_part`) is
                neither copied in nor moved across: its peers copy it out of
                (or into) their mapping of that pool; so is one of
                ``pool_first`` bytes or more in huge pages. The call's
                ``last_direct``, ``last_window`` and ``last_pooled`` count
                its last run's reads and writes of each kind.
                ``(readers, shared, copies_in, pool_first, (ralts,
                copies_out, piece))``: a direct reduction. ``reduce``
                reduces this rank's block: its sources, in rank order, are
                this rank's array and peers' published arrays, read ``piece``
                bytes at a time (a peer's part in its pool in place, else
                across); ``dst`` is this rank's array, and every ``after``
                copy writes all of it (``src`` is ``dst``) into a peer's
                array, piece by piece as it is reduced. With a fallback,
                ``ralts`` names each peer source's copy in its rank's region
                (None for this rank's own source), each ``after`` copy
                names the same place fourth (a peer whose array is taken
                through the window gets its reduced block there), and such
                a rank, once every peer is done, makes the copies
                ``copies_out`` from its region into its array.

        A place is ``(i, byte offset, 0)`` in the run's array i, or ``(-1, a0,
        a1)`` in the window: address a0 on steps k with ``(k - 1) % 2 ==
        0``, a1 on the others; or, as a direct call's ``after`` source or
        destination (never both in one copy), ``(-2 - i, rank, byte
        offset)`` in rank's published array i.

        A run that stops for good reports ``(rank, kind, value)`` with a
        negative kind: the records disagree (at rank), rank aborted, a
        direct read or write would fall outside rank's published array
        (value: its bytes), or the kernel refused one (value: the errno).

        Raises:
            NotImplementedError: the window does not offer ``"compiled_calls"``.
            ValueError, TypeError: a malformed description.
        """
        raise NotImplementedError("this window has no compiled calls")

    def record_calls(self, ring: Any) -> None:
        """("compiled_calls") Have every compiled call record itself in row
        ``seq & (n - 1)`` of ``ring``, n rows of 8 float64 (one cache line
        each; n a power of two: a flight recorder's ring): its start and end
        (seconds of the monotonic clock, as ``time.monotonic()``) as elements
        0 and 1, and its signature (word 0 with the call number, as in a
        record) as elements 2 to 4 seen as uint64; None stops it. A window may
        ignore it (its calls are then recorded from Python)."""

    def settle(self, call: CompiledCall, arrays: tuple, late: Any, deadline: float) -> None:
        """Finish a :meth:`CompiledCall.run` that returned ``late``: wait, resume,
        until it is done (feature ``"compiled_calls"``).

        Raises:
            MismatchedCollective, BadArgument: the records disagree, or a
                rank refused (the run read nothing of any peer).
            CollectiveTimeout, PeerLost, or the error of a peer's abort (the
                run is abandoned).
        """
        raise NotImplementedError("this window has no compiled calls")

    # -------------------------------------------------------- feature "pool"

    def allocation(self, rank: int) -> np.ndarray:
        """A uint8 array over ``rank``'s shared allocation pool (feature ``"pool"``)."""
        raise NotImplementedError("this window has no shared pool")

    def locate(self, arr: np.ndarray) -> tuple[int, int] | None:
        """(this rank, byte offset in its pool) when ``arr`` lies wholly in this
        rank's pool (memory from :meth:`~collectives.transport.Transport.alloc`),
        else None (always None without ``"pool"``)."""
        return None

    def shared_part(self, arr: np.ndarray, adopt: bool = False) -> tuple[int, int, int] | None:
        """Where ``arr``'s bytes lie in this rank's pool: (pool offset of its
        byte 0, first byte, end byte of the part that lies there), or None.
        With ``adopt`` (feature ``"adoption"``; ignored without it), a private
        buffer seen again may be moved there now. Default: from :meth:`locate`."""
        where = self.locate(arr)
        return None if where is None else (where[1], 0, arr.nbytes)

    def map_in(self, rank: int, offset: int, nbytes: int) -> None:
        """Make bytes [offset, offset + nbytes) of ``rank``'s pool cheap to touch
        now (a hint before reading or writing them; default: nothing)."""

    def check_aborted(self) -> None:
        """Raise now if a peer aborted the call in progress: before each piece
        an algorithm writes into a peer's buffer, as that peer, having given
        up on the call (a timeout), has returned to its caller, who may use
        the buffer again (default: nothing).

        Raises:
            The peer's error (see :meth:`~collectives.transport.Transport.abort`).
        """

    # ----------------------------------------------- feature "direct_access"

    def read(self, rank: int, address: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes at ``address`` in ``rank``'s own address
        space into ``out`` (feature ``"direct_access"``).

        Raises:
            PeerLost: the read failed (the peer exited, or its memory is gone).
        """
        raise NotImplementedError("this window has no direct access to peers' memory")

    def write(self, rank: int, address: int, src: np.ndarray) -> None:
        """Copy ``src`` to ``address`` in ``rank``'s own address space
        (feature ``"direct_access"``).

        Raises:
            PeerLost: the write failed (the peer exited, or its memory is gone).
        """
        raise NotImplementedError("this window has no direct access to peers' memory")

    # --------------------------------------------------- feature "huge_pages"

    def huge_pages(self, buf: np.ndarray) -> bool:
        """Whether ``buf`` lies in huge pages, so that :meth:`read` and
        :meth:`write` from other ranks run at full speed (feature ``"huge_pages"``)."""
        raise NotImplementedError("this window cannot tell page sizes")

    # ------------------------------------------------------------ lifecycle

    def release(self) -> None:
        """Let go of the window's resources; its transport calls this when it
        closes (default: nothing)."""
