"""The cffi declarations of libibverbs match the installed <infiniband/verbs.h>.

A C program compiled at test time prints sizeof and offsetof of every struct
and field the bindings touch; cffi's view must agree byte for byte.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from collectives.transports import verbs

HEADER = "/usr/include/infiniband/verbs.h"
CC = shutil.which("cc") or shutil.which("gcc")

pytestmark = [
    pytest.mark.skipif(CC is None, reason="no C compiler to read the header's layout"),
    pytest.mark.skipif(not os.path.exists(HEADER),
                       reason="verbs.h not installed (apt-get install libibverbs-dev)"),
]


def _c_program() -> str:
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <infiniband/verbs.h>", "int main(void) {"]
    for ctype, fields in verbs.LAYOUT_CHECKS.items():
        if ctype not in verbs.PREFIX_ONLY:
            lines.append(f'  printf("sizeof {ctype} %zu\\n", sizeof({ctype}));')
        for f in fields:
            lines.append(f'  printf("offsetof {ctype}.{f} %zu\\n", offsetof({ctype}, {f}));')
    lines += ["  return 0;", "}"]
    return "\n".join(lines)


def _c_layout(tmp_path) -> dict[str, int]:
    src, exe = tmp_path / "layout.c", tmp_path / "layout"
    src.write_text(_c_program())
    subprocess.run([CC, str(src), "-o", str(exe)], check=True, capture_output=True, timeout=60)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=30).stdout
    return {key: int(value) for key, value in (line.rsplit(" ", 1) for line in out.splitlines())}


def _cffi_layout() -> dict[str, int]:
    ffi = verbs.ffi()
    got = {}
    for ctype, fields in verbs.LAYOUT_CHECKS.items():
        if ctype not in verbs.PREFIX_ONLY:
            got[f"sizeof {ctype}"] = ffi.sizeof(ctype)
        for f in fields:
            got[f"offsetof {ctype}.{f}"] = ffi.offsetof(ctype, f)
    return got


def test_every_struct_and_field_matches_the_header(tmp_path):
    c, py = _c_layout(tmp_path), _cffi_layout()
    assert c.keys() == py.keys()
    wrong = {k: (py[k], c[k]) for k in c if c[k] != py[k]}
    assert not wrong, f"cffi vs C (bytes): {wrong}"


def test_layout_covers_the_inline_functions_calls():
    """post_send, post_recv and poll_cq are called through context->ops."""
    assert {"poll_cq", "post_send", "post_recv"} <= set(verbs.LAYOUT_CHECKS["struct ibv_context_ops"])
