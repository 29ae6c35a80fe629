"""Every ``COLLECTIVES_*`` environment variable, declared once.

Each setting is declared here with its name, type, default and one line of
documentation (as NCCL's ``NCCL_PARAM(Name, "ENV", default)`` declares its
knobs), read through one typed accessor (:func:`get`), whose error names
the variable, and listed in ``docs/environment.md``, which
``collectives settings --write-docs`` generates from these declarations (a test checks the file is current). :func:`log_settings`
logs, at debug level, the ones that are set.

Launcher-set variables (rank, size, job, secret, ...) are read by
:mod:`collectives.environment` and the launcher; they are declared here too,
so that every name the library reads has one place.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from .arithmetic import parse_bytes

__all__ = ["Setting", "SETTINGS", "get", "option", "is_set", "log_settings", "markdown"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Setting:
    """One environment variable.

    Attributes:
        name: without the ``COLLECTIVES_`` prefix.
        kind: ``bool``, ``int``, ``float``, ``str`` or ``bytes`` (an integer
            number of bytes; ``K``, ``M``, ``G`` suffixes allowed).
        default: the value when unset (None: no default, "unset").
        doc: one line.
        group: where the docs list it.
        choices: the values a ``str`` may take (None: any).
    """

    name: str
    kind: str
    default: Any
    doc: str
    group: str
    choices: tuple[str, ...] | None = None

    @property
    def variable(self) -> str:
        return "COLLECTIVES_" + self.name


def _settings() -> dict[str, Setting]:
    s = [
        # launching (set by `collectives run`; read by collectives.init)
        Setting("RANK", "int", None, "this process's rank (set by the launcher)", "launch"),
        Setting("SIZE", "int", None, "the number of ranks (set by the launcher)", "launch"),
        Setting("JOB", "str", None, "an id shared by the ranks of one job (set by the launcher)", "launch"),
        Setting("SECRET", "str", None, "the job's secret: every connection proves it knows it (set by the launcher)",
                "launch"),
        Setting("LOCAL", "bool", True, "every rank runs on this host (set by the launcher)", "launch"),
        Setting("TRANSPORT", "str", "auto", "the transport: auto, shm, zmq, mpi, rdma, sim", "launch"),
        Setting("BIND", "str", "auto", "bind ranks to cores: auto (a share each, or one each round robin "
                "when they outnumber the cores), core (one each), none", "launch", ("auto", "core", "none")),
        Setting("SOCKET_IFNAME", "str", None, "the network interface TCP listens on", "launch"),
        Setting("NNODES", "int", 1, "nodes of a `collectives run` job, one launcher each (--nnodes)", "launch"),
        Setting("NODE_RANK", "int", 0, "this node's index in a `collectives run` job over several nodes "
                "(--node-rank)", "launch"),
        Setting("MASTER_ADDR", "str", "127.0.0.1", "where node 0's `collectives run` listens for the other "
                "nodes' launchers (--master-addr)", "launch"),
        Setting("MASTER_PORT", "int", 29500, "the port node 0's `collectives run` listens on (--master-port); "
                "the ranks get another as MASTER_PORT", "launch"),
        Setting("JOIN_TIMEOUT", "float", 300.0, "seconds for every node of a `collectives run` job to join "
                "(--join-timeout)", "launch"),
        Setting("HOST_ID", "str", None, "this rank's host identity: ranks with the same one share memory (default: "
                "the boot id, the /dev/shm mount and the PID namespace; see docs/hierarchy.md)", "launch"),
        # shared memory
        Setting("SHM_RING_BYTES", "bytes", None, "bytes of each sender's ring (default 1 MiB up to 4 ranks, "
                "less above, never below 64 KiB); all ranks must agree", "shm"),
        Setting("SHM_WINDOW_BYTES", "bytes", None, "bytes of data in each rank's shared window (default 4 MiB, "
                "less when /dev/shm is small); all ranks must agree", "shm"),
        Setting("SHM_ALLOC_BYTES", "bytes", 1 << 30, "address space of each rank's shared allocation pool "
                "(sparse: pages cost memory only once touched)", "shm"),
        Setting("SHM_CMA", "bool", True, "read and write peers' private memory directly (cross-memory attach) "
                "where permitted", "shm"),
        Setting("SHM_CMA_FASTER", "bool", None, "whether one cross-memory read beats the window's two copies "
                "(1: at every size, 0: at none), which picks the window's direct "
                "compiled calls (default: raced at startup from 256 KiB to 1 MiB; rank 0's counts)", "shm"),
        Setting("SHM_ADOPT", "bool", True, "move buffers used again and again into the shared pool in place", "shm"),
        Setting("SHM_YIELD_US", "float", 20000.0, "how long a wait keeps yielding the CPU (after its spin) before it "
                "blocks until woken, microseconds: a blocked rank waits for the scheduler to wake it, which on a busy "
                "machine costs every call 100 us or more", "shm"),
        Setting("WINDOW_DIRECT_BYTES", "bytes", None, "read peers' buffers directly from this size on, for every "
                "collective (default: per collective, see docs/shared-memory.md); all ranks must agree", "shm"),
        Setting("WINDOW_COMPILED_DIRECT_BYTES", "bytes", None, "allgather, alltoall, scatter, bcast, gather, "
                "allreduce and reduce read peers' buffers directly in one compiled call at every size from this one on "
                "(default: per collective, see docs/shared-memory.md); all ranks must agree", "shm"),
        Setting("WINDOW_PIECE_BYTES", "bytes", None, "every compiled call of two pieces or more moves its data "
                "through the window in pieces of this size, a reader taking each piece once its writer has filled "
                "it (0: none; unset: from a copy of 1 MiB where each rank has a core, see docs/shared-memory.md)",
                "shm"),
        Setting("COMPILED", "bool", True, "use the C fast path when it is built", "shm"),
        Setting("COPY_REP_MOVSB", "bool", True, "compiled copies of 4 KiB and more are one rep movsb where the "
                "processor has fast string copies (x86-64 ERMS); 0: the C library's memcpy (to measure)", "shm"),
        # TCP
        Setting("ZMQ_LANES", "bool", True, "carry the data of TCP jobs on direct lanes (not over ZeroMQ)", "tcp"),
        Setting("ZMQ_REUSE_BUFFERS", "bool", True, "let glibc reuse libzmq's receive buffers", "tcp"),
        # RDMA and GPUs
        Setting("IBVERBS", "str", None, "the path of libibverbs to load", "rdma"),
        Setting("IB_GID_INDEX", "int", 0, "the GID index of RDMA over Ethernet", "rdma"),
        Setting("CUDART", "str", None, "the path of libcudart to load", "gpu"),
        Setting("CUDA_PINNED_CACHE_BYTES", "bytes", 512 << 20, "pinned host memory kept for reuse by the staging "
                "of GPU arrays (allocating it costs about 0.7 ms per MiB); 0 keeps none", "gpu"),
        # integrations
        Setting("JAX_FFI", "bool", True, "run JAX's in-jit allreduce as an XLA FFI call (built on first use "
                "with the C++ compiler); 0: an ordered io_callback", "integrations"),
        # algorithms
        Setting("PROFILE", "str", None, "where calibration profiles are: a folder of them, or one .json used for "
                "every transport (default: the user's cache folder)", "algorithms"),
        Setting("SELECTOR", "str", "auto", "what algorithm=\"auto\" follows: auto (the cost models with rank 0's "
                "calibration profile of the transport where it has one, else the rule), model (the cost models, "
                "with default parameters where no profile), rule (the size-and-ranks rule)", "algorithms",
                ("auto", "model", "rule")),
        Setting("HIERARCHY", "str", "auto", "ranks on several hosts, some sharing one: auto (shared memory within "
                "a host, the job's transport between hosts, algorithms chosen by the cost models) or off (flat)",
                "algorithms", ("auto", "off")),
        # trust and observability
        Setting("SIGNATURE_CHECKS", "bool", True, "check every call's signature: turn off only to measure "
                "what the checks cost (mismatched calls then go unnoticed)", "observability"),
        Setting("FLIGHT_RECORDER", "int", 2000, "calls each rank keeps in its flight recorder (0: off)",
                "observability"),
        Setting("DEBUG_DIR", "str", None, "where flight records are written (default "
                "$XDG_CACHE_HOME/collectives/flight or ~/.cache/collectives/flight)", "observability"),
        Setting("TRACE", "str", None, "a directory: every rank writes its timeline there (Chrome trace JSON)",
                "observability"),
        Setting("DEBUG", "str", None, "the debug log's level: WARN, INFO or TRACE", "observability",
                ("WARN", "WARNING", "INFO", "DEBUG", "TRACE", "ERROR")),
        Setting("DEBUG_SUBSYS", "str", None, "the debug log's subsystems, e.g. init,shm,tcp,select (^x drops x)",
                "observability"),
        Setting("DEBUG_FILE", "str", None, "the debug log's file (%h host, %p pid, %r rank), default stderr",
                "observability"),
        # the test suite and benches
        Setting("SUITE_TIMEOUT", "float", None, "seconds per test of torch's suite (python -m "
                "collectives.bench.torch_suite)", "benches"),
        Setting("SUITE_BACKEND", "str", None, "set by the torch suite's driver for its ranks", "benches"),
        Setting("SUITE_SPAWN_ALL", "bool", False, "set by the torch suite's driver for its ranks", "benches"),
        Setting("SUITE_PROFILE_CHECKS", "bool", True, "set by the torch suite's driver for its ranks", "benches"),
        Setting("SUITE_START", "str", "spawn", "set by the torch suite's driver: how its ranks start", "benches",
                ("spawn", "forkserver")),
    ]
    return {x.name: x for x in s}


SETTINGS: dict[str, Setting] = _settings()

def _parse(setting: Setting, raw: str) -> Any:
    kind = setting.kind
    if kind == "bool":
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError("expected 1/0, true/false, yes/no or on/off")
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    if kind == "bytes":
        return parse_bytes(raw)
    if setting.choices is not None and raw.upper() not in setting.choices and raw not in setting.choices:
        raise ValueError(f"expected one of {', '.join(setting.choices)}")
    return raw


def get(name: str, default: Any = None, env: dict[str, str] | None = None) -> Any:
    """The value of ``COLLECTIVES_<name>`` as its declared type, its default
    when unset (or ``default`` where given).

    Raises:
        KeyError: ``name`` is not declared (a bug in the caller).
        BadArgument: the value is not of the declared type (naming the variable).
    """
    setting = SETTINGS[name]
    raw = (os.environ if env is None else env).get(setting.variable)
    if raw is None or (raw == "" and setting.kind not in ("str", "bool")):
        return setting.default if default is None else default
    try:
        return _parse(setting, raw)
    except ValueError as exc:
        from .errors import BadArgument

        raise BadArgument(f"{setting.variable}={raw!r}: {exc} (a {setting.kind} setting: {setting.doc})") from None


def option(options: dict[str, Any], key: str, name: str) -> Any:
    """An option given in code (``options[key]``, read as ``COLLECTIVES_<name>``'s
    type when it is text) or else the setting ``COLLECTIVES_<name>``.

    Raises:
        BadArgument: as :func:`get`, naming the option.
    """
    if options.get(key) is None:
        return get(name)
    value = options[key]
    if not isinstance(value, str):
        return value
    setting = SETTINGS[name]
    try:
        return _parse(setting, value)
    except ValueError as exc:
        from .errors import BadArgument

        raise BadArgument(f"option {key}={value!r}: {exc} (as {setting.variable}: {setting.doc})") from None


def is_set(name: str) -> bool:
    """Whether ``COLLECTIVES_<name>`` is set (to anything but an empty string)."""
    return bool(os.environ.get(SETTINGS[name].variable))


#: Variables that were renamed: old name -> new name (a warning says so when the old one is set).
RENAMED = {"NATIVE": "COMPILED"}


def log_settings(log: logging.Logger) -> None:
    """Log, at debug level, every declared variable that is set, and any
    ``COLLECTIVES_*`` variable that is not declared (a typo?); warn about
    renamed ones, which are not read."""
    for old, new in RENAMED.items():
        if ("COLLECTIVES_" + old) in os.environ:
            log.warning("COLLECTIVES_%s is not read any more: it is now COLLECTIVES_%s", old, new)
    if not log.isEnabledFor(logging.DEBUG):
        return
    for key, value in sorted(os.environ.items()):
        if key.startswith("COLLECTIVES_"):
            name = key[len("COLLECTIVES_"):]
            shown = "(set)" if name == "SECRET" else value
            if name in SETTINGS:
                log.debug("setting %s=%s", key, shown)
            else:
                log.debug("setting %s=%s is not a setting of this library (a typo?)", key, shown)


_GROUPS = {"launch": "Launching", "shm": "Shared memory", "tcp": "TCP", "rdma": "RDMA", "gpu": "GPUs", "integrations": "Integrations",
           "algorithms": "Algorithms", "observability": "Trust and observability", "benches": "Benches"}


def markdown() -> str:
    """docs/environment.md, from the declarations."""
    lines = ["# Environment variables", "",
             "Every setting the library reads from the environment, generated from "
             "`collectives/config.py` (`collectives settings --write-docs`). Booleans take "
             "1/0, true/false, yes/no or on/off; byte counts take K, M and G suffixes.", ""]
    for group, title in _GROUPS.items():
        members = [s for s in SETTINGS.values() if s.group == group]
        if not members:
            continue
        lines += [f"## {title}", "", "| variable | type | default | what |", "|---|---|---|---|"]
        for s in members:
            default = "unset" if s.default is None else (
                str(int(s.default)) if s.kind == "bool" else str(s.default))
            lines.append(f"| `{s.variable}` | {s.kind} | {default} | {s.doc} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``collectives settings [--write-docs]``: print the settings (or write docs/environment.md)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "environment.md")
    if argv[:1] == ["--write-docs"]:
        with open(path, "w") as f:
            f.write(markdown())
        print(f"wrote {path}")
        return 0
    print(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
