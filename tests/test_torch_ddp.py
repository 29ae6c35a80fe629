"""DDP on the ``collectives`` backend trains exactly as DDP on Gloo.

Each test starts one job whose ranks run this file as a script
(``python test_torch_ddp.py CHECK ...``). Every rank joins the default
group on the ``collectives`` backend and a second group on Gloo, then
trains the same model from the same seed on the same data once on each
group and compares the parameters: with ``find_unused_parameters`` (a
branch no rank uses and one only rank 0 uses), ``static_graph``,
gradient accumulation under ``no_sync``, mixed precision (bfloat16
parameters reduced in float32 by a comm hook that calls ``all_reduce`` on
the group, and bfloat16 autocast over float32 parameters),
and activation checkpointing (non-reentrant, and reentrant with a static
graph). Every rank prints one ``RESULT`` line with the checks that failed.

The rank side never imports ``collectives``: ``backend="collectives"`` is
found through the package's ``torch.backends`` entry point, which
``import torch`` loads, so these are unmodified training scripts with only
the backend's name changed; one test runs them under ``torchrun`` and
checks that the backend's module was imported only when the first group
was made. The profiler check imports the hooks and the optimizer wrapper
and checks their spans (``collectives:all_reduce``, with the fields of
torch's ``record_param_comms`` events) and the backend's.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import pytest

from launched import clean_env, collectives_run, run_checked, run_torch_checks

HERE = os.path.abspath(__file__)
DEADLINE = 150
STEPS = 4

# ---------------------------------------------------------------------- rank side


_LOADED_BEFORE_INIT: dict = {}


def _setup():
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _LOADED_BEFORE_INIT["backend module"] = "collectives.integrations.torch_backend" in sys.modules
    dist.init_process_group(backend="collectives", timeout=datetime.timedelta(seconds=60))
    return torch, dist


def _model(torch, checkpointing=None, extra=False):
    """A small MLP; ``checkpointing``: None, "non-reentrant" or "reentrant";
    ``extra``: with a branch used on rank 0 only and one never used."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.fc2 = torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(16, 2)
            if extra:
                self.side = torch.nn.Linear(16, 2)      # used on rank 0 only
                self.unused = torch.nn.Linear(16, 2)    # never used

        def block(self, x):
            return torch.tanh(self.fc2(torch.tanh(self.fc1(x))))

        def forward(self, x, use_side=False):
            if checkpointing is None:
                h = self.block(x)
            else:
                h = checkpoint(self.block, x, use_reentrant=checkpointing == "reentrant")
            out = self.head(h)
            return out + self.side(h) if use_side else out

    return Net()


