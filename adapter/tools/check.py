"""`dsv41 check`: install a profile line into the pinned engine in a child Python, report.

The child starts exactly as a production process of the image does: the line's environment (plus
PATH/HOME/locale) and the line's launch arguments as argv. From a checkout it gets
PYTHONPATH=<repo root>, so the repo's sitecustomize.py arms the installer; from an installed wheel
no PYTHONPATH, so the wheel's site-packages/dsv41.pth arms it. Or nothing does: the child never
arms it itself. It then imports every engine module of the table and writes each adapter's state and the
entry that armed the installer (`sitecustomize` with the module's path relative to the repo, or
`plugin`), and the line's admin-route exposure: each route the engine marks ADMIN_OPTIONAL or
ADMIN_FORCE, open / closed (by admin_guard or the engine) / keyed for a client without a key, from
the engine's app, the line's keys (read by the engine's parser) and admin_guard's state (the
admin_guard row's `admin_exposure`); and which kernel swan's router serves with (the swan row's
`kernel`: "swan256.so" in a process with CUDA, "CPU twin" without, as in this check's child
unless it runs beside a GPU). Exit 0 only when every enabled adapter installed.
"""
from __future__ import annotations

import json
import os
import re
import pathlib
import subprocess
import sys
import tempfile

from adapter import keys
from adapter.tools.profile import Line
from adapter.table import ADAPTERS, HOOKS

from adapter import locations

# The checkout the child arms from (PYTHONPATH=<it>, its sitecustomize.py), or None for an
# installed wheel (its dsv41.pth arms every process of the interpreter).
REPO_ROOT = locations.source_tree()
NOT_ARMED_TREE = ("the installer was never armed in the child: sitecustomize.py did not run it "
                  "(is {root}/sitecustomize.py the one Python imported?)")
NOT_ARMED_WHEEL = ("the installer was never armed in the child: site-packages/" + locations.PTH_NAME
                   + " did not run it (was dsv41 installed from its wheel into this interpreter?)")
BASE_ENV_KEYS = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")


def child_env(line: Line) -> dict[str, str]:
    env = {k: os.environ[k] for k in BASE_ENV_KEYS if k in os.environ}
    env.update(line.env)
    if REPO_ROOT is not None:
        env["PYTHONPATH"] = str(REPO_ROOT)
    return env


def not_armed() -> str:
    return NOT_ARMED_TREE.format(root=REPO_ROOT.name) if REPO_ROOT is not None else NOT_ARMED_WHEEL


def run(line: Line) -> tuple[int, list[dict], str]:
    """Returns (child exit code, rows, child stderr)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "report.json"
        proc = subprocess.run([sys.executable, "-m", "adapter.tools.check", "--child", str(out), *line.args],
                              env=child_env(line), cwd=REPO_ROOT or tmp, capture_output=True, text=True)
        report = json.loads(out.read_text()) if out.exists() else {}
    states, entry, entry_path = report.get("adapters", {}), report.get("entry"), report.get("entry_path")
    swan_kernel = report.get("swan_kernel")
    admin = report.get("admin_exposure")
    cluster_resolved = report.get("cluster") or {}
    rows = []
    for name in ADAPTERS:
        state = states.get(name)
        adapter_keys = {k.name: line.env[k.name] for k in keys.KEYS
                        if k.adapter == name and k.name in line.env}
        if state is None:
            reason = _last_fatal(proc.stderr) or _site_error(proc.stderr) or (
                not_armed() if out_written(report) and adapter_keys
                else _last_error(proc.stderr) or f"child exited {proc.returncode}")
            state = {"status": "refused" if adapter_keys else "off", "pin_ok": None, "detail": reason}
        rows.append({"adapter": name, "keys": adapter_keys, "enabled": state["status"] != "off",
                     "pin_ok": state["pin_ok"], "installed": state["status"] == "installed",
                     "status": state["status"], "reason": state["detail"],
                     "entry": entry, "entry_path": entry_path})
        if name == "swan":
            # which kernel the router serves with in the child (None: swan not installed)
            rows[-1]["kernel"] = swan_kernel if state["status"] == "installed" else None
        if name == "admin_guard":
            # the line's admin routes, as a client without a key finds them (open, closed by
            # admin_guard or the engine, keyed): adapter/admin_guard.py exposure()
            rows[-1]["admin_exposure"] = admin
    attach_cluster(rows, cluster_resolved, line.env)
    return proc.returncode, rows, proc.stderr


def attach_cluster(rows: list[dict], resolved: dict, env) -> None:
    """Each enabled row's verdict for DeepSeek-V4.1 on the cluster (`on_cluster`: {"acts", "why"}),
    and the engine's resolution it rests on (`cluster`, on every row): adapter/tools/cluster.py."""
    from adapter.tools import cluster

    verdict = cluster.verdicts(resolved, env, {r["adapter"]: r["enabled"] for r in rows}) if resolved else {}
    for r in rows:
        r["cluster"] = resolved or None
        r["on_cluster"] = verdict.get(r["adapter"])


