"""The CPU stand-ins for the kernels only the DeepSeek-V4.1 forward reaches
(adapter/cpu/dsv41/): the fp4 index-K quantizer, store and gather (Triton), the compressed-KV
store `fused_store_cache` (CUDA-JIT store.cuh) and the fp4 index decode logits (Triton).

References, the engine's own where it ships one:
- quantize / store: `sglang.test.kernels.deepseek_v4.common.quantize_fp4_indexer_ref` and
  `store_fp4_index_cache_ref` (its 64-slot pages), byte for byte; and the real Triton kernels
  under Triton's CPU interpreter (both roundings, the store and the gather), byte for byte;
- the read side: the pool's own torch readers (`DeepSeekV4IndexerPool.get_index_k_fp4` /
  `get_index_k_dequant`, the branch the engine runs off CUDA);
- decode logits: the engine's torch scoring (`DeepseekV41Indexer.scores` over
  `get_index_k_dequant`, what the prefill torch path runs) with -inf past each length. (Under
  Triton's interpreter the logits kernel itself returns ~1e10 for a row of ones whose logit is
  128: the interpreter does not run that kernel faithfully, so it is not a reference here.)
- fused_store_cache: read back with the engine's V4 reader (`dequantize_k_cache_paged_ref`)
  against store.cuh's rule; and the ROCm Triton kernels of the same V4 layout
  (`triton_store_cache`) under the interpreter: the same scale and rope bytes, 99 % of the fp8
  codes (the interpreter's float -> fp8 cast is not the CUDA kernel's round-to-nearest: it
  returned 16 for an exact 32 and codes one step apart; 202 of 114,688 codes differed).
"""
import json
import types

import pytest
import torch

from adapter.cpu.dsv41 import fp4_index_k, fp4_indexer, store_cache
from conftest import run_python

P = 64


@pytest.fixture(scope="module")
def engine():
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()
    import sglang.srt.mem_cache.deepseek_v4_memory_pool as pool
    from sglang.test.kernels.deepseek_v4 import common

    return types.SimpleNamespace(pool=pool, common=common)


def _rows(g, n=37):
    x = (torch.randn(n, 128, generator=g) * torch.rand(n, 1, generator=g) * 4).to(torch.bfloat16)
    x[3, :32] = 0.0                           # an all-zero group: the 1e-4 scale floor
    x[4, :4] = torch.tensor([0.25, 0.75, 1.25, 2.5]) * 2 ** -3      # exact e2m1 boundaries
    x[4, 4:32] = 0.0
    x[4, 5] = 0.75                            # group amax 0.75 -> scale 2^-3
    return x


def test_quantize_equals_the_engine_reference(engine):
    g = torch.Generator().manual_seed(1)
    x = _rows(g)
    payload, packed = fp4_index_k.quantize_fp4_indexer_tensor(x)
    want_payload, want_packed = engine.common.quantize_fp4_indexer_ref(x)
    assert payload.dtype == torch.int8 and packed.dtype == torch.int32
    assert torch.equal(payload.view(torch.uint8), want_payload)
    assert torch.equal(packed, want_packed.to(torch.int32))


def test_rne_rounds_exact_boundaries_to_even():
    # 0.25 and 2.5 sit between codes 0|1 and 4|5: round-half-even keeps the even code, the
    # default thresholds (strictly greater) too; 0.75 and 1.25 go up to the even code 2.
    x = torch.tensor([0.25, 0.75, 1.25, 2.5, 5.0, -0.25, 0.3, 6.5])
    assert fp4_index_k.e2m1_code(x, rne=True).tolist() == [0, 2, 2, 4, 6, 0, 1, 7]
    assert fp4_index_k.e2m1_code(x, rne=False).tolist() == [0, 1, 2, 4, 6, 0, 1, 7]


def test_store_equals_the_engine_reference_and_the_pools_readers(engine):
    g = torch.Generator().manual_seed(2)
    x = _rows(g)
    loc = torch.randperm(4 * P, generator=g)[:37]
    cache = torch.zeros(4, P * 68, dtype=torch.uint8)
    fp4_index_k.store_fp4_index_k_cache(x, cache, loc, page_size=P)
    payload, packed = engine.common.quantize_fp4_indexer_ref(x)
    assert torch.equal(cache, engine.common.store_fp4_index_cache_ref(payload, packed, loc, 4))
    # read back: the gather stand-in and the pool's own CPU reader agree with the quantizer
    pool = types.SimpleNamespace(use_fp4_indexer=True, index_k_with_scale_buffer=[cache],
                                 start_layer=0, page_size=P, size=4 * P)
    slots = loc[[5, 0, 36, 17]].contiguous()
    got = fp4_index_k.gather_fp4_index_k(cache, slots, page_size=P)
    want = engine.pool.DeepSeekV4IndexerPool.get_index_k_fp4(pool, 0, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(torch.uint8), payload[[5, 0, 36, 17]])
    dequant = engine.pool.DeepSeekV4IndexerPool.get_index_k_dequant(pool, 0, slots)
    assert torch.equal(fp4_index_k.dequantize_rows(cache, slots, P), dequant)


