"""docs/commands.md stays true to the command line, and every relative link of the docs resolves.

Every command that `ddloco --help` lists (and every command of `ddloco sim --help`, `ddloco bench
sync|group`, and the `python -m` tools of TOOLS) has a heading in docs/commands.md, and every long
flag its `--help` prints is named in that heading's section. The help is the real one, printed in
this process by `ddloco.cli.main` (or the tool's `__main__`), so a flag added to (or generated for)
a command fails here until it is documented. Every relative link of README.md and docs/ names a
file that exists, and an anchor into a markdown file names one of its headings."""
from __future__ import annotations

import contextlib
import io
import re
import runpy
import sys
import warnings
from pathlib import Path

import pytest

from ddloco.cli import main

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
COMMANDS_MD = REPO / "docs" / "commands.md"
NESTED = {"bench": ("sync", "group"), "slurm": ("submit", "add", "report", "stop")}
"""Subcommands whose --help is their own but that `ddloco bench --help` names only in prose."""
TOOLS = ("ddloco.bench.insider", "ddloco.bench.security", "ddloco.bench.rejoin", "ddloco.bench.member_limits",
         "ddloco.bench.multihost", "ddloco.slurm.check", "ddloco.slurm.services", "common.health", "common.redis_server", "docker/compose_check.py")
"""The tools outside `ddloco` that take flags: `python -m MODULE` (or `python FILE.py`)."""

_OPTION = re.compile(r"^(?: {1,4}|[│|] {0,3})(?:-[A-Za-z0-9], )?(--[A-Za-z0-9][\w-]*)", re.M)
_COMMAND_ROW = re.compile(r"^ {4}([a-z][\w-]*)(?: {2,}\S|\s*$)", re.M)
_HEADING = re.compile(r"^(#{1,6}) (.*)$", re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def help_text(*argv: str) -> str:
    """What `ddloco ARGV --help` prints (argparse exits 0 after printing it)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main([*argv, "--help"])
        except SystemExit as e:
            code = e.code
    assert code in (0, None), f"ddloco {' '.join(argv)} --help exited {code}"
    return out.getvalue()


def tool_help_text(tool: str) -> str:
    """What `python -m TOOL --help` (or `python TOOL --help` for a file) prints, run in this process."""
    out, argv = io.StringIO(), sys.argv
    sys.argv = [tool, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # runpy: the module was imported before
            if tool.endswith(".py"):
                runpy.run_path(str(REPO / tool), run_name="__main__")
            else:
                runpy.run_module(tool, run_name="__main__", alter_sys=False)
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = argv
    assert code in (0, None), f"{tool} --help exited {code}"
    return out.getvalue()


def long_flags(text: str) -> set[str]:
    """The long flags of a --help's option lines (not the ones its prose mentions)."""
    return set(_OPTION.findall(text)) - {"--help"}


def subcommands(text: str) -> list[str]:
    """The COMMAND names a --help lists under its positional arguments (else its usage's {a,b,...})."""
    if "positional arguments:" not in text:
        choices = re.search(r"\{([\w,-]+)\}", text)
        return choices.group(1).split(",") if choices else []
    block = text.split("positional arguments:", 1)[1].split("\noptions:", 1)[0]
    return [name for name in _COMMAND_ROW.findall(block) if name != "command"]


def section(doc: str, title: str) -> str:
    """The text under the heading whose title is exactly ``title`` (backquotes ignored), up to the
    next heading of the same or a higher level; '' when there is no such heading."""
    headings = list(_HEADING.finditer(doc))
    for i, h in enumerate(headings):
        if h.group(2).replace("`", "").strip() == title:
            level = len(h.group(1))
            end = next((n.start() for n in headings[i + 1:] if len(n.group(1)) <= level), len(doc))
            return doc[h.end():end]
    return ""


def undocumented(doc: str, argv: tuple[str, ...], tool: str = "") -> list[str]:
    """What `ddloco ARGV` (or the tool `python -m TOOL`) lacks in ``doc``: its heading, or the flags
    its section does not name."""
    title = (f"python {tool}" if tool.endswith(".py") else f"python -m {tool}") if tool else " ".join(("ddloco", *argv))
    body = section(doc, title)
    if not body:
        return [f"no heading '{title}'"]
    flags = long_flags(tool_help_text(tool) if tool else help_text(*argv))
    assert flags or argv in (("sim",), ("slurm",)), f"no flags parsed from `{title} --help`: the help's layout changed?"
    return [f"{title} {flag}" for flag in sorted(flags)
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", body)]


def documented_commands() -> list[tuple[str, ...]]:
    """(ddloco's argv of) every command and subcommand whose flags docs/commands.md must name."""
    top = subcommands(help_text())
    assert {"up", "learner", "syncer", "broker", "sim", "bench"} <= set(top), top
    out = [(c,) for c in top]
    out += [("sim", c) for c in subcommands(help_text("sim"))]
    out += [(parent, c) for parent, children in NESTED.items() for c in children]
    return out


def test_every_command_and_long_flag_of_the_help_is_in_docs_commands_md() -> None:
    doc = COMMANDS_MD.read_text()
    missing = [m for argv in documented_commands() for m in undocumented(doc, argv)]
    assert missing == [], f"docs/commands.md does not document: {missing}"


def test_every_long_flag_of_the_tools_is_in_docs_commands_md() -> None:
    doc = COMMANDS_MD.read_text()
    missing = [m for tool in TOOLS for m in undocumented(doc, (), tool)]
    assert missing == [], f"docs/commands.md does not document: {missing}"


def test_a_command_or_flag_removed_from_the_doc_is_reported() -> None:
    """The check itself: the doc less a flag's mentions, or less a command's heading, fails."""
    doc = COMMANDS_MD.read_text()
    without_flag = re.sub(r"(?<![\w-])--checkpoint-every(?![\w-])", "", doc)
    assert undocumented(without_flag, ("syncer",)) == ["ddloco syncer --checkpoint-every"]
    without_heading = doc.replace("## `ddloco status`", "## status, the live view")
    assert undocumented(without_heading, ("status",)) == ["no heading 'ddloco status'"]
    without_tool_flag = re.sub(r"(?<![\w-])--cut-s(?![\w-])", "", doc)
    assert undocumented(without_tool_flag, (), "ddloco.bench.multihost") == ["python -m ddloco.bench.multihost --cut-s"]


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: lower case, punctuation dropped, spaces
    as hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.group(2).strip().lower()).replace(" ", "-") for h in _HEADING.finditer(text)}


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """Relative links of a markdown file whose target file does not exist, or whose anchor names no
    heading of the markdown file it points to."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    out = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http:, mailto:
        file, _, anchor = target.partition("#")
        dest = path.parent / file if file else path
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            out.append(f"{path.relative_to(root)}: {target}")
    return out


def test_every_relative_link_of_the_readme_and_docs_points_to_a_file_and_heading() -> None:
    files = markdown_files()
    assert REPO / "docs" / "commands.md" in files
    broken = [b for f in files for b in broken_links(f)]
    assert broken == [], f"links to a missing file or heading: {broken}"


def test_a_link_to_a_missing_file_or_heading_is_reported(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A page\n## The `x` flag's use\n[ok](page.md#a-page) [anchor](#the-x-flags-use) "
                    "[web](https://example.org) [gone](docs/nowhere.md#a) [no heading](#nowhere)\n"
                    "```\n[in code](not/checked.md)\n# not a heading\n```\n")
    assert broken_links(page, root=tmp_path) == ["page.md: docs/nowhere.md#a", "page.md: #nowhere"]
