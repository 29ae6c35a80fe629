"""``ModelSelector``: the algorithm with the least predicted time.

Implements the :class:`collectives.selection.Selector` protocol. For a
collective, size, p, dtype and the transport's capabilities it predicts
every registered algorithm the transport can run (``needs`` a subset of the
capabilities) with the formulas of :mod:`collectives.cost_models` and the
parameters of the transport's calibration profile, and picks the least;
one predicted within :data:`TIE` of the library's rule's choice
(:data:`WINDOW_TIE` where that is the shared window) is a tie, and the
rule's choice runs. Decisions are cached per (collective, size
bucket, p, itemsize, capabilities); a bucket (a quarter of an octave) is
decided on its least size so that every rank decides alike, so the hot
path costs one dict lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from collectives.errors import BadArgument
from collectives.registry import algorithms_for
from collectives.selection import bucket_floor, rule, size_bucket
from collectives.window_contract import describe_cma_from

from .model import MODELS, Params, predict

__all__ = ["ModelSelector", "Explanation", "Candidate", "TIE", "WINDOW_TIE", "tie_for"]

#: Predictions this close (a fraction of the rule's) are a tie, which the
#: library's rule breaks: a 2-rank scatter of 64 MiB was predicted 3,489 us
#: over messages and 3,492 us through the window, and measured 4,885 and
#: 3,671. On the validation sweep (docs/performance.md) a tie of 2 % changes
#: no shared-memory choice and lowers TCP's mean regret from 1.2 to 1.1 %.
TIE = 0.02

#: Where the rule's choice is the shared window, predictions within this
#: much of its own are a tie. The window's time at large sizes follows the
#: host's state more than the message paths' do (its copies go from core
#: to core): a 2-rank alltoall of 64 MiB took 3.6-4.4 ms and 5.9-6.2 ms
#: through the window in runs minutes apart, pairwise 5.0-6.2 ms, and the
#: anchors of a calibration hold one of those states. On the validation
#: sweeps of shared memory (p = 2, 3, 4, 5, 8; 288 choices) a window tie of
#: 20 % changed 8 choices, all at 2 and 3 ranks and 1 MiB or more, and took
#: the mean regret from 1.15 to 0.64 % and the largest from 72 to 51 %
#: (docs/cost-models.md, "Ties").
WINDOW_TIE = 0.20


def tie_for(ruled_name: str) -> float:
    """The tie (a fraction) against the rule's choice ``ruled_name``."""
    return WINDOW_TIE if ruled_name == "shared_window" else TIE


def _tie(best: float, ruled: float, ruled_name: str) -> bool:
    """Whether a best prediction of ``best`` seconds ties with ``ruled``, the
    rule's choice's (``ruled_name``: :data:`WINDOW_TIE` for the shared window)."""
    return best >= (1.0 - tie_for(ruled_name)) * ruled


@dataclass(frozen=True)
class Candidate:
    """One algorithm's prediction.

    Attributes:
        name: the algorithm.
        seconds: predicted time (inf when the transport cannot run it).
        runnable: whether the transport offers what it needs.
        needs: capabilities it needs.
        formula: one line of its cost model.
    """

    name: str
    seconds: float
    runnable: bool
    needs: frozenset[str]
    formula: str


