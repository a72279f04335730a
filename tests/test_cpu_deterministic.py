"""The CPU harness's deterministic-inference switch (adapter/cpu/deterministic.py, test boots only:
DSV41CPU_DETERMINISTIC=1, tests/e2e/test_e2e_seed.py): the engine's own ServerArgs resolution
refuses `--enable-deterministic-inference` on torch_native without it and accepts it with it; the
seeded sampler's murmur hash stand-in gives the engine's CPU kernel's known values; the
batch-invariant mode that raises on CPU is stood in."""
import json

import pytest

from adapter.cpu import deterministic

from conftest import run_python

# The engine's own known values for its CPU kernel sgl_kernel::murmur_hash32_cpu (sgl-kernel's CPU
# test, test_murmur_hash32_cpu_known_values): seeds 0, 1, 42, 0x123456789ABCDEF0 at positions
# 0, 7, 123, 456, columns 0, 1, 2, 17.
SEEDS = [0, 1, 42, 0x123456789ABCDEF0]
POSITIONS = [0, 7, 123, 456]
COLUMNS = [0, 1, 2, 17]
KNOWN = [[2167721464, 10027521, 2423355346, 2203067026],
         [3755322398, 4196701286, 1002451629, 183234019],
         [772287619, 548237471, 2740678348, 3656549299],
         [3746406971, 2891010872, 104055988, 3372550890]]


@pytest.mark.parametrize("positions_dtype", ["int64", "uint64"])
def test_the_hash_stand_in_gives_the_engine_kernels_known_values(positions_dtype):
    import torch

    out = deterministic.murmur_hash32(torch.tensor(SEEDS, dtype=torch.uint64),
                                      torch.tensor(POSITIONS, dtype=getattr(torch, positions_dtype)),
                                      torch.tensor(COLUMNS, dtype=torch.int64))
    assert out.dtype == torch.uint32 and out.shape == (4, 4)
    assert out.tolist() == KNOWN


def test_the_hash_stand_in_refuses_what_the_kernel_refuses():
    import torch

    with pytest.raises(TypeError, match="seed"):
        deterministic.murmur_hash32(torch.tensor([1]), torch.tensor([1]), torch.tensor([0]))


# In a child: the registrations are process-wide (a list of the engine's, a torch op).
CHILD = r"""
import json, sys
from adapter.cpu import cpu_engine, deterministic
cpu_engine.install_torchvision_shim()
cpu_engine.install_sgl_kernel_stand_in()
import torch
from sglang.srt.server_args import ServerArgs
from sglang.srt.arg_groups.model_override_base import resolved_view
from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32
import sglang.srt.batch_invariant_ops as bio

def resolve():
    args = ServerArgs(model_path=sys.argv[1], device="cpu", attention_backend="torch_native",
                      enable_deterministic_inference=True)
    try:
        args.resolve_once()
    except ValueError as e:
        return "refused: " + str(e)
    view = resolved_view(args)      # what the resolution decided (the record keeps the input)
    return "accepted: " + view.attention_backend + " " + view.sampling_backend

def attempt(fn):
    try:
        fn()
        return "ran"
    except Exception as e:
        return type(e).__name__ + ": " + str(e)

hash_args = (torch.tensor([42], dtype=torch.uint64), torch.tensor([123]), torch.tensor([0, 1, 2, 17]))
out = {"before": {"resolve": resolve(), "hash": attempt(lambda: murmur_hash32(*hash_args)),
                  "batch_invariant": attempt(bio.enable_batch_invariant_mode)}}
deterministic.install()         # the engine modules are imported: each hook acts now
out["after"] = {"resolve": resolve(), "hash": murmur_hash32(*hash_args).tolist(),
                "batch_invariant": attempt(bio.enable_batch_invariant_mode)}
print(json.dumps(out))
"""


def test_the_switch_makes_the_engine_accept_deterministic_inference_on_torch_native():
    from adapter.cpu import models

    proc = run_python(CHILD, env={"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"},
                      argv=[str(models.ensure_model("dense"))])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # negative controls: what the engine does on CPU without the switch
    assert out["before"]["resolve"].startswith("refused: Currently only [")
    assert "'torch_native'" in out["before"]["resolve"]
    assert "murmur_hash32_cpu" in out["before"]["hash"]
    assert out["before"]["batch_invariant"] == "RuntimeError: No supported accelerator (CUDA/XPU) available"
    # with it: the engine's own resolution accepts (and forces its pytorch sampling backend)
    assert out["after"]["resolve"] == "accepted: torch_native pytorch"
    assert out["after"]["hash"] == [KNOWN[2]]         # the engine's sampler path reaches the stand-in
    assert out["after"]["batch_invariant"] == "ran"
    for line in (deterministic.BACKEND_LINE, deterministic.HASH_LINE,
                 deterministic.BATCH_INVARIANT_LINE):
        assert proc.stderr.count(line) == 1, line
