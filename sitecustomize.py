"""dsv41 bootstrap (on PYTHONPATH in the image): arm the adapter installer when a DSV41_* key is set.

With no DSV41_* key this imports nothing. Python's `site` swallows exceptions raised here, so any
failure is printed and ends the process with a non-zero exit instead.
"""
import os

if any(name.startswith("DSV41_") for name in os.environ):
    try:
        from adapter import plugin

        plugin.start("sitecustomize")
    except BaseException:  # noqa: BLE001 - site would print one line and carry on
        import sys
        import traceback

        traceback.print_exc()
        sys.stderr.write("[dsv41] FATAL: the dsv41 bootstrap failed (traceback above); "
                         "unset the DSV41_* keys to boot without dsv41.\n")
        sys.stderr.flush()
        os._exit(2)
