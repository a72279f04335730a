"""`dsv41 profile diff --profile F [--line production] [--against control] [--against-profile F2]`:
what changes from line A (--against, of --against-profile or --profile) to line B (--line of
--profile), and how to roll back.

Lines are named as in every dsv41 command (--profile/--line/--against). For every key and launch
argument that differs it says whether it is volatile (autotune_keep keeps the tuned tactics
across it) and the rollback (what to put back on B to return to A); overall, whether B re-tunes
once on its first boot (its launch fingerprint differs from A's).
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


def diff(a: profile.Line, b: profile.Line) -> dict:
    volatile = set(keys.volatile_keys())
    changes = []
    for key in list(dict.fromkeys([*a.env, *b.env])):
        old, new = a.env.get(key), b.env.get(key)
        if old == new:
            continue
        if old is None:
            rollback = f"delete {key}={new} from {profile.ENV_VAR}"
        elif new is None:
            rollback = f"add {key}={old} to {profile.ENV_VAR}"
        else:
            rollback = f"set {key}={old} in {profile.ENV_VAR}"
        env = dict(b.env)
        if old is None:
            env.pop(key)
        else:
            env[key] = old
        line = f'{profile.ENV_VAR}="{" ".join(f"{k}={v}" for k, v in env.items())}"'
        if key == "DSV41_SWA_THIN" and new and b.arg_value("--swa-prefix-tails") not in (None, "128"):
            rollback += " and set --swa-prefix-tails 128 (thin's tails go back with it)"
        changes.append({"kind": "env", "name": key, "a": old, "b": new,
                        "volatile": key in volatile, "rollback": rollback, "rollback_line": line})
    fa, fb = _flags(a.args), _flags(b.args)
    for flag in list(dict.fromkeys([*fa, *fb])):
        if fa.get(flag, "<absent>") == fb.get(flag, "<absent>"):
            continue
        old, new = fa.get(flag), fb.get(flag)
        if flag not in fb:
            rollback = f"add {flag} {old or ''}".rstrip() + f" to {profile.ARGS_VAR}"
        elif flag not in fa:
            rollback = f"delete {flag} {new or ''}".rstrip() + f" from {profile.ARGS_VAR}"
        else:
            rollback = f"set {flag} {old} in {profile.ARGS_VAR}"
        args = dict(fb)
        if flag in fa:
            args[flag] = old
        else:
            args.pop(flag)
        words = [w for f, v in args.items() for w in ([f] if v is None else [f, v])]
        changes.append({"kind": "arg", "name": flag, "a": old, "b": new, "volatile": False,
                        "rollback": rollback,
                        "rollback_line": f'{profile.ARGS_VAR}="{" ".join(words)}"'})
    fp_a = launch(["sglang", *a.args], a.env).fingerprint
    fp_b = launch(["sglang", *b.args], b.env).fingerprint
    return {"a": a.name, "b": b.name, "changes": changes, "retunes": fp_a != fp_b,
            "fingerprint_a": fp_a, "fingerprint_b": fp_b}


def main(args) -> int:
    """`dsv41 profile diff --profile F [--line production] [--against control]
    [--against-profile F2]`: the changes from the --against line to the --line line."""
    from adapter.tools import exits

    against_profile = args.against_profile or args.profile
    try:
        a, b = load(against_profile, args.against), load(args.profile, args.line)
        result = diff(a, b)
    except (OSError, profile.ProfileError) as exc:
        print(f"dsv41 profile diff: {exc}", file=sys.stderr)
        return exits.USAGE
    if args.json:
        print(json.dumps(result, indent=2))
        return exits.OK
    print(f"{against_profile}:{args.against} -> {args.profile}:{args.line}: "
          f"{len(result['changes'])} change(s)")
    for c in result["changes"]:
        kind = "volatile" if c["volatile"] else ("launch arg" if c["kind"] == "arg" else "re-tunes")
        print(f"  {c['name']}: {c['a']} -> {c['b']}  [{kind}]  rollback: {c['rollback']}")
        print(f"      {c['rollback_line']}")
    print("autotune: " + ("the line re-tunes once on its first boot (launch fingerprint differs)"
                          if result["retunes"] else "tuned tactics kept (only volatile changes)"))
    return exits.OK
