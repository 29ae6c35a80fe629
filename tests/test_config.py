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


#: A read of a COLLECTIVES_* variable straight from the environment (writes, for child processes, are fine).
_RAW_READ = re.compile(r"""(environ\.get\(|getenv\(|environ\[)\s*["']COLLECTIVES_[A-Z0-9_]+["']\s*(?!\]\s*=[^=])""")


def test_the_library_reads_settings_only_through_the_typed_accessor():
    raw = []
    for top in ("collectives", "transports", "devices", "cost_models", "integrations"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(dirpath, name)
                if name.endswith(".py") and not path.endswith(os.path.join("collectives", "config.py")):
                    with open(path) as f:
                        raw += [f"{os.path.relpath(path, ROOT)}:{i}" for i, line in enumerate(f, 1)
                                if _RAW_READ.search(line)]
    assert not raw, f"read these through collectives.config.get or option: {raw}"


def test_an_option_given_in_code_is_read_as_its_settings_type():
    assert config.option({"zmq_lanes": "off"}, "zmq_lanes", "ZMQ_LANES") is False
    assert config.option({"zmq_lanes": False}, "zmq_lanes", "ZMQ_LANES") is False
    assert config.option({}, "zmq_lanes", "ZMQ_LANES") is True
    with pytest.raises(BadArgument, match="option zmq_lanes='maybe'"):
        config.option({"zmq_lanes": "maybe"}, "zmq_lanes", "ZMQ_LANES")


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


def test_a_renamed_setting_is_named_with_its_new_name(monkeypatch, caplog):
    monkeypatch.setenv("COLLECTIVES_NATIVE", "0")
    log = logging.getLogger("collectives.test-config")
    with caplog.at_level(logging.WARNING, logger=log.name):
        config.log_settings(log)
    assert "COLLECTIVES_NATIVE is not read any more: it is now COLLECTIVES_COMPILED" in caplog.text
    assert all(old not in config.SETTINGS and new in config.SETTINGS for old, new in config.RENAMED.items())
