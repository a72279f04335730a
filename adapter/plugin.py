"""SGLang plugin entry point (group `sglang.srt.plugins`, name `dsv41`).

`load_plugins()` calls `load()` in every engine process; it arms the same installer, from the
same table, as sitecustomize.py. Whichever runs first installs; the other finds it done.
"""


def load() -> None:
    from adapter import installer

    installer.bootstrap()