def _scores_reference(engine, q, w, slots, lens, table):
    """The engine's torch scoring: DeepseekV41Indexer.scores over the pool's dequantized keys."""
    from sglang.srt.layers.attention.dsv4.dsv41_sparse import DeepseekV41Indexer

    pool = types.SimpleNamespace(use_fp4_indexer=True, index_k_with_scale_buffer=[table],
                                 start_layer=0, page_size=P, size=table.shape[0] * P)
    out = torch.full(slots.shape, float("-inf"))
    for b in range(q.shape[0]):
        k = engine.pool.DeepSeekV4IndexerPool.get_index_k_dequant(pool, 0, slots[b])
        s = DeepseekV41Indexer.scores(None, q[b:b + 1], k, w[b:b + 1])[0]
        n = int(lens[b])
        out[b, :n] = s[:n]
    return out


def test_decode_logits_equal_the_engines_torch_scoring(engine):
    g = torch.Generator().manual_seed(3)
    B, H, L = 4, 4, 70
    table = torch.zeros(4, P * 68, dtype=torch.uint8)
    keys = torch.randn(4 * P, 128, generator=g).to(torch.bfloat16)
    fp4_index_k.store_fp4_index_k_cache(keys, table, torch.arange(4 * P), page_size=P, rne=True)
    q = torch.randn(B, H, 128, generator=g).to(torch.bfloat16)
    w = (torch.randn(B, H, generator=g) * 0.1).to(torch.bfloat16)
    slots = torch.randint(0, 4 * P, (B, L), generator=g)
    lens = torch.tensor([70, 33, 0, 1])
    got = fp4_indexer.fp4_index_logits_decode(q, w, slots, lens, table, P)
    want = _scores_reference(engine, q, w, slots, lens, table)
    assert got.dtype == torch.float32 and got.shape == (B, L)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.isinf(got[2]).all() and torch.isfinite(got[0]).all() and torch.isfinite(got[1, :33]).all()
    finite = torch.isfinite(want)
    # the same bf16 rounding points; only the fp32 dot's summation order may differ (one bf16 step)
    torch.testing.assert_close(got[finite], want[finite], rtol=2 ** -7, atol=1e-6)
    assert (got[finite] == want[finite]).float().mean() > 0.9


def _read_latent(buf, locs, page):
    from sglang.test.kernels.deepseek_v4.k_cache_reference import dequantize_k_cache_paged_ref

    return dequantize_k_cache_paged_ref(buf, torch.tensor(locs), page)[:, 0].float()


