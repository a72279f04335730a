"""Every `dsv41 …` command line quoted in README.md, docs/*.md and .env.tp4.example parses with
today's CLI (issue 51: the docs had kept `profile diff FILE:LINE FILE:LINE` and gate boot's
`--control` / `--candidate` / `--model` after the CLI changed).

Parsed at the argparse level only, nothing runs: `dsv41 …` through adapter/tools/cli.py
build_parser, `dsv41 sim NAME …` through the simulation's own parser (caught at parse_args).

What counts as a quoted command line:
- a backtick span that starts with `dsv41 `, `.venv/bin/dsv41 ` or `$ dsv41 `;
- a code line (indented 4+ spaces, or inside a ``` fence) where `dsv41` is a command word: at
  the start (after an optional `$ ` and a directory) or after `&&`;
- in .env.tp4.example, every `dsv41 …` in a comment, which must be in backticks.
A code line must parse whole, required options included. A backtick quote in prose may be a
fragment (`dsv41 canary --nodes 2`, `dsv41 calibrate yield`): its command words must be command
names and its options, values and positionals must parse, required options aside. Synopsis
notation is expanded: each
`[...]` is included, each `a|b` is tried per alternative; placeholders (`<run-id>`, `$(...)`,
all-caps metavariables such as F, N, URL) become a value the option accepts.
"""
import argparse
import importlib
import re
import shlex

import pytest
from conftest import REPO_ROOT

from adapter.tools import cli

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
PROFILE = REPO_ROOT / ".env.tp4.example"
SPAN = re.compile(r"`([^`\n]+)`")
START = re.compile(r"^(?:\$ )?(?:\S*/)?dsv41 (?=[a-z])")
CODE_CMD = re.compile(r"(?:^\s*(?:\$ )?|&&\s*)((?:\S*/)?dsv41 [a-z].*?)(?=\s+&&|$)")
METAVAR = re.compile(r"^[A-Z][A-Z0-9_]*$")


def _code_lines(text: str):
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            yield n, line


