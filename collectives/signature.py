"""Call signatures: what every rank says it is doing, checked before data moves.

Every collective call carries a signature: its sequence number, the
collective, the algorithm, the reduction op, the root, the dtype, the
element count and, for the v-collectives, a digest of the counts. It packs
into three 64-bit words (:data:`Sig`) that travel in every message header
and sit beside every shared-window post, so checking costs a compare of
three integers:

* word 0: ``refused:1 | seq:23 | collective:4 | op:4 | dtype:8 | algorithm:8 | root:16``
* word 1: the element count (the same on every rank: see :func:`count_of`)
* word 2: the v-counts (0 for the even collectives): the counts themselves
  where they fit (top bit set, then the number of ranks in 7 bits, then
  each count in an equal share of the other 56 bits), else a 63-bit hash;
  either way a mismatch names the counts where they can be known
  (:func:`counts_of`)

``refused`` marks a root that refused its own arguments (a gather's receive
buffer too small, say): the call is then refused on every rank
(:class:`~collectives.errors.BadArgument`) and nothing is exchanged.

Transports compare a message's signature with the receive's through
:func:`check_message`; the shared window compares every rank's through
:func:`check_all`. Both name every disagreeing field and rank.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from .errors import BadArgument, MismatchedCollective

__all__ = ["Sig", "NO_SIG", "checks_enabled", "REFUSED", "SEQ_BITS", "make", "with_seq", "refused", "fields",
           "describe", "check_message", "check_all", "out_of_step", "counts_digest", "counts_of", "dtype_code",
           "seq_of_tag", "agreement", "is_agreement", "AGREEMENT"]

#: Three 64-bit words (see the module docstring); a plain tuple, compared with ``!=``.
Sig = tuple

#: The signature of a point-to-point message: never checked.
NO_SIG: Sig = (0, 0, 0)

REFUSED = 1 << 63
SEQ_BITS = 23
SEQ_SHIFT = 40
SEQ_MASK = (1 << SEQ_BITS) - 1
_SEQ_FIELD = SEQ_MASK << SEQ_SHIFT
_U64 = (1 << 64) - 1

# The collectives in a fixed order (codes 1..9; 0: a point-to-point message).
_COLLECTIVES = ("bcast", "scatter", "gather", "allgather", "reduce", "allreduce",
                "reduce_scatter", "alltoall", "barrier")
_COLLECTIVE_CODE = {c: i + 1 for i, c in enumerate(_COLLECTIVES)}
_OPS = ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor", "land", "lor")
_OP_CODE = {o: i + 1 for i, o in enumerate(_OPS)}
_OP_OTHER = 15  # a user-defined op


def _dtype_table() -> dict[np.dtype, int]:
    names = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
             "float16", "float32", "float64", "longdouble", "complex64", "complex128", "clongdouble"]
    table = {np.dtype(n): i + 1 for i, n in enumerate(names)}
    try:
        import ml_dtypes

        table[np.dtype(ml_dtypes.bfloat16)] = len(names) + 1
    except ImportError:  # pragma: no cover - a declared dependency
        pass
    return table


_DTYPE_CODE = _dtype_table()
_DTYPE_NAME = {code: str(dt) for dt, code in _DTYPE_CODE.items()}
_DTYPE_BY_NAME = {str(dt): dt for dt in _DTYPE_CODE}
_DTYPE_OTHER = 255


def checks_enabled() -> bool:
    """Whether calls carry and check signatures: ``COLLECTIVES_SIGNATURE_CHECKS=0``
    turns them off, for measuring what they cost (never for real work:
    mismatched calls then go unnoticed)."""
    from . import config

    return bool(config.get("SIGNATURE_CHECKS"))


def dtype_code(dtype: np.dtype | None) -> int:
    """The 8-bit code of ``dtype`` (0: none, 255: one without a code)."""
    if dtype is None:
        return 0
    return _DTYPE_CODE.get(dtype, _DTYPE_OTHER)


def itemsize_of(sig: Sig) -> int:
    """Bytes per element of the dtype in ``sig`` (0 when it has none or one without a code)."""
    code = (sig[0] >> 24) & 0xFF
    name = _DTYPE_NAME.get(code)
    return np.dtype(_DTYPE_BY_NAME[name]).itemsize if name else 0


def algorithm_code(name: str) -> int:
    """The 8-bit code of an algorithm's name (1..255)."""
    return zlib.crc32(name.encode()) % 255 + 1


