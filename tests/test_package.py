"""The package's public names load on first use: the launcher starts without
the library's numpy and algorithms, and every public name and submodule is
still there as before."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _python(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_launcher_imports_neither_numpy_nor_the_algorithms():
    got = _python("import json, sys, collectives, collectives.cli, collectives.launcher; "
                  "print(json.dumps(sorted(m for m in ('numpy', 'collectives.communicator', "
                  "'collectives.algorithms') if m in sys.modules)))")
    assert got == []


def test_every_public_name_and_submodule_is_there():
    got = _python("import json, collectives as c; "
                  "names = {n: type(getattr(c, n)).__name__ for n in c.__all__}; "
                  "print(json.dumps([names, c.signature.__name__, len(c.algorithms_for('allreduce')) > 1, "
                  "hasattr(c, 'no_such_name'), set(c.__all__) <= set(dir(c))]))")
    names, submodule, registered, missing, listed = got
    assert set(names) == set(__import__("collectives").__all__) and names["init"] == "function"
    assert submodule == "collectives.signature" and registered and not missing and listed


def test_a_missing_name_is_an_import_error():
    with pytest.raises(ImportError, match="no_such_name"):
        exec("from collectives import no_such_name")