def _batches(torch, r, micro):
    g = torch.Generator().manual_seed(1234 + r)
    return [[(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(micro)]
            for _ in range(STEPS)]


def _fp32_reduce_hook(group, torch, dist):
    """A comm hook that averages a bfloat16 bucket in float32 with ``all_reduce`` on ``group``."""
    def hook(state, bucket):
        grad = bucket.buffer()
        wide = grad.float().div_(dist.get_world_size(group))
        fut = dist.all_reduce(wide, group=group, async_op=True).get_future()

        def narrow(f):
            grad.copy_(f.value()[0])
            return grad

        return fut.then(narrow)

    return hook


def _train(torch, dist, group, *, micro=1, side=False, checkpointing=None, dtype=None, hook=False,
           autocast=False, **ddp):
    """Train with DDP on ``group``; the trained parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    r = dist.get_rank()
    model = _model(torch, checkpointing, extra=side)
    if dtype is not None:
        model = model.to(dtype)
    net = DDP(model, process_group=group, **ddp)
    if hook:
        net.register_comm_hook(None, _fp32_reduce_hook(group, torch, dist))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in _batches(torch, r, micro):
        opt.zero_grad()
        for m, (x, y) in enumerate(step):
            ctx = net.no_sync() if m < micro - 1 else _NoContext()
            with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = net(x.to(dtype) if dtype is not None else x, side and r == 0)
                torch.nn.functional.mse_loss(out.float(), y).backward()
        opt.step()
    return {n: p.detach().float().clone() for n, p in net.module.named_parameters()}


class _NoContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _same(torch, name, ours, gloo, tol=1e-5):
    """The parameters that differ between the two runs beyond ``tol`` (relative;
    sums may round differently at three ranks and more)."""
    fails = []
    for n, a in ours.items():
        b = gloo[n]
        if not torch.allclose(a, b, rtol=tol, atol=tol / 10):
            fails.append(f"{name}: parameter {n} differs from Gloo's by {(a - b).abs().max().item():.3g}")
    initial = {n: p.detach().float() for n, p in _model(torch, extra=True).named_parameters()}
    if all(torch.equal(a, initial[n]) for n, a in ours.items()):
        fails.append(f"{name}: the parameters did not change")
    return fails


def _compare(torch, dist, name, **kwargs):
    gloo = dist.new_group(backend="gloo")
    tol = 2e-2 if kwargs.get("dtype") == torch.bfloat16 else 1e-5  # a bfloat16 step is 2**-8 relative
    return _same(torch, name, _train(torch, dist, None, **kwargs), _train(torch, dist, gloo, **kwargs), tol)


def check_unused(torch, dist):
    """find_unused_parameters: a branch nobody uses and one only rank 0 uses."""
    return _compare(torch, dist, "find_unused_parameters", side=True, find_unused_parameters=True)


def check_static_graph(torch, dist):
    """static_graph with small buckets."""
    return _compare(torch, dist, "static_graph", static_graph=True, bucket_cap_mb=0.001)


def check_no_sync(torch, dist):
    """Gradient accumulation over three micro-batches under no_sync."""
    return _compare(torch, dist, "no_sync", micro=3)


def check_mixed_precision(torch, dist):
    """bfloat16 compute with a float32 reduction: bfloat16 parameters whose
    buckets a comm hook reduces in float32, and float32 parameters under
    bfloat16 autocast. (DDP's own ``mixed_precision`` records CUDA events,
    so it does not run on the CPU, on any backend.)"""
    fails = _compare(torch, dist, "bf16 parameters, fp32 comm hook", dtype=torch.bfloat16, hook=True)
    fails += _compare(torch, dist, "bf16 autocast, fp32 reduce", autocast=True)
    return fails


def check_checkpointing(torch, dist):
    """Activation checkpointing: non-reentrant; reentrant under a static graph."""
    fails = _compare(torch, dist, "checkpoint (non-reentrant)", checkpointing="non-reentrant")
    fails += _compare(torch, dist, "checkpoint (reentrant, static_graph)", checkpointing="reentrant",
                      static_graph=True)
    return fails


def check_autoload(torch, dist):
    """The backend was found without an import: registered by ``import torch``,
    its module imported when the first group was made."""
    fails = []
    if _LOADED_BEFORE_INIT.get("backend module", True):
        fails.append("the backend's module was imported before init_process_group")
    if "collectives.integrations.torch_backend" not in sys.modules or dist.get_backend() != "collectives":
        fails.append(f"the default group's backend is {dist.get_backend()!r}")
    return fails


def _spans(torch, prof, name):
    """(event, trace args) of every span called ``name`` in the profile ``prof``."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))["traceEvents"]
    args = [e.get("args", {}) for e in sorted(trace, key=lambda e: e.get("ts", 0)) if e.get("name") == name]
    events = sorted((e for e in prof.events() if e.name == name), key=lambda e: e.time_range.start)
    return list(zip(events, args)) if len(events) == len(args) else [(e, {}) for e in events]


def _check_spans(torch, dist, label, spans, nelems, at_least=1):
    """The spans are asynchronous and carry the record_param_comms fields."""
    fails = []
    if len(spans) < at_least:
        return [f"{label}: {len(spans)} collectives:all_reduce spans, expected at least {at_least}"]
    seqs = []
    for event, args in spans:
        if not event.is_async:
            fails.append(f"{label}: a span is not asynchronous")
        want = {"Collective name": "all_reduce", "dtype": "Float", "In msg nelems": nelems,
                "Out msg nelems": nelems, "Group size": dist.get_world_size(), "Rank": dist.get_rank(),
                "Process Group Ranks": str(list(range(dist.get_world_size())))}
        wrong = {k: (args.get(k), v) for k, v in want.items() if args.get(k) != v}
        if wrong:
            fails.append(f"{label}: span fields (got, want): {wrong}")
        seqs.append(args.get("Seq", -1))
    if seqs != sorted(seqs) or len(set(seqs)) != len(seqs) or min(seqs) < 1:
        fails.append(f"{label}: sequence numbers {seqs} are not increasing")
    return fails


def check_profiler(torch, dist):
    """Spans of the DDP comm hook, the optimizer wrapper and the backend."""
    import collectives.integrations.torch as ct
    from torch.nn.parallel import DistributedDataParallel as DDP

    activities = [torch.profiler.ProfilerActivity.CPU]
    r = dist.get_rank()
    x, y = _batches(torch, r, 1)[0][0]
    nelems = sum(p.numel() for p in _model(torch).parameters())
    net = DDP(_model(torch))
    net.register_comm_hook(ct.HookState(), ct.allreduce_hook)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(2):
            torch.nn.functional.mse_loss(net(x), y).backward()
    fails = _check_spans(torch, dist, "DDP allreduce_hook", _spans(torch, prof, "collectives:all_reduce"),
                         nelems, at_least=2)

    model = _model(torch)
    opt = ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(2):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    fails += _check_spans(torch, dist, "DistributedOptimizer", _spans(torch, prof, "collectives:all_reduce"),
                          nelems, at_least=2)

    group = dist.distributed_c10d._get_default_group()
    before = group._get_sequence_number_for_group()
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        dist.all_reduce(torch.ones(3, 5))
        dist.all_reduce(torch.ones(3, 5), async_op=True).wait()
    spans = _spans(torch, prof, "collectives:all_reduce")
    fails += _check_spans(torch, dist, "dist.all_reduce", spans, 15, at_least=2)
    if [event.input_shapes for event, _ in spans] != [[[3, 5]], [[3, 5]]]:
        fails.append(f"dist.all_reduce spans' input shapes: {[event.input_shapes for event, _ in spans]}")
    if [args.get("Process Group Description") for _, args in spans] != ["default_pg"] * 2:
        fails.append(f"dist.all_reduce spans' group: {[args.get('Process Group Description') for _, args in spans]}")
    if group._get_sequence_number_for_group() != before + 2:
        fails.append(f"sequence number {before} became {group._get_sequence_number_for_group()} after two calls")
    return fails


CHECKS = {"autoload": check_autoload, "profiler": check_profiler, "unused": check_unused, "static_graph": check_static_graph, "no_sync": check_no_sync,
          "mixed_precision": check_mixed_precision, "checkpointing": check_checkpointing}


def main(names):
    run_torch_checks(CHECKS, names, _setup)


# ---------------------------------------------------------------------- test side


def _run(p, *checks, torchrun=False, env=None):
    if torchrun:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(p),
                HERE, *checks]
    else:
        argv = collectives_run(p, HERE, *checks, deadline=DEADLINE)
    run_checked(argv, p, DEADLINE, env)


