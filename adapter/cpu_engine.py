"""What the pinned engine needs to import and run on a CPU machine (tests and sims only).

PyPI's torchvision is CUDA-linked and fails beside the CPU build of torch, yet engine modules on
the scheduler's import path import it at module level (configs/deepseek_ocr.py,
multimodal/internvl_utils.py, and transformers' image utilities behind them). The stand-in below
answers `import torchvision[.x.y]` with placeholder modules: every attribute is a placeholder
class that can be referenced, subclassed and read further, and that raises if anything tries to
*use* it (call it). Nothing the scheduler, the radix cache or the autotune helpers run calls into
torchvision, so a call reaching it is a bug worth seeing. Production images have the real
torchvision; nothing in production imports this module.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

SHIM_VERSION = "0.0.0+dsv41.cpu.shim"


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"torchvision stand-in: {cls.__qualname__} was called; the CPU "
                           "harness has no torchvision (see adapter/cpu_engine.py)")


def _placeholder(qualname: str) -> type:
    return _PlaceholderMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname,
                                                             "__module__": "torchvision"})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__version__ = SHIM_VERSION
        module.__dsv41_shim__ = True
        return module

    def exec_module(self, module):
        pass


def install_torchvision_shim() -> bool:
    """Install the stand-in unless a real torchvision is importable. Returns True if installed."""
    if any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        return True
    if "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is not None:
        return False
    sys.meta_path.insert(0, _StandInFinder())
    return True
