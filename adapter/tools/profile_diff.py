"""`dsv41 profile diff --profile F [--line production] [--against control] [--against-profile F2]`:
what changes from line A (--against, of --against-profile or --profile) to line B (--line of
--profile), and how to roll back.

Lines are named as in every dsv41 command (--profile/--line/--against). For every key and launch
argument that differs it says whether it is volatile (autotune_keep keeps the tuned tactics
across it). The rollback is given per adapter: the keys of one adapter (adapter/keys.py) and the
launch arguments that belong to it (ADAPTER_ARGS: thin's --swa-prefix-tails) go back together,
with why (an enabling key turns the adapter off; a setting alone would not) and whether that
rollback re-tunes once (it changes a launch argument). Keys and arguments of no adapter form the
group `other`. Overall: whether B re-tunes once on its first boot (its launch fingerprint differs
from A's). A rollback is a profile edit and a restart of every engine process (keys are read at
process start): no image rebuild.
"""
from __future__ import annotations

import json
import os
import sys

from adapter import keys
from adapter.tools import profile
from adapter.autotune_keep import launch


def load(path: str, line: str) -> profile.Line:
    """A named line of a profile file; a missing file is an error naming it (never read as a line)."""
    if not os.path.isfile(path):
        raise profile.ProfileError(f"{path}: no such profile file")
    return profile.load_line(path, line)


def _flags(args) -> dict[str, str | None]:
    out, i = {}, 0
    while i < len(args):
        if args[i].startswith("--"):
            takes = i + 1 < len(args) and not args[i + 1].startswith("--")
            out[args[i]] = args[i + 1] if takes else None
            i += 2 if takes else 1
        else:
            out[f"<positional {i}>"] = args[i]
            i += 1
    return out


# Launch arguments that belong to an adapter: its rollback puts them back with its keys. thin's
# tails: the production line raises --swa-prefix-tails to 384 for thin; with thin off the larger
# SWA pool only costs full-KV tokens (docs/swa_thin.md), so thin's rollback returns it too.
ADAPTER_ARGS = {"swa_thin": ("--swa-prefix-tails",)}
OTHER = "other"      # env keys outside the registry and launch arguments of no adapter
# Keys are read from the environment when a process starts (adapter/keys.py parse_env, when the
# installer is armed at interpreter startup): a rollback is an edit of the profile line and a
# restart of every engine process of the group; the image and swan's module stay as they are.
RESTART = ("edit the profile line, then restart every engine process (all nodes: the keys are read "
           "from the environment at process start); no image rebuild")
RETUNE_NOTE = ("re-tunes once on its first boot: {names} changes the launch fingerprint "
               "(autotune_keep keeps tuned tactics across volatile keys only; launch arguments "
               "never are)")


def _shown(value) -> str:
    return "unset" if value is None else value


def _env_line(env: dict) -> str:
    return f'{profile.ENV_VAR}="{" ".join(f"{k}={v}" for k, v in env.items())}"'


def _args_line(flags: dict) -> str:
    return f'{profile.ARGS_VAR}="{" ".join(_words(flags))}"'


def _owner(change: dict) -> str:
    if change["kind"] == "env":
        key = keys.KEY_BY_NAME.get(change["name"])
        return key.adapter if key else OTHER
    return next((a for a, flags in ADAPTER_ARGS.items() if change["name"] in flags), OTHER)


def _edit(change: dict) -> tuple[str, str, str]:
    """One change's rollback as (verb, words, variable): ("delete", "K=v", ENV_VAR), ...."""
    name, old, new = change["name"], change["a"], change["b"]
    if change["kind"] == "env":
        if change["_absent_in_a"]:
            return "delete", f"{name}={new}", profile.ENV_VAR
        if new is None:
            return "add", f"{name}={old}", profile.ENV_VAR
        return "set", f"{name}={old}", profile.ENV_VAR
    if change["_absent_in_a"]:
        return "delete", f"{name} {new or ''}".rstrip(), profile.ARGS_VAR
    if change["_absent_in_b"]:
        return "add", f"{name} {old or ''}".rstrip(), profile.ARGS_VAR
    return "set", f"{name} {old}", profile.ARGS_VAR


