"""The torch integration on real processes: the ``collectives`` backend under our
launcher and under torchrun, DDP on it (against single-process training on
the whole batch and against DDP on Gloo), the DDP comm hooks and the
optimizer wrapper.

Each test starts one job whose ranks run this file as a script
(``python test_torch_integration.py CHECK ...``); every rank prints one
``RESULT`` line with the checks that failed.
"""

from __future__ import annotations

import datetime
import os
import sys

import pytest

from launched import collectives_run, run_checked, run_torch_checks

HERE = os.path.abspath(__file__)
DEADLINE = 100

# ---------------------------------------------------------------------- rank side


def _setup():
    import torch
    import torch.distributed as dist

    import collectives.integrations.torch  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dist.init_process_group(backend="collectives", timeout=datetime.timedelta(seconds=30))
    return torch, dist


def _expect(torch, fails, name, got, want, tol=0.0):
    if not torch.allclose(got.double(), want.double(), atol=tol, rtol=0):
        fails.append(f"{name}: got {got.tolist()}, want {want.tolist()}")


def _reductions(torch, dist, r, p, fails):
    x = torch.full((7,), float(r + 1))
    dist.all_reduce(x)
    _expect(torch, fails, "all_reduce", x, torch.full((7,), p * (p + 1) / 2))
    x = torch.full((4,), float(r + 1))
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    _expect(torch, fails, "all_reduce max", x, torch.full((4,), float(p)))
    for dtype in (torch.float16, torch.bfloat16):
        h = torch.full((33,), 0.5 * (r + 1), dtype=dtype)
        dist.all_reduce(h)
        _expect(torch, fails, f"all_reduce {dtype}", h, torch.full((33,), 0.5 * p * (p + 1) / 2))
    strided = torch.arange(12.).reshape(3, 4)[:, 1] * (r + 1)
    dist.all_reduce(strided)
    _expect(torch, fails, "all_reduce non-contiguous", strided, torch.tensor([1., 5., 9.]) * p * (p + 1) / 2)
    o = torch.empty(2)
    dist.reduce_scatter_tensor(o, torch.arange(2. * p))
    _expect(torch, fails, "reduce_scatter_tensor", o, torch.arange(2. * r, 2. * r + 2) * p)


def _gathers(torch, dist, r, p, fails):
    y = torch.arange(5.) * (r + 1)
    dist.broadcast(y, src=p - 1)
    _expect(torch, fails, "broadcast", y, torch.arange(5.) * p)
    outs = [torch.empty(3) for _ in range(p)]
    dist.all_gather(outs, torch.full((3,), float(r)))
    _expect(torch, fails, "all_gather", torch.stack(outs), torch.arange(float(p)).repeat_interleave(3).reshape(p, 3))
    o = torch.empty(2 * p)
    dist.all_gather_into_tensor(o, torch.full((2,), float(r)))
    _expect(torch, fails, "all_gather_into_tensor", o, torch.arange(float(p)).repeat_interleave(2))


def _all_to_all(torch, dist, r, p, fails):
    send = torch.arange(float(p)) + 10 * r
    recv = torch.empty(p)
    dist.all_to_all_single(recv, send)
    _expect(torch, fails, "all_to_all_single", recv, torch.arange(float(p)) * 10 + r)
    in_splits = [k + 1 for k in range(p)]            # rank r sends k+1 rows to rank k
    out_splits = [r + 1] * p                          # and receives r+1 rows from each
    send = torch.full((sum(in_splits),), float(r))
    recv = torch.empty(sum(out_splits))
    dist.all_to_all_single(recv, send, out_splits, in_splits)
    _expect(torch, fails, "all_to_all_single uneven", recv, torch.arange(float(p)).repeat_interleave(r + 1))