def quoted_commands():
    """(where, command text after `dsv41 `, whole) for every quote; whole: a code line, parsed
    with its required options."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in SPAN.finditer(text):
            span = m.group(1).replace("\\|", "|")
            for part in span.split("&&"):
                part = part.strip()
                if START.match(part):
                    out.append((f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}",
                                START.sub("", part, count=1), False))
        for n, line in _code_lines(text):
            for m in CODE_CMD.finditer(line):
                out.append((f"{path.name}:{n}", re.sub(r"^(?:\S*/)?dsv41 ", "", m.group(1)), True))
    for n, line in enumerate(PROFILE.read_text().splitlines(), 1):
        if line.startswith("#"):
            for m in SPAN.finditer(line):
                if START.match(m.group(1)):
                    out.append((f"{PROFILE.name}:{n}", START.sub("", m.group(1), count=1), False))
    return out


def _tree(parser, path=()):
    out = {path: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.update(_tree(sub, path + (name,)))
    return out


PARSERS = _tree(cli.build_parser())


class _Parsed(Exception):
    pass


def _sim_parser(name, monkeypatch):
    found = {}

    def catch(self, *args, **kwargs):
        found["parser"] = self
        raise _Parsed()

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", catch)
        with pytest.raises(_Parsed):
            importlib.import_module(cli.SIMS[name]).main([])
    return found["parser"]


def _options(parser):
    return {o: a for a in parser._actions for o in a.option_strings}


def _value_for(action) -> str:
    """A value the option accepts, for a placeholder."""
    if action is None:
        return "x"
    if action.choices:
        return str(next(iter(action.choices)))
    if action.type in (int, float):
        return "1"
    if isinstance(action.default, (list, tuple)):
        return ",".join(map(str, action.default))
    if action.default not in (None, False):
        return str(action.default)
    return "x"


def _words(command: str) -> list[str]:
    text = re.sub(r"\$\([^)]*\)", "x", command)          # $(date -u +%Y%m%d)
    text = re.sub(r"<[^<>\s]+>", "x", text)              # runs/<run-id>, http://<head>:30000
    # [...] groups are included (innermost first); `...` is an ellipsis
    while re.search(r"\[([^\[\]]*)\]", text):
        text = re.sub(r"\[([^\[\]]*)\]", r" \1 ", text)
    text = text.replace("…", " ").replace("...", " ")
    return shlex.split(text, comments=True)


def _variants(words: list[str]) -> list[list[str]]:
    """One word list per alternative of the `a|b|c` words (the i-th alternative of each)."""
    alts = [w.split("|") if "|" in w and not w.startswith("http") else [w] for w in words]
    n = max(len(a) for a in alts) if alts else 1
    return [[a[min(i, len(a) - 1)] for a in alts] for i in range(n)]


def _path(words: list[str]) -> tuple[tuple[str, ...], list[str]]:
    path = ()
    while words and path + (words[0],) in PARSERS:
        path, words = path + (words[0],), words[1:]
    return path, words


def _fill(parser, words: list[str]) -> list[str]:
    """Metavariables (F, N, URL, ...) replaced by a value their option accepts."""
    options, out = _options(parser), []
    for i, w in enumerate(words):
        if METAVAR.match(w):
            prev = options.get(words[i - 1]) if i else None
            out.append(_value_for(prev))
        else:
            out.append(w)
    return out


def _parse(parser, words: list[str], capsys, whole: bool = True) -> str:
    """'' when argparse accepts the words; else its error. Not whole: required options aside."""
    relaxed = [] if whole else [a for a in parser._actions if a.option_strings and a.required]
    for a in relaxed:
        a.required = False
    try:
        parser.parse_args(words)
    except SystemExit as exc:
        return f"exit {exc.code}: {capsys.readouterr().err.strip().splitlines()[-1:]}"
    except _Parsed:
        pass
    finally:
        for a in relaxed:
            a.required = True
    return ""


def test_the_docs_quote_commands():
    found = quoted_commands()
    assert len(found) >= 40
    where = {w.split(":")[0] for w, _, _ in found}
    assert sum(whole for _, _, whole in found) >= 15
    assert {"README.md", "gate.md", ".env.tp4.example"} <= where


def test_every_quoted_command_parses(monkeypatch, capsys):
    bad = []
    for where, command, whole in quoted_commands():
        words = _words(command)
        if not words:
            continue
        for variant in _variants(words):
            path, rest = _path(variant)
            if not path:
                bad.append(f"{where}: dsv41 {command}: {variant[0]!r} is no dsv41 command")
                break
            if not rest and not whole:
                continue                  # the command's name only: its words are command names
            if path == ("sim",):
                name, rest = rest[0], rest[1:]
                if name not in cli.SIMS:
                    bad.append(f"{where}: dsv41 {command}: no simulation {name!r}")
                    break
                parser = _sim_parser(name, monkeypatch)
            else:
                parser = PARSERS[path]
                if any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
                    bad.append(f"{where}: dsv41 {command}: {' '.join(path)} needs a sub-command")
                    break
            error = _parse(parser, _fill(parser, rest), capsys, whole)
            if error:
                bad.append(f"{where}: dsv41 {command}: {' '.join(variant)}: {error}")
    assert not bad, "quoted dsv41 commands that today's CLI refuses:\n" + "\n".join(bad)


def test_the_profile_quotes_its_commands_in_backticks():
    """.env.tp4.example: every `dsv41 <command>` in its comments is a backtick quote (so the check
    above sees it)."""
    loose = []
    for n, line in enumerate(PROFILE.read_text().splitlines(), 1):
        if not line.startswith("#"):
            continue
        outside = SPAN.sub("", line)
        if re.search(r"\bdsv41 (?:" + "|".join(p[0] for p in PARSERS if len(p) == 1) + r")\b", outside):
            loose.append(f"{n}: {line}")
    assert not loose, loose


@pytest.mark.parametrize("stale", [
    "profile diff .env.tp4.example:control .env.tp4.example:production",
    "gate boot --profile F --out DIR --control control --candidate production --model dense",
    "check --profile F --nosuch",
    "sim thin --tails N --nosuch",
])
def test_the_check_refuses_stale_syntax(stale, monkeypatch, capsys):
    """Negative controls: the stale lines the issue found fail the same parse."""
    words = _words(stale)
    path, rest = _path(words)
    if path == ("sim",):
        parser, rest = _sim_parser(rest[0], monkeypatch), rest[1:]
    else:
        parser = PARSERS[path]
    assert _parse(parser, _fill(parser, rest), capsys).startswith("exit 2")
