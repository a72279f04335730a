"""Shared by the e2e tests: real `sglang.launch_server` processes on this CPU machine, HTTP API only.

One boot per configuration per test session: `boots.run(model, keys, args)` boots a server,
runs the canary's traffic through it (adapter/tools/canary.py), stops it (whole process group)
and caches the result; every test that needs that configuration reads the cached run. The canary
test passes `boots.run` to `dsv41 canary`, so its control and production boots are shared too.

Configurations come from the production profile (.env.tp4.example): stock = no DSV41 keys with
the control line's CPU launch args; "each adapter on" = that adapter's keys from the production
line with the production line's CPU launch args; production = the whole line.
"""
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from adapter import keys as key_registry  # noqa: E402
from adapter.tools import canary, profile  # noqa: E402

PROFILE = REPO_ROOT / ".env.tp4.example"
MODELS = ("dense", "swa")


def _lines():
    prod_keys, prod_args, _ = canary.split_line(profile.load_line(PROFILE, "production"))
    ctrl_keys, ctrl_args, _ = canary.split_line(profile.load_line(PROFILE, "control"))
    return prod_keys, prod_args, ctrl_keys, ctrl_args


PROD_KEYS, PROD_ARGS, CTRL_KEYS, CTRL_ARGS = _lines()


def adapter_keys(adapter: str) -> dict:
    names = {k.name for k in key_registry.KEYS if k.adapter == adapter}
    return {k: v for k, v in PROD_KEYS.items() if k in names}


CONFIGS = {   # name -> (keys, args)
    "stock": ({}, CTRL_ARGS),
    "production": (PROD_KEYS, PROD_ARGS),
    **{a: (adapter_keys(a), PROD_ARGS) for a in ("swan", "decode_yield", "swa_thin", "swa_cone")},
    # autotune_keep alone is the control line (its only key): shared with the canary's control.
    "autotune_keep": (CTRL_KEYS, CTRL_ARGS),
    "yield50": ({"DSV41_DECODE_YIELD": "50"}, PROD_ARGS),
}


class Boots:
    def __init__(self):
        self.runs = {}
        self.boots = {}

    def run(self, model, keys, args, progress=None, name="", scenarios=None):
        key = canary.config_key(model, keys, args)
        if key not in self.runs:
            if scenarios is None:
                # Stream cadence only where decode yield is on or for the baselines it is read against.
                cadence = (not keys or keys == CTRL_KEYS or "DSV41_DECODE_YIELD" in keys)
                scenarios = ("equality", "window", "idle") + (("cadence",) if cadence else ())
            self.boots[key] = self.boots.get(key, 0) + 1
            self.runs[key] = canary.run_config(model, keys, args, scenarios=scenarios,
                                               progress=progress or _progress, name=name or model)
        return self.runs[key]

    def config(self, model, name):
        keys, args = CONFIGS[name]
        return self.run(model, keys, args, name=f"{model} {name}")


def _progress(msg):
    sys.stderr.write(f"[e2e] {msg}\n")
