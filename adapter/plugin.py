"""Entry points: the SGLang plugin (group `sglang.srt.plugins`, name `dsv41`) and sitecustomize.py.

`load_plugins()` calls `load()` in every engine process; sitecustomize.py calls `start()` in every
Python process of the image. Both arm the same per-process installer from the same table, and the
metrics exporter's settle-at-publish; whichever runs first installs and is recorded as the entry
(`installer.entry()`, reported by `dsv41 check`), the other finds the work done.
"""


def start(entry: str) -> None:
    from adapter import installer
    from adapter.table import ADAPTERS

    settings = installer.bootstrap(entry=entry)
    if any(settings.enabled(name) for name in ADAPTERS):
        from adapter import metrics

        metrics.arm()


def load() -> None:
    start("plugin")
