"""dsv41 bootstrap for a checkout on PYTHONPATH: arm the adapter installer when a DSV41_* key is set.

An installed wheel does the same through site-packages/dsv41.pth. With no DSV41_* key this imports
nothing but `os`. Python's `site` swallows exceptions raised here, so any failure is printed and
ends the process with exit code 2 (adapter/plugin.py arm_at_startup).
"""
import os

if any(name.startswith("DSV41_") for name in os.environ):
    try:
        from adapter import plugin
    except BaseException:  # noqa: BLE001 - site would print one line and carry on
        import sys
        import traceback

        traceback.print_exc()
        sys.stderr.write("[dsv41] FATAL: the dsv41 bootstrap failed (traceback above); "
                         "unset the DSV41_* keys to boot without dsv41.\n")
        sys.stderr.flush()
        os._exit(2)
    plugin.arm_at_startup("sitecustomize")
