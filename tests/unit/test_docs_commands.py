"""Every `dldctl` command the README and docs/ show still parses: the command path exists and
the real command-line parser accepts its options and values (nothing is run).

A concrete command (`dldctl chaos kill learner-2 --down-for 5`) is parsed whole, as the shell
would pass it; a synopsis (`dldctl chaos pause LEARNER --duration S [--force] [--json]`) must
name a command that exists and only options it has, as must a command named in prose (inline
code) and a documented mistake (a command whose next line is its `error: ...`). Commands come
from fenced code blocks (in a block with `$ ` prompts, only the prompted lines: the rest is
output) and from inline code.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer

from dldctl.cli import ClickException, app

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SYNOPSIS = re.compile(r"\[|\||\.\.\.|<[^>]+>")  # [optional], a|b, ..., <placeholder>


@dataclass(frozen=True)
class Documented:
    where: str
    line: str
    is_mistake: bool = False  # a documented mistake: the next line is its `error: ...`
    inline: bool = False  # in prose, a reference (`dldctl logs`) rather than a whole command


def _clean(text: str) -> str:
    """The command alone: no comment, redirection or pipe after it."""
    text = re.split(r"\s+#\s", text, maxsplit=1)[0]
    text = re.split(r"\s+\d?>|\s+\|\s", text, maxsplit=1)[0]
    return text.strip().rstrip("`").strip()


def _block_commands(path: Path, lines: list[str], start: int) -> list[Documented]:
    prompted = any(line.lstrip().startswith("$ ") for line in lines)
    out = []
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if prompted and not line.startswith("$ "):
            i += 1
            continue
        line = line.removeprefix("$ ").strip()
        first = i
        while line.endswith("\\") and i + 1 < len(lines):  # a continued line
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        if line.startswith("dldctl ") or line == "dldctl":
            mistake = i + 1 < len(lines) and lines[i + 1].strip().startswith("error:")
            out.append(Documented(f"{path.name}:{start + first + 1}", _clean(line), mistake))
        i += 1
    return out


def documented_commands() -> list[Documented]:
    found: list[Documented] = []
    for path in DOCS:
        text = path.read_text().splitlines()
        block: list[str] | None = None
        start = 0
        for n, line in enumerate(text):
            if line.strip().startswith("```"):
                if block is None:
                    block, start = [], n + 1
                else:
                    found += _block_commands(path, block, start)
                    block = None
                continue
            if block is not None:
                block.append(line)
                continue
            for inline in re.findall(r"`(dldctl [^`]+)`", line):
                found.append(Documented(f"{path.name}:{n + 1}", _clean(inline), inline=True))
    return found


def _resolve(args: list[str]) -> tuple[Any, list[str]]:
    """The (sub)command named by the leading words, and the words left for it (the parser's
    own command objects: typer carries its own click, reached through typer's public API)."""
    command: Any = typer.main.get_command(app)
    while getattr(command, "commands", None) is not None and args and not args[0].startswith("-"):
        sub = command.commands.get(args[0])
        assert sub is not None, f"no command {args[0]!r}"
        command, args = sub, args[1:]
    return command, args


def _options(command: Any) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)} | {"-h", "--help"}


def check(doc: Documented) -> None:
    words = shlex.split(doc.line)[1:]
    if doc.inline or doc.is_mistake or SYNOPSIS.search(doc.line):  # the command and its options exist
        alternatives = [w.split("|")[0] if re.fullmatch(r"[a-z-]+(\|[a-z-]+)+", w) else w for w in words]
        command, rest = _resolve([w for w in alternatives if not SYNOPSIS.search(w)][:3])
        named = {w.split("=")[0].strip("[]|.") for w in re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", doc.line)}
        unknown = named - _options(command)
        assert not unknown, f"{doc.where}: `{doc.line}`: {command.name} has no {sorted(unknown)}"
        return
    command, rest = _resolve(words)
    if getattr(command, "commands", None) is not None and not rest:  # `dldctl chaos`: its help
        return
    try:
        command.make_context(command.name or "dldctl", rest, resilient_parsing=False)
    except typer.Exit:  # an eager option that answers and exits: --version, --help
        pass


CASES = documented_commands()


def test_the_docs_show_commands() -> None:
    assert len(CASES) > 60  # the extraction works (a regression would silently test nothing)
    assert any(c.is_mistake for c in CASES)


@pytest.mark.parametrize("doc", CASES, ids=[f"{c.where} {c.line}" for c in CASES])
def test_documented_command_parses(doc: Documented) -> None:
    try:
        check(doc)
    except ClickException as exc:
        message: Any = exc
        pytest.fail(f"{doc.where}: `{doc.line}` does not parse: {message.format_message()}")
