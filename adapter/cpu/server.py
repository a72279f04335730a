"""A real `sglang.launch_server` on this CPU machine, with the production install path.

The server runs with the repo root on PYTHONPATH (our sitecustomize.py) and the plugin entry
point installed (pip install -e .), exactly as in the image; in front of it on PYTHONPATH is the
CPU harness's own sitecustomize (adapter/cpu/site/), which arms the stand-ins and the
torch_native fix and then chains to ours. Every process of the server writes its output to
<log_dir>/<pid>.log; `process_logs()` names each pid by the engine's process title
(sglang::scheduler_TP0, sglang::detokenizer; the launcher hosts HTTP + tokenizer manager).

The server is its own process group (start_new_session): `stop()` ends the whole group, TERM
then KILL, and waits until no live process of the group is left. Use it as a context manager or
call stop() in a finally; a failed boot stops the group before raising.

`nodes=N` boots the production topology on this machine: N launch processes on 127.0.0.1, one
per node, `--nnodes N --node-rank r --dist-init-addr 127.0.0.1:<port>` (the ranks of the
`--tp-size` split evenly over the nodes, as the cluster's one rank per node). Node 0 serves HTTP
on `port`; a node r > 0 runs only its schedulers and the engine's health stub, on a port of its
own (on the cluster every node uses the same port on its own host). Each node is a process group
of its own; `stop()` ends them all (node 0 first: it broadcasts the engine's shutdown).

The boot is the line it is given: the harness sets no DSV41_* key of its own. Per model it adds
the launch args of MODEL_HARNESS_ARGS to control and production line alike: the engine's own
defaults on the cluster's hardware that it does not resolve on CPU (dsv41:
--enable-decoder-swa-bounded-replay, the engine's V4.1 default on CUDA); `harness_args` lists
them, and reports print them with their reason. Where the harness
calls admin routes (`admin_calls=True`: flush_cache() between scenarios, /abort_request) and the
line closes them (admin_guard on, no --admin-api-key), it empties the cache as an operator would:
the boot gets the engine's own `--admin-api-key` with a random key per boot (`harness_args`,
which the canary prints as a difference from the line) and admin_headers() sends it.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Iterable, Mapping, Optional

import psutil
import requests

from adapter.cpu import models

from adapter import locations

# The checkout (its sitecustomize.py goes on PYTHONPATH after the harness's), or None for an
# installed wheel, whose dsv41.pth arms the line in every process of the interpreter.
REPO_ROOT = locations.source_tree()
HARNESS_SITE = pathlib.Path(__file__).resolve().parent / "site"

# What the engine needs to serve the tiny models on 2 CPU cores (../SPEC: "The real engine on CPU").
# --mem-fraction-static 0.3 (SPEC's line has 0.05): on CPU the engine profiles the machine's
# available memory before and after the model load and refuses the boot when it fell by more than
# the fraction ("Loaded weights leave no GPU memory for the KV cache"); another process loading
# beside the boot (a second server, a test) moved it by 6.6 % of 24 GB once. The pools are set by
# --max-total-tokens (DEFAULT_ARGS and per model), which caps the profiled size: nothing else moves.
CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
            "--disable-cuda-graph", "--dtype", "float32", "--max-running-requests", "8",
            "--mem-fraction-static", "0.3", "--sleep-on-idle", "--skip-server-warmup")
DEFAULT_ARGS = {"--max-total-tokens": "8192", "--chunked-prefill-size": "1024"}
# model="dsv4": the engine's DeepSeek-V4 backend on its GB10 (SM120) route with the torch sparse
# decode and torch top-k, page 256, bf16, 512-token chunks (SPEC "A whole DeepSeek-V4 in the real
# server on CPU"); the stand-ins for its GPU kernels are armed by the harness sitecustomize
# (DSV41CPU_DSV4=1, adapter/cpu/dsv4/).
# The engine's memory check needs a larger static fraction for this model. KV stays fp8 (the V4
# pool asserts a uint8 store); the engine's CPU refusal of fp8 KV without AMX is lifted for the V4
# pool only (adapter/cpu/dsv4/kv_pool.py).
MODEL_CPU_ARGS = {"dsv4": {"--attention-backend": "dsv4", "--dtype": "bfloat16",
                           "--mem-fraction-static": "0.3"}}
MODEL_CPU_ARGS["dsv41"] = MODEL_CPU_ARGS["dsv4"]
# --swa-full-tokens-ratio 0.25 (SWA pool 2048 of 8192): at the engine's 0.1 (768 = 3 pages of 256)
# a request whose radix hit locks one SWA page never passes the prefill admission (SWA needed 512
# is not < the 512 left, and it is not a permanent shortfall, so the scheduler waits for ever).
MODEL_DEFAULT_ARGS = {"dsv4": {"--dsa-topk-backend": "torch", "--page-size": "256",
                               "--chunked-prefill-size": "512", "--swa-full-tokens-ratio": "0.25"}}
# model="dsv41" (the tiny DeepSeek-V4.1): the dsv4 route and sizes. --swa-full-tokens-ratio stays
# explicit: the engine's 0.1 override skips deepseek_v41 (model_overrides/deepseek_v4.py), whose
# SWA pool it sizes from the request cap instead, on the cluster as here (docs/cpu_server.md).
MODEL_DEFAULT_ARGS["dsv41"] = MODEL_DEFAULT_ARGS["dsv4"]
DEEPSEEK_MODELS = ("dsv4", "dsv41")
# Launch args the harness adds to every boot of a model, control and production line alike, each
# with why: the engine's own V4.1 defaults that it resolves on CUDA but not on CPU, so that the
# CPU boot runs what the cluster runs. A line that names the flag itself (or its --no- form) keeps
# its own. Reports print them beside the line (canary: under "scaled").
BOUNDED_REPLAY_FLAG = "--enable-decoder-swa-bounded-replay"
MODEL_HARNESS_ARGS = {"dsv41": {BOUNDED_REPLAY_FLAG: (
    "", "the engine's V4.1 default on CUDA (arg_groups/deepseek_v4_hook.py "
        "validate_deepseek_v41_features resolves it on for CUDA/HIP, off on CPU)")}}
BOOT_TIMEOUT_S = 240.0
LAUNCHER_ROLE = "launcher (HTTP + tokenizer manager)"


# Lines a process writes when it stops a boot on purpose: the installer's refusal / config error,
# the bootstrap's and the CPU harness's own fatal errors.
FATAL_MARKERS = ("[dsv41] FATAL:", "[dsv41-cpu] FATAL:")
_TRACEBACK = "Traceback (most recent call last):"


def error_lines(logs: Mapping[str, str]) -> list[str]:
    """The server's own error lines, "[<role> pid N] <line>": every FATAL line first (each once,
    from the text of the marker on: the engine's log prefix dropped), then per process the line
    that ends its last traceback (the exception raised)."""
    fatal, raised = [], []
    for role, text in logs.items():
        lines = text.splitlines()
        for line in lines:
            for marker in FATAL_MARKERS:
                if marker in line:
                    entry = f"[{role}] {line[line.index(marker):].strip()}"
                    if entry not in fatal:
                        fatal.append(entry)
                    break
        starts = [i for i, line in enumerate(lines) if line.rstrip().endswith(_TRACEBACK)]
        if starts:
            # frames are indented; the first unindented line after them names the exception
            last = next((ln for ln in lines[starts[-1] + 1:] if ln.strip() and not ln[0].isspace()), None)
            if last is not None:
                raised.append(f"[{role}] {last.strip()[:400]}")
    return fatal + raised


class BootError(RuntimeError):
    """The server exited or never became healthy. `.server` holds its logs and exit code.

    The message's first line is the headline and the first error line (the refusal when there
    is one); then every error line (error_lines()), the last log lines, and the log directory.
    `.headline`, `.errors`: the parts, for reports that print them their own way."""

    def __init__(self, headline: str, server: "CpuServer"):
        self.headline = headline
        self.server = server
        logs = server.process_logs()
        self.errors = error_lines(logs)
        cause = self.errors[0].split("] ", 1)[1] if self.errors else "no error line in the server's logs"
        parts = [f"{headline}: {cause}"]
        if self.errors:
            parts += ["error lines (refusals first):", *(f"  {ln}" for ln in self.errors)]
        parts += ["log tail:", *(f"  {ln}" for ln in server.tail(12).splitlines()),
                  f"logs: {server.log_dir}"]
        super().__init__("\n".join(parts))

    def summary(self) -> str:
        """First line, error lines and log directory (no tail): what a report prints."""
        return "\n".join([str(self).splitlines()[0], *(f"  {ln}" for ln in self.errors),
                          f"  logs: {self.server.log_dir}"])


_STARTED: "weakref.WeakSet[CpuServer]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """A harness process that exits (or is interrupted) stops every server it started."""
    for server in list(_STARTED):
        with contextlib.suppress(Exception):
            server.stop()


ADMIN_KEY_FLAG = "--admin-api-key"


def closes_admin_routes(keys: Mapping[str, str], args: Mapping[str, Optional[str]]) -> bool:
    """Whether a boot of these keys and launch args answers its admin routes (/flush_cache,
    /abort_request ...) 403 to a client without a key: admin_guard on and no --admin-api-key
    (adapter/admin_guard.py). Stock leaves them open."""
    from adapter import keys as key_registry

    return key_registry.parse_env(keys).enabled("admin_guard") and not args.get(ADMIN_KEY_FLAG)


# A CPU server binds its ports 30-70 s after the harness chose them. A port the kernel handed out
# for port 0 could meanwhile go to any other process's outgoing connection or port-0 bind, so the
# harness takes its ports below the kernel's ephemeral range (which the kernel never hands out on
# its own) and holds each, with an flock on a file named after it, from the moment it is chosen
# until the server stops: two harness processes (the e2e lane, a canary beside the suite) never
# pick the same one.
_HELD_PORTS: dict = {}          # port -> fd of its held lock file
PORT_SPAN = 12_000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port nobody listens on, outside the ephemeral range, held until release_port()."""
    import fcntl
    import random

    high = _ephemeral_low()
    low = max(1024, high - PORT_SPAN)
    lock_dir = pathlib.Path(tempfile.gettempdir()) / "dsv41-cpu-ports"
    lock_dir.mkdir(exist_ok=True)
    for _ in range(2000):
        port = random.randrange(low, high)
        if port in _HELD_PORTS:
            continue
        fd = os.open(lock_dir / f"{port}.lock", os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", port))          # nobody has it now
        except OSError:
            os.close(fd)                                # held by another harness, or bound
            continue
        _HELD_PORTS[port] = fd
        return port
    raise RuntimeError(f"no free loopback port in {low}..{high - 1}")


def release_port(port: int) -> None:
    fd = _HELD_PORTS.pop(port, None)
    if fd is not None:
        os.close(fd)


@dataclasses.dataclass(eq=False)
class CpuServer:
    model: str                                  # "dense" | "swa" | "dsv4" | "dsv41" (adapter/cpu/models.py)
    keys: Mapping[str, str] = dataclasses.field(default_factory=dict)   # DSV41_* keys
    args: Mapping[str, Optional[str]] = dataclasses.field(default_factory=dict)  # launch args
    name: str = ""
    log_dir: Optional[pathlib.Path] = None
    port: int = 0
    proc: Optional[subprocess.Popen] = None
    boot_s: float = 0.0
    roles: dict = dataclasses.field(default_factory=dict)   # pid -> process title
    extra_env: dict = dataclasses.field(default_factory=dict)   # harness switches (DSV41CPU_*)
    nodes: int = 1                              # launch processes, one per node (--nnodes)
    node_procs: list = dataclasses.field(default_factory=list)   # nodes 1..N-1 (Popen)
    node_ports: list = dataclasses.field(default_factory=list)   # their health-stub ports
    dist_port: int = 0                          # --dist-init-addr port (nodes > 1)
    # The harness calls admin routes on this boot (flush_cache(), /abort_request): where the line
    # closes them (admin_guard on, no --admin-api-key) the boot gets the engine's own
    # --admin-api-key with a random key per boot, and admin_headers() sends it, as an operator
    # who flushes or aborts would. `harness_args` says what was added (reports print it).
    admin_calls: bool = False
    harness_args: dict = dataclasses.field(default_factory=dict)   # launch args the harness added

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def returncode(self) -> Optional[int]:
        return None if self.proc is None else self.proc.poll()

    def _cpu_args(self) -> list[str]:
        overrides = MODEL_CPU_ARGS.get(self.model, {})
        argv = list(CPU_ARGS)
        for i, item in enumerate(argv):
            if item in overrides:
                argv[i + 1] = overrides[item]
        return argv

    def command(self, node_rank: int = 0) -> list[str]:
        merged = dict(DEFAULT_ARGS)
        merged.update(MODEL_DEFAULT_ARGS.get(self.model, {}))
        merged.update(self.args)
        merged.update(self.harness_args)
        port = self.port if node_rank == 0 else self.node_ports[node_rank - 1]
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path",
                str(models.ensure_model(self.model)), "--host", "127.0.0.1", "--port", str(port),
                *self._cpu_args()]
        for flag, value in merged.items():
            if value is None:
                continue
            argv += [flag] if value == "" else [flag, str(value)]
        if self.nodes > 1:
            argv += ["--nnodes", str(self.nodes), "--node-rank", str(node_rank),
                     "--dist-init-addr", f"127.0.0.1:{self.dist_port}"]
        return argv

    def environment(self, node_rank: int = 0) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("DSV41_") and k not in ("PYTHONPATH", "SGLANG_PLUGINS")}
        env.update({str(k): str(v) for k, v in self.keys.items()})
        env["PYTHONPATH"] = os.pathsep.join([str(HARNESS_SITE), *([str(REPO_ROOT)] if REPO_ROOT else [])])
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["DSV41CPU_LOG_DIR"] = str(self.log_dir)
        if self.model in DEEPSEEK_MODELS:
            from adapter.cpu.dsv4 import ENGINE_ENV

            env.update(ENGINE_ENV)
            env["DSV41CPU_DSV4"] = "1"
        if self.model == "dsv41":
            env["DSV41CPU_DSV41"] = "1"
        env.update(self.extra_env)
        env.setdefault("OMP_NUM_THREADS", "1")
        tp = int(self.args.get("--tp-size") or 1)
        if tp > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in env:
            # The engine binds each CPU rank to one NUMA node unless told otherwise, and this
            # machine has one: give each rank its own share of the cores instead (a node lists
            # its own ranks only: its local rank 0 is global rank node_rank x ranks per node).
            cores = sorted(os.sched_getaffinity(0))
            per_node = max(tp // self.nodes, 1)
            ranks = range(node_rank * per_node, (node_rank + 1) * per_node)
            env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(str(c) for c in cores[r::tp]) or str(cores[r % len(cores)]) for r in ranks)
        env["PYTHONUNBUFFERED"] = "1"
        # No GPU and no py-spy here: the engine's crash diagnostics would only sleep 5 s on every
        # stop (stop() signals the whole group, so the launcher sees its scheduler end first and
        # takes its crash path). An operator's env may turn them back on.
        env.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
        env.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")
        return env

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self, timeout: float = BOOT_TIMEOUT_S, expect_exit: bool = False) -> "CpuServer":
        """Boot and wait for /health. expect_exit: the boot should fail; wait for the exit instead."""
        if self.log_dir is None:
            self.log_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"dsv41-cpu-{self.name or self.model}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self.harness_args = {}
        for flag, (value, _why) in MODEL_HARNESS_ARGS.get(self.model, {}).items():
            if flag not in self.args and "--no-" + flag[2:] not in self.args:
                self.harness_args[flag] = value
        if self.admin_calls and closes_admin_routes(self.keys, self.args):
            self.harness_args[ADMIN_KEY_FLAG] = secrets.token_hex(16)    # one per boot
        if self.nodes > 1:
            self.dist_port = self.dist_port or free_port()
            self.node_ports = self.node_ports or [free_port() for _ in range(self.nodes - 1)]
        argv = self.command()       # node 0 (subclasses may override command() without a rank)
        (self.log_dir / "command.txt").write_text("".join(
            " ".join(self.command(r) if r else argv) + "\n" for r in range(self.nodes)) + "".join(
            f"{k}={v}\n" for k, v in sorted(self.keys.items())))
        began = time.monotonic()
        _STARTED.add(self)
        for rank in range(1, self.nodes):     # the other nodes first: node 0's schedulers wait on them
            out = open(self.log_dir / f"launcher-node{rank}.out", "wb")
            proc = subprocess.Popen(self.command(rank), env=self.environment(rank),
                                    cwd=str(REPO_ROOT or self.log_dir), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            out.close()
            self.node_procs.append(proc)
            self.roles[proc.pid] = f"node {rank} launcher"
        launcher_out = open(self.log_dir / "launcher.out", "wb")
        self.proc = subprocess.Popen(argv, env=self.environment(), cwd=str(REPO_ROOT or self.log_dir),
                                     stdin=subprocess.DEVNULL, stdout=launcher_out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        launcher_out.close()
        self.roles[self.proc.pid] = LAUNCHER_ROLE
        try:
            if expect_exit:
                self.proc.wait(timeout=timeout)
                self.boot_s = time.monotonic() - began
                return self
            self._wait_healthy(began, timeout)
            self.boot_s = time.monotonic() - began
            self._name_processes()
            return self
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, began: float, timeout: float) -> None:
        while time.monotonic() < began + timeout:
            code = self.proc.poll()
            if code is not None:
                raise BootError(f"server {self.name or self.model} exited with code {code} during boot", self)
            for rank, proc in enumerate(self.node_procs, 1):
                if proc.poll() is not None:
                    raise BootError(f"server {self.name or self.model} node {rank} exited with code "
                                    f"{proc.returncode} during boot", self)
            # Titles now, while the processes live: a boot that fails has no other chance to
            # name whose log holds the error.
            self._name_processes()
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            time.sleep(0.5)
        self._name_processes()
        raise BootError(f"server {self.name or self.model} not healthy after {timeout:.0f}s", self)

    def _roots(self) -> list:
        """Launch processes: node 0's, then the other nodes'."""
        return ([self.proc] if self.proc is not None else []) + list(self.node_procs)

    def _name_processes(self) -> None:
        for rank, proc in enumerate(self._roots()):
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(proc.pid)
                self.roles[root.pid] = LAUNCHER_ROLE if proc is self.proc else f"node {rank} launcher"
                for child in root.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        title = " ".join(child.cmdline()).strip() or child.name()
                        if title.startswith("sglang::") or not self.roles.get(child.pid, "").startswith("sglang::"):
                            self.roles[child.pid] = title if title.startswith("sglang::") else child.name()

    def group_alive(self) -> list[int]:
        """Live (non-zombie) processes of the server's process groups (one per node)."""
        groups = {proc.pid for proc in self._roots()}
        if not groups:
            return []
        alive = []
        for p in psutil.process_iter(["pid", "status"]):
            with contextlib.suppress(psutil.Error, ProcessLookupError, OSError):
                if os.getpgid(p.pid) in groups and p.info["status"] != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
        return alive

    def stop(self, grace_s: float = 20.0) -> None:
        """End every process group of the server (node 0 first); return only when none is left."""
        roots = self._roots()
        if not roots:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            if not self.group_alive():
                break
            for proc in roots:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and self.group_alive():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    roots[0].wait(timeout=0.2)
                for proc in roots[1:]:
                    proc.poll()
        for proc in roots:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        left = self.group_alive()
        if left:
            raise RuntimeError(f"server {self.name or self.model}: processes {left} survived SIGKILL")
        for port in (self.port, self.dist_port, *self.node_ports):
            release_port(port)

    def __enter__(self) -> "CpuServer":
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- logs ----------------------------------------------------------------------------------

    def process_logs(self) -> dict[str, str]:
        """{"<role> pid N": text} for every process that wrote output, plus "launcher.out"."""
        out = {}
        if self.log_dir is None:
            return out
        for path in sorted(self.log_dir.glob("*.log")):
            pid = int(path.stem)
            role = self.roles.get(pid, "process")
            out[f"{role} pid {pid}"] = path.read_text(errors="replace")
        launcher = self.log_dir / "launcher.out"
        if launcher.exists():
            out["launcher.out"] = launcher.read_text(errors="replace")
        for path in sorted(self.log_dir.glob("launcher-node*.out")):
            out[path.name] = path.read_text(errors="replace")
        return out

    def log(self) -> str:
        return "\n".join(self.process_logs().values())

    def tail(self, n: int = 40) -> str:
        lines = []
        for role, text in self.process_logs().items():
            lines += [f"[{role}] {line}" for line in text.splitlines()[-n:]]
        return "\n".join(lines[-n:])

    # --- HTTP ----------------------------------------------------------------------------------

    def generate(self, input_ids: Iterable[int], max_new_tokens: int = 16, timeout: float = 300.0,
                 **extra) -> dict:
        """Greedy /generate on token ids, logprobs returned. Raises on an HTTP error."""
        payload = {"input_ids": list(input_ids), "return_logprob": True,
                   "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                       "ignore_eos": True}}
        payload.update(extra)
        resp = requests.post(self.url + "/generate", json=payload, timeout=timeout)
        resp.raise_for_status()
        return resp.json()

    def healthy(self, timeout: float = 30.0) -> bool:
        """/health answers 200 (False when it answers anything else or nothing)."""
        try:
            return requests.get(self.url + "/health", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def survived(self, status, wait_s: float) -> bool:
        """After a request answered `status` (an HTTP status; anything else: no answer): whether
        the server still runs and is healthy. A 5xx or no answer gives a dying server up to
        `wait_s` to exit first (a scheduler's death takes the launcher down)."""
        if not isinstance(status, int) or status >= 500:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
        return self.returncode is None and self.healthy()

    def admin_headers(self) -> dict:
        """The engine's admin key as a bearer token when the boot has `--admin-api-key` (the
        line's, or the harness's: admin_calls) (its admin routes then need it: /flush_cache,
        /abort_request ...), else no header."""
        key = self.harness_args.get(ADMIN_KEY_FLAG) or self.args.get(ADMIN_KEY_FLAG)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def flush_cache(self, wait_s: float = 0.0) -> None:
        """Empty the radix cache (the engine's /flush_cache; it answers 400 while a request is
        running): retry for up to `wait_s` seconds, e.g. while aborted streams drain. A boot whose
        line closes the admin routes needs admin_calls=True (the engine's own admin key)."""
        deadline = time.monotonic() + wait_s
        while True:
            resp = requests.post(self.url + "/flush_cache", headers=self.admin_headers(), timeout=60)
            if resp.status_code in (401, 403) and not self.admin_headers():
                raise RuntimeError(
                    f"server {self.name or self.model}: /flush_cache answered {resp.status_code}: "
                    "the line closes the admin routes (admin_guard) and the boot has no "
                    f"{ADMIN_KEY_FLAG}; boot it with CpuServer(admin_calls=True)")
            if resp.status_code != 400 or time.monotonic() >= deadline:
                resp.raise_for_status()
                return
            time.sleep(0.5)


def output_of(response: dict) -> tuple[list[int], list[float]]:
    """(output token ids, their logprobs) from a /generate response."""
    entries = response["meta_info"]["output_token_logprobs"]
    return [int(e[1]) for e in entries], [float(e[0]) for e in entries]