def _edit_text(edits: list[tuple[str, str, str]]) -> str:
    """Edits joined per (verb, variable): "delete A=1 B=2 from EXTRA_CONTAINER_ENV; set ... in ..."."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for verb, words, var in edits:
        grouped.setdefault((verb, var), []).append(words)
    prep = {"delete": "from", "add": "to", "set": "in"}
    return "; ".join(f"{verb} {' '.join(words)} {prep[verb]} {var}"
                     for (verb, var), words in grouped.items())


def _apply(b: profile.Line, flags_b: dict, changes: list[dict]) -> tuple[dict, dict]:
    """B's env and flags with `changes` put back to A's values."""
    env, flags = dict(b.env), dict(flags_b)
    for c in changes:
        target = env if c["kind"] == "env" else flags
        if c["_absent_in_a"]:
            target.pop(c["name"], None)
        else:
            target[c["name"]] = c["a"]
    return env, flags


def _words(flags: dict) -> list[str]:
    return [w for f, v in flags.items() for w in ([f] if v is None else [f, v])]


def _together(adapter: str, group: list[dict], on_in_a: bool) -> str:
    """Why these keys and arguments go back together: the rollback that turns the adapter off is
    the enabling key's; the others alone would leave it as it is."""
    if on_in_a:
        return ""
    enabling = [c["name"] for c in group if c["kind"] == "env" and keys.KEY_BY_NAME[c["name"]].enables]
    notes = []
    for c in group:
        key = keys.KEY_BY_NAME.get(c["name"]) if c["kind"] == "env" else None
        if key is not None and not key.enables and c["b"] is not None:
            if key.default is not None and str(key.default) == c["b"]:
                notes.append(f"deleting {c['name']} alone would leave {adapter} on ({c['b']} is its "
                             f"default)")
            else:
                notes.append(f"{c['name']} does nothing without {' / '.join(enabling) or 'its adapter'}")
        elif c["kind"] == "arg":
            notes.append(f"{c['name']} {_shown(c['b'])} is {adapter}'s and goes back to "
                         f"{_shown(c['a'])} with it")
    if enabling and notes:
        notes.insert(0, f"{' / '.join(enabling)} turns {adapter} off")
    return "; ".join(notes)