def _large(torch, dist, r, p, fails):
    """Sizes the shared window's direct compiled calls take (cross-memory
    reads of the peers' tensors), each twice (the second a prepared call):
    every element checked, and the sent tensors unchanged."""
    n = 1 << 18  # float32 elements per block: 1 MiB
    ramp = torch.arange(float(n))
    for turn in range(2):
        mine = ramp + 1e6 * r + turn
        o = torch.empty(n * p)
        dist.all_gather_into_tensor(o, mine)
        _expect(torch, fails, "all_gather_into_tensor 1 MiB", o,
                torch.cat([ramp + 1e6 * q + turn for q in range(p)]))
        send = torch.cat([ramp + 1e6 * r + 1e3 * k + turn for k in range(p)])
        recv = torch.empty(n * p)
        dist.all_to_all_single(recv, send)
        _expect(torch, fails, "all_to_all_single 1 MiB", recv,
                torch.cat([ramp + 1e6 * q + 1e3 * r + turn for q in range(p)]))
        _expect(torch, fails, "all_to_all_single 1 MiB, its input", send,
                torch.cat([ramp + 1e6 * r + 1e3 * k + turn for k in range(p)]))
        chunks = [ramp + 1e3 * k + turn for k in range(p)] if r == 0 else None
        got = torch.empty(n)
        dist.scatter(got, chunks, src=0)
        _expect(torch, fails, "scatter 1 MiB", got, ramp + 1e3 * r + turn)
        big = torch.arange(float(4 * n)) + turn if r == p - 1 else torch.zeros(4 * n)
        dist.broadcast(big, src=p - 1)
        _expect(torch, fails, "broadcast 4 MiB", big, torch.arange(float(4 * n)) + turn)
        parts = [torch.empty(2 * n) for _ in range(p)] if r == 0 else None
        dist.gather(torch.arange(float(2 * n)) + r + turn, parts, dst=0)
        if r == 0:
            _expect(torch, fails, "gather 2 MiB", torch.stack(parts),
                    torch.stack([torch.arange(float(2 * n)) + q + turn for q in range(p)]))


def _barrier(torch, dist, r, p, fails):
    dist.barrier()


def _point_to_point(torch, dist, r, p, fails):
    peer, src = (r + 1) % p, (r - 1) % p
    buf = torch.empty(4)
    if r % 2 == 0:
        dist.send(torch.full((4,), float(r)), dst=peer, tag=3)
        dist.recv(buf, src=src, tag=3)
    else:
        dist.recv(buf, src=src, tag=3)
        dist.send(torch.full((4,), float(r)), dst=peer, tag=3)
    _expect(torch, fails, "send/recv", buf, torch.full((4,), float(src)))
    rq = dist.irecv(buf, src=src, tag=4)
    sq = dist.isend(torch.full((4,), float(r) + 0.5), dst=peer, tag=4)
    sq.wait()
    rq.wait()
    _expect(torch, fails, "isend/irecv", buf, torch.full((4,), src + 0.5))
    # non-contiguous receive tensors: received into a contiguous stand-in, copied back when done
    grid = torch.zeros(4, 2)
    rq = dist.irecv(grid[:, 1], src=src, tag=5)
    dist.send(torch.arange(4.0) + r, dst=peer, tag=5)
    rq.wait()
    _expect(torch, fails, "irecv into a strided tensor", grid, torch.stack([torch.zeros(4), torch.arange(4.0) + src], 1))
    strided = torch.zeros(8)[::2]
    if r % 2 == 0:
        dist.send(torch.full((4,), 7.0 + r), dst=peer, tag=6)
        got_from = dist.recv(strided, tag=6)  # from any source
    else:
        got_from = dist.recv(strided, tag=6)
        dist.send(torch.full((4,), 7.0 + r), dst=peer, tag=6)
    _expect(torch, fails, "recv from any source into a strided tensor", strided, torch.full((4,), 7.0 + src))
    if got_from != src:
        fails.append(f"recv from any source: sender {got_from}, expected {src}")