def test_fused_store_cache_v4_follows_store_cuh(engine):
    g = torch.Generator().manual_seed(4)
    kv = (torch.randn(5, 512, generator=g) * 3).to(torch.bfloat16)
    kv[1, :64] = 0.0                                    # a zero tile: scale floor 1e-4 / 448
    loc = [2, 65, 7, 130, 64]
    page_bytes = -(-584 * P // 576) * 576
    buf = torch.zeros(3, page_bytes, dtype=torch.uint8)
    store_cache.fused_store_cache(kv, buf, torch.tensor(loc), page_size=P, type="flashmla")
    got = _read_latent(buf, loc, P)
    want = kv.float()
    tiles = want[:, :448].view(5, 7, 64)
    # ue8m0 scale = 2^ceil(log2(max(1e-4, amax) / 448)): fp8 e4m3 keeps 3 mantissa bits
    scale = torch.exp2(torch.ceil(torch.log2(tiles.abs().amax(-1).clamp_min(1e-4) / 448)))
    assert bool(((got[:, :448].view_as(tiles) - tiles).abs() <= scale[..., None] * 16 + 1e-12).all())
    assert bool(((got[:, :448].view_as(tiles) - tiles).abs() <= tiles.abs().amax(-1, keepdim=True) * 2 ** -3).all())
    assert torch.equal(got[:, 448:], want[:, 448:])                   # rope dims: bf16 as given
    assert torch.equal(got[1, :64], torch.zeros(64))


def test_fused_store_cache_indexer_and_refusals(engine):
    g = torch.Generator().manual_seed(5)
    k = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    buf = torch.zeros(2, P * 132, dtype=torch.uint8)
    store_cache.fused_store_cache(k, buf, torch.tensor([1, 70, 3]), page_size=P, type="indexer")
    scale = buf[1].view(torch.float32)[P * 32 + 6]
    want = k[1].float().abs().max() / 448
    torch.testing.assert_close(scale, want)
    data = buf[1, 6 * 128:7 * 128].view(torch.float8_e4m3fn).float() * scale
    torch.testing.assert_close(data, k[1].float(), rtol=2 ** -3, atol=float(want) * 8)
    with pytest.raises(NotImplementedError):
        store_cache.fused_store_cache(torch.zeros(1, 512, dtype=torch.bfloat16),
                                      torch.zeros(1, P * 528, dtype=torch.uint8), torch.tensor([0]),
                                      page_size=P, type="flashmla", layout="v41")


INTERPRETER_CHILD = r"""
import json, os
assert os.environ.get("TRITON_INTERPRET") == "1"
from adapter.cpu import cpu_engine
cpu_engine.install_torchvision_shim()
import torch
from sglang.kernels.ops.quantization import fp4_indexer_quant as q
from sglang.kernels.ops.kvcache import dsv4_fp4_index_k_cache as kc
from sglang.kernels.ops.kvcache import triton_store_cache as tsc
from adapter.cpu.dsv41 import fp4_index_k, store_cache

g = torch.Generator().manual_seed(11)
P = 64
rep = {}
x = (torch.randn(37, 128, generator=g) * torch.rand(37, 1, generator=g) * 4).to(torch.bfloat16)
x[3, :32] = 0.0
x[4, :4] = torch.tensor([0.25, 0.75, 1.25, 2.5]) * 2 ** -3
for rne in (False, True):
    a = q.quantize_fp4_indexer_tensor(x, rne=rne)
    b = fp4_index_k.quantize_fp4_indexer_tensor(x, rne=rne)
    rep[f"quantize rne={rne}"] = bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
loc = torch.randperm(4 * P, generator=g)[:37].to(torch.int64)
caches = []
for store in (kc.store_fp4_index_k_cache, fp4_index_k.store_fp4_index_k_cache):
    c = torch.full((4, P * 68), 0xAB, dtype=torch.uint8)
    store(x, c, loc, page_size=P, rne=True)
    caches.append(c)
rep["store"] = bool(torch.equal(*caches))
slots = loc[torch.randperm(37, generator=g)[:20]].contiguous()
ga = kc.gather_fp4_index_k(caches[0], slots, page_size=P)
gb = fp4_index_k.gather_fp4_index_k(caches[0], slots, page_size=P)
rep["gather"] = bool(torch.equal(ga[0], gb[0]) and torch.equal(ga[1], gb[1]))
kv = (torch.randn(9, 512, generator=g) * 3).to(torch.bfloat16)
l2 = torch.tensor([0, 5, 63, 64, 100, 130, 200, 255, 17])
page_bytes = -(-584 * P // 576) * 576
outs = []
for triton in (True, False):
    c = torch.zeros(4, page_bytes, dtype=torch.uint8)
    if triton:
        tsc.triton_fused_store_flashmla(kv, c, l2, P)
    else:
        store_cache.fused_store_cache(kv, c, l2, page_size=P, type="flashmla")
    outs.append(c)
data = [o[:, :P * 576].reshape(4, P, 576) for o in outs]
rep["flashmla scales"] = bool(torch.equal(outs[0][:, P * 576:P * 584], outs[1][:, P * 576:P * 584]))
rep["flashmla rope"] = bool(torch.equal(data[0][:, :, 448:], data[1][:, :, 448:]))
codes = [d[:, :, :448].reshape(-1).view(torch.float8_e4m3fn).float() for d in data]
rep["flashmla fp8 codes differing (of all)"] = [int((codes[0] != codes[1]).sum()), codes[0].numel()]
print("REPORT " + json.dumps(rep))
"""


def test_stand_ins_equal_the_triton_kernels_under_the_interpreter():
    """The real Triton kernels (Triton's CPU interpreter; TRITON_INTERPRET must be set before the
    engine imports, hence a child) and the stand-ins on the same rows: equal bytes for the fp4
    quantizer (both roundings), store and gather; the V4 latent store against the ROCm Triton
    kernel of the same layout: equal scale and rope bytes, fp8 codes but a few equal."""
    proc = run_python(INTERPRETER_CHILD, env={"TRITON_INTERPRET": "1"}, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    report = json.loads(lines[-1][len("REPORT "):])
    differing, total = report.pop("flashmla fp8 codes differing (of all)")
    assert all(report.values()), report
    # the interpreter's float -> fp8 cast is not the CUDA kernel's round-to-nearest (seen: 16
    # for an exact 32, codes one step apart): the fp8 data is checked against the engine's
    # reader above; here only that nearly all codes agree
    assert differing < total // 100


def test_install_rebinds_where_the_engine_binds_the_names(engine):
    """Each stand-in is bound in its defining module and in the modules that import it by name."""
    import importlib

    from adapter.cpu import dsv41

    table = dsv41._stand_ins()
    for module_name, names in table.items():
        module = importlib.import_module(module_name)
        for name in names:
            assert name in module.__dict__, f"{module_name} does not bind {name}"
    assert "sglang.srt.mem_cache.deepseek_v4_memory_pool" in table
    assert "sglang.srt.layers.attention.dsv4.v41_indexer.scoring" in table
