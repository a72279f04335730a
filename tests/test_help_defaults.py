"""Every `dsv41` help text states the default the code applies (issue 51: `gate boot --help` said
0.01 for --t1-alpha while the code used 2e-5).

Read from the parsers themselves (adapter/tools/cli.py build_parser and each simulation's own
parser): an option with a default states it in its help, and the stated value equals the
parser's. An option whose parser default is None but whose help states a number (a value the
command fills in later) must be listed in RESOLVED with the code's constant, so the two cannot
drift apart."""
import argparse
import importlib
import re

import pytest

from adapter.tools import calibrate, cli
from adapter.tools.gate import boot, verdict

STATED = re.compile(r"\bdefault:? ([^\s;)]+)|\b(\S+) \(default\)")
NUMBER = re.compile(r"^-?\d[\d.e+-]*$")

# Defaults the code applies after parsing (the parser keeps None): (command path, option) -> value.
RESOLVED = {
    ("dsv41", "calibrate", "--decode-log-interval"): calibrate.DEFAULT_DECODE_LOG_INTERVAL,
    **{("dsv41", "gate", "verdict", f"--{k.replace('_', '-')}"): v
       for k, v in verdict.DEFAULTS.items() if v is not None},
    **{("dsv41", "gate", "boot", f"--{k.replace('_', '-')}"): v
       for k, v in verdict.DEFAULTS.items() if v is not None},
    ("dsv41", "gate", "boot", "--speed-floor"): boot.CPU_SPEED_FLOOR,
    ("dsv41", "gate", "boot", "--t1-alpha"): boot.CPU_T1_ALPHA,
}


def _parsers(parser, path=("dsv41",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def _sim_parsers(monkeypatch):
    """Each simulation builds its parser in main(): catch it at parse_args (`--help` never runs)."""
    found = {}

    def catch(self, *args, **kwargs):
        found[self.prog] = self
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    for name, module in sorted(cli.SIMS.items()):
        with pytest.raises(SystemExit):
            importlib.import_module(module).main(["--help"])
    return [(("dsv41", "sim", name), found[f"dsv41 sim {name}"]) for name in sorted(cli.SIMS)]


def _stated(parser, action):
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    m = STATED.search(text)
    return text, (None if m is None else (m.group(1) or m.group(2)).rstrip(",."))


def _same(stated: str, value) -> bool:
    if isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(stated) == float(value)
        except ValueError:
            return False
    return stated == str(value)


def _actions(monkeypatch):
    for path, parser in [*_parsers(cli.build_parser()), *_sim_parsers(monkeypatch)]:
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not action.option_strings:
                continue
            yield path, parser, action


def test_every_stated_default_is_the_codes(monkeypatch):
    bad, seen = [], 0
    for path, parser, action in _actions(monkeypatch):
        option = action.option_strings[-1]
        text, stated = _stated(parser, action)
        default = action.default
        if default not in (None, False, argparse.SUPPRESS):
            seen += 1
            if stated is None or not _same(stated, default):
                bad.append(f"{' '.join(path)} {option}: default {default!r}, help says {stated!r}: {text}")
        elif stated is not None and NUMBER.match(stated):
            key = (*path, option)
            if key not in RESOLVED:
                bad.append(f"{' '.join(path)} {option}: help states {stated} but the parser default "
                           f"is None and RESOLVED does not name the code's value")
            elif not _same(stated, RESOLVED[key]):
                bad.append(f"{' '.join(path)} {option}: help says {stated}, the code applies "
                           f"{RESOLVED[key]!r}: {text}")
    assert seen >= 20
    assert not bad, "\n".join(bad)


def test_resolved_defaults_are_the_ones_the_commands_apply():
    """gate boot applies its CPU values, gate verdict its DEFAULTS (read back from the objects the
    commands build, not from this file's table)."""
    ns = boot.verdict_args("runs/x", "A,B,A2", False, boot.CPU_SPEED_FLOOR, t1_alpha=boot.CPU_T1_ALPHA)
    assert ns.t1_alpha == 2e-5 and ns.speed_floor == 0.65
    assert verdict.DEFAULTS["t1_alpha"] == 0.01


def test_the_matcher_catches_a_stale_help(monkeypatch):
    """Negative control: the help the issue found (0.01 for gate boot's --t1-alpha) fails."""
    p = argparse.ArgumentParser()
    a = p.add_argument("--t1-alpha", type=float, default=None, help="level (default 0.01, Bonferroni)")
    _, stated = _stated(p, a)
    assert stated == "0.01" and not _same(stated, RESOLVED[("dsv41", "gate", "boot", "--t1-alpha")])
    b = p.add_argument("--tails", type=int, default=384, help="tails (default 128)")
    assert not _same(_stated(p, b)[1], b.default)


def test_help_texts_are_whole_sentences():
    """A description cut mid-sentence (issue 51: `sim cone --help`) ends without a full stop."""
    import io
    import contextlib

    for name, module in sorted(cli.SIMS.items()):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            importlib.import_module(module).main(["--help"])
        description = out.getvalue().split("\n\n")[1]
        assert description.rstrip().endswith((".", ")")), (name, description)
