"""The JAX adapter on real processes: pytree allreduce between steps and inside
``jit`` give the same parameters as a single-process step on the whole batch.

Each test starts one job (``collectives run``) whose ranks run this file as a
script; every rank prints one ``RESULT`` line with the checks that failed.
"""

from __future__ import annotations

import json
import os
import shutil
import traceback

import pytest

from launched import collectives_run, environment_without, run_checked

HERE = os.path.abspath(__file__)
DEADLINE = 150  # the first job builds the FFI target (about 30 s)
PER_RANK, STEPS, LR = 4, 4, 0.1

# ---------------------------------------------------------------------- rank side


def _problem(jax, jnp, p):
    key = jax.random.PRNGKey(0)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    params = {"w1": jax.random.normal(k1, (6, 8)) * 0.3, "b1": jnp.zeros(8),
              "out": [jax.random.normal(k2, (8, 2)) * 0.3, jnp.zeros(2)]}
    xs = jax.random.normal(k3, (STEPS, p * PER_RANK, 6))
    ys = jax.random.normal(k4, (STEPS, p * PER_RANK, 2))

    def loss(prm, x, y):
        h = jnp.tanh(x @ prm["w1"] + prm["b1"])
        return jnp.mean((h @ prm["out"][0] + prm["out"][1] - y) ** 2)

    return params, xs, ys, loss


def _sgd(jax, params, grads):
    return jax.tree_util.tree_map(lambda a, g: a - LR * g, params, grads)


def _max_diff(jax, a, b):
    import numpy as np

    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def check_training(jax, jnp, comm):
    """Between-steps and in-jit allreduce against single-process training."""
    import collectives.integrations.jax as cj

    r, p = comm.rank, comm.size
    params, xs, ys, loss = _problem(jax, jnp, p)
    grad = jax.grad(loss)
    ref = params
    for s in range(STEPS):
        ref = _sgd(jax, ref, grad(ref, xs[s], ys[s]))
    local = slice(r * PER_RANK, (r + 1) * PER_RANK)
    fails = []

    eager = params
    for s in range(STEPS):
        g = cj.allreduce_tree(grad(eager, xs[s, local], ys[s, local]), comm, bucket_cap_mb=0.0005)
        eager = _sgd(jax, eager, g)
    if _max_diff(jax, eager, ref) > 1e-5:
        fails.append(f"allreduce_tree: differs by {_max_diff(jax, eager, ref):.3g}")

    @jax.jit
    def step(prm, x, y):
        return _sgd(jax, prm, cj.allreduce_tree_in_jit(grad(prm, x, y), comm))

    jitted = params
    for s in range(STEPS):
        jitted = step(jitted, xs[s, local], ys[s, local])
    if _max_diff(jax, jitted, ref) > 1e-5:
        fails.append(f"allreduce_tree_in_jit: differs by {_max_diff(jax, jitted, ref):.3g}")
    return fails


def check_dtypes(jax, jnp, comm):
    """bfloat16, float16 and int leaves, mixed in one tree; the sum op."""
    import collectives.integrations.jax as cj

    r, p = comm.rank, comm.size
    tree = {"bf16": jnp.full((5,), r + 1, jnp.bfloat16), "f16": jnp.full((3, 2), 0.5 * (r + 1), jnp.float16),
            "i32": (jnp.arange(4, dtype=jnp.int32) * (r + 1),)}
    out = cj.allreduce_tree(tree, comm, op="sum")
    total = p * (p + 1) / 2
    fails = []
    if not bool(jnp.all(out["bf16"] == total)) or out["bf16"].dtype != jnp.bfloat16:
        fails.append(f"bf16 leaf: {out['bf16']}")
    if not bool(jnp.all(out["f16"] == 0.5 * total)) or out["f16"].dtype != jnp.float16:
        fails.append(f"f16 leaf: {out['f16']}")
    if not bool(jnp.all(out["i32"][0] == jnp.arange(4) * total)):
        fails.append(f"i32 leaf: {out['i32']}")
    return fails


def check_in_jit(jax, jnp, comm):
    """Inside jit: mixed dtypes in one tree, two calls in one function (kept
    in order on every rank), a leaf of each size class, and which path ran."""
    import collectives.integrations.jax as cj

    r, p = comm.rank, comm.size
    total = p * (p + 1) / 2
    fails = []

    @jax.jit
    def mixed(tree):
        return cj.allreduce_tree_in_jit(tree, comm, op="sum")

    tree = {"bf16": jnp.full((5,), r + 1, jnp.bfloat16), "f16": jnp.full((3, 2), 0.5 * (r + 1), jnp.float16),
            "i32": (jnp.arange(4, dtype=jnp.int32) * (r + 1),), "big": jnp.full((70000,), r + 1.0, jnp.float32),
            "f32": jnp.full((2, 3), r + 1.0, jnp.float32)}
    for _ in range(3):  # the same compiled function again: prepared calls
        out = mixed(tree)
        if not bool(jnp.all(out["bf16"] == total)) or out["bf16"].dtype != jnp.bfloat16:
            fails.append(f"in jit, bf16 leaf: {out['bf16']}")
        if not bool(jnp.all(out["f16"] == 0.5 * total)) or out["f16"].shape != (3, 2):
            fails.append(f"in jit, f16 leaf: {out['f16']}")
        if not bool(jnp.all(out["i32"][0] == jnp.arange(4) * total)):
            fails.append(f"in jit, i32 leaf: {out['i32']}")
        if not (bool(jnp.all(out["big"] == total)) and bool(jnp.all(out["f32"] == total))):
            fails.append("in jit, float32 leaves wrong")
        if not bool(jnp.all(tree["big"] == r + 1.0)):
            fails.append("in jit, the input array changed")

    @jax.jit
    def twice(x):
        y = cj.allreduce_tree_in_jit(x * 2.0, comm, op="sum")
        z = cj.allreduce_tree_in_jit(x + 1.0, comm, op="max")
        return y, z

    y, z = twice(jnp.full((7,), r + 1.0))
    if not (bool(jnp.all(y == 2 * total)) and bool(jnp.all(z == p + 1.0))):
        fails.append(f"two calls in one jit: {y}, {z}")

    @jax.jit
    def looped(x, flag):
        x = jax.lax.fori_loop(0, 3, lambda i, x: cj.allreduce_tree_in_jit(x, comm, op="sum") / p + 1.0, x)
        return jax.lax.cond(flag, lambda x: cj.allreduce_tree_in_jit(x, comm, op="max"), lambda x: -x, x)

    mean = (p - 1) / 2  # of the ranks' starting values
    want = ((mean + 1.0) + 1.0) + 1.0
    got = looped(jnp.full((4,), float(r)), True)
    if not bool(jnp.allclose(got, want)):
        fails.append(f"in a loop and a cond: {got}, want {want}")
    return fails


