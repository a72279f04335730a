"""The `dsv41` commands as one family: profile lines named one way, --cpu-model vs gate run's
--model, help on every flag, --json where a command reports, one exit-code table (README)."""
import argparse
import importlib
import re

import pytest
from conftest import REPO_ROOT, run_python

from adapter.tools import cli, exits

CLI = "from adapter.tools.cli import main; raise SystemExit(main())"


def _parsers(parser, path=("dsv41",)):
    """(path, parser) of dsv41 and every sub-command, recursively."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def _options(parser):
    return {opt: a for a in parser._actions for opt in a.option_strings}


def test_every_flag_and_argument_has_help():
    missing = []
    for path, parser in _parsers(cli.build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not action.help:
                missing.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing


@pytest.mark.parametrize("name", sorted(cli.SIMS))
def test_every_simulation_flag_has_help(name, monkeypatch):
    """The sims build their parsers in main(): record every add_argument made for `--help`."""
    seen = []
    real = argparse._ActionsContainer.add_argument

    def record(self, *args, **kwargs):
        action = real(self, *args, **kwargs)
        seen.append(action)
        return action

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", record)
    with pytest.raises(SystemExit) as done:
        importlib.import_module(cli.SIMS[name]).main(["--help"])
    assert done.value.code == 0
    bare = [a.option_strings or a.dest for a in seen
            if not a.help and not isinstance(a, argparse._HelpAction)]
    assert not bare, (name, bare)


def test_profile_lines_are_named_one_way():
    parsers = dict(_parsers(cli.build_parser()))
    takes_lines = {("dsv41", "check"): False, ("dsv41", "canary"): True,
                   ("dsv41", "gate", "boot"): True, ("dsv41", "profile"): True}
    for path, compares in takes_lines.items():
        opts = _options(parsers[path])
        assert {"--profile", "--line"} <= set(opts), path
        assert ("--against" in opts) == compares, path
        assert not {"--control", "--candidate"} & set(opts), path
    # --cpu-model is a tiny CPU model kind; gate run's --model is a served model name
    assert "--cpu-model" in _options(parsers[("dsv41", "canary")])
    assert "--cpu-model" in _options(parsers[("dsv41", "gate", "boot")])
    assert "--model" not in _options(parsers[("dsv41", "canary")])
    assert "--model" in _options(parsers[("dsv41", "gate", "run")])


def test_every_reporting_command_has_json():
    parsers = dict(_parsers(cli.build_parser()))
    for path in [("dsv41", c) for c in ("check", "canary", "calibrate", "pins", "keys", "profile")] + \
                [("dsv41", "gate", c) for c in ("run", "verdict", "boot")]:
        assert "--json" in _options(parsers[path]), path


def test_sim_help_exits_0_and_lists_the_simulations():
    proc = run_python(CLI, argv=("sim", "--help"))
    assert proc.returncode == 0, proc.stderr
    assert all(name in proc.stdout for name in cli.SIMS)
    bad = run_python(CLI, argv=("sim", "nosuch"))
    assert bad.returncode == exits.USAGE and "unknown simulation 'nosuch'" in bad.stderr


def test_readme_has_the_one_exit_code_table():
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d) \| `(\w+)` \| (.+?) \|$", section, re.M)
    assert [(int(c), n) for c, n, _ in rows] == [(c, n) for c, n, _ in exits.TABLE]
    assert len(set(c for c, _, _ in exits.TABLE)) == len(exits.TABLE)


def test_pins_json_reports_wraps_and_touches_per_adapter():
    import json

    proc = run_python(CLI, argv=("pins", "--json"), timeout=600)
    assert proc.returncode == exits.OK, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["ok"] and out["drift"] == 0
    by_name = {a["adapter"]: a for a in out["adapters"]}
    assert by_name["swa_thin"]["touches"] and by_name["installer"]["touches"]
    assert all(i["ok"] for a in out["adapters"] for i in a["wraps"] + a["touches"])


def test_canary_cpu_model_lists_the_models_and_takes_a_comma_list():
    from adapter.tools import cli

    parser = cli.build_parser()
    assert parser.parse_args(["canary", "--profile", "p"]).model == ["dense", "dsv41"]   # issue 48
    assert parser.parse_args(["canary", "--profile", "p", "--cpu-model", "all"]).model == ["dense", "swa", "dsv4", "dsv41"]
    assert parser.parse_args(["canary", "--profile", "p", "--cpu-model", "both"]).model == ["dense", "swa"]
    assert parser.parse_args(["canary", "--profile", "p", "--cpu-model", "dsv4,dense"]).model == ["dsv4", "dense"]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helptext = sub.choices["canary"].format_help()
    assert all(m in helptext for m in ("dense", "swa", "dsv4", "dsv41"))
    assert parser.parse_args(["canary", "--profile", "p", "--cpu-model", "dense,dsv41"]).model == ["dense", "dsv41"]
    with pytest.raises(SystemExit):
        parser.parse_args(["canary", "--profile", "p", "--cpu-model", "llama"])
