"""PyTorch integration: a ``torch.distributed`` backend, DDP hooks, an optimizer wrapper.

Importing this module registers the backend ``"collectives"``::

    import torch.distributed as dist
    import collectives.integrations.torch as ct

    dist.init_process_group(backend="collectives")   # under torchrun or `collectives run`
    model = torch.nn.parallel.DistributedDataParallel(model)
    model.register_comm_hook(ct.HookState(), ct.allreduce_hook)   # optional

or, without DDP::

    opt = ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters())
"""

from __future__ import annotations

from .torch_backend import (BACKEND_NAME, CollectivesProcessGroup, CollectivesWork, StoreAdapter, as_numpy,
                            communicator_of, configure, post_lock, reduce_op_name)
from .torch_hooks import HookState, allreduce_hook, bfloat16_compress_hook, fp16_compress_hook
from .torch_optimizer import DistributedOptimizer

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