def check_mismatch_in_jit(jax, jnp, comm):
    """One rank's in-jit allreduce has another size: every rank raises, and
    the error names the rank, the collective and its number, and both sizes.
    The value is computed in the function, so the call and its error are on
    one of XLA's worker threads."""
    import time

    import collectives.integrations.jax as cj

    n = 4096 if comm.rank == 0 else 4097
    start = time.monotonic()
    try:
        jax.block_until_ready(jax.jit(lambda x: cj.allreduce_tree_in_jit(x * 2.0, comm, op="sum"))(jnp.ones(n)))
    except Exception as exc:
        text = str(exc)
        took = time.monotonic() - start
        named = all(w in text for w in ("MismatchedCollective", f"rank {comm.rank}", "allreduce #", "x 4096", "x 4097"))
        fails = [] if named else [f"mismatch: the error says {text[-600:]!r}"]
        return fails + ([f"mismatch: raised after {took:.1f} s"] if took > 10 else [])
    return ["mismatch: no rank raised"]


def check_on_workers(jax, jnp, comm):
    """A value the function computes is reduced on XLA's worker threads: many
    calls there, each right, the interpreter's lock handed back every time
    (the main thread goes on)."""
    import threading

    import collectives.integrations.jax as cj
    from collectives.integrations import jax_ffi

    r, p = comm.rank, comm.size
    f = jax.jit(lambda x: cj.allreduce_tree_in_jit(x * 2.0, comm, op="sum"))
    x = jnp.full((4096,), r + 1.0)
    jax.block_until_ready(f(x))  # compiled: its host function is registered
    threads = set()
    for key, host in list(jax_ffi._hosts.items()):
        def noting(outputs, host=host):
            threads.add(threading.get_ident())
            host(outputs)
        jax_ffi._hosts[key] = noting
    fails = []
    for i in range(30):
        y = jax.block_until_ready(f(x + i))
        want = 2.0 * (p * (p + 1) / 2 + p * i)
        if not bool(jnp.all(y == want)):
            fails.append(f"on workers, call {i}: {y[:3]}, want {want}")
            break
    ffi = jax_ffi.available()[0] and os.environ.get("COLLECTIVES_JAX_FFI", "1") != "0"
    if ffi and (not threads or threading.get_ident() in threads):
        fails.append(f"the calls did not run on XLA's workers: {threads}")
    return fails


def main():
    import jax
    import jax.numpy as jnp

    import collectives
    from collectives.integrations import jax_ffi

    comm = collectives.init(timeout=30)
    failures = []
    for check in (check_training, check_dtypes, check_in_jit, check_on_workers, check_mismatch_in_jit):
        try:
            failures += check(jax, jnp, comm)
        except Exception:
            failures.append(f"{check.__name__} raised:\n{traceback.format_exc()}")
    built, why = jax_ffi.available()
    used = built and os.environ.get("COLLECTIVES_JAX_FFI", "1") != "0"
    print("RESULT " + json.dumps({"rank": comm.rank, "failures": failures, "ffi": used, "why": why}), flush=True)
    comm.close()


# ---------------------------------------------------------------------- test side


@pytest.mark.parametrize("p,ffi", [(2, True), (3, True), (2, False)])
def test_jax_adapter_matches_single_process(p, ffi):
    pytest.importorskip("jax")
    env = environment_without(("COLLECTIVES_", "PMI_", "OMPI_"))
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    if not ffi:
        env["COLLECTIVES_JAX_FFI"] = "0"  # the ordered io_callback
    argv = collectives_run(p, HERE, deadline=DEADLINE)
    results = run_checked(argv, p, DEADLINE, env)
    if _can_build_ffi():  # the FFI call ran, unless turned off
        assert all(r["ffi"] == ffi for r in results), [r["why"] for r in results]


def _can_build_ffi() -> bool:
    """A C++ compiler, Python's headers and jaxlib's FFI headers are here."""
    import sysconfig

    import jax

    return bool(hasattr(jax, "ffi") and (shutil.which("c++") or shutil.which("g++"))
                and os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
                and os.path.isdir(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api")))


if __name__ == "__main__":
    main()
