"""The CPU stand-ins that write the DeepSeek-V4 KV pool, the LM-head mixer and the fp8-KV pool
refusal (adapter/cpu/dsv4/norm_rope.py, compressor.py, mhc.py, kv_pool.py).

Stores are read back with the engine's own V4-layout reader
(sglang.test.kernels.deepseek_v4.k_cache_reference.dequantize_k_cache_paged_ref) or, for the
index-K pages, by the layout the kernels write (128 fp8 bytes per token, then one fp32 scale per
token after the page's data); the expected rows follow the kernel sources' rule (RMSNorm with
weight, RoPE of the last 64 dims, a Sylvester Hadamard / sqrt(128) for index keys) built here
from first principles where the stand-in's helpers are not already checked elsewhere."""
import types

import pytest
import torch

from adapter.cpu.dsv4 import compressor, kv_pool, mhc, norm_rope

PAGE = 64
FP8 = torch.float8_e4m3fn


def _freqs(n=256):
    g = torch.Generator().manual_seed(5)
    return torch.polar(torch.ones(n, 32), torch.rand(n, 32, generator=g) * 6.28)


def _read_latent(buf, locs):
    from sglang.test.kernels.deepseek_v4.k_cache_reference import dequantize_k_cache_paged_ref

    return dequantize_k_cache_paged_ref(buf, torch.tensor(locs), PAGE)[:, 0].float()


def _close_fp8(got, want):
    """fp8 e4m3 with a power-of-two scale per 64-wide tile: relative error <= 2^-4 of the tile's
    largest magnitude (twice that after the ue8m0 rounding up); the bf16 rope tail: bf16."""
    tiles = want[:, :448].view(want.shape[0], 7, 64)
    bound = tiles.abs().amax(-1, keepdim=True) * 2 ** -3
    assert bool(((got[:, :448].view_as(tiles) - tiles).abs() <= bound + 1e-6).all())
    torch.testing.assert_close(got[:, 448:], want[:, 448:], atol=0, rtol=2 ** -7)


def test_k_norm_rope_store_writes_kept_rows_only():
    g = torch.Generator().manual_seed(0)
    n = 5
    kv = torch.randn(n, 512, generator=g).to(torch.bfloat16)
    weight = torch.rand(512, generator=g) + 0.5
    positions = torch.tensor([3, 70, 71, 130, 200])
    out_loc = torch.tensor([2, -1, 65, 7, -1])
    buf = torch.zeros(3, PAGE * 584, dtype=torch.uint8)
    norm_rope.fused_k_norm_rope_flashmla(kv, weight, 1e-6, _freqs(), positions, out_loc, buf, PAGE)
    want = norm_rope.rope(norm_rope.rms_norm(kv, weight, 1e-6), _freqs(), positions)
    want = want.to(torch.bfloat16).float()
    _close_fp8(_read_latent(buf, [2, 65, 7]), want[[0, 2, 3]])
    # Nothing else written: the masked rows (out_loc -1) land nowhere.
    other = torch.zeros(3, PAGE * 584, dtype=torch.uint8)
    norm_rope.fused_k_norm_rope_flashmla(kv[[0, 2, 3]], weight, 1e-6, _freqs(), positions[[0, 2, 3]],
                                         out_loc[[0, 2, 3]], other, PAGE)
    assert torch.equal(buf, other)


def _decode_plan(ratio, seq_lens):
    seq = torch.tensor(seq_lens)
    return compressor.TorchCompressPlan(
        ratio, True, seq, torch.arange(len(seq_lens)), *(torch.zeros(0),) * 4,
        write_row=torch.zeros(0, dtype=torch.int64), write_slot=torch.zeros(0, dtype=torch.int64))


def test_compress_store_latent_at_boundaries_only():
    """Decode: only rows whose seq_len % ratio == 0 are stored, roped at seq_len - ratio."""
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(3, 512, generator=g)
    weight = torch.rand(512, generator=g) + 0.5
    plan = _decode_plan(4, [8, 9, 12])
    buf = torch.zeros(2, PAGE * 584, dtype=torch.uint8)
    compressor.compress_norm_rope_store(kv, plan, norm_weight=weight, norm_eps=1e-6,
                                        freq_cis=_freqs(), out_loc=torch.tensor([1, 2, 3]),
                                        kvcache=buf, page_size=PAGE)
    want = norm_rope.rope(norm_rope.rms_norm(kv, weight, 1e-6), _freqs(), torch.tensor([4, 5, 8]))
    _close_fp8(_read_latent(buf, [1, 3]), want.to(torch.bfloat16).float()[[0, 2]])
    assert not bool(_read_latent(buf, [2]).any()), "seq_len 9 is no group boundary"


def test_compress_store_writes_nothing_between_boundaries():
    """Decode steps with no group boundary (most of them) store nothing, latent or index key."""
    for dim, row in ((512, 584), (128, 132)):
        buf = torch.zeros(2, PAGE * row, dtype=torch.uint8)
        compressor.compress_norm_rope_store(torch.randn(2, dim), _decode_plan(4, [9, 14]),
                                            norm_weight=torch.ones(dim), norm_eps=1e-6,
                                            freq_cis=_freqs(), out_loc=torch.tensor([1, 2]),
                                            kvcache=buf, page_size=PAGE)
        assert not bool(buf.any())