_LITERAL = 1 << 63
_LITERAL_BITS = 56
#: Hashed counts this process made, by digest, so that its messages can name
#: them (the newest few: a peer's hashed counts cannot be told).
_HASHED: dict[int, tuple[int, ...]] = {}
_HASHED_KEPT = 64


def counts_digest(counts: Sequence[int] | None) -> int:
    """Word 2 of a signature for v-collective ``counts`` (0 for None): the
    counts themselves when they fit (see the module docstring), else a
    63-bit hash of them."""
    if counts is None:
        return 0
    n = len(counts)
    if 0 < n < 128:
        width = _LITERAL_BITS // n
        if width and all(0 <= c < (1 << width) for c in counts):
            word = _LITERAL | (n << _LITERAL_BITS)
            for i, c in enumerate(counts):
                word |= int(c) << (i * width)
            return word
    data = np.asarray(counts, dtype=np.int64).tobytes()
    digest = ((zlib.crc32(data) << 32) | zlib.crc32(data, 0x5BD1E995)) & ~_LITERAL or 1
    if digest not in _HASHED:
        if len(_HASHED) >= _HASHED_KEPT:
            del _HASHED[next(iter(_HASHED))]
        _HASHED[digest] = tuple(int(c) for c in counts)
    return digest


def counts_of(digest: int) -> tuple[int, ...] | None:
    """The counts of word 2 of a signature, where they can be known: always
    when they fit in it, and hashed ones this process made; else None."""
    if digest & _LITERAL:
        n = (digest >> _LITERAL_BITS) & 0x7F
        width = _LITERAL_BITS // n if n else 0
        if not width:
            return None
        mask = (1 << width) - 1
        return tuple((digest >> (i * width)) & mask for i in range(n))
    return _HASHED.get(digest)


def make(collective: str, algorithm: str, op: str | None = None, root: int | None = None,
         dtype: np.dtype | None = None, count: int = 0, counts: Sequence[int] | None = None) -> Sig:
    """The signature of a call, without its sequence number (see :func:`with_seq`).

    Args:
        collective: one of the nine collectives.
        algorithm: the algorithm's name (as every rank must have chosen it).
        op: the user's reduction op name (``avg`` stays ``avg``), or None.
        root: the root rank of a rooted collective, or None.
        dtype: the element type, or None (barrier).
        count: the element count every rank must agree on (:func:`count_of`).
        counts: the v-collectives' counts (every rank must pass the same).
    """
    op_code = 0 if op is None else _OP_CODE.get(op, _OP_OTHER)
    w0 = ((_COLLECTIVE_CODE[collective] << 36) | (op_code << 32) | (dtype_code(dtype) << 24)
          | (algorithm_code(algorithm) << 16) | ((0 if root is None else root + 1) & 0xFFFF))
    return (w0, int(count) & _U64, counts_digest(counts))


def with_seq(sig: Sig, seq: int) -> Sig:
    """``sig`` for call number ``seq``."""
    return (sig[0] & ~_SEQ_FIELD) | ((seq & SEQ_MASK) << SEQ_SHIFT), sig[1], sig[2]


def refused(sig: Sig) -> Sig:
    """``sig`` marked as refused by its root."""
    return (sig[0] | REFUSED, sig[1], sig[2])


#: Word 2 of the header of a rooted call's signature check over messages
#: (see :func:`agreement`; the v-counts' word of a real call is this one
#: with odds of 2**-63).
AGREEMENT = 0x7F00_0000_0000_0000
_AGREEMENT_KEEP = _SEQ_FIELD | (0xF << 36)


def agreement(sig: Sig) -> Sig:
    """The header of the messages of call ``sig``'s signature check (a rooted
    call over messages starts by gathering every rank's signature, see the
    communicator's execution): only the call number and the collective, so
    that ranks in that same check exchange their records whatever else they
    disagree about, and a rank in another call or collective fails at once."""
    return (sig[0] & _AGREEMENT_KEEP, 0, AGREEMENT)


