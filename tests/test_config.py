"""Every COLLECTIVES_* variable is declared once, typed, and documented."""

from __future__ import annotations

import logging
import os
import re

import pytest

from collectives import BadArgument, config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("collectives", "transports", "devices", "cost_models", "integrations", "bench")


def _names_in_source() -> set[str]:
    found = set()
    for top in SOURCES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith((".py", ".c")):
                    with open(os.path.join(dirpath, name)) as f:
                        found |= set(re.findall(r"COLLECTIVES_([A-Z0-9_]*[A-Z0-9])", f.read()))
    return found


def test_every_variable_the_code_names_is_declared():
    undeclared = sorted(_names_in_source() - set(config.SETTINGS))
    assert not undeclared, f"declare these in collectives/config.py: {undeclared}"


def test_docs_environment_is_generated_from_the_declarations():
    with open(os.path.join(ROOT, "docs", "environment.md")) as f:
        assert f.read() == config.markdown(), "run: collectives settings --write-docs"


def test_typed_values_and_errors_that_name_the_variable():
    env = {"COLLECTIVES_SHM_RING_BYTES": "2M", "COLLECTIVES_SHM_CMA": "off", "COLLECTIVES_FLIGHT_RECORDER": "64",
           "COLLECTIVES_BIND": "core"}
    assert config.get("SHM_RING_BYTES", env=env) == 2 << 20
    assert config.get("SHM_CMA", env=env) is False
    assert config.get("FLIGHT_RECORDER", env=env) == 64
    assert config.get("BIND", env=env) == "core"
    assert config.get("SHM_ADOPT", env={}) is True and config.get("SHM_WINDOW_BYTES", env={}) is None
    for name, bad in (("SHM_CMA", "maybe"), ("FLIGHT_RECORDER", "lots"), ("BIND", "everywhere"),
                      ("SHM_RING_BYTES", "big")):
        with pytest.raises(BadArgument, match=f"COLLECTIVES_{name}="):
            config.get(name, env={f"COLLECTIVES_{name}": bad})


def test_settings_that_are_set_are_logged_at_debug_level(monkeypatch, caplog):
    monkeypatch.setenv("COLLECTIVES_FLIGHT_RECORDER", "16")
    monkeypatch.setenv("COLLECTIVES_FLIGHT_RECORDR", "16")
    log = logging.getLogger("collectives.test-config")
    with caplog.at_level(logging.DEBUG, logger=log.name):
        config.log_settings(log)
    text = caplog.text
    assert "COLLECTIVES_FLIGHT_RECORDER=16" in text and "COLLECTIVES_FLIGHT_RECORDR=16 is not a setting" in text
