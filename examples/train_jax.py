"""Data-parallel JAX training: gradients averaged over the ranks inside ``jit``.

Run with either launcher::

    collectives run -n 2 examples/train_jax.py
    torchrun --standalone --nproc-per-node 2 examples/train_jax.py
"""

import argparse

import jax
import jax.numpy as jnp

import collectives
import collectives.integrations.jax as cj


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    comm = collectives.init()
    k_w, k_t = jax.random.split(jax.random.PRNGKey(0))
    params = {"w": jax.random.normal(k_w, (32, 1)) * 0.1, "b": jnp.zeros(1)}  # same on every rank
    target = jax.random.normal(k_t, (32, 1))

    def loss_fn(p, x):
        return jnp.mean((x @ p["w"] + p["b"] - x @ target) ** 2)

    @jax.jit
    def step(p, x):
        loss, grads = jax.value_and_grad(loss_fn)(p, x)
        grads = cj.allreduce_tree_in_jit(grads, comm)  # average over the ranks
        return jax.tree_util.tree_map(lambda a, g: a - 0.05 * g, p, grads), loss

    key = jax.random.PRNGKey(1 + comm.rank)  # each rank its own data
    for i in range(args.steps):
        key, sub = jax.random.split(key)
        params, loss = step(params, jax.random.normal(sub, (64, 32)))
        if comm.rank == 0 and i % 5 == 0:
            print(f"step {i:3d}  loss {float(loss):.4f}  ({comm.size} ranks)")
    comm.close()


if __name__ == "__main__":
    main()
