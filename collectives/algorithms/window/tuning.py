"""Where the shared-window algorithms switch paths: one table.

Sizes are the message's bytes (the same on every rank). The measurements
behind each number are in ``docs/shared-memory.md`` (section "Tuning");
the cost models (:mod:`collectives.cost_models.window`) use the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from ... import config


__all__ = [
    "SMALL_BYTES", "SMALL_TOTAL_BYTES", "PIECE_BYTES", "COMPILED_REDUCE_BYTES", "PIECED_FROM", "PIECE",
    "ALLREDUCE_PIECED_FROM", "ALLREDUCE_PIECE", "ALLREDUCE_TWO_STEPS_FROM", "REDUCE_TWO_STEPS_FROM",
    "DIRECT_FROM", "POOLED_ACROSS", "one_fence_limit", "reduce_one_fence_limit", "direct_from",
    "compiled_piece", "two_steps", "allreduce_two_steps", "reduce_two_steps", "DIRECT_REDUCTION_PIECE",
    "DIRECT_REDUCTION_HUGE_FROM", "wants_huge_pages", "PerBlock", "COMPILED_DIRECT",
    "compiled_direct", "direct_where_huge", "POOLED_CALLS", "POOL_FIRST_BYTES", "POOL_SPAN", "HugeOnly",
]

SMALL_BYTES = 32 * 1024          # bytes: allreduce and reduce up to this take the one-fence path ...
SMALL_TOTAL_BYTES = 1 << 20      # bytes: ... and up to this divided by p (each rank reads p * n bytes)
PIECE_BYTES = 2 << 20            # bytes per rank and half: the largest piece of the pipelined paths
COMPILED_REDUCE_BYTES = 16 * 1024  # bytes: blocks from this on are reduced by the compiled kernel
PIECED_FROM = 1 << 20           # bytes: a compiled call whose largest copy or reduction through the
PIECE = 64 * 1024                # window has this many runs in pieces of PIECE bytes (ranks <= cores)
ALLREDUCE_PIECED_FROM = 64 * 1024  # bytes: the same for allreduce's one-fence call (every rank reduces
ALLREDUCE_PIECE = 32 * 1024        # every rank's vector as it is filled), in pieces of this many
ALLREDUCE_TWO_STEPS_FROM = 16 * 1024  # bytes: where ranks share cores, allreduce from this up to a half
                                      # takes one compiled call of two steps (each rank reduces 1/p)
REDUCE_TWO_STEPS_FROM = 64 * 1024    # bytes: the same for reduce (each rank reduces 1/p, the root gathers)
DIRECT_REDUCTION_PIECE = 512 * 1024  # bytes: allreduce's and reduce's direct calls reduce and write pieces of this
DIRECT_REDUCTION_HUGE_FROM = 512 * 1024  # bytes: and read a vector in huge pages across from this size on

#: From which size each collective reads and writes peers' buffers directly
#: (one copy, through the kernel or the shared pool) rather than through
#: the window in pieces (two copies): ``bytes`` times (ranks per core) to
#: the ``power`` (a negative power divides); with ``huge``, only when every
#: buffer reached through cross-memory attach lies in huge pages.
DIRECT_FROM: dict[str, tuple[int, int, bool]] = {
    # collective:      (bytes,    power, huge)
    "allreduce":       (4 << 20,   0,    True),
    "reduce_scatter":  (16 << 20,  2,    True),
    "allgather":       (2 << 20,   1,    True),
    "bcast":           (4 << 20,   0,    False),
    "gather":          (2 << 20,   2,    False),
    "alltoall":        (4 << 20,  -1,    False),
    "scatter":         (4 << 20,   0,    False),
}


#: The collectives whose pool's direct path (from :data:`DIRECT_FROM` on) a
#: direct compiled call takes over (see ``compiled_calls.direct_mode``). The
#: call moves a peer's buffer out of or into its pool, or across, as the path
#: does, in C (2 ranks, 4 KiB pages: allgather of 2 MiB 49-50 -> 24-25 us,
#: alltoall of 4 MiB 109-110 -> 78-79, bcast of 16 MiB 513-523 -> 401-422).
#: Gather's call, as its path, has every sender write its block into the
#: root's buffer at once (2 ranks, 2 MiB 48-51 -> 21-25 us, 16 MiB 286-350 ->
#: 156-262): where the root read them one after another it lost
#: (2 ranks: 4 MiB 66-67 -> 72-75 us, 8 MiB 102-105 -> 146-155), and a read
#: makes the sender's next write of its buffer slower, a write does not (2
#: MiB with ``collectives bench --rewrite``: 68-70 us by the path, 166-171
#: read by the root).
POOLED_CALLS = frozenset({"allgather", "alltoall", "bcast", "gather", "scatter"})

#: Of :data:`POOLED_CALLS` whose ``DIRECT_FROM`` wants huge pages, those
#: whose call takes the pool's direct path's whole span over, on any cores:
#: it reads peers' arrays in huge pages or in their pools, takes an array
#: that lies in neither through the window where the call has a fallback
#: (a rank's block fits a half) and reads it across past that (as the MPIs
#: read every array), rather than leaving the call to the pool's direct
#: path in Python and the window's pieces. Allgather at 2 ranks, ``collectives
#: bench allgather -n 2 --sizes 8M,16M,64M --pages P``, us, the call / the
#: path: buffers used again (the pool adopts them) 77 / 106-114, 170-184 /
#: 215-320, 1439-1671 / 1726-2839; in huge pages, nothing adopted, 109 /
#: 125, 224 / 395, 2300 / 3466; but in 4 KiB pages and never adopted (a
#: buffer made anew every call, outside numpy, which gives huge pages from
#: 4 MiB) 332 / 216, 1038 / 524, 5846 / 3367. Where ranks share cores (4
#: ranks on 2 cores, ``-n 4 --sizes 4M,8M,16M,64M``, two rounds): huge
#: pages 132-137 / 259-276, 274-344 / 500-672, 1030-1825 / 1499-2213,
#: 5777-8811 / 6478-9549; the same with ``--rewrite`` 569-821 / 1011-1061,
#: 1967-2171 / 2414-2427; 4 KiB pages used again 136-138 / 265-267, 280-287
#: / 481, 982-1011 / 1348-1352; never adopted (``COLLECTIVES_SHM_ADOPT=0``),
#: 4 and 16 MiB, within noise (445-479 / 435-439, 2293-2471 / 2229-2542);
#: 8 ranks, 8 and 16 MiB, 1050-1848 / 2367-2714 and 2827-4253 / 4436-5541.
POOLED_ACROSS = frozenset({"allgather"})

#: Bytes from which a direct compiled call reads a peer's array out of its
#: pool even where it lies in huge pages (the pool adopts a buffer used
#: again, see ``transports/shm/pages.py``): a copy runs faster than a
#: cross-memory read of huge pages (4 MiB: 66 against 81-87 us), by more
#: than the pool's question costs (about 5 us a call).
POOL_FIRST_BYTES = 4 << 20


#: A span's end in :data:`COMPILED_DIRECT`: where the pool's direct path's
#: span starts (:func:`direct_from`). Every span of the :data:`POOLED_CALLS`
#: ends there: from there their pooled call (``compiled_calls.direct_mode``)
#: copies a peer's array out of its pool where it lies there (a buffer used
#: again, which the pool adopts) rather than reading it across, and reads
#: across only the rest. ``collectives bench C -n P --sizes ... --pages P``,
#: two rounds in turns, us, before (the direct call's reads across) -> after:
#: 4 KiB pages, 4 ranks on 2 cores: alltoall 2 MiB 309-311 -> 97-99, 4 MiB
#: 852-897 -> 245-279, 16 MiB 4763-4866 -> 2754-2994 (with ``--rewrite`` 4
#: MiB 1663-1688 -> 925-979); scatter 4 MiB 165-237 -> 67-71, 16 MiB 843 ->
#: 228-354; 8 ranks, alltoall 4 MiB 1970-2016 -> 658-724; 2 ranks, scatter 4
#: MiB 144 -> 44-50. Where the race found the read faster
#: (``COLLECTIVES_SHM_CMA_FASTER=1``), 2 ranks, 4 KiB pages: allgather 16
#: MiB 977-1011 -> 236-245, alltoall 16 MiB 1413-1432 -> 523-577, bcast 8
#: MiB 686-801 -> 144-145, gather 32 MiB 3599-3695 -> 754-762 (huge pages
#: 1707-1868 -> 626-755); 4 ranks, bcast 4 MiB 1357-1871 -> 206-212. Lost,
#: huge pages at 4 ranks, 4 MiB (copied out of the pool from there,
#: :data:`POOL_FIRST_BYTES`): scatter 55-60 -> 67-68, bcast where the read
#: wins 172-182 -> 198-205.
POOL_SPAN = "pool span"


@dataclass(frozen=True)
class PerBlock:
    """A span's start counted in each rank's block (``nbytes / p``) instead
    of the whole message."""

    nbytes: int

    def reached(self, nbytes: int, p: int, cores: int) -> bool:
        return nbytes >= self.nbytes * p


@dataclass(frozen=True)
class HugeOnly:
    """A span that reads only arrays in huge pages, and takes the rest
    through the window, whatever the race answers (a read of 4 KiB pages
    lost there even where the race found it faster)."""

    start: int | PerBlock


#: Where each collective's one compiled call reads peers' buffers by
#: cross-memory attach (one copy, all in C: publish, post, read, wait for the
#: readers) instead of going through the window (two copies) or the pool's
#: direct path (:data:`DIRECT_FROM`): from ``from`` bytes up to (not
#: including) ``until`` (None: no end; :data:`POOL_SPAN`: the pool's span),
#: the same on every rank; a ``from`` of None: never. Four columns: where ranks have a core each, then where
#: they share cores; each first from the size on which one read beats the
#: window's two copies (as a read of huge pages does: below the race's
#: size these spans run with a fallback on the window for arrays in 4 KiB
#: pages, :func:`direct_where_huge`), then below it (the rendezvous races the two,
#: ``transports/shm/copy_race.py``: on the 2-core test machines the window
#: won up to 2 MiB in some hours, the direct calls from 1 MiB in others). Below
#: that size only scatter's stays where ranks share cores, from blocks of
#: 512 KiB (:class:`PerBlock`: 2 MiB at 4 ranks) up to its pool's span
#: (4 MiB); there its compiled call won at 3 to 8 ranks, and the window
#: below. Scatter's from 4 MiB with a core each and alltoall's from 4 MiB of
#: all ranks' buffers per core where ranks share cores lie in the pool's
#: span now (:data:`POOL_SPAN`). Where one rank reads from every
#: other (gather, with a core each) or every rank from one (bcast), the
#: window's copies overlap below 2 MiB and the direct read did not win
#: there (their spans began where their pools' spans begin, so they have
#: none now). Where ranks share cores, the reads of bcast and gather from huge
#: pages beat the window from 512 KiB to 4 MiB (measured) at 3, 4 and 8
#: ranks on 2 cores. So do allgather's from blocks of 256 KiB up to its pool's
#: span (:data:`POOL_SPAN`; 4 ranks: 1 MiB 63-66 -> 47-48 us, 2 MiB 122-123 ->
#: 80-83, and with ``--rewrite`` 2 MiB 271-276 -> 214-219; 3 ranks: 1 MiB 60 ->
#: 39, 2 MiB 116-117 -> 68-70; 8 ranks: 4 MiB 1137-1300 -> 615-653; 8 ranks, 1
#: MiB, blocks of 128 KiB, lost: 110 -> 133), but it reads only huge pages
#: (:class:`HugeOnly`): from 4 KiB pages every read lost there, even where the
#: race found the read faster (4 ranks, 1 MiB 66-67 -> 146-148 us). Allreduce's
#: call reduces from the peers' buffers where they lie and writes into
#: them (its own fallback, see ``direct_reduction.direct_call``): from 64 KiB at
#: 2 ranks (1 MiB 46 -> 27-30 us, 64 KiB 3.5 -> 2.8-2.9), from 1 MiB where
#: ranks share cores (4 ranks: 1 MiB 134-137 -> 92-96; 512 KiB from 4 KiB
#: pages lost, 78 against 70). Reduce's, which writes the root's buffer
#: only, from 1 MiB where ranks share cores (4 ranks, 1 MiB 79-89 -> 65-70
#: us, 2 MiB 170-191 -> 101-105; 3 and 8 ranks won too); at 2 ranks the
#: root reducing alone won up to its one-fence limit (1 MiB 20-21 against
#: 34), and the call from 2 MiB (2 MiB 60-64 -> 48-55 us; 4 MiB, where the
#: window's pieces ran before, 404-427 -> 90-104). The numbers are in
#: docs/shared-memory.md.
COMPILED_DIRECT: dict[str, tuple[tuple[int | PerBlock | HugeOnly | None, int | str | None], ...]] = {
    #              a core each:                               ranks share cores:
    # collective:  the read wins,          below,             the read wins,                            below
    "allgather":   ((128 << 10, POOL_SPAN), (None, None),     (HugeOnly(PerBlock(256 << 10)), POOL_SPAN), (None, None)),
    "alltoall":    ((128 << 10, POOL_SPAN), (None, None),     (256 << 10, POOL_SPAN),                   (None, None)),
    "scatter":     ((128 << 10, POOL_SPAN), (None, None),     (128 << 10, POOL_SPAN),
                    (PerBlock(512 << 10), POOL_SPAN)),
    "bcast":       ((None, None),           (None, None),     (512 << 10, POOL_SPAN),                   (None, None)),
    "gather":      ((None, None),           (None, None),     (512 << 10, POOL_SPAN),                   (None, None)),
    "allreduce":   ((64 << 10, None),       (64 << 10, None), (1 << 20, None),                          (1 << 20, None)),
    "reduce":      ((2 << 20, None),        (2 << 20, None),  (1 << 20, None),                          (1 << 20, None)),
}


def compiled_direct(collective: str, nbytes: int, p: int, cores: int, cma_from: int = 0) -> bool:
    """Whether ``collective`` of ``nbytes`` at ``p`` ranks on ``cores`` cores
    (0: a core each) takes the direct compiled call, ``cma_from`` being the
    bytes from which a cross-memory read beats the window's two copies (see
    :data:`COMPILED_DIRECT`); ``COLLECTIVES_WINDOW_COMPILED_DIRECT_BYTES``,
    when set, makes every one of them take it from that size on (all ranks
    must agree)."""
    if collective not in COMPILED_DIRECT:
        return False
    forced = config.get("WINDOW_COMPILED_DIRECT_BYTES")
    if forced is not None:
        return nbytes >= forced
    return _in_span(collective, nbytes, p, cores, cma_from, huge_only=False)


def direct_where_huge(collective: str, nbytes: int, p: int, cores: int, cma_from: int) -> bool:
    """Whether ``collective`` of ``nbytes`` takes the direct compiled call
    only where every array it reads lies in huge pages, and the window
    otherwise: in a span of the columns where the read wins that the race's
    answer ``cma_from`` leaves to the window, and in a :class:`HugeOnly`
    span whatever the race answers. The race reads 4 KiB pages; a
    read of huge pages pins one page per 2 MiB and runs about as fast as
    a copy (1 MiB: 21-23 us against 69-72 us from 4 KiB pages, and 17-18 us
    for a copy within one process)."""
    if collective not in COMPILED_DIRECT or config.get("WINDOW_COMPILED_DIRECT_BYTES") is not None:
        return False
    return (_in_span(collective, nbytes, p, cores, 0, huge_only=True)
            and not compiled_direct(collective, nbytes, p, cores, cma_from))


def _in_span(collective: str, nbytes: int, p: int, cores: int, cma_from: int, huge_only: bool) -> bool:
    """Whether ``nbytes`` lies in ``collective``'s span of
    :data:`COMPILED_DIRECT` (with ``huge_only``, a :class:`HugeOnly` span
    counts too)."""
    shared = bool(cores and p > cores)
    start, until = COMPILED_DIRECT[collective][2 * shared + (nbytes < cma_from)]
    if until == POOL_SPAN:
        until = direct_from(collective, p, cores)
    if isinstance(start, HugeOnly):
        start = start.start if huge_only else None
    if start is None or (until is not None and nbytes >= until):
        return False
    return nbytes >= start if isinstance(start, int) else start.reached(nbytes, p, cores)


def one_fence_limit(p: int) -> int:
    """Bytes up to which allreduce and reduce take the one-fence path at p
    ranks (every rank's whole vector in the window; further bounded by the
    size of a half of the window)."""
    return max(SMALL_BYTES, SMALL_TOTAL_BYTES // p)


def reduce_one_fence_limit(p: int, cores: int) -> int:
    """Bytes up to which reduce takes the one-fence path at p ranks on
    ``cores`` cores (0: a core each): as allreduce's (:func:`one_fence_limit`)
    where ranks share cores, and up to a whole piece (:data:`PIECE_BYTES`)
    where each has its own. Only the root reads every vector, and it reads
    them while the others' copies are still in cache: 2 ranks, 1 MiB, 23 us
    against 50 us through pieces."""
    if cores and p > cores:
        return one_fence_limit(p)
    return max(one_fence_limit(p), PIECE_BYTES)


def direct_from(collective: str, p: int, cores: int) -> int:
    """Bytes from which ``collective`` at ``p`` ranks on ``cores`` cores (0:
    a core each) reads peers' buffers directly (see :data:`DIRECT_FROM`);
    ``COLLECTIVES_WINDOW_DIRECT_BYTES``, when set, replaces it for every
    collective (all ranks must agree)."""
    forced = config.get("WINDOW_DIRECT_BYTES")
    if forced is not None:
        return forced
    nbytes, power, _ = DIRECT_FROM[collective]
    per_core = -(-p // cores) if cores else 1
    return nbytes * per_core ** power if power >= 0 else nbytes // per_core ** -power


def wants_huge_pages(collective: str) -> bool:
    """Whether ``collective`` reads private buffers directly only when they lie
    in huge pages (not when ``COLLECTIVES_WINDOW_DIRECT_BYTES`` forces the size)."""
    return DIRECT_FROM[collective][2] and not config.is_set("WINDOW_DIRECT_BYTES")


def two_steps(nbytes: int, p: int, cores: int, from_bytes: int = ALLREDUCE_TWO_STEPS_FROM) -> bool:
    """Whether allreduce (reduce: ``from_bytes`` :data:`REDUCE_TWO_STEPS_FROM`)
    of ``nbytes`` at ``p`` ranks on ``cores`` cores (0: a core each) takes
    the compiled call of two steps, when its vector fits a half: from
    :data:`ALLREDUCE_TWO_STEPS_FROM` on, where ranks share cores. Each rank
    reduces 1/p of the vector, where allreduce's one-fence call has every
    rank reduce all of it (work the shared cores do p times over) and
    reduce's has the root alone reduce it (one core of the shared ones).
    Allreduce, 4 ranks on 2 cores: 64 KiB 25-27 -> 16-21 us, 256 KiB
    85-108 -> 39-51 us (the one-fence call), 1 MiB 248-322 -> 164-187 us
    (in pieces with two fences each); 3 ranks: 64 KiB 18-23 -> 11-12 us,
    1 MiB 178-267 -> 119-157 us; below 16 KiB within noise. Reduce, 4
    ranks: 128 KiB 25-66 -> 17-25 us, 512 KiB 173-178 -> 54-99 us; 3
    ranks: 128 KiB 23-41 -> 15-25 us; at 64 KiB within noise, below it no
    gain."""
    return bool(cores) and p > cores and nbytes >= from_bytes


def allreduce_two_steps(nbytes: int, p: int, cores: int) -> bool:
    """Whether allreduce of ``nbytes`` takes the compiled call of two steps
    (when its vector fits a half): where ranks share cores
    (:func:`two_steps`), and at 2 ranks from
    :data:`ALLREDUCE_TWO_STEPS_FROM` on even on cores of their own: each
    rank then reads and reduces half the vector rather than all of it, for
    one more fence. 2 ranks on 2 cores, the one-fence call against two
    steps: 16 KiB 1.70-1.96 -> 1.08-1.18 us, 32 KiB 3.0-3.2 -> 1.6-1.8, 64
    KiB 4.2-4.5 -> 3.0-3.3, 256 KiB 13.3-13.9 -> 10.5-10.9, 1 MiB 69-71 ->
    51-52 (out of place 93-96 -> 54-55), 2 MiB 121-133 -> 110-113; at 8
    KiB no change. More ranks than 2, each on its own core, were not
    measured (this machine has 2 cores)."""
    return two_steps(nbytes, p, cores) or (p == 2 and nbytes >= ALLREDUCE_TWO_STEPS_FROM)


def reduce_two_steps(nbytes: int, p: int, cores: int) -> bool:
    """Whether reduce of ``nbytes`` takes the compiled call of two steps
    (when its vector fits a half): where ranks share cores, from
    :data:`REDUCE_TWO_STEPS_FROM` on (:func:`two_steps`). At 2 ranks on
    cores of their own the root reducing alone was as fast or faster (64
    KiB to 512 KiB)."""
    return two_steps(nbytes, p, cores, REDUCE_TWO_STEPS_FROM)


def compiled_piece(largest: int, p: int, cores: int, pieced_from: int = PIECED_FROM, piece: int = PIECE) -> int:
    """Bytes a piece of a compiled call whose largest copy or reduction
    through the window is ``largest`` bytes, at ``p`` ranks on ``cores``
    cores (0: a core each); 0 to run it whole: below ``pieced_from``
    (:data:`PIECED_FROM`; allreduce's one-fence call passes
    :data:`ALLREDUCE_PIECED_FROM` and :data:`ALLREDUCE_PIECE`),
    and where ranks share cores (a reader would wait for a writer that is
    not running). A copy of 1 MiB or more no longer stays in the writer's
    cache for the reader; in pieces the reader takes each piece while it is
    there (2 ranks: bcast of 1 MiB 130 -> 38 us, of 2 MiB 255 -> 58-80 us;
    alltoall of 2 MiB 180 -> 80 us); below that, pieces gained nothing
    for the other collectives. Allreduce's one-fence call, where every rank
    reduces every vector, gains from 64 KiB in pieces of 32 KiB (2 ranks:
    64 KiB 5.6 -> 4.0-4.3 us, 128 KiB 10.7 -> 7.3-8.3 us where the machine
    was fast; 8.6 -> 8.1 us and 16.3 -> 14.6-15.3 us where it was slow).
    ``COLLECTIVES_WINDOW_PIECE_BYTES``, when set, makes every call of two
    pieces or more of that size run in pieces, on any cores (0: none)."""
    forced = config.get("WINDOW_PIECE_BYTES")
    if forced is not None:  # from two pieces on, whatever the cores (to measure, and for tests)
        return forced if forced > 0 and largest >= 2 * forced else 0
    if largest < pieced_from or (cores and p > cores):
        return 0
    return piece