def is_agreement(sig: Sig) -> bool:
    """Whether ``sig`` is the header of a signature check (:func:`agreement`)."""
    return sig[2] == AGREEMENT and sig[1] == 0 and not sig[0] & ~_AGREEMENT_KEEP


def seq_of_tag(tag: int) -> int:
    """The call number of a collective message's tag (tags are 2 * seq + 1)."""
    return tag >> 1


def fields(sig: Sig, algorithms: dict[int, str] | None = None) -> dict[str, object]:
    """The fields of ``sig``, decoded (names where known)."""
    w0, count, digest = sig
    coll = (w0 >> 36) & 0xF
    op = (w0 >> 32) & 0xF
    root = w0 & 0xFFFF
    collective = _COLLECTIVES[coll - 1] if 1 <= coll <= len(_COLLECTIVES) else "point-to-point"
    names = algorithms if algorithms is not None else _algorithm_names(collective)
    algo = (w0 >> 16) & 0xFF
    check = digest == AGREEMENT and not count and not w0 & ~_AGREEMENT_KEEP
    return {
        "seq": (w0 >> SEQ_SHIFT) & SEQ_MASK,
        "collective": collective,
        "algorithm": "signature check" if check else names.get(algo, f"#{algo}"),
        "op": None if op == 0 else (_OPS[op - 1] if op <= len(_OPS) else "user-defined"),
        "root": None if root == 0 else root - 1,
        "dtype": None if not (w0 >> 24) & 0xFF else _DTYPE_NAME.get((w0 >> 24) & 0xFF, "another dtype"),
        "count": count,
        "counts": digest,
        "refused": bool(w0 & REFUSED),
    }


def _algorithm_names(collective: str) -> dict[int, str]:
    from .registry import algorithms_for

    try:
        return {algorithm_code(n): n for n in algorithms_for(collective)}
    except Exception:  # an unknown collective: no names
        return {}


def describe(sig: Sig) -> str:
    """``sig`` in words: ``allreduce #412 (ring): sum of float32 x 1048576``."""
    f = fields(sig)
    if f["algorithm"] == "signature check" and is_agreement(sig):
        return f"{f['collective']} #{f['seq']} (checking every rank's signature)"
    what = f"{f['dtype']} x {f['count']}" if f["dtype"] else f"{f['count']} elements"
    parts = [f"{f['collective']} #{f['seq']} ({f['algorithm']})"]
    detail = what if f["collective"] != "barrier" else ""
    if f["op"]:
        detail = f"{f['op']} of {what}"
    if f["root"] is not None:
        detail += f" to/from root {f['root']}"
    return parts[0] + (": " + detail if detail else "")


_FIELD_ORDER = ("seq", "collective", "algorithm", "op", "root", "dtype", "count", "counts")


def _value(name: str, v: object) -> str:
    if name == "counts":
        if not v:
            return "no v-counts"
        counts = counts_of(v)
        return str(list(counts)) if counts is not None else f"other counts (digest {v:#x})"
    if name == "seq":
        return f"call #{v}"
    return "none" if v is None else str(v)


def _differences(a: dict, b: dict) -> list[str]:
    return [k for k in _FIELD_ORDER if a[k] != b[k]]


def check_message(mine: Sig, theirs: Sig, rank: int, peer: int) -> Exception | None:
    """The error of a message with signature ``theirs`` from ``peer`` arriving
    at a receive with ``mine`` on ``rank`` (None when they agree). A message
    marked refused gives :class:`BadArgument`; any other difference
    :class:`MismatchedCollective` naming each field with both values."""
    if mine[1] == theirs[1] and mine[2] == theirs[2] and (mine[0] ^ theirs[0]) & ~REFUSED == 0:
        if theirs[0] & REFUSED:
            return BadArgument(f"rank {rank}: {describe(mine)} was refused by its root, rank {peer}")
        return None
    return MismatchedCollective(_pair_text(mine, theirs, rank, peer))


