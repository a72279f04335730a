"""The torch_native SWA read-index engine bug (CPU harness only) and the harness's fix.

Real engine objects: SWAKVPool, ReqToTokenPool, RadixAttention, TorchNativeAttnBackend. The only
stand-ins are the model runner (the backend reads three attributes of it) and the forward batch
(the six fields the extend path reads): building the real ones needs a loaded model.
docs/upstream_torch_native_swa.md is the write-up for the upstream report.
"""
import types

import pytest
import torch

from adapter.cpu import torch_native_swa_fix

H, D, WINDOW = 2, 8, 4
FULL, SWA = 64, 32


def _setup(full_slots, swa_slots):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))
    pool = SWAKVPool(size=FULL, size_swa=SWA, page_size=1, dtype=torch.float32, head_num=H,
                     head_dim=D, swa_attention_layer_ids=[0], full_attention_layer_ids=[1],
                     device="cpu")
    # What SWATokenToKVPoolAllocator maintains: full slot -> SWA slot of the same token.
    mapping = torch.zeros(FULL + 1, dtype=torch.int64)
    mapping[torch.tensor(full_slots)] = torch.tensor(swa_slots)
    pool.register_mapping(mapping)
    req_to_token = ReqToTokenPool(size=2, max_context_len=FULL, device="cpu", enable_memory_saver=False)
    n = len(full_slots)
    req_to_token.req_to_token[0, :n] = torch.tensor(full_slots, dtype=torch.int32)
    runner = types.SimpleNamespace(device="cpu", req_to_token_pool=req_to_token, token_to_kv_pool=pool)
    backend = TorchNativeAttnBackend(runner)
    layer = RadixAttention(H, D, D ** -0.5, num_kv_heads=H, layer_id=0, sliding_window_size=WINDOW)
    batch = types.SimpleNamespace(
        out_cache_loc=torch.tensor(full_slots, dtype=torch.int64), req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([n]), extend_prefix_lens=torch.tensor([0]),
        extend_seq_lens=torch.tensor([n]), encoder_lens=None, encoder_out_cache_loc=None)
    return backend, layer, batch


def _reference(q, k, v, n):
    qh, kh, vh = (t.view(n, H, D).transpose(0, 1) for t in (q, k, v))
    pos = torch.arange(n)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - WINDOW)
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=D ** -0.5)
    return out.transpose(0, 1).reshape(n, H * D)


def _extend(full_slots, swa_slots):
    backend, layer, batch = _setup(full_slots, swa_slots)
    n = len(full_slots)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, H * D, generator=gen) for _ in range(3))
    backend.init_forward_metadata(batch)
    return (backend.forward_extend(q, k.view(n, H, D), v.view(n, H, D), layer, batch),
            _reference(q, k, v, n))


@pytest.fixture
def backend_cls():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    torch_native_swa_fix.remove(TorchNativeAttnBackend)
    yield TorchNativeAttnBackend
    torch_native_swa_fix.remove(TorchNativeAttnBackend)


# 12 tokens whose full slots are 10..21 and whose SWA slots are 3..14 (in range of the SWA buffer).
FULL_SLOTS = list(range(10, 22))
SWA_SLOTS = list(range(3, 15))


def test_stock_backend_reads_swa_layers_with_full_pool_indices(backend_cls):
    out, ref = _extend(FULL_SLOTS, SWA_SLOTS)
    assert not torch.allclose(out, ref, atol=1e-4)      # the wrong read: silently other slots


def test_stock_backend_index_error_past_the_swa_pool(backend_cls):
    with pytest.raises(IndexError):
        _extend(list(range(40, 52)), SWA_SLOTS)         # full slots beyond the SWA buffer


def test_harness_fix_reads_through_the_mapping(backend_cls):
    assert torch_native_swa_fix.apply(backend_cls) is True
    assert torch_native_swa_fix.apply(backend_cls) is False     # idempotent
    for full in (FULL_SLOTS, list(range(40, 52))):
        out, ref = _extend(full, SWA_SLOTS)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fix_leaves_full_layers_alone(backend_cls):
    """A full-attention layer of the same pool reads with full-pool indices, as it should."""
    torch_native_swa_fix.apply(backend_cls)
    backend, _, batch = _setup(FULL_SLOTS, SWA_SLOTS)
    from sglang.srt.layers.radix_attention import RadixAttention

    layer = RadixAttention(H, D, D ** -0.5, num_kv_heads=H, layer_id=1)
    n = len(FULL_SLOTS)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, H * D, generator=gen) for _ in range(3))
    backend.init_forward_metadata(batch)
    out = backend.forward_extend(q, k.view(n, H, D), v.view(n, H, D), layer, batch)
    qh, kh, vh = (t.view(n, H, D).transpose(0, 1) for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=D ** -0.5)
    torch.testing.assert_close(out, ref.transpose(0, 1).reshape(n, H * D), atol=1e-5, rtol=1e-5)
