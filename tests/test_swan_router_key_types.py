"""The swan router key's tensor check (runtime/swan256/router_key.cpp, issue 30.4).

The key reads an argument as a tensor only when its real type is torch.Tensor or a subclass.
An object that only claims to be one through __class__ (a MagicMock(spec=torch.Tensor)) used to
be cast to a C++ tensor (the process crashed), and a __class__ that raises used to leave a Python
error pending after the key had swallowed the C++ exception (SystemError). Now both get None: the
router's Python path decides the call. The impostor cases run in a child Python, so that a crash
fails the test instead of killing pytest.
"""
import pytest
import torch
from conftest import run_python
from swan_module_dir import built_router_key

from adapter import swan

# In the child: the built module's router key, loaded as install() loads it, given each impostor
# in four of the tensor slots (q and k_cache are read first and more deeply than the others).
CHILD = r"""
import sys
import unittest.mock

import torch

from adapter import swan

info = swan.verify_module(swan.module_dir(), swan.installed_flashinfer_version())
key = swan.load_router_key(info)


class ClassRaises:
    @property
    def __class__(self):
        raise RuntimeError("__class__ raises")


IMPOSTORS = {"MagicMock(spec=torch.Tensor)": lambda: unittest.mock.MagicMock(spec=torch.Tensor),
             "__class__ raises": ClassRaises}
make = IMPOSTORS[sys.argv[1]]
for name in ("q", "k_cache", "indices", "extra_topk_length"):
    kw = dict(q=torch.zeros(4, 1, 16, 512, dtype=torch.bfloat16),
              k_cache=torch.zeros(5, 256, 1, 584, dtype=torch.uint8), head_dim_v=512)
    assert key.decode_key(kw) is not None, "the base call must be natively keyed"
    kw[name] = make()
    assert key.decode_key(kw) is None, name
    trivial = [n for n in range(2)]      # a pending error would surface here (SystemError)
    assert key.lookup(kw, {}) is None, name
    trivial = [n for n in range(2)]
    print("python path:", name)
print("no pending error")
"""


@pytest.mark.parametrize("impostor", ["MagicMock(spec=torch.Tensor)", "__class__ raises"])
def test_a_tensor_impostor_takes_the_python_path(impostor):
    built_router_key()
    proc = run_python(CHILD, argv=[impostor], timeout=300)
    # a negative exit: killed by that signal (-11: the impostor was read as a C++ tensor)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}{proc.stderr[-3000:]}"
    assert proc.stdout.count("python path:") == 4 and "no pending error" in proc.stdout


@pytest.fixture(scope="module")
def native():
    built_router_key()
    info = swan.verify_module(swan.module_dir(), swan.installed_flashinfer_version())
    return swan.load_router_key(info)


class MarkedTensor(torch.Tensor):
    """A real subclass: a THPVariable by its type's MRO, whatever Python adds on top."""


def test_a_real_tensor_subclass_takes_the_native_path(native):
    """Negative control for the check: real subclasses and Parameter keep the native key, and it
    is the plain tensors' key (the key reads metadata, not the Python type)."""
    kw = dict(q=torch.zeros(4, 1, 16, 512, dtype=torch.bfloat16),
              k_cache=torch.zeros(5, 256, 1, 584, dtype=torch.uint8),
              indices=torch.full((4, 1, 128), -1, dtype=torch.int32), head_dim_v=512)
    plain = native.decode_key(kw)
    assert isinstance(plain, bytes)
    sub = dict(kw, q=kw["q"].as_subclass(MarkedTensor),
               indices=kw["indices"].as_subclass(MarkedTensor),
               k_cache=torch.nn.Parameter(kw["k_cache"], requires_grad=False))
    assert type(sub["q"]) is MarkedTensor and type(sub["k_cache"]) is torch.nn.Parameter
    assert native.decode_key(sub) == plain
    slot, key = native.lookup(sub, {})
    assert key == plain
    decision = object()
    assert native.lookup(kw, {slot: (key, decision)}) is decision