def out_written(report: dict) -> bool:
    return "adapters" in report


def _site_error(stderr: str) -> str:
    """`site` prints one line when sitecustomize raises, and the process carries on unarmed."""
    lines = stderr.splitlines()
    at = [i for i, ln in enumerate(lines) if ln.startswith("Error in sitecustomize")]
    if not at:
        return ""
    error = lines[at[-1] + 1].strip() if at[-1] + 1 < len(lines) else lines[at[-1]]
    return f"sitecustomize.py raised, so the installer was never armed: {error}"


def _last_error(stderr: str) -> str:
    """The last line of a traceback (`site` or the bootstrap printing one), else ''."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln)]
    return errors[-1] if errors else ""


def _last_fatal(stderr: str) -> str:
    fatal = [ln for ln in stderr.splitlines() if "FATAL" in ln]
    return fatal[-1].strip() if fatal else ""


def ok(returncode: int, rows: list[dict]) -> bool:
    return returncode == 0 and all(r["installed"] for r in rows if r["enabled"])


def exit_code(returncode: int, rows: list[dict]) -> int:
    """exits.OK when every enabled adapter installed; USAGE for a bad key (the child stopped with
    a configuration error); REFUSED when an adapter refused; FAILED otherwise."""
    from adapter.tools import exits

    if ok(returncode, rows):
        return exits.OK
    if returncode == exits.USAGE:
        return exits.USAGE
    if any(r["status"] == "refused" and r["pin_ok"] is not None for r in rows if r["enabled"]):
        return exits.REFUSED
    return exits.FAILED


def format_table(rows: list[dict], receipts: list[str] = ()) -> str:
    """The text report: one row per adapter, the entry that installed them, swan's kernel and the
    admin routes. A row's reason is shown only where no receipt line (printed after the table,
    once each) carries it: an installed adapter's reason is its receipt."""
    head = ("adapter", "key=value", "pin ok", "installed", "note")
    body = [(r["adapter"], " ".join(f"{k}={v}" for k, v in r["keys"].items()) or "-",
             {True: "yes", False: "NO", None: "-"}[r["pin_ok"]],
             "yes" if r["installed"] else ("off" if not r["enabled"] else "NO"),
             _note(r, receipts)) for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head) - 1)]
    lines = []
    for cells in [head, *body]:
        lines.append(("  ".join(c.ljust(w) for c, w in zip(cells, widths)) + "  " + cells[-1]).rstrip())
    lines.append(format_entry(rows))
    kernel = next((r.get("kernel") for r in rows if r["adapter"] == "swan"), None)
    if kernel:
        lines.append(f"swan kernel: {kernel}")
    admin = next((r.get("admin_exposure") for r in rows if r["adapter"] == "admin_guard"), None)
    if admin:
        lines.append(format_exposure(admin))
    lines += format_cluster(rows)
    return "\n".join(lines)


def format_cluster(rows: list[dict]) -> list[str]:
    from adapter.tools import cluster

    resolved = next((r.get("cluster") for r in rows if r.get("cluster")), None)
    verdict = {r["adapter"]: r["on_cluster"] for r in rows if r.get("on_cluster")}
    return cluster.format_lines(resolved or {}, verdict)


def act_on_cluster(rows: list[dict]) -> tuple[int, int]:
    """(enabled adapters that act on the cluster, enabled adapters with a verdict)."""
    judged = [r["on_cluster"] for r in rows if r["enabled"] and r.get("on_cluster")]
    return sum(v["acts"] for v in judged), len(judged)


def _note(row: dict, receipts) -> str:
    """A row's reason, or "receipt below" when a receipt line printed after the table carries it."""
    reason = row["reason"].splitlines()[0] if row["reason"] else ""
    if reason and any(reason[:60] in r for r in receipts):
        return "receipt below"
    return "" if row["installed"] else reason