@dataclass(frozen=True)
class Explanation:
    """Why an algorithm is chosen.

    Attributes:
        collective, nbytes, p, dtype: the call.
        params: the parameters used.
        candidates: every algorithm, fastest first (runnable before others).
        choice: the chosen algorithm.
    """

    collective: str
    nbytes: int
    p: int
    dtype: str
    params: Params
    candidates: list[Candidate]
    choice: str
    how: str = ""  # what auto follows (set by collectives explain): the models with which profile, or the rule

    def table(self) -> str:
        """A printable table of the candidates and the parameters."""
        P = self.params
        lines = [f"{self.collective}: {self.nbytes} bytes, {self.p} ranks, {self.dtype}",
                 f"params ({P.source}): a message {P.messages()}, gamma={P.gamma * 1e9:.4f} ns/B, "
                 f"memory {P.mem_bandwidth / 1e9:.2f} GB/s, fence={P.fence * 1e6:.2f} us, "
                 f"overhead={P.overhead * 1e6:.2f} us/msg, call={P.call * 1e6:.2f} us, "
                 f"cores={P.cores or 'one per rank'}, "
                 f"{describe_cma_from(P.cma_from) + ', ' if P.cma_from else ''}"
                 f"segment={P.segment_bytes} B",
                 f"{'algorithm':40s} {'predicted':>14s}  formula"]
        for c in self.candidates:
            t = f"{c.seconds * 1e6:11.2f} us" if c.runnable else f"{'(needs ' + ','.join(sorted(c.needs)) + ')':>14s}"
            mark = "*" if c.name == self.choice else " "
            lines.append(f"{mark}{c.name:39s} {t}  {c.formula}")
        modelled = min((c for c in self.candidates if c.runnable and c.name != "native"),
                       key=lambda c: c.seconds, default=None)
        if modelled is not None and modelled.name != self.choice:
            chosen = next(c for c in self.candidates if c.name == self.choice)
            why = (f"a tie: {modelled.name} is predicted within {tie_for(chosen.name):.0%} of the rule's choice"
                   if chosen.runnable and _tie(modelled.seconds, chosen.seconds, chosen.name)
                   else f"the cost models would take {modelled.name}")
            lines.append(f"choice: {self.choice} ({why})")
        else:
            lines.append(f"choice: {self.choice}")
        if self.how:
            lines.append(self.how)
        return "\n".join(lines)


class ModelSelector:
    """Picks the algorithm with the least predicted time.

    Args:
        params: model parameters; default: the calibration profile of
            ``transport`` (see :func:`collectives.cost_models.profile.load_profile`),
            or the documented defaults.
        transport: name of the transport whose profile to load.
    """

    def __init__(self, params: Params | None = None, transport: str | None = None) -> None:
        if params is None:
            from .profile import load_profile

            params = load_profile(transport or "shm")
        self.params = params
        self.transport = transport
        self._cache: dict[tuple, str] = {}

    def choose(self, collective: str, nbytes: int, p: int, dtype: np.dtype,
               capabilities: frozenset[str]) -> str:
        """Name of the algorithm to run (see :class:`collectives.selection.Selector`)."""
        dtype = np.dtype(dtype)
        key = (collective, size_bucket(nbytes), p, dtype.itemsize, capabilities)
        name = self._cache.get(key)
        if name is None:
            name = self.explain(collective, bucket_floor(key[1]), p, dtype, capabilities).choice
            self._cache[key] = name
        return name

    def explain(self, collective: str, nbytes: int, p: int, dtype: Any = np.float32,
                capabilities: frozenset[str] | None = None) -> Explanation:
        """Every candidate's predicted time and the choice.

        Args:
            collective: the collective.
            nbytes: message size (the selector's convention).
            p: number of ranks.
            dtype: element type.
            capabilities: the transport's capabilities (default: none).

        Returns:
            An :class:`Explanation`.
        """
        from . import _load

        _load()
        capabilities = frozenset(capabilities or ())
        dtype = np.dtype(dtype)
        cands = []
        for algo in algorithms_for(collective).values():
            runnable = algo.needs <= capabilities
            model = MODELS.get((collective, algo.name))
            seconds = predict(collective, algo.name, p, nbytes, self.params, dtype) if model else float("inf")
            cands.append(Candidate(algo.name, seconds if runnable else float("inf"), runnable, algo.needs,
                                   model.summary if model else "(no cost model)"))
        runnable = [c for c in cands if c.runnable]
        if not runnable:
            raise BadArgument(f"no {collective} algorithm can run on a transport offering "
                              f"{sorted(capabilities) or 'no capabilities'}")
        # The transport's own collective is a baseline, never the automatic choice.
        pool = [c for c in runnable if c.name != "native"] or runnable
        best = min(pool, key=lambda c: c.seconds)
        choice = best.name
        ruled = next((c for c in pool if c.name == rule(collective, int(nbytes), p, dtype.itemsize, capabilities)),
                     None)
        if ruled is not None and _tie(best.seconds, ruled.seconds, ruled.name):
            choice = ruled.name  # a tie (predictions err by ~9 %): the rule's choice, which was measured
        cands.sort(key=lambda c: (not c.runnable, c.seconds))
        return Explanation(collective, int(nbytes), int(p), dtype.name, self.params, cands, choice)
