"""Mutation check of the adapters' decision code: mutmut per module, score per module.

    python bench/mutation.py                      # every measured module, one after another
    python bench/mutation.py keys decode_yield    # some of them
    python bench/mutation.py --list               # the modules, their scope and test selection
    python bench/mutation.py --report keys        # the score of the last run, without running
    python bench/mutation.py --fresh swa_cone     # forget earlier results of that module first
    python bench/mutation.py --survivors keys     # re-run only survivors and unchecked mutants
    python bench/mutation.py --survivors --recheck-timeouts input_guard   # and the timeouts

Needs mutmut (pinned in requirements/test-tools.lock, with libcst and coverage) in the
interpreter that runs this script. Each module runs in its own scratch directory,
`mutants/<module>/` (git-ignored): links to `adapter/` and `tests/`, a `setup.cfg` with the
module's mutmut section, and mutmut's own `mutants/` copy under it. mutmut runs the selected tests
in process from that copy, so the selection leaves out tests that start a child interpreter (the
child imports the original `adapter/` through PYTHONPATH, not the mutated copy) and tests that read a
module's own source file (the copy is mutmut's rewritten file): each module's `deselect` says which
and why. Those tests still run in the ordinary suite. Directories some tests read beside `tests/`
(a module's `copy`, e.g. the input guard's field tables under docs/ and bench/) are linked into the
scratch directory and copied into mutmut's copy.

The score counts the mutants of the module's decision functions (`scope`: "*" for every function
of the files, else "module:function" / "module:Class.method" entries; only those mutants run):
killed / total, where
total = killed + survived + no tests + timeout + suspicious (a timeout is printed apart and counted
as killed, as mutmut does: a mutant that loops forever is caught by every run). A mutant is
"no tests" when no selected test calls its function: it counts against the score.

Results are cached per mutant in the scratch directory (mutmut skips a mutant it has a result for
unless its function changed): re-runs after a test change need --fresh for that module.

CPU: one mutmut worker by default (--jobs), OMP_NUM_THREADS=1; about 1-2 mutants per second on a
2-core machine for the fast modules. docs/testing.md has the last scores and every survivor's
reason.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
WORK = REPO / "mutants"

# Tests that start a child interpreter (the child would import the unmutated source) or read a
# module's source file (mutmut's copy is its rewritten file) are deselected: see the module docstring.
MODULES: dict[str, dict] = {
    "keys": {
        "what": "the keys parser",
        "files": ["adapter/keys.py"],
        "scope": ["*"],
        "tests": ["tests/test_keys.py"],
        "deselect": [],
    },
    "decode_yield": {
        "what": "decode yield's planner (cost model, step count, arm / defer / disarm, the online "
                "calibration: OnlineScales, since, readings, agree, wanted_steps, and install's "
                "closures finish_plan, timing_or_none, online_scales, replan)",
        "files": ["adapter/decode_yield.py"],
        # "*": every function and method of the file; install()'s closures are mutated as part
        # of install (mutmut mutates a nested function inside its enclosing one)
        "scope": ["*"],
        "tests": ["tests/test_decode_yield.py", "tests/test_decode_yield_mutants.py"],
        "deselect": [
            # reads adapter/decode_yield.py's own imports from its file (mutmut's copy imports more)
            "tests/test_decode_yield.py::test_adapter_reads_no_clock_and_nothing_rank_local",
        ],
    },
    "swa_thin": {
        "what": "thin's move rule (which SWA LRU nodes move, kept reasons, all-or-none relink)",
        "files": ["adapter/swa_thin/__init__.py", "adapter/swa_thin/core.py"],
        "scope": [
            "adapter.swa_thin:_window_nodes", "adapter.swa_thin:_to_evict_first_end",
            "adapter.swa_thin:_put_back", "adapter.swa_thin:_move_all",
            "adapter.swa_thin:move_passed_checkpoint", "adapter.swa_thin:_move_through_binding",
            "adapter.swa_thin:_window_ids", "adapter.swa_thin:_checkpoint_into_tree",
            "adapter.swa_thin.core:ThinTreeCore.demote_swa_lru",
        ],
        "tests": ["tests/test_swa_thin.py", "tests/test_swa_thin_props.py",
                  "tests/test_swa_thin_failure.py", "tests/test_swa_thin_core.py"],
        "deselect": [
            # sitecustomize in a child interpreter
            "tests/test_swa_thin.py::test_production_path_in_a_child",
        ],
    },
    "swa_cone": {
        "what": "cone's plan / floor (the candidate's s and F, the admission's coverage check, the "
                "commit, which rows get the copy / mask / floor and the floor itself)",
        "files": ["adapter/swa_cone.py"],
        # Not in scope: the plan store, aborts and the TP verdict (failure handling), install's
        # wiring, the TEST-only copy check (tested in tests/test_swa_cone_failure.py, not measured).
        "scope": [
            "adapter.swa_cone:Cone.candidate", "adapter.swa_cone:Cone.select_admission",
            "adapter.swa_cone:Cone._commit", "adapter.swa_cone:Cone.apply",
            "adapter.swa_cone:Cone._prepare", "adapter.swa_cone:Cone.init_prefill_metadata",
            "adapter.swa_cone:_pad_to", "adapter.swa_cone:_path_len",
        ],
        # tests/test_swa_cone_forward.py is left out for its cost (its harness builds the
        # engine's DSV4 backend, ~20 s per worker, and each negative control runs 10-17 s);
        # test_swa_cone_compose.py starts a child interpreter.
        "tests": ["tests/test_swa_cone.py", "tests/test_swa_cone_failure.py",
                  "tests/test_swa_cone_copy.py", "tests/test_swa_cone_edges.py"],
        "deselect": [],
    },
    "input_guard": {
        "what": "the input guard's checks (each field against the engine's type and range, the "
                "sampling numbers, logit_bias, stops, grammar fields, prompt indices, log-prob cost)",
        "files": ["adapter/input_guard/rules.py"],
        # Not in scope: the hooks (adapter/input_guard/hooks.py: install() and its parts, the
        # tokenizer-manager hook, n at the way in, exact aborts, the grammar step bound), the RE2
        # stand-in, the messages' helpers.
        "scope": [
            "adapter.input_guard.rules:first_out_of_range", "adapter.input_guard.rules:kind_of",
            "adapter.input_guard.rules:_is_int", "adapter.input_guard.rules:_bounds",
            "adapter.input_guard.rules:check_field", "adapter.input_guard.rules:check_ids",
            "adapter.input_guard.rules:_is_real", "adapter.input_guard.rules:check_number",
            "adapter.input_guard.rules:check_logit_bias", "adapter.input_guard.rules:_strings",
            "adapter.input_guard.rules:check_stops", "adapter.input_guard.rules:check_grammar_fields",
            "adapter.input_guard.rules:_prompt_len", "adapter.input_guard.rules:check_prompt_indices",
            "adapter.input_guard.rules:check_logprob_cost", "adapter.input_guard.rules:check",
            "adapter.input_guard.rules:Limits.from_ctx",
            # issue 50
            "adapter.input_guard.rules:check_pooling", "adapter.input_guard.rules:check_samples",
            "adapter.input_guard.rules:check_text_size", "adapter.input_guard.rules:check_parse_size",
            "adapter.input_guard.rules:check_sampling_value",
            "adapter.input_guard.rules:sampling_value_problem",
            "adapter.input_guard.rules:check_sampling_params",
            "adapter.input_guard.rules:check_ollama_options", "adapter.input_guard.rules:check_vertex",
            "adapter.input_guard.rules:check_prompt_present",
            "adapter.input_guard.rules:check_embedding_batch",
            # issue 50, its last bounds: the chat-like routes' text, the whole request's
            # log-probs, the text bound's default, one client's share of the compile pool
            "adapter.input_guard.rules:Limits.text_limit", "adapter.input_guard.rules:Limits.with_context",
            "adapter.input_guard.rules:_prompts", "adapter.input_guard.rules:_model_fields",
            "adapter.input_guard.rules:text_size", "adapter.input_guard.rules:check_body_text",
            "adapter.input_guard.rules:_per_prompt", "adapter.input_guard.rules:_batch_shape",
            "adapter.input_guard.rules:_prompt_positions",
            "adapter.input_guard.rules:check_request_logprobs",
            "adapter.input_guard.rules:compile_workers", "adapter.input_guard.rules:grammar_share",
            "adapter.input_guard.rules:grammar_keys",
            "adapter.input_guard.rules:client_of", "adapter.input_guard.rules:check_grammar_share",
            "adapter.input_guard.rules:check_chat_messages",
        ],
        "tests": ["tests/test_input_guard.py", "tests/test_input_guard_mutants.py",
                  "tests/test_input_guard_routes.py", "tests/test_input_guard_text_routes.py"],
        # tests/test_input_guard.py reads the field tables (docs/input_guard_fields*.json) and
        # their generator (bench/input_guard_fields.py) next to its own file's parent
        "copy": ["bench", "docs"],
        # mutmut's wall-clock limit is 15 x (the tests' recorded call time + this constant); the
        # recorded time leaves out the fixtures (each test here builds the engine's
        # TokenizerManager, ~0.4 s), so at mutmut's default of 1 s a mutant of check() that only
        # the last of its ~60 tests fails ran out of time and counted as killed
        "timeout_constant": 5,
        "deselect": [
            # stands another rank's all-reduce in by patching agreed_step_us.__defaults__: under
            # mutmut the name is its trampoline, whose defaults the original does not read, so the
            # real all-reduce gets the test's stand-in group (not in scope: the grammar bound)
            "tests/test_input_guard.py::test_the_verdict_is_the_groups_max_not_this_ranks",
            # two-rank children (conftest.run_two_ranks): each child imports mutmut's copy with its
            # trampolines, whose patched __defaults__ (the "local" control) the original ignores
            "tests/test_input_guard.py::test_both_ranks_finish_the_grammar_request_at_the_same_step",
            "tests/test_input_guard.py::test_without_the_agreement_the_ranks_split",
        ],
    },
    "admin_guard": {
        "what": "the admin guard's route rule (which routes are admin routes, wherever registered; "
                "which requests reach one and are refused; the path prefilter; key redaction)",
        "files": ["adapter/admin_guard.py"],
        # Not in scope: guard_app / install (wiring, receipts), the 403 / 401 bodies.
        "scope": [
            "adapter.admin_guard:_routes", "adapter.admin_guard:_walk",
            "adapter.admin_guard:route_entries", "adapter.admin_guard:admin_routes",
            "adapter.admin_guard:_match", "adapter.admin_guard:refuses",
            "adapter.admin_guard:admin_path_regex", "adapter.admin_guard:AdminGuard._candidate",
            "adapter.admin_guard:AdminGuard._refused_route", "adapter.admin_guard:redact_keys",
            "adapter.admin_guard:exposure",
        ],
        "tests": ["tests/test_admin_guard.py", "tests/test_admin_guard_mutants.py"],
        "deselect": [],
    },
}

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout",
          37: "caught by type check", None: "not checked"}


def scratch(name: str) -> pathlib.Path:
    return WORK / name


def _cfg_list(values) -> str:
    return "".join(f"\n    {v}" for v in values)


def refresh_copy(d: pathlib.Path, mod: dict) -> int:
    """mutmut copies the files it does not mutate into its `mutants/` copy once, at its first run,
    and rewrites only the mutated ones later: a later run would test against stale neighbours
    (seen: an old adapter/pins.json refused cone's install, every test failed). Refresh every such
    file from the work tree; returns how many were replaced."""
    import filecmp

    copy = d / "mutants"
    if not copy.is_dir():
        return 0
    mutated = {pathlib.Path(f) for f in mod["files"]}
    replaced = 0
    for top in ("adapter", "tests", *mod.get("copy", ())):
        for src in (REPO / top).rglob("*"):
            rel = src.relative_to(REPO)
            if src.is_dir() or "__pycache__" in rel.parts or rel in mutated:
                continue
            dst = copy / rel
            if dst.exists() and filecmp.cmp(src, dst, shallow=False):
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
            replaced += 1
    return replaced


def prepare(name: str, fresh: bool) -> pathlib.Path:
    mod = MODULES[name]
    d = scratch(name)
    if fresh and d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True, exist_ok=True)
    for link in ("adapter", "tests", *mod.get("copy", ())):
        p = d / link
        if not p.is_symlink():
            p.symlink_to(REPO / link, target_is_directory=True)
    refresh_copy(d, mod)
    args = ["-p", "no:xdist", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]
    for node in mod["deselect"]:
        args += ["--deselect", node]
    (d / "setup.cfg").write_text(
        "# written by bench/mutation.py for one module's mutmut run\n"
        "[mutmut]\n"
        "source_paths = adapter\n"
        f"only_mutate = {_cfg_list(mod['files'])}\n"
        f"pytest_add_cli_args_test_selection = {_cfg_list(mod['tests'])}\n"
        f"pytest_add_cli_args = {_cfg_list(args)}\n"
        # directories some tests read beside tests/ (mutmut copies them into its own copy)
        + (f"also_copy = {_cfg_list(mod['copy'])}\n" if mod.get("copy") else "") +
        # Each mutant's worker is forked from mutmut's process after its stats pass, with the
        # engine imported and warm (one OpenMP thread: CPU torch forks safely then); a fork
        # server that only collected would import the engine again in every worker (~10 s each).
        f"process_isolation = {mod.get('isolation', 'fork')}\n"
        + (f"timeout_constant = {mod['timeout_constant']}\n" if "timeout_constant" in mod else "") +
        "use_git_change_detection = false\n"
        "\n[tool:pytest]\n"
        "addopts = -p no:randomly\n")
    return d


def mutant_pattern(entry: str) -> str:
    """A scope entry "module:function" or "module:Class.method" as mutmut's mutant-name glob
    (mutmut names a mutant <module>.x_<func>__mutmut_<n> or <module>.xǁ<Class>ǁ<meth>__mutmut_<n>)."""
    module, _, qual = entry.partition(":")
    if "." in qual:
        cls, meth = qual.split(".", 1)
        return f"{module}.xǁ{cls}ǁ{meth}__mutmut_*"
    return f"{module}.x_{qual}__mutmut_*"


def in_scope(name: str, mutant: str) -> bool:
    scope = MODULES[name]["scope"]
    if scope == ["*"]:
        return True
    bare = mutant.replace(".__init__.", ".")
    return any(fnmatch.fnmatchcase(bare, mutant_pattern(e)) for e in scope)


def results(name: str) -> dict[str, str]:
    d = scratch(name) / "mutants"
    out = {}
    for f in MODULES[name]["files"]:
        meta = d / (f + ".meta")
        if not meta.exists():
            continue
        for _ in range(20):              # a running mutmut rewrites the file: read a whole one
            try:
                codes = json.loads(meta.read_text())["exit_code_by_key"]
                break
            except json.JSONDecodeError:
                time.sleep(0.2)
        else:
            raise RuntimeError(f"{meta}: not readable as JSON")
        for key, code in codes.items():
            if in_scope(name, key):
                out[key] = STATUS.get(code, "suspicious")
    return out


def score(name: str) -> tuple[int, int, list[str], dict[str, int]]:
    res = results(name)
    by = {}
    for status in res.values():
        by[status] = by.get(status, 0) + 1
    killed = by.get("killed", 0) + by.get("timeout", 0)
    total = sum(v for k, v in by.items() if k not in ("skipped", "caught by type check"))
    survivors = sorted(k for k, v in res.items() if v not in ("killed", "timeout", "skipped"))
    return killed, total, survivors, by


def child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env.pop("PYTHONPATH", None)      # the mutated copy must be the `adapter` the tests import
    return env


def run(name: str, jobs: int, fresh: bool, quiet: bool, survivors: bool = False,
        survived_only: bool = False, timeouts: bool = False) -> int:
    # survivors and the mutants a stopped run did not reach (or only the survivors); with
    # `timeouts`, the timeouts too (after a change of the module's timeout)
    skip = ("killed", "skipped") + (() if timeouts else ("timeout",)) + (
        ("not checked",) if survived_only else ())
    again = sorted(k for k, v in results(name).items() if v not in skip) if survivors else []
    if survivors and not again:
        report(name, quiet)
        return 0
    d = prepare(name, fresh and not survivors)
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs)]
    if again:                                # mutmut re-runs the mutants it is given by name
        cmd += again
    elif MODULES[name]["scope"] != ["*"]:    # only the decision functions' mutants run
        cmd += [mutant_pattern(e) for e in MODULES[name]["scope"]]
    log = d / "run.log"
    print(f"== {name}: {MODULES[name]['what']}", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, cwd=d, env=child_env(), stdout=fh, stderr=subprocess.STDOUT)
    dt = time.monotonic() - t0
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").replace("\r", "\n").splitlines()[-15:]
        print("\n".join(f"   | {ln}" for ln in tail if "\u280b" not in ln and ln.strip()))
        print(f"   mutmut exited {proc.returncode} after {dt:.0f} s; see {log}", flush=True)
        return proc.returncode
    report(name, quiet, seconds=dt)
    return 0


SHOW = r"""
import sys
from mutmut.mutation.diff_apply import find_mutant, get_diff_for_mutant
for name in sys.argv[1:]:
    print("@@MUTANT " + name)
    print(get_diff_for_mutant(name, path=find_mutant(name).path))
"""


def diffs(name: str, mutants: list[str]) -> dict[str, str]:
    """mutmut's diff of each mutant, from one child interpreter in the module's scratch directory."""
    if not mutants:
        return {}
    proc = subprocess.run([sys.executable, "-c", SHOW, *mutants], cwd=scratch(name), env=child_env(),
                          capture_output=True, text=True)
    out, cur = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith("@@MUTANT "):
            cur = line[len("@@MUTANT "):]
            out[cur] = ""
        elif cur is not None:
            out[cur] += line + "\n"
    return out


def report(name: str, quiet: bool = False, seconds: float | None = None) -> tuple[int, int]:
    killed, total, survivors, by = score(name)
    pct = 100.0 * killed / total if total else 0.0
    extra = ", ".join(f"{v} {k}" for k, v in sorted(by.items()) if k != "killed")
    took = f" in {seconds:.0f} s" if seconds is not None else ""
    print(f"{name}: {killed} / {total} killed ({pct:.1f} %){took}" + (f"; {extra}" if extra else ""),
          flush=True)
    status = results(name)
    shown = {} if quiet else diffs(name, survivors)
    for m in survivors:
        print(f"   survivor ({status[m]}): {m}")
        for line in shown.get(m, "").splitlines():
            if line.startswith(("+", "-")) and not line.startswith(("+++", "---")):
                print(f"      {line}")
    return killed, total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", help=f"default: all of {', '.join(MODULES)}")
    ap.add_argument("--jobs", type=int, default=1, help="mutmut workers (default 1: shared machine)")
    ap.add_argument("--fresh", action="store_true", help="forget the module's earlier results first")
    ap.add_argument("--report", action="store_true", help="print the last run's scores only")
    ap.add_argument("--survivors", action="store_true",
                    help="re-run only the last run's survivors and unchecked mutants")
    ap.add_argument("--survived-only", action="store_true",
                    help="with --survivors: leave the unchecked mutants for a later run")
    ap.add_argument("--recheck-timeouts", action="store_true",
                    help="with --survivors: re-run the timeouts too (after a timeout change)")
    ap.add_argument("--quiet", action="store_true", help="survivor names without their diffs")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--min", type=float, default=None, help="exit 1 if a module scores below this %%")
    a = ap.parse_args(argv)
    if a.list:
        for name, mod in MODULES.items():
            print(f"{name}: {mod['what']}\n   files: {' '.join(mod['files'])}\n"
                  f"   scope: {' '.join(mod['scope'])}\n   tests: {' '.join(mod['tests'])}\n"
                  f"   deselected: {' '.join(mod['deselect']) or '-'}")
        return 0
    names = a.modules or list(MODULES)
    for n in names:
        if n not in MODULES:
            ap.error(f"unknown module {n!r}")
    low = []
    for n in names:
        if a.report:
            killed, total = report(n, a.quiet)
        else:
            if run(n, a.jobs, a.fresh, a.quiet, a.survivors, a.survived_only, a.recheck_timeouts):
                return 2
            killed, total, _, _ = score(n)
        if a.min is not None and (not total or 100.0 * killed / total < a.min):
            low.append(n)
    if low:
        print(f"below {a.min} %: {', '.join(low)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
