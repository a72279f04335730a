"""Entry points: the SGLang plugin (group `sglang.srt.plugins`, name `dsv41`), sitecustomize.py
(a checkout on PYTHONPATH) and dsv41.pth (an installed wheel).

`load_plugins()` calls `load()` in every engine process; sitecustomize.py and dsv41.pth call
`arm_at_startup()` in every Python process. All arm the same per-process installer from the same
table, and the metrics exporter's settle-at-publish; whichever runs first installs and is recorded
as the entry (`installer.entry()`, reported by `dsv41 check`), the others find the work done.
"""
import os


def start(entry: str) -> None:
    from adapter import installer
    from adapter.table import ADAPTERS

    settings = installer.bootstrap(entry=entry)
    if any(settings.enabled(name) for name in ADAPTERS):
        from adapter import metrics

        metrics.arm()


def load() -> None:
    start("plugin")


def arm_at_startup(entry: str) -> None:
    """Arm the installer when a DSV41_* key is set; with none this imports nothing.

    Python's `site` swallows exceptions raised in sitecustomize and .pth lines (one line, then the
    process carries on unarmed), so any failure is printed and ends the process with exit code 2.
    """
    if not any(name.startswith("DSV41_") for name in os.environ):
        return
    try:
        start(entry)
    except BaseException:  # noqa: BLE001 - site would print one line and carry on
        import sys
        import traceback

        traceback.print_exc()
        sys.stderr.write("[dsv41] FATAL: the dsv41 bootstrap failed (traceback above); "
                         "unset the DSV41_* keys to boot without dsv41.\n")
        sys.stderr.flush()
        os._exit(2)
