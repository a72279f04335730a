"""CPU harness, test boots only: the engine's `--enable-deterministic-inference` on CPU torch_native.

DSV41CPU_DETERMINISTIC=1 (set through CpuServer's extra_env) arms three things in each process of
the server, each as its engine module imports (tests/e2e/test_e2e_seed.py boots with it):

1. torch_native joins the engine's deterministic attention backends, through the engine's own
   registration hook for platforms (`arg_groups.choices.add_deterministic_attention_backend_
   choices`). Without it the engine refuses the flag on torch_native ("Currently only ['ascend',
   'fa3', 'fa4', 'flashinfer', 'intel_xpu', 'triton'] attention backends are supported for
   deterministic inference"). Why it is fair here: the harness stands in for the cluster's GPU
   attention backends (flashinfer / triton, which the engine lists), and a single request at a
   time on CPU torch_native computes the same shapes each call, with the same torch CPU kernels
   (one OpenMP thread: adapter/cpu/server.py), so it gives the same logits each call. It is not
   registered for the radix cache (`add_radix_supported_deterministic_attention_backend_choices`,
   which only absorbed-MLA models require): the engine then turns the radix cache off on this
   boot, so a repeated prompt is prefilled again, not read from the cache.
2. `torch.ops.sgl_kernel.murmur_hash32_cpu`, the CPU kernel the engine's seeded sampler calls
   (kernels/ops/sampling/murmur_hash.py: `multinomial_with_seed` hashes seed, position and token
   id into its Gumbel noise). It lives in the CPU build of sgl_kernel, which this machine lacks
   (adapter/cpu/cpu_engine.py); the stand-in is the same MurmurHash3 in torch integer ops, checked
   against the engine's own known values (tests/test_cpu_deterministic.py).
3. `batch_invariant_ops.enable_batch_invariant_mode`, which the model runner calls under the flag:
   it registers Triton GPU kernels for aten::mm / addmm / bmm / log_softmax / mean and asks the
   platform for an accelerator dispatch key, which raises on CPU ("No supported accelerator").
   The stand-in registers nothing and says so: batch invariance (a request's result not depending
   on what else is in the batch) is NOT given on this boot, and the test that uses it sends one
   request at a time.
Everything else the flag changes runs as the engine wrote it: the pytorch sampling backend, the
per-request seed tensor (SamplingBatchInfo.from_schedule_batch: 42 for an unseeded request), the
seeded top-k / top-p sampler (sampler.py `multinomial_with_seed`), the scheduler's truncation
alignment (none for torch_native), log_softmax logprobs.

Production never imports this module: only the CPU harness's sitecustomize (adapter/cpu/site/)
applies it, and only when the variable is set. Each piece writes one `[dsv41-cpu] deterministic
inference: ...` line to the process's log when it acts.
"""
from __future__ import annotations

import sys

ENV = "DSV41CPU_DETERMINISTIC"
BACKEND = "torch_native"
CHOICES_MODULE = "sglang.srt.arg_groups.choices"
HASH_MODULE = "sglang.kernels.ops.sampling.murmur_hash"
BATCH_INVARIANT_MODULE = "sglang.srt.batch_invariant_ops"
PREFIX = "[dsv41-cpu] deterministic inference: "
BACKEND_LINE = (PREFIX + "torch_native registered as a deterministic attention backend "
                "(add_deterministic_attention_backend_choices): the CPU harness stands in for the "
                "cluster's GPU attention backends; one request at a time on CPU torch_native "
                "computes the same shapes each call")
HASH_LINE = (PREFIX + "sgl_kernel::murmur_hash32_cpu stood in (torch integer ops; no CPU "
             "sgl_kernel here)")
BATCH_INVARIANT_LINE = (PREFIX + "enable_batch_invariant_mode stood in: its Triton GPU kernels "
                        "are not registered on CPU, so results are not batch-invariant on this "
                        "boot (send one request at a time)")
_MARK = "__dsv41_cpu_deterministic__"
_LIBRARY = []       # the torch.library fragment: its registration lasts as long as the object


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def register_backend(module=None) -> bool:
    """torch_native into the engine's DETERMINISTIC_ATTENTION_BACKEND_CHOICES (idempotent).
    True if this call added it."""
    module = module or sys.modules[CHOICES_MODULE]
    if BACKEND in module.DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        return False
    module.add_deterministic_attention_backend_choices([BACKEND])
    _say(BACKEND_LINE)
    return True


# --- MurmurHash3 (32-bit) as the engine's CPU kernel computes it -------------------------------
# Every value is an int64 tensor holding an unsigned 32-bit number; products are split in 16-bit
# halves so that no int64 product overflows (the kernel's uint32 arithmetic wraps mod 2^32).
_M32 = 0xFFFFFFFF


def _mul32(a, b: int):
    return (a * (b & 0xFFFF) + (((a * (b >> 16)) & 0xFFFF) << 16)) & _M32


def _rotl32(x, r: int):
    return ((x << r) | (x >> (32 - r))) & _M32


def _mix(h, k):
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _M32


def _fmix(h):
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur_hash32(seed, positions, col_indices):
    """[n, m] uint32: MurmurHash3 of (seed low, seed high, position, column) per row and column,
    finalized with length 16, as sgl_kernel's murmur_hash32_cpu (and the engine's Triton kernel)."""
    import torch

    if seed.dtype != torch.uint64:
        raise TypeError("seed must have dtype torch.uint64")
    if positions.dtype not in (torch.int64, torch.uint64) or col_indices.dtype != torch.int64:
        raise TypeError("positions must be int64 or uint64, col_indices int64")
    s = seed.view(torch.int64)
    low, high = s & _M32, (s >> 32) & _M32      # the arithmetic shift's sign bits are masked off
    h = torch.zeros_like(s)
    h = _mix(_mix(_mix(h, low), high), positions.view(torch.int64) & _M32)
    h = _mix(h.view(-1, 1), (col_indices & _M32).view(1, -1))
    return _fmix(h ^ 16).to(torch.uint32)


def register_hash(module=None) -> bool:
    """Define sgl_kernel::murmur_hash32_cpu with the stand-in, unless the op exists (a real CPU
    sgl_kernel). True if this call defined it."""
    import torch

    try:
        torch.ops.sgl_kernel.murmur_hash32_cpu
        return False
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    lib.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
    lib.impl("murmur_hash32_cpu", murmur_hash32, "CPU")
    _LIBRARY.append(lib)
    _say(HASH_LINE)
    return True


def stand_in_batch_invariant_mode(module=None) -> bool:
    """Replace the package's enable_batch_invariant_mode (what model_runner imports under the
    flag) with one that registers nothing and says so. True if this call replaced it."""
    module = module or sys.modules[BATCH_INVARIANT_MODULE]
    if getattr(module.enable_batch_invariant_mode, _MARK, False):
        return False

    def enable_batch_invariant_mode(enable_bmm: bool = True):
        _say(BATCH_INVARIANT_LINE)

    setattr(enable_batch_invariant_mode, _MARK, True)
    module.enable_batch_invariant_mode = enable_batch_invariant_mode
    return True


def install() -> None:
    """Arm the three pieces in this process, each when its engine module imports."""
    import wrapt

    wrapt.register_post_import_hook(register_backend, CHOICES_MODULE)
    wrapt.register_post_import_hook(register_hash, HASH_MODULE)
    wrapt.register_post_import_hook(stand_in_batch_invariant_mode, BATCH_INVARIANT_MODULE)