def _sylvester(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / n ** 0.5


def test_compress_store_index_keys():
    """head_dim 128: RMSNorm, RoPE, Hadamard, then fp8 with one fp32 scale per row,
    scale = max(amax, 1e-4) / 448, in the index-K page layout."""
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(2, 128, generator=g)
    kv[1] = 0                                      # amax 0: the 1e-4 floor
    weight = torch.rand(128, generator=g) + 0.5
    plan = _decode_plan(4, [4, 16])
    buf = torch.zeros(2, PAGE * 132, dtype=torch.uint8)
    out_loc = torch.tensor([5, PAGE + 9])
    compressor.compress_norm_rope_store(kv, plan, norm_weight=weight, norm_eps=1e-6,
                                        freq_cis=_freqs(), out_loc=out_loc, kvcache=buf, page_size=PAGE)
    want = norm_rope.rope(norm_rope.rms_norm(kv, weight, 1e-6), _freqs(), torch.tensor([0, 12]))
    want = want @ _sylvester(128).T
    for row, loc in enumerate(out_loc.tolist()):
        page, slot = divmod(loc, PAGE)
        data = buf[page, slot * 128:(slot + 1) * 128].view(FP8).float()
        scale = buf[page, PAGE * 128 + slot * 4:PAGE * 128 + slot * 4 + 4].view(torch.float32)
        amax = float(want[row].abs().max())
        assert float(scale) == pytest.approx(max(amax, 1e-4) / 448.0, rel=1e-6)
        assert bool(((data * scale - want[row]).abs() <= amax * 2 ** -3 + 1e-6).all())


def test_hc_head_rule():
    """The documented rule of mhc_head.fused_hc_head (its module docstring), written out here."""
    g = torch.Generator().manual_seed(3)
    t, hc, hidden = 3, 4, 16
    x = torch.randn(t, hc, hidden, generator=g).to(torch.bfloat16)
    fn = torch.randn(hc, hc * hidden, generator=g)
    scale, base = torch.rand(1, generator=g), torch.randn(hc, generator=g)
    flat = x.float().reshape(t, hc * hidden)
    rsqrt = 1 / (flat.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    pre = torch.sigmoid(flat @ fn.T * rsqrt * scale + base) + 1e-3
    want = (pre[:, :, None] * x.float()).sum(1)
    got = mhc.fused_hc_head(x, fn, scale, base, norm_eps=1e-6, hc_eps=1e-3)
    assert got.dtype == torch.bfloat16 and got.shape == (t, hidden)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


class _Configurator:
    """Just what KVCacheConfigurator.configure reads before it sizes the pools; sizing is where
    this stops (a sentinel), recording which AMX / backend answers the module holds then."""

    def __init__(self, arch, module):
        self.kv_cache_dtype = torch.float8_e4m3fn
        self.use_mla_backend = False
        self.model_config = types.SimpleNamespace(hf_config={"architectures": [arch]})
        self.module = module
        self.seen = None

    def _resolve_memory_pool_config(self, pre_model_load_memory):
        self.seen = (self.module.cpu_has_amx_support, self.module.attention_backends)
        raise LookupError("sizing reached")

    spec_algorithm = types.SimpleNamespace(is_none=lambda: True)
    is_draft_worker = False


@pytest.fixture
def configurator_module(monkeypatch):
    from sglang.srt.mem_cache import kv_cache_configurator as module

    monkeypatch.setattr(module, "current_platform", types.SimpleNamespace(is_cpu=lambda: True))
    monkeypatch.setattr(module, "cpu_has_amx_support", lambda: False)
    return module


def test_fp8_refusal_lifted_for_the_v4_pool_only(configurator_module):
    module = configurator_module
    engine = module.KVCacheConfigurator.configure
    wrapped = kv_pool.allow_v4_fp8_pool(engine)
    originals = (module.cpu_has_amx_support, module.attention_backends)
    # The engine refuses fp8 KV on a CPU without AMX, for any model.
    for arch in ("DeepseekV4ForCausalLM", "LlamaForCausalLM"):
        with pytest.raises(ValueError, match="requires Intel AMX"):
            engine(_Configurator(arch, module), pre_model_load_memory=0)
    # Wrapped: other models still refused ...
    with pytest.raises(ValueError, match="requires Intel AMX"):
        wrapped(_Configurator("LlamaForCausalLM", module), pre_model_load_memory=0)
    # ... the V4 pool passes the check, and sizing sees the engine's own functions again.
    v4 = _Configurator("DeepseekV4ForCausalLM", module)
    with pytest.raises(LookupError, match="sizing reached"):
        wrapped(v4, pre_model_load_memory=0)
    assert v4.seen == originals
    assert (module.cpu_has_amx_support, module.attention_backends) == originals