def _async(torch, dist, r, p, fails):
    z = torch.ones(6) * (r + 1)
    work = dist.all_reduce(z, async_op=True)
    chained = work.get_future().then(lambda f: f.value()[0] * 2)
    work.wait()
    _expect(torch, fails, "async_op wait", z, torch.full((6,), p * (p + 1) / 2))
    _expect(torch, fails, "get_future then", chained.wait(), torch.full((6,), p * (p + 1.0)))
    if not (work.is_completed() and work.is_success() and work.exception() is None):
        fails.append(f"work after wait: completed {work.is_completed()}, success {work.is_success()}, "
                     f"exception {work.exception()!r}")
    if [t.data_ptr() for t in work.result()] != [z.data_ptr()]:
        fails.append(f"work.result(): {work.result()}")
    if dist.barrier(async_op=True).wait() is not True:
        fails.append("barrier work: wait() did not return True")


def _objects(torch, dist, r, p, fails):
    objs = [None] * p
    dist.all_gather_object(objs, {"rank": r, "name": f"r{r}"})
    if objs != [{"rank": k, "name": f"r{k}"} for k in range(p)]:
        fails.append(f"all_gather_object: {objs}")
    lst = [f"from {r}", r] if r == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    if lst != ["from 0", 0]:
        fails.append(f"broadcast_object_list: {lst}")


def _rooted_objects(torch, dist, r, p, fails):
    gathered = [None] * p if r == 0 else None
    dist.gather_object(("g", r), gathered, dst=0)
    if r == 0 and gathered != [("g", k) for k in range(p)]:
        fails.append(f"gather_object: {gathered}")
    got = [None]
    dist.scatter_object_list(got, [("s", k) for k in range(p)] if r == 0 else None, src=0)
    if got != [("s", r)]:
        fails.append(f"scatter_object_list: {got}")


def _new_group(torch, dist, r, p, fails):
    sub_ranks = [0, p - 1]
    sub = dist.new_group(sub_ranks)
    if r in sub_ranks:
        s = torch.full((3,), float(r))
        dist.all_reduce(s, group=sub)
        _expect(torch, fails, "new_group all_reduce", s, torch.full((3,), float(p - 1)))
        if sub.name() != "collectives":
            fails.append(f"new_group backend: {sub.name()}")
    x = torch.ones(1)
    dist.all_reduce(x)


def check_collectives(torch, dist):
    """Every torch.distributed call on the collectives backend (each part on its own)."""
    r, p = dist.get_rank(), dist.get_world_size()
    fails = []
    for part in (_reductions, _gathers, _async, _objects, _new_group, _point_to_point, _barrier,
                 _all_to_all, _rooted_objects, _large):
        try:
            part(torch, dist, r, p, fails)
        except Exception as exc:
            fails.append(f"{part.__name__.strip('_')} raised {type(exc).__name__}: {exc}")
            if "no " in str(exc) and "algorithm" in str(exc):
                continue  # that collective has no algorithm on this transport: the others go on
            break
    return fails


# ---- training


def _model(torch, seed=0, extra=False):
    torch.manual_seed(seed)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.fc2 = torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(16, 2)
            if extra:
                self.side = torch.nn.Linear(16, 2)      # used only when asked
                self.unused = torch.nn.Linear(16, 2)    # never used

        def forward(self, x, use_side=False):
            h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
            out = self.head(h)
            return out + self.side(h) if use_side else out

    return Net()


def _data(torch, p, steps, per_rank=4, micro=1):
    g = torch.Generator().manual_seed(1234)
    xs = torch.randn(steps, micro, p * per_rank, 8, generator=g)
    ys = torch.randn(steps, micro, p * per_rank, 2, generator=g)
    return xs, ys


def _local(t, r, per_rank=4):
    return t[..., r * per_rank:(r + 1) * per_rank, :]


