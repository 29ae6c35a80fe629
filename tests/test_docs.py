"""The documentation against the code: links resolve, every public call and
setting named exists, and the README's two commands are the ones CI runs.

Reads README.md, docs/*.md and .ci/run as text; imports the package only to
list the Communicator's public methods and the command line's subcommands.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
CI_RUN = ROOT / ".ci" / "run"
SOURCE_DIRS = ("collectives", "transports", "devices", "cost_models", "integrations", "bench")
#: Top-level folders whose paths the docs may name in inline code.
REPO_DIRS = ("collectives", "transports", "devices", "cost_models", "integrations", "bench", "examples", "tests",
             "docs", ".ci")
#: Pages generated from the code; a link to one stands while its generator does.
GENERATED = {"docs/environment.md": ("collectives.config", "markdown")}

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
SETTING = re.compile(r"\bCOLLECTIVES_[A-Z0-9]+(?:_[A-Z0-9]+)*\b")
PY_MODULE = re.compile(r"python3? -m ((?:collectives|bench)(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (links there are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _fenced_blocks(text: str) -> list[str]:
    """The contents of every fenced code block of ``text``."""
    blocks = []
    for m in FENCE.finditer(text):
        lines = m.group(0).splitlines()
        blocks.append("\n".join(lines[1:-1]))
    return blocks


def _code(text: str) -> list[str]:
    """Every fenced block and inline code span of ``text``."""
    outside = FENCE.sub("", text)
    return _fenced_blocks(text) + INLINE_CODE.findall(outside)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for m in HEADING.finditer(FENCE.sub("", _text(page))):
        base = _slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def _relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(_text(page)))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def _generated(rel: str) -> bool:
    """Whether ``rel`` (from the repository root) is a generated page whose
    generator exists."""
    if rel not in GENERATED:
        return False
    module, function = GENERATED[rel]
    spec = importlib.util.find_spec(module)
    if spec is None:
        return False
    mod = importlib.import_module(module)
    return callable(getattr(mod, function, None))


def test_there_are_docs_to_check():
    assert README.exists()
    names = {p.name for p in DOCS}
    for wanted in ("guide.md", "transports.md", "performance.md", "cost-models.md", "training-model.md",
                   "observability.md", "architecture.md", "launching.md", "failures.md", "shared-memory.md"):
        assert wanted in names, f"docs/{wanted} is missing"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_an_existing_file_and_heading(page):
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        dest = page if not path else (page.parent / path).resolve()
        rel = os.path.relpath(dest, ROOT)
        if not dest.exists():
            if not _generated(rel):
                broken.append(f"{target}: no file {rel}")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {rel}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_named_in_code_exists(page):
    missing = []
    for span in INLINE_CODE.findall(FENCE.sub("", _text(page))):
        span = span.strip()
        if not re.fullmatch(r"[A-Za-z_.][\w.-]*(/[\w.-]+)+/?", span):
            continue
        if span.split("/")[0] not in REPO_DIRS:
            continue
        if not (ROOT / span).exists() and not _generated(span.rstrip("/")):
            missing.append(span)
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_every_public_method_of_the_communicator_is_in_the_guide():
    from collectives import Communicator

    guide = _text(ROOT / "docs" / "guide.md")
    public = sorted(n for n in dir(Communicator) if not n.startswith("_"))
    assert public, "the Communicator has no public method?"
    missing = [n for n in public if not re.search(rf"[`.]{re.escape(n)}\b", guide)]
    assert not missing, f"docs/guide.md does not document Communicator.{', .'.join(missing)}"


def _source_text() -> str:
    parts = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".c") and path.is_file():
                parts.append(path.read_text(encoding="utf-8", errors="replace"))
    return "\n".join(parts)


def _declared_settings() -> set[str]:
    """Names declared in collectives/config.py (``Setting("NAME", ...)``), with the prefix."""
    config = ROOT / "collectives" / "config.py"
    if not config.exists():
        return set()
    return {"COLLECTIVES_" + n for n in re.findall(r"Setting\(\s*\"([A-Z0-9_]+)\"", _text(config))}


def test_every_setting_named_in_the_docs_exists_in_the_code():
    source = _source_text()
    declared = _declared_settings()
    unknown = {}
    for page in PAGES:
        for name in sorted(set(SETTING.findall(_text(page)))):
            if name not in source and name not in declared:
                unknown.setdefault(str(page.relative_to(ROOT)), []).append(name)
    assert not unknown, f"settings named in the docs that no code reads: {unknown}"


def _subcommands() -> set[str]:
    from collectives.cli import SUBCOMMANDS

    return set(SUBCOMMANDS)


def _command_lines(page: Path) -> list[str]:
    """Every shell line of the code in ``page`` that runs the ``collectives`` command
    (a leading ``$ `` prompt and ``VAR=value`` assignments dropped)."""
    lines = []
    for code in _code(_text(page)):
        for line in code.splitlines():
            line = line.strip().removeprefix("$ ")
            for part in re.split(r"&&|;|\|", line):
                words = part.split()
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                    words.pop(0)
                if len(words) >= 2 and words[0] == "collectives":
                    lines.append(" ".join(words))
    return lines


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_subcommand_and_module_named_exists(page):
    known = _subcommands()
    wrong = []
    for line in _command_lines(page):
        sub = line.split()[1].rstrip(":,.")  # "collectives run: ..." is the launcher speaking
        if not sub.startswith("-") and sub not in known and not sub.isupper():
            wrong.append(line)
    for code in _code(_text(page)):
        for module in PY_MODULE.findall(code):
            name = module if module.startswith("collectives") else "collectives." + module
            if importlib.util.find_spec(name) is None:
                wrong.append(f"python -m {module}")
    assert not wrong, f"{page.relative_to(ROOT)} names commands that do not exist: {wrong}"


# -- the README's two commands and CI ------------------------------------------


def _two_commands() -> list[str]:
    """The fenced commands of the README's "Two commands" section."""
    text = _text(README)
    m = re.search(r"^## Two commands\s*$(.*?)(?=^## )", text, re.S | re.M)
    assert m, "README.md has no '## Two commands' section"
    blocks = [b.strip() for b in _fenced_blocks(m.group(1))]
    assert len(blocks) == 2, f"the 'Two commands' section must hold two commands, found {blocks}"
    for b in blocks:
        assert "\n" not in b, f"each of the two commands is one line: {b!r}"
    return blocks


