"""Which implementation a calibration anchor measured.

An anchor (:attr:`~.model.Params.anchors`) is one algorithm's measured
time; it holds only for the code that was measured. Calibration stores a
digest of each anchored algorithm's code beside its anchors, and loading a
profile drops the anchors whose algorithm's code has changed since (or
that carry no digest), so that ``auto`` never follows a measurement of
code that no longer runs. The digest covers the module that defines the
algorithm and, transitively, the modules of ``collectives.algorithms`` it
imports from (the shared window's helpers and tuning table, for example);
changes elsewhere (a transport, the compiled extension) call for a new
``collectives calibrate`` by hand.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import sys
from typing import Any, Iterable

__all__ = ["algorithm_digest", "anchor_digests", "drop_stale_anchors"]

_PACKAGE = "collectives.algorithms"


@functools.lru_cache(maxsize=None)
def _imports_within(module: str) -> frozenset[str]:
    """Modules of :data:`_PACKAGE` that ``module``'s source imports from."""
    source = _source(module)
    if source is None:
        return frozenset()
    found = set()
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                if node.level else (node.module or "")
            found.update([base] + [f"{base}.{a.name}" for a in node.names])  # a name may be a module
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return frozenset(n for n in found if n.startswith(_PACKAGE) and _source(n) is not None)


@functools.lru_cache(maxsize=None)
def _source(module: str) -> str | None:
    """The source text of ``module`` (imported already), or None where it has none."""
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None)
    if not path or not path.endswith(".py"):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


@functools.lru_cache(maxsize=None)
def algorithm_digest(collective: str, name: str) -> str | None:
    """A short digest of the code of algorithm ``name`` of ``collective``
    (see the module docstring), or None where it is not registered or its
    source cannot be read."""
    from collectives.registry import algorithms_for

    algo = algorithms_for(collective).get(name)
    if algo is None:
        return None
    first = getattr(algo.func, "__module__", None)
    if not first or _source(first) is None:
        return None
    seen, todo = set(), [first]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(_imports_within(module))
    h = hashlib.sha256()
    for module in sorted(seen):
        h.update(module.encode() + b"\0" + (_source(module) or "").encode() + b"\0")
    return h.hexdigest()[:16]


def anchor_digests(anchors: Iterable[tuple]) -> dict[str, str]:
    """``{"collective/algorithm": digest}`` of every algorithm in ``anchors``."""
    out = {}
    for c, a, *_ in anchors:
        digest = algorithm_digest(str(c), str(a))
        if digest is not None:
            out[f"{c}/{a}"] = digest
    return out


def drop_stale_anchors(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A profile's ``data`` without the anchors of algorithms whose code is
    not the code they measured (by ``anchor_digests``), and those algorithms'
    names ("collective/algorithm"), sorted."""
    anchors = data.get("anchors") or []
    if not anchors:
        return data, []
    stored = data.get("anchor_digests") or {}
    keep, stale = [], set()
    for t in anchors:
        key = f"{t[0]}/{t[1]}"
        digest = stored.get(key)
        if digest is not None and digest == algorithm_digest(str(t[0]), str(t[1])):
            keep.append(t)
        else:
            stale.add(key)
    return ({**data, "anchors": keep} if stale else data), sorted(stale)