def format_entry(rows: list[dict]) -> str:
    """Which entry armed the installer in the child: the wheel's dsv41.pth, a checkout's
    sitecustomize.py or the engine's plugin framework."""
    entry = next((r.get("entry") for r in rows if r.get("entry")), None)
    path = next((r.get("entry_path") for r in rows if r.get("entry_path")), None)
    if entry is None:
        return "installed by: nothing (the installer was not armed in the child)"
    return f"installed by: {entry}" + (f" ({path})" if path else "")


def receipt_lines(stderr: str) -> list[str]:
    """The child's `[dsv41] ...` lines, once each (a line logged by two handlers, or with and
    without the engine's timestamp, is one line)."""
    seen, out = set(), []
    for line in stderr.splitlines():
        if "[dsv41]" not in line:
            continue
        text = line[line.index("[dsv41]"):]
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def format_exposure(admin: dict) -> str:
    """One line on the line's admin routes, then the open ones by name."""
    if "error" in admin:
        return f"admin routes: not read ({admin['error']})"
    def by(state):
        names = sorted({r["by"] for r in admin["routes"] if r["exposure"] == state and r["by"]})
        return f" (by {', '.join(names)})" if names else ""

    text = (f"admin routes ({len(admin['routes'])}, the engine's ADMIN_OPTIONAL/ADMIN_FORCE) for a "
            f"client without a key: {admin['open']} open, {admin['closed']} closed{by('closed')}, "
            f"{admin['keyed']} keyed{by('keyed')}")
    open_ = sorted({r["path"] for r in admin["routes"] if r["exposure"] == "open"})
    if open_:
        text += "\n  open: " + " ".join(open_)
    return text


def _admin_exposure(argv: list[str], guarded: bool) -> dict:
    """Inside the child: the line's keys read by the engine's own parser, its app's admin routes."""
    import argparse

    from adapter import admin_guard

    try:
        from sglang.srt.entrypoints.http_server import app
        from sglang.srt.server_args import ServerArgs

        parser = argparse.ArgumentParser(exit_on_error=False, add_help=False)
        ServerArgs.add_cli_args(parser)
        ns, _ = parser.parse_known_args(["--model-path", "/models/x", *argv])
        return admin_guard.exposure(app, api_key=ns.api_key, admin_api_key=ns.admin_api_key,
                                    tokenizer_worker_num=ns.tokenizer_worker_num, guarded=guarded)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported, the check goes on
        return {"error": f"{type(exc).__name__}: {exc}"}


def _child(out_path: str) -> int:
    """Inside the child: import the engine modules of the table, report each adapter's state and
    the entry that armed the installer. Never arms the installer itself."""
    from adapter import installer
    from adapter.cpu import cpu_engine

    installer.set_mode("report")
    cpu_engine.install_torchvision_shim()   # only where no real torchvision is importable
    for module in dict.fromkeys(h.module for h in HOOKS):
        __import__(module)
    states = {name: {"status": s.status, "pin_ok": s.pin_ok, "detail": s.detail}
              for name, s in installer.status().items()}
    entry, entry_path = installer.entry(), None
    if entry == "sitecustomize":
        site = pathlib.Path(getattr(sys.modules.get("sitecustomize"), "__file__", "") or "").resolve()
        entry_path = (str(site.relative_to(REPO_ROOT)) if REPO_ROOT is not None and site.is_relative_to(REPO_ROOT)
                      else str(site))
    elif entry == locations.PTH_NAME:
        entry_path = str(locations.PACKAGE_PARENT / locations.PTH_NAME)
    admin = _admin_exposure(sys.argv[3:], states.get("admin_guard", {}).get("status") == "installed")
    try:
        from adapter.tools import cluster

        resolved = cluster.resolve(sys.argv[3:])
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported, the check goes on
        resolved = {"error": f"{type(exc).__name__}: {exc}", "platform": "CUDA"}
    router = getattr(sys.modules.get("adapter.swan"), "ROUTER", None)
    pathlib.Path(out_path).write_text(json.dumps({"adapters": states, "entry": entry,
                                                  "entry_path": entry_path,
                                                  "admin_exposure": admin,
                                                  "cluster": resolved,
                                                  "swan_kernel": router.kernel_name() if router else None}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        sys.exit(_child(sys.argv[2]))
    sys.exit("usage: python -m adapter.tools.check --child OUT.json [launch args]  (use `dsv41 check`)")