def diff(a: profile.Line, b: profile.Line) -> dict:
    volatile = set(keys.volatile_keys())
    changes = []
    for key in list(dict.fromkeys([*a.env, *b.env])):
        old, new = a.env.get(key), b.env.get(key)
        if old == new:
            continue
        change = {"kind": "env", "name": key, "a": old, "b": new, "volatile": key in volatile,
                  "_absent_in_a": key not in a.env, "_absent_in_b": key not in b.env}
        change["_edit"] = _edit(change)
        changes.append(change)
    fa, fb = _flags(a.args), _flags(b.args)
    for flag in list(dict.fromkeys([*fa, *fb])):
        if fa.get(flag, "<absent>") == fb.get(flag, "<absent>"):
            continue
        old, new = fa.get(flag), fb.get(flag)
        change = {"kind": "arg", "name": flag, "a": old, "b": new, "volatile": False,
                  "_absent_in_a": flag not in fa, "_absent_in_b": flag not in fb}
        change["_edit"] = _edit(change)
        changes.append(change)
    fp_a = launch(["sglang", *a.args], a.env).fingerprint
    fp_b = launch(["sglang", *b.args], b.env).fingerprint
    for c in changes:
        c["adapter"] = _owner(c)
    # One rollback per adapter: its keys and its launch arguments go back together.
    adapters = []
    for name in dict.fromkeys(c["adapter"] for c in changes):
        group = [c for c in changes if c["adapter"] == name]
        if name != OTHER and not any(c["kind"] == "env" for c in group):
            for c in group:            # a launch argument whose adapter did not change: other
                c["adapter"] = OTHER
            continue
        adapters.append(name)
    if any(c["adapter"] == OTHER for c in changes) and OTHER not in adapters:
        adapters.append(OTHER)
    groups = []
    for name in adapters:
        group = [c for c in changes if c["adapter"] == name]
        env, flags = _apply(b, fb, group)
        fp = launch(["sglang", *_words(flags)], env).fingerprint
        retunes = fp != fp_b
        a_on = name != OTHER and keys.parse_env(
            {k: v for k, v in a.env.items() if k in keys.KEY_BY_NAME}).enabled(name)
        b_on = name != OTHER and keys.parse_env(
            {k: v for k, v in b.env.items() if k in keys.KEY_BY_NAME}).enabled(name)
        groups.append({
            "adapter": name,
            "keys": [c["name"] for c in group if c["kind"] == "env"],
            "args": [c["name"] for c in group if c["kind"] == "arg"],
            "on_in_a": a_on, "on_in_b": b_on,
            "edits": [_edit_text([c["_edit"]]) for c in group],
            "rollback": _edit_text([c["_edit"] for c in group]),
            "together": _together(name, group, a_on) if name != OTHER else "",
            "rollback_env_line": _env_line(env),
            "rollback_args_line": _args_line(flags),
            "retunes": retunes,
            "note": (RETUNE_NOTE.format(names=" / ".join(c["name"] for c in group if not c["volatile"]))
                     if retunes else "tuned tactics kept (volatile keys only)"),
            "restart": RESTART,
        })
    # Each change's rollback is its adapter's: the keys and arguments that go back together
    # (`rollback_key` is the one word's edit alone).
    by_group = {g["adapter"]: g for g in groups}
    for c in changes:
        g = by_group[c["adapter"]]
        c["rollback_key"] = _edit_text([c["_edit"]])
        c["rollback"] = g["rollback"]
        c["rollback_line"] = g["rollback_env_line"] if c["kind"] == "env" else g["rollback_args_line"]
        for private in ("_absent_in_a", "_absent_in_b", "_edit"):
            c.pop(private, None)
    return {"a": a.name, "b": b.name, "changes": changes, "adapters": groups, "retunes": fp_a != fp_b,
            "fingerprint_a": fp_a, "fingerprint_b": fp_b,
            "line_a_env": _env_line(dict(a.env)), "line_a_args": _args_line(fa)}


def format_text(result: dict, title: str) -> str:
    """The text report: one rollback per adapter, the whole line once at the end."""
    out = [f"{title}: {len(result['changes'])} change(s) in {len(result['adapters'])} group(s)"]
    for g in result["adapters"]:
        members = [c for c in result["changes"] if c["adapter"] == g["adapter"]]
        state = ("" if g["adapter"] == OTHER else
                 f"  ({'on' if g['on_in_b'] else 'off'} in {result['b']}, "
                 f"{'on' if g['on_in_a'] else 'off'} in {result['a']})")
        out.append(f"{g['adapter']}{state}")
        for c in members:
            kind = "volatile" if c["volatile"] else ("launch arg" if c["kind"] == "arg" else "re-tunes")
            out.append(f"  {c['name']}: {_shown(c['a'])} -> {_shown(c['b'])}  [{kind}]")
        out.append(f"  rollback: {g['rollback']}")
        if g["together"]:
            out.append(f"    together: {g['together']}")
        out.append(f"    autotune: {g['note']}")
    out.append(f"every rollback: {RESTART}")
    out.append(f"all rolled back = the {result['a']} line:")
    out.append(f"  {result['line_a_env']}")
    out.append(f"  {result['line_a_args']}")
    out.append("autotune: " + ("the line re-tunes once on its first boot (launch fingerprint differs)"
                               if result["retunes"] else "tuned tactics kept (only volatile changes)"))
    return "\n".join(out)


def main(args) -> int:
    """`dsv41 profile diff --profile F [--line production] [--against control]
    [--against-profile F2]`: the changes from the --against line to the --line line."""
    from adapter.tools import exits

    against_profile = args.against_profile or args.profile
    try:
        a, b = load(against_profile, args.against), load(args.profile, args.line)
        result = diff(a, b)
    except (OSError, profile.ProfileError, keys.ConfigError) as exc:
        print(f"dsv41 profile diff: {exc}", file=sys.stderr)
        return exits.USAGE
    if args.json:
        print(json.dumps(result, indent=2))
        return exits.OK
    print(format_text(result, f"{against_profile}:{args.against} -> {args.profile}:{args.line}"))
    return exits.OK