def _reference(torch, p, steps, micro=1, side_on_rank0=False, momentum=0.0):
    """Single-process training on the whole batch (the ranks' slices together)."""
    model = _model(torch, extra=side_on_rank0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    xs, ys = _data(torch, p, steps, micro=micro)
    for s in range(steps):
        opt.zero_grad()
        for m in range(micro):
            losses = [torch.nn.functional.mse_loss(model(_local(xs[s, m], k), side_on_rank0 and k == 0),
                                                   _local(ys[s, m], k)) for k in range(p)]
            (sum(losses) / p).backward()
        opt.step()
    return model


def _compare(torch, name, model, ref, tol):
    theirs = dict(ref.named_parameters())
    for n, a in model.named_parameters():
        if n not in theirs:
            continue
        b = theirs[n]
        err = (a.detach() - b.detach()).abs().max().item()
        if err > tol:
            return [f"{name}: parameter {n} differs by {err:.3g} (tolerance {tol})"]
    return []


def _train_ddp(torch, dist, ddp_kwargs, steps=4, micro=1, hook=None, group=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, p = dist.get_rank(), dist.get_world_size()
    ddp = DDP(_model(torch), process_group=group, **ddp_kwargs)
    if hook is not None:
        ddp.register_comm_hook(*hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    xs, ys = _data(torch, p, steps, micro=micro)
    for s in range(steps):
        opt.zero_grad()
        for m in range(micro):
            ctx = ddp.no_sync() if m < micro - 1 else _nullcontext()
            with ctx:
                torch.nn.functional.mse_loss(ddp(_local(xs[s, m], r)), _local(ys[s, m], r)).backward()
        opt.step()
    return ddp.module


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def check_ddp(torch, dist):
    """DDP on the collectives backend equals single-process training and DDP on Gloo."""
    p = dist.get_world_size()
    ref = _reference(torch, p, 4)
    fails = []
    for name, kwargs in [("default", {}),
                         ("small buckets + gradient_as_bucket_view", {"bucket_cap_mb": 0.001,
                                                                      "gradient_as_bucket_view": True}),
                         ("static_graph", {"static_graph": True, "bucket_cap_mb": 0.002})]:
        fails += _compare(torch, f"ddp {name}", _train_ddp(torch, dist, kwargs), ref, 1e-5)
    gloo = dist.new_group(backend="gloo")
    on_gloo = _train_ddp(torch, dist, {"bucket_cap_mb": 0.001}, group=gloo)
    fails += _compare(torch, "ddp on gloo vs reference", on_gloo, ref, 1e-5)
    fails += _compare(torch, "ddp on collectives vs gloo", _train_ddp(torch, dist, {"bucket_cap_mb": 0.001}),
                      on_gloo, 1e-5)
    ref2 = _reference(torch, p, 3, micro=2)
    fails += _compare(torch, "ddp no_sync", _train_ddp(torch, dist, {}, steps=3, micro=2), ref2, 1e-5)
    return fails


def check_hooks(torch, dist):
    """The comm hooks (plain, float16, bfloat16), also with DDP running on Gloo."""
    import collectives.integrations.torch as ct

    p = dist.get_world_size()
    ref = _reference(torch, p, 4)
    fails = []
    kw = {"bucket_cap_mb": 0.001}
    fails += _compare(torch, "allreduce_hook", _train_ddp(torch, dist, kw, hook=(ct.HookState(), ct.allreduce_hook)),
                      ref, 1e-5)
    fails += _compare(torch, "fp16_compress_hook",
                      _train_ddp(torch, dist, kw, hook=(ct.HookState(), ct.fp16_compress_hook)), ref, 2e-3)
    fails += _compare(torch, "bfloat16_compress_hook",
                      _train_ddp(torch, dist, kw, hook=(ct.communicator_of(), ct.bfloat16_compress_hook)), ref, 2e-2)
    gloo = dist.new_group(backend="gloo")
    fails += _compare(torch, "allreduce_hook with DDP on gloo",
                      _train_ddp(torch, dist, kw, hook=(ct.HookState(ct.communicator_of()), ct.allreduce_hook),
                                 group=gloo), ref, 1e-5)
    return fails


def _train_wrapped(torch, dist, steps, micro=1, side_on_rank0=False, momentum=0.0, **wrap):
    import collectives.integrations.torch as ct

    r, p = dist.get_rank(), dist.get_world_size()
    model = _model(torch, extra=True)
    opt = ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                  model.named_parameters(), **wrap)
    xs, ys = _data(torch, p, steps, micro=micro)
    for s in range(steps):
        opt.zero_grad()
        for m in range(micro):
            out = model(_local(xs[s, m], r), side_on_rank0 and r == 0)
            torch.nn.functional.mse_loss(out, _local(ys[s, m], r)).backward()
        opt.step()
    return model, opt


def check_optimizer(torch, dist):
    """The optimizer wrapper equals single-process training (and DDP)."""
    p = dist.get_world_size()
    fails = []
    ref = _reference(torch, p, 4, momentum=0.9)
    for name, wrap in [("one bucket", {}),
                       ("small buckets", {"bucket_cap_mb": 0.0005, "first_bucket_cap_mb": 0.0002}),
                       ("no overlap", {"bucket_cap_mb": 0.001, "overlap": False})]:
        model, opt = _train_wrapped(torch, dist, 4, momentum=0.9, **wrap)
        fails += _compare(torch, f"optimizer {name}", model, ref, 1e-5)
        if name == "small buckets" and len(opt.bucket_sizes) < 3:
            fails.append(f"small buckets: expected several buckets, got {opt.bucket_sizes}")
    ddp = _train_ddp(torch, dist, {"bucket_cap_mb": 0.001})
    model, _ = _train_wrapped(torch, dist, 4, bucket_cap_mb=0.001)
    fails += _compare(torch, "optimizer vs ddp", model, ddp, 1e-5)
    ref2 = _reference(torch, p, 3, micro=2)
    model, _ = _train_wrapped(torch, dist, 3, micro=2, backward_passes_per_step=2, bucket_cap_mb=0.001)
    fails += _compare(torch, "optimizer accumulation", model, ref2, 1e-5)
    ref3 = _reference(torch, p, 3, side_on_rank0=True)
    model, _ = _train_wrapped(torch, dist, 3, side_on_rank0=True, bucket_cap_mb=0.001)
    fails += _compare(torch, "optimizer params without grads", model, ref3, 1e-5)
    return fails


def check_torchrun(torch, dist):
    """A short smoke test: the backend and DDP under torchrun."""
    p = dist.get_world_size()
    x = torch.ones(5) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    fails = [] if torch.allclose(x, torch.full((5,), p * (p + 1) / 2)) else [f"all_reduce: {x}"]
    return fails + _compare(torch, "ddp", _train_ddp(torch, dist, {"bucket_cap_mb": 0.001}),
                            _reference(torch, p, 4), 1e-5)


CHECKS = {"collectives": check_collectives, "ddp": check_ddp, "hooks": check_hooks,
          "optimizer": check_optimizer, "torchrun": check_torchrun}


def main(names):
    run_torch_checks(CHECKS, names, _setup)


# ---------------------------------------------------------------------- test side


def _run(argv, p):
    run_checked(argv, p, DEADLINE)


def _launch(p, *checks):
    return collectives_run(p, HERE, *checks, deadline=DEADLINE)


@pytest.fixture(scope="module")
def torch_installed():
    return pytest.importorskip("torch")


def test_backend_and_training_two_ranks(torch_installed):
    _run(_launch(2, "collectives", "ddp", "hooks", "optimizer"), 2)


def test_backend_and_training_three_ranks(torch_installed):
    _run(_launch(3, "collectives", "ddp", "optimizer"), 3)


def test_under_torchrun(torch_installed):
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            HERE, "collectives", "torchrun"]
    _run(argv, 2)


if __name__ == "__main__":
    main(sys.argv[1:])
