"""PyTorch integration: a ``torch.distributed`` backend, DDP hooks, an optimizer wrapper.

The backend ``"collectives"`` is found without an import: the package
declares an entry point in torch's ``torch.backends`` group, which
``import torch`` loads (unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``), and
that entry point (``collectives_autoload``) registers the name, so an
unmodified training script only changes the backend's name::

    import torch.distributed as dist

    dist.init_process_group(backend="collectives")   # under torchrun or `collectives run`
    model = torch.nn.parallel.DistributedDataParallel(model)

The registration is cheap: the backend itself (:mod:`.torch_backend`, the
process group, composed of the ``torch_*`` modules it lists) is imported
when the first group is created. Importing this module registers
the name too, and gives the hooks and the optimizer wrapper::

    import collectives.integrations.torch as ct

    model.register_comm_hook(ct.HookState(), ct.allreduce_hook)   # optional
    opt = ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters())         # without DDP
"""

from __future__ import annotations

import datetime
import importlib
from typing import Any

__all__ = [
    "BACKEND_NAME",
    "CollectivesProcessGroup",
    "CollectivesWork",
    "StoreAdapter",
    "communicator_of",
    "configure",
    "reduce_op_name",
    "as_numpy",
    "post_lock",
    "HookState",
    "allreduce_hook",
    "fp16_compress_hook",
    "bfloat16_compress_hook",
    "DistributedOptimizer",
]

BACKEND_NAME = "collectives"

# Where each public name lives; imported on first use.
_HOMES = {
    "CollectivesProcessGroup": ".torch_backend", "communicator_of": ".torch_backend",
    "CollectivesWork": ".torch_work",
    "StoreAdapter": ".torch_store", "configure": ".torch_store",
    "reduce_op_name": ".torch_tensors", "as_numpy": ".torch_tensors",
    "post_lock": ".torch_posting",
    "HookState": ".torch_hooks", "allreduce_hook": ".torch_hooks", "fp16_compress_hook": ".torch_hooks",
    "bfloat16_compress_hook": ".torch_hooks", "DistributedOptimizer": ".torch_optimizer",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __package__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


def _create_process_group(store: Any, group_rank: int, group_size: int, timeout: datetime.timedelta) -> Any:
    """The creator torch calls for ``backend="collectives"``: imports the backend, then builds the group."""
    from .torch_backend import _create_process_group as create

    return create(store, group_rank, group_size, timeout)


def register() -> None:
    """Register the backend name ``"collectives"`` with ``torch.distributed`` (once)."""
    import torch.distributed as dist

    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create_process_group, devices=["cpu"])


register()
