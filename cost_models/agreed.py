"""The selector every rank's ``algorithm="auto"`` follows, agreed at init.

``COLLECTIVES_SELECTOR`` (default ``auto``):

* ``auto``: where rank 0 has a calibration profile of the job's transport
  (``collectives calibrate``; see :mod:`.profile`), every rank chooses by
  the cost models with rank 0's profile (:class:`~.selector.ModelSelector`);
  where it has none, by the size-and-ranks rule
  (:class:`~collectives.selection.RuleSelector`);
* ``model``: the cost models, with rank 0's profile or the defaults;
* ``rule``: the rule, and no exchange at init.

Rank 0 reads its profile and passes it to every rank at init
(:func:`collectives.bootstrap.from_rank_zero`), so every rank chooses
alike although hosts may hold different profiles, or none. The rank-0
profile's origin ends up in ``params.source`` ("PATH on HOST, rank 0's"),
which ``comm.explain``, the init log line and ``collectives explain`` show.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import replace
from typing import Any

from collectives import config
from collectives.bootstrap import PROFILE_TAG, from_rank_zero
from collectives.selection import RuleSelector

from .profile import DEFAULTS, GENERIC, find_profile, read_profile

__all__ = ["agreed_selector", "local_selector", "how_auto_chooses", "explain_choice"]


def _rank_zero_profile(transport: str) -> bytes:
    """Rank 0's profile of ``transport`` as JSON (empty when it has none)."""
    path = find_profile(transport)
    data = read_profile(path, f"{path} on {socket.gethostname()}, rank 0's") if path is not None else None
    return b"" if data is None else json.dumps(data).encode()


def _selector(transport: str, profile: bytes, mode: str, cma_from: int | None = None) -> Any:
    """The model with ``profile`` (else the defaults where ``mode`` asks for
    the model), else the rule; ``cma_from``: the open transport's copy race
    (the same on every rank), which replaces the profile's."""
    from .model import Params
    from .selector import ModelSelector

    if profile:
        params = Params.from_dict(json.loads(profile))
    elif mode == "model":
        params = DEFAULTS.get(transport, GENERIC)
    else:
        return RuleSelector()
    if cma_from is not None:
        params = replace(params, cma_from=cma_from)
    return ModelSelector(params, transport=transport)


def agreed_selector(t: Any, transport: str, timeout: float) -> Any:
    """The selector of every rank of the job over the open transport ``t``
    (registered as ``transport``): see the module docstring.

    Raises:
        CollectiveTimeout, PeerLost: a rank did not take part in time, or died.
    """
    mode = config.get("SELECTOR")
    if mode == "rule":
        return RuleSelector()
    profile = (_rank_zero_profile(transport) if t.size == 1 else
               from_rank_zero(t, lambda: _rank_zero_profile(transport), PROFILE_TAG, time.monotonic() + timeout))
    # the window's paths follow the race of this job, not the profile's
    return _selector(transport, profile, mode, getattr(t, "cma_from", None))


def local_selector(transport: str) -> Any:
    """The selector a job's ``auto`` would follow if this host were rank 0's."""
    mode = config.get("SELECTOR")
    if mode == "rule":
        return RuleSelector()
    return _selector(transport, _rank_zero_profile(transport), mode)


def how_auto_chooses(selector: Any, transport: str) -> str:
    """One line: what ``auto`` follows (the model, with which profile; or the rule, and why)."""
    params = getattr(selector, "params", None)
    if params is not None:
        return f"auto follows the cost models, with {params.source}"
    if config.get("SELECTOR") == "rule":
        return "auto follows the rule (COLLECTIVES_SELECTOR=rule)"
    return (f"auto follows the rule: no calibration profile of {transport} on rank 0's host "
            f"(`collectives calibrate --transport {transport}` makes one)")


def explain_choice(selector: Any, transport: str, collective: str, nbytes: int, p: int, dtype: Any,
                   capabilities: frozenset[str]) -> Any:
    """Every candidate's predicted time (with ``selector``'s profile, else
    the transport's defaults) and what ``auto`` runs under ``selector``, with why.

    Returns:
        An :class:`~.selector.Explanation` whose ``choice`` is what ``auto`` runs.
    """
    from dataclasses import replace

    import numpy as np

    from .selector import ModelSelector

    model = selector if isinstance(selector, ModelSelector) else ModelSelector(DEFAULTS.get(transport, GENERIC),
                                                                                transport)
    found = model.explain(collective, nbytes, p, dtype, capabilities)
    choice = selector.choose(collective, nbytes, p, np.dtype(dtype), capabilities)
    return replace(found, choice=choice, how=f"auto runs {choice}: {how_auto_chooses(selector, transport)}")