def _normalized(command: str) -> list[str]:
    """A command's words as CI and a user would run it alike: ``python3`` is
    ``python``, ``python -m pip`` is ``pip``, pip's ``-q`` is dropped, and a
    trailing comment goes."""
    words = shlex.split(command, comments=True)
    words = ["python" if w == "python3" else w for w in words]
    if words[:3] == ["python", "-m", "pip"]:
        words = words[2:]
    if words[:1] == ["pip"]:
        words = [w for w in words if w not in ("-q", "--quiet")]
    return words


def _ci_commands() -> tuple[list[str], list[str]]:
    """The install and test commands of .ci/run."""
    install = test = None
    for line in _text(CI_RUN).replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        words = _normalized(line)
        if words[:2] == ["pip", "install"]:
            assert install is None, ".ci/run installs twice"
            install = words
        elif "pytest" in words:
            assert test is None, ".ci/run runs pytest twice"
            test = words
    assert install and test, ".ci/run must install the project and run pytest"
    return install, test


def test_the_readme_test_command_is_what_ci_runs():
    _, test_command = _two_commands()
    parts = [p.strip() for p in test_command.split("&&")]
    assert len(parts) == 2, f"the test command installs, then tests: {test_command!r}"
    install, test = _ci_commands()
    assert _normalized(parts[0]) == install, (
        f"README installs {parts[0]!r}, .ci/run {' '.join(install)!r}: keep them the same")
    assert _normalized(parts[1]) == test, (
        f"README tests with {parts[1]!r}, .ci/run with {' '.join(test)!r}: keep them the same")


def test_the_readme_main_command_installs_the_project_and_runs_the_bench():
    main_command, _ = _two_commands()
    parts = [_normalized(p) for p in main_command.split("&&")]
    assert parts == [["pip", "install", "-e", "."], ["collectives", "bench"]], main_command
    install, _ = _ci_commands()
    assert "-e" in install and any(w == "." or w.startswith(".[") for w in install), (
        ".ci/run installs the project the README's first command installs")
    pyproject = _text(ROOT / "pyproject.toml")
    assert re.search(r'^collectives\s*=\s*"collectives\.cli:main"', pyproject, re.M), (
        "pyproject.toml declares no 'collectives' command")
    assert "bench" in _subcommands()


def test_the_bench_subcommand_starts():
    res = subprocess.run([sys.executable, "-m", "collectives.cli", "bench", "--help"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage: collectives bench" in res.stdout
