"""The communicator of a torch process group: its transport, its job id, torch's store.

The ranks of a group agree on a job id through the store torch hands to the
backend (under torchrun, the agent's store on MASTER_PORT), so ``new_group``
works the same way. The transport is chosen as :func:`collectives.init`
chooses it (``COLLECTIVES_TRANSPORT`` overrides), or by :func:`configure`.
"""

from __future__ import annotations

import datetime
import secrets
from typing import Any

import torch.distributed as dist

import collectives
from collectives import Communicator

__all__ = ["configure", "StoreAdapter", "open_communicator"]

_settings: dict[str, Any] = {"transport": "auto", "options": {}}


def configure(transport: str = "auto", **options: Any) -> None:
    """Choose the transport (and transport options) of groups created from now on.

    Args:
        transport: a transport name or ``"auto"`` (as in :func:`collectives.init`).
        **options: transport options passed to :func:`collectives.init`.
    """
    _settings["transport"] = transport
    _settings["options"] = dict(options)


class StoreAdapter:
    """A ``torch.distributed.Store`` seen as the rendezvous store transports use.

    Args:
        store: a torch store (TCPStore, FileStore, PrefixStore, ...).
    """

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def set(self, key: str, value: bytes | str) -> None:
        """Publish ``value`` under ``key``."""
        self.store.set(key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to appear."""
        if timeout is not None:
            self.store.wait([key], datetime.timedelta(seconds=float(timeout)))
        return self.store.get(key)


def _agree_on_job(store: dist.Store, group_rank: int, timeout: float) -> tuple[str, str]:
    """A job id and secret shared by the group's ranks, published by group rank 0."""
    adapter = StoreAdapter(store)
    if group_rank == 0:
        adapter.set("collectives/job", f"pg-{secrets.token_hex(6)}:{secrets.token_hex(16)}")
    job, secret = adapter.get("collectives/job", timeout).decode().split(":")
    return job, secret


def open_communicator(store: dist.Store, group_rank: int, group_size: int, seconds: float) -> Communicator:
    """The communicator of a new group: its ranks agree on a job id through
    ``store``, then open the transport chosen by :func:`configure`."""
    job, secret = _agree_on_job(store, group_rank, seconds)
    options = {"secret": secret, "store": StoreAdapter(store), **_settings["options"]}
    return collectives.init(group_rank, group_size, transport=_settings["transport"], job=job,
                            timeout=seconds, **options)
