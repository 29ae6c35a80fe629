"""Registers the torch.distributed backend ``"collectives"`` when torch is imported.

``import torch`` runs the ``torch.backends`` entry points it finds; this
module is ours. It lives outside the ``collectives`` package so that nothing
the package does at import can make ``import torch`` fail: any error becomes
a warning and the backend is simply not registered.
Set ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` to skip it.
"""

import warnings


def torch_backend() -> None:
    """The entry point: register the backend's name (the backend loads later)."""
    try:
        from collectives.integrations.torch import register

        register()
    except Exception as exc:  # a broken install, torch without distributed, an older torch
        warnings.warn(f"the collectives torch.distributed backend was not registered: {exc!r}", stacklevel=2)
