"""Only what pyproject.toml cannot say: the wheel ships dsv41.pth at the root of site-packages.

Its one line arms the adapter installer at interpreter startup when a DSV41_* key is set (as the
checkout's sitecustomize.py does through PYTHONPATH), so `pip install dsv41-*.whl` arms the
production line with no PYTHONPATH. An editable install (`pip install -e .`, the developers'
.venv) does not get it: there the checkout's sitecustomize.py is the entry, and tests start
children without it.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "dsv41.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH))
        return outputs


setup(cmdclass={"build_py": BuildPyWithPth})