def _pair_text(mine: Sig, theirs: Sig, rank: int, peer: int) -> str:
    a, b = fields(mine), fields(theirs)
    head = f"{a['collective']} #{a['seq']}"
    if is_agreement(mine) or is_agreement(theirs):  # a signature check meets a call's data, or another check
        diffs = [k for k in ("seq", "collective", "algorithm") if a[k] != b[k]]
        said = "; ".join(f"{k}: rank {peer} has {_value(k, b[k])}, rank {rank} has {_value(k, a[k])}"
                         for k in diffs)
        return f"{head}: ranks disagree ({said}); rank {peer} is in {describe(theirs)}"
    diffs = _differences(a, b) or ["signature"]
    if diffs == ["dtype"] or diffs == ["count"] or diffs == ["dtype", "count"]:
        return (f"{head}: rank {peer} has {b['dtype']} x {b['count']}, "
                f"rank {rank} has {a['dtype']} x {a['count']}")
    said = "; ".join(f"{k}: rank {peer} has {_value(k, b[k])}, rank {rank} has {_value(k, a[k])}"
                     for k in diffs)
    return f"{head}: ranks disagree ({said}); rank {peer} is in {describe(theirs)}"


def check_all(sigs: Sequence[Sig], rank: int, reasons: dict[int, str] | None = None,
              ranks: Sequence[int] | None = None) -> Exception | None:
    """The verdict on every rank's signature of one call (the same on every
    rank that sees the same list): None when they all agree; BadArgument
    when a root refused (with its ``reasons`` where known); otherwise
    MismatchedCollective naming each disagreeing field and which ranks have
    which value. ``ranks``: the rank of each signature, where ``sigs`` are
    not every rank's in order."""
    first = sigs[0]
    if all(s == first for s in sigs) and not first[0] & REFUSED:
        return None
    ranks = range(len(sigs)) if ranks is None else ranks
    plain = [(s[0] & ~REFUSED, s[1], s[2]) for s in sigs]
    refusers = [r for r, s in zip(ranks, sigs) if s[0] & REFUSED]
    decoded = [fields(s) for s in plain]
    differ = [k for k in _FIELD_ORDER if len({str(f[k]) for f in decoded}) > 1]
    head = (f"{decoded[0]['collective']} #{decoded[0]['seq']}" if "collective" not in differ
            else f"call #{decoded[0]['seq']}")
    if set(differ) <= {"dtype", "count"}:  # the common case, said the short way
        said = _groups([f"{f['dtype']} x {f['count']}" for f in decoded], ranks)
    else:
        said = "ranks disagree: " + "; ".join(f"{k}: " + _groups([_value(k, f[k]) for f in decoded], ranks)
                                              for k in differ)
    if refusers:  # a refusal comes first: nothing was exchanged, every rank raises it alike
        why = "; ".join(f"rank {r} refused it: {(reasons or {}).get(r) or 'its arguments are invalid'}"
                        for r in refusers)
        return BadArgument(f"{head}: {why}" + (f" (and {said})" if differ else ""))
    return MismatchedCollective(f"{head}: {said}")


def _groups(values: Sequence[str], ranks: Sequence[int]) -> str:
    """``rank 1 has a, ranks 0, 2 have b``: the ranks of each value, fewest first."""
    by: dict[str, list[int]] = {}
    for r, v in zip(ranks, values):
        by.setdefault(v, []).append(r)
    ordered = sorted(by.items(), key=lambda kv: (len(kv[1]), kv[1][0]))
    return ", ".join((f"rank {rs[0]} has" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs)) + " have")
                     + f" {v}" for v, rs in ordered)


def out_of_step(rank: int, peer: int, waiting_tag: int, arrived_tag: int, arrived: Sig) -> MismatchedCollective:
    """A message from ``peer`` for another call arrived while ``rank`` waits for
    one of call ``seq_of_tag(waiting_tag)`` from it: messages between two ranks
    keep their order, so ``peer`` will never send it (it skipped or added a
    call, or ran another algorithm)."""
    want, got = seq_of_tag(waiting_tag) & SEQ_MASK, seq_of_tag(arrived_tag) & SEQ_MASK
    what = describe(arrived) if arrived != NO_SIG else f"call #{got}"
    return MismatchedCollective(
        f"call #{want}: rank {rank} waits for a message of call #{want} from rank {peer}, but rank {peer} "
        f"sent one of {what} instead (it skipped or added a call, or ran another algorithm)")
