"""A seeded, randomized campaign of mismatched calls: no silent result, no
write outside a buffer.

    python -m collectives.bench.mismatch_fuzz [-n 2] [--transport shm] [--trials 10000] [--seed 1] [--kept 3]

starts P local ranks. In each trial every rank draws a call (collective,
algorithm, dtype, count, op, root; allreduce in place or out of place) from
the trial's seed; with probability one in four every rank makes rank 0's
call, otherwise each its own. The call runs on a fresh communicator, on
buffers with guard regions. With ``--kept K`` every rank first makes rank
0's call K times (agreed calls, each checked), so that the trial's call
meets a kept call (prepared, and from C where it is a compiled call); then
each rank makes rank 0's call again with probability one half, else its
own. Counted:

* silent: every rank returned, but their calls differed, or a result is wrong;
* outside: a guard region after some buffer was written;
* hung: a call ran into its timeout (each is 5 s; none should);
* caught: the ranks' calls differed and every rank raised (MismatchedCollective
  or BadArgument); a rank that only sent over messages may have returned
  and raised at its next call instead (counted as late);
* changed: of the caught trials where every rank ran the shared window,
  those where some buffer of some rank no longer held what it held before
  (the window moves nothing before every rank agreed);
* agreed: the same call everywhere, every rank correct;
* from_c: of the trials whose calls differed, those where some rank's call
  ran from C (a kept compiled call; only with ``--kept``).

Exits 1 if any trial was silent, wrote outside a buffer, changed one or hung.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Sequence

import numpy as np

from collectives.bench.faults import Spec, call, expected, fresh, named_algorithms

__all__ = ["main", "draw", "fuzz", "tally"]

COLLECTIVES = ("allreduce", "reduce", "bcast", "allgather", "gather", "scatter", "reduce_scatter", "alltoall",
               "barrier")
DTYPES = ("float32", "float64", "int32", "int64", "uint8", "float16")
COUNTS = (0, 1, 7, 64, 1000, 40_000, 300_000)
OPS = ("sum", "max", "min", "prod")
REDUCING = ("allreduce", "reduce", "reduce_scatter")
ROOTED = ("bcast", "reduce", "gather", "scatter")


def draw(rng: random.Random, p: int, capabilities: frozenset[str]) -> Spec:
    """A random call (the shared window twice as likely as any other algorithm)."""
    collective = rng.choice(COLLECTIVES)
    algos = named_algorithms(collective, capabilities)
    if "shared_window" in algos:
        algos.append("shared_window")
    spec = Spec(collective, rng.choice(algos), rng.choice(DTYPES), rng.choice(COUNTS), rng.choice(OPS),
                rng.randrange(min(p, 2)))
    return spec.with_(out=rng.random() < 0.5) if collective == "allreduce" else spec


def canonical(spec: Spec) -> tuple:
    """What of ``spec`` the ranks must agree on (what its signature holds)."""
    if spec.collective == "barrier":
        return ("barrier", spec.algorithm)
    return (spec.collective, spec.algorithm, spec.dtype, spec.count,
            spec.op if spec.collective in REDUCING else None, spec.root if spec.collective in ROOTED else None)


def fuzz(comm, seed: int, first: int, trials: int, timeout: float = 5.0, kept: int = 0) -> list[dict]:
    """Rank function: trials ``first`` .. ``first + trials - 1``; one record
    per trial (``kept``: agreed calls first, see the module docstring)."""
    caps = frozenset(comm.transport.capabilities)
    records = []
    for t in range(first, first + trials):
        agree = random.Random(f"{seed}:{t}").random() < 0.25
        spec = draw(random.Random(f"{seed}:{t}:{0 if agree else comm.rank}"), comm.size, caps)
        c = fresh(f"f{t}", timeout)
        warm = []
        if kept:
            agreed = draw(random.Random(f"{seed}:{t}:0"), comm.size, caps)
            warm = [_checked(c, agreed) for _ in range(kept)]
            if random.Random(f"{seed}:{t}:{comm.rank}:kept").random() < 0.5:
                spec = agreed
        hits = c._fast.hits
        got = _checked(c, spec)
        got["from_c"] = c._fast.hits > hits  # the call ran from C, as a kept compiled call
        got["next"] = call(c, Spec("barrier"))["outcome"] if got["outcome"] == "ok" else None
        got.update(trial=t, spec=canonical(spec), warm=[(w["outcome"], w["intact"], w["correct"]) for w in warm],
                   window=spec.algorithm == "shared_window" and comm.transport.name == "shm")
        records.append(got)
        c.close()
    return records


def _checked(c, spec: Spec) -> dict:
    """``spec``'s call on ``c``: its outcome, time, guards, and whether a result it returned is right."""
    got = call(c, spec)
    want = expected(spec, c.size, c.rank)
    correct = got["outcome"] != "ok" or want is None or np.array_equal(got["result"], want)
    return {"outcome": got["outcome"], "elapsed": got["elapsed"], "intact": got["intact"],
            "untouched": got["untouched"], "correct": bool(correct), "message": got["message"][:300]}


