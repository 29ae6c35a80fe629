"""Adapters for training frameworks (installed as ``collectives.integrations``)."""