@pytest.fixture(scope="module")
def torch_installed():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("check", ["unused", "static_graph", "no_sync", "mixed_precision", "checkpointing"])
def test_ddp_matches_gloo_two_ranks(torch_installed, check):
    _run(2, check)


def test_ddp_matches_gloo_three_ranks(torch_installed):
    _run(3, "unused", "static_graph", "no_sync", "mixed_precision", "checkpointing")


def test_unmodified_script_under_torchrun(torch_installed):
    _run(2, "autoload", "no_sync", torchrun=True)


def test_spans_of_hooks_optimizer_and_backend(torch_installed):
    _run(2, "autoload", "profiler")


def test_without_autoload_the_name_is_unknown(torch_installed, tmp_path):
    """``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns the entry point off: the
    script must then import ``collectives.integrations.torch`` itself."""
    script = ("import sys, torch.distributed as dist\n"
              "try:\n"
              "    dist.init_process_group('collectives', init_method='file://' + sys.argv[1], rank=0, world_size=1)\n"
              "except Exception as exc:\n"
              "    print('REFUSED', exc)\n"
              "print('IMPORTED', 'collectives' in sys.modules)\n")
    env = {**clean_env(), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path / "store")], capture_output=True, text=True,
                         timeout=60, env=env)
    assert "REFUSED Unknown backend type collectives" in res.stdout, res.stdout + res.stderr
    assert "IMPORTED False" in res.stdout, res.stdout + res.stderr


def test_a_broken_package_does_not_break_import_torch(torch_installed, tmp_path):
    """The entry point turns any failure to load the package into a warning:
    a ``collectives`` that cannot be imported leaves ``import torch`` working."""
    broken = tmp_path / "collectives"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise RuntimeError('this install is broken')\n")
    env = {**clean_env(), "PYTHONPATH": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", "import torch; print('TORCH OK')"], capture_output=True, text=True,
                         timeout=60, env=env, cwd=tmp_path)
    assert res.returncode == 0 and "TORCH OK" in res.stdout, res.stdout + res.stderr
    assert "backend was not registered" in res.stderr and "this install is broken" in res.stderr, res.stderr


if __name__ == "__main__":
    main(sys.argv[1:])