def tally(per_rank: Sequence[Sequence[dict]]) -> dict:
    """Counts over every trial (see the module docstring), and the bad trials."""
    counts = {"trials": 0, "agreed": 0, "caught": 0, "late": 0, "silent": 0, "outside": 0, "hung": 0,
              "changed": 0, "from_c": 0}
    bad = []
    for trial in zip(*per_rank):
        counts["trials"] += 1
        warm = _warm_fault(trial)
        if warm is not None:
            counts[warm] += 1
            bad.append((f"a kept call: {warm}", trial))
            continue
        same = len({tuple(r["spec"]) for r in trial}) == 1
        counts["from_c"] += not same and any(r.get("from_c") for r in trial)
        outcomes = [r["outcome"] for r in trial]
        if not all(r["intact"] for r in trial):
            counts["outside"] += 1
            bad.append(("outside", trial))
        if any(o == "CollectiveTimeout" for o in outcomes):
            counts["hung"] += 1
            bad.append(("hung", trial))
            continue
        if same and all(o == "ok" for o in outcomes):
            if all(r["correct"] for r in trial):
                counts["agreed"] += 1
            else:
                counts["silent"] += 1
                bad.append(("wrong result", trial))
        elif any(not r["correct"] for r in trial):
            counts["silent"] += 1
            bad.append(("wrong result", trial))
        elif all(o != "ok" or r["next"] not in (None, "ok") for o, r in zip(outcomes, trial)):
            counts["caught" if all(o != "ok" for o in outcomes) else "late"] += 1
            if all(r.get("window") for r in trial) and not all(r.get("untouched", True) for r in trial):
                counts["changed"] += 1  # the shared window moves nothing before every rank agreed
                bad.append(("a caught call changed a buffer", trial))
        else:
            counts["silent"] += 1
            bad.append(("returned without hearing", trial))
    return {"counts": counts, "bad": bad}


def _warm_fault(trial: Sequence[dict]) -> str | None:
    """What went wrong in a trial's agreed calls before its own (see
    ``kept``): ``hung``, ``outside`` (a guard written), ``silent`` (a wrong
    result, or ranks whose outcomes differ), or None."""
    warm = [[tuple(w) for w in r.get("warm", [])] for r in trial]
    calls = [c for w in warm for c in w]
    if any(outcome == "CollectiveTimeout" for outcome, _, _ in calls):
        return "hung"
    if not all(ok for _, ok, _ in calls):
        return "outside"
    if not all(right for _, _, right in calls) or len({tuple(w) for w in warm}) > 1:
        return "silent"
    return None


def rank_main(ns) -> int:
    import collectives

    comm = collectives.init(timeout=60)
    t0 = time.monotonic()
    records = fuzz(comm, ns.seed, 0, ns.trials, kept=ns.kept)
    gathered = _gather_json(comm, records)
    if comm.rank == 0:
        result = tally(gathered)
        c = result["counts"]
        print(f"{c['trials']} trials, {comm.size} ranks on {comm.transport.name}, seed {ns.seed}, "
              f"{ns.kept} kept calls first, "
              f"{time.monotonic() - t0:.0f} s: agreed {c['agreed']}, caught {c['caught']}, late {c['late']}, "
              f"silent {c['silent']}, outside {c['outside']}, changed {c['changed']}, hung {c['hung']}; "
              f"differing calls from C {c['from_c']}")
        for why, trial in result["bad"][:20]:
            print(f"  {why}: " + " | ".join(f"{r['spec']} -> {r['outcome']} {r['message'][:120]}" for r in trial))
        if ns.out:
            with open(ns.out, "w") as f:
                json.dump({"counts": c, "seed": ns.seed, "kept": ns.kept, "ranks": comm.size,
                           "transport": comm.transport.name}, f)
        status = 1 if c["silent"] or c["outside"] or c["changed"] or c["hung"] else 0
    else:
        status = 0
    comm.close()
    return status


def _gather_json(comm, records: list[dict]) -> list | None:
    """Every rank's records on rank 0 (as JSON bytes through the communicator)."""
    data = np.frombuffer(json.dumps(records).encode(), np.uint8)
    sizes = np.zeros(comm.size, np.int64)
    comm.allgather(np.array([data.size], np.int64), sizes)
    out = np.zeros(int(sizes.sum()), np.uint8) if comm.rank == 0 else None
    comm.gatherv(data, out, [int(s) for s in sizes], 0)
    if comm.rank != 0:
        return None
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [json.loads(out[bounds[i]:bounds[i + 1]].tobytes()) for i in range(comm.size)]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; starts the ranks unless run as one of them."""
    ap = argparse.ArgumentParser(prog="python -m collectives.bench.mismatch_fuzz",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--nprocs", type=int, default=2)
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--trials", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kept", type=int, default=0, help="agreed calls before each trial's call (kept calls)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.rank_main:
        return rank_main(ns)
    from collectives.launcher import launch

    cmd = [sys.executable, "-m", "collectives.bench.mismatch_fuzz", "--rank-main", "--trials", str(ns.trials),
           "--seed", str(ns.seed), "--kept", str(ns.kept)] + (["--out", ns.out] if ns.out else [])
    return launch(cmd, ns.nprocs, transport=ns.transport, prefix=False, timeout=ns.timeout)


if __name__ == "__main__":
    sys.exit(main())
