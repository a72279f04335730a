"""One world of cone's proof: the engine's own DeepseekV4AttnBackend and DeepSeekV4TokenToKVPool on
CPU (built by the engine's attention test kit, GB10 / SM120 dispatch, pure-torch sparse attention),
the tiny stack's forward through it, and byte views of what a request reads from the pools. The
compressor's writes stand in for its kernels: a group's latent / index key is written from the row
that completes the group, at the engine's `c4_out_loc` / `c128_out_loc`; SWA keys go to the
engine's `get_swa_out_cache_loc`; writes use the engine kit's `set_k_and_s_torch`
(adapter/cpu/dsv4/attention.py). Tests and benches only.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Optional

import torch

from adapter.cpu.cone_forward.indexer import IndexerInputs
from adapter.cpu.cone_forward.model import CONTEXT, DIM, HEADS, PAGE, RATIOS, Stack, _mm


class World:
    """One backend + pool: the engine kit's MockDSV4ModelRunner (server args published with
    attention backend dsv4), a DeepSeekV4TokenToKVPool sized for the harness, the backend built
    by the engine's `dsv4` registry entry."""

    def __init__(self, stack: Stack, *, full_pages: int, swa_pages: int, req_slots: int = 4):
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.runtime_context import get_context
        from sglang.test.kits.attention_unittest.attention_methods import dsv4_attention as kit

        self.stack = stack
        case = kit.DSV4AttentionCase(name="cone", backend="dsv4", forward_mode=ForwardMode.EXTEND,
                                     num_heads=HEADS, page_size=PAGE, prefix_lens=(0,),
                                     extend_lens=(1,))
        config = kit.TinyDSV4ModelConfig(num_heads=HEADS, context_len=CONTEXT,
                                         compression_ratios=list(RATIOS))
        runner = kit.MockDSV4ModelRunner(case=case, model_config=config, dtype=torch.bfloat16,
                                         device="cpu", max_context_len=CONTEXT, swa_size=PAGE,
                                         runner_batch_size=req_slots,
                                         compression_ratios=list(RATIOS))
        # Published as the engine publishes its server args, plus --dsa-topk-backend torch.
        kit_override = runner._server_args_override
        fields = dict(kit_override._fields, dsa_topk_backend="torch")
        kit_override.restore()
        self._override = get_context().override_server_args(**fields)
        runner.server_args = self._override.install()
        full = full_pages * PAGE
        self.pool = DeepSeekV4TokenToKVPool(
            max_num_reqs=req_slots, swa_size=swa_pages * PAGE, c4_size=full // 4,
            c128_size=full // 128, c4_state_pool_size=req_slots, c128_state_pool_size=req_slots,
            page_size=PAGE, swa_page_size=PAGE, dtype=torch.float8_e4m3fn,
            c4_state_dtype=torch.bfloat16, c128_state_dtype=torch.bfloat16,
            qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128,
            layer_num=len(RATIOS), device="cpu", enable_memory_saver=False,
            compression_ratios=list(RATIOS), kv_source_layers=[], full_size=full)
        self.mapping = torch.zeros(full, dtype=torch.int64)
        self.pool.register_mapping(self.mapping)
        runner.token_to_kv_pool = self.pool
        runner.kv_index_translator = KVIndexTranslator(
            req_to_token=runner.req_to_token_pool.req_to_token,
            token_to_kv_pool_allocator=SimpleNamespace(page_size=PAGE),
            token_to_kv_pool=self.pool, page_size=PAGE, device="cpu")
        self.runner = runner
        self.backend = ATTENTION_BACKENDS["dsv4"](runner)
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.layers = [RadixAttention(num_heads=HEADS, head_dim=DIM, scaling=DIM ** -0.5,
                                      num_kv_heads=1, layer_id=i, v_head_dim=DIM)
                       for i in range(len(RATIOS))]

    def close(self) -> None:
        self._override.restore()

    # -- state ------------------------------------------------------------------------------

    def buffers(self) -> list:
        """Every byte buffer the forward reads or writes (SWA, latents, index keys)."""
        bufs = list(self.pool.swa_kv_pool.kv_buffer)
        for ratio in sorted(self.pool.kv_pools):
            bufs += list(self.pool.kv_pools[ratio].kv_buffer)
        for ratio in sorted(self.pool.index_pools):
            bufs += list(self.pool.index_pools[ratio].index_k_with_scale_buffer)
        return bufs

    def snapshot(self) -> dict:
        return {"buffers": [b.clone() for b in self.buffers()], "mapping": self.mapping.clone(),
                "req_to_token": self.req_to_token.clone()}

    def load(self, snap: dict) -> None:
        for dst, src in zip(self.buffers(), snap["buffers"]):
            dst.copy_(src)
        self.mapping.copy_(snap["mapping"])
        self.req_to_token.copy_(snap["req_to_token"])

    def swa_buffer(self, layer_id: int):
        return self.pool.swa_kv_pool.kv_buffer[layer_id]

    def latent_buffer(self, layer_id: int):
        item = self.pool.layer_mapping[layer_id]
        kv = item.compress_kv_pool
        return kv.kv_buffer[item.compress_layer_id], kv.page_size

    def index_buffer(self, layer_id: int):
        item = self.pool.layer_mapping[layer_id]
        ix = self.pool.index_pools[item.compress_ratio]
        return ix.index_k_with_scale_buffer[item.compress_layer_id], ix.page_size

    # -- forwards ---------------------------------------------------------------------------

    def _batch(self, segments: list, decode: bool):
        """A ForwardBatch of requests (rid, slot, start, end, salt): rows [start, end) each."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        lens = [end - start for _, _, start, end, _ in segments]
        positions = torch.cat([torch.arange(start, end) for _, _, start, end, _ in segments])
        tokens = torch.cat([self.stack.tokens(torch.arange(start, end) + salt)
                            for _, _, start, end, salt in segments])
        slots = [slot for _, slot, _, _, _ in segments]
        ends = [end for _, _, _, end, _ in segments]
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            batch_size=len(segments), input_ids=tokens,
            req_pool_indices=torch.tensor(slots, dtype=torch.int32),
            seq_lens=torch.tensor(ends, dtype=torch.int32),
            seq_lens_cpu=torch.tensor(ends, dtype=torch.int32),
            out_cache_loc=torch.cat([self.req_to_token[slot, start:end].to(torch.int64)
                                     for _, slot, start, end, _ in segments]),
            seq_lens_sum=sum(ends), positions=positions)
        self.runner.kv_index_translator.bind_own_plan(fb)
        fb.rids = [rid for rid, *_ in segments]
        fb.req_pool_indices_cpu = torch.tensor(slots, dtype=torch.int64)
        if not decode:
            starts = [start for _, _, start, _, _ in segments]
            fb.extend_prefix_lens = torch.tensor(starts, dtype=torch.int32)
            fb.extend_prefix_lens_cpu = starts
            fb.extend_seq_lens = torch.tensor(lens, dtype=torch.int32)
            fb.extend_seq_lens_cpu = lens
            fb.extend_start_loc = torch.tensor([sum(lens[:i]) for i in range(len(lens))],
                                               dtype=torch.int32)
            fb.extend_num_tokens = sum(lens)
        return fb, tokens

    def forward(self, segments: list, *, decode: bool = False,
                audit: Optional[Callable] = None) -> list:
        """One forward of the requests `segments` [(rid, slot, start, end, salt)] through the
        three layers; returns each layer's attention output [rows, heads, 512] (float32 of the
        backend's bf16), rows in batch order. `audit(md)` sees each layer's core metadata
        before its attention runs."""
        from adapter.cpu.dsv4.attention import store_index_k, store_k
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        fb, tokens = self._batch(segments, decode)
        backend = self.backend
        positions = fb.positions
        completes = {r: ((positions + 1) % r == 0) for r in (4, 128)}
        outs = []
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
            backend.init_forward_metadata(fb)
            h = self.stack.embed[tokens]
            for layer_id, ratio in enumerate(RATIOS):
                w = self.stack.layers[layer_id]
                md = backend.forward_metadata.core_attn_metadata
                k = _mm(h, w.k)
                store_k(self.swa_buffer(layer_id), backend.get_swa_out_cache_loc(fb), k,
                        self.pool.swa_kv_pool.page_size)
                if ratio:
                    rows = completes[ratio]
                    out_loc = md.c4_out_loc if ratio == 4 else md.c128_out_loc
                    buf, page = self.latent_buffer(layer_id)
                    store_k(buf, out_loc[rows], _mm(h, w.latent)[rows], page)
                if ratio == 4:
                    buf, page = self.index_buffer(layer_id)
                    store_index_k(buf, md.c4_out_loc[rows], _mm(h, w.index_k)[rows], page)
                    backend.forward_c4_indexer(h, h, IndexerInputs(layer_id, h, w), fb,
                                               skip_compressor=True)
                if audit is not None:
                    audit(backend.forward_metadata.core_attn_metadata)
                q = _mm(h, w.q).view(-1, HEADS, DIM)
                o = backend.forward(q, k, k, self.layers[layer_id], fb, compress_ratio=ratio,
                                    save_kv_cache=False, attn_sink=w.sink)
                outs.append(o.float())
                h = (h.double() + _mm(o.reshape(o.shape[0], -1), w.o).double()).to(torch.bfloat16)
        return outs


# ---- byte views of what a request reads ------------------------------------------------------

def _v4_rows(buf: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """The 584 bytes (576 data + 8 scale) of V4-layout token slots."""
    slots = slots.to(torch.int64)
    page, row = slots // page_size, slots % page_size
    data = row[:, None] * 576 + torch.arange(576)
    scale = page_size * 576 + row[:, None] * 8 + torch.arange(8)
    cols = torch.cat([data, scale], 1)
    return buf[page[:, None].expand_as(cols), cols]


def _index_rows(buf: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    slots = slots.to(torch.int64)
    page, row = slots // page_size, slots % page_size
    cols = torch.cat([row[:, None] * 128 + torch.arange(128),
                      page_size * 128 + row[:, None] * 4 + torch.arange(4)], 1)
    return buf[page[:, None].expand_as(cols), cols]


def request_view(world: World, slot: int, *, swa_from: int, groups_from: int, end: int) -> dict:
    """What a request at length `end` reads, by logical position: SWA rows [swa_from, end) per
    layer, latents of every c4 / c128 group and index keys of every c4 group in [groups_from,
    end), as bytes: {(kind, layer): (positions (a group's first), bytes per position)}."""
    out = {}
    full = world.req_to_token[slot].to(torch.int64)
    swa_page = world.pool.swa_kv_pool.page_size
    for layer_id, ratio in enumerate(RATIOS):
        pos = torch.arange(swa_from, end)
        out[("swa", layer_id)] = (pos, _v4_rows(world.swa_buffer(layer_id),
                                                world.mapping[full[pos]], swa_page))
        if ratio:
            first = torch.arange(-(-groups_from // ratio) * ratio, end - ratio + 1, ratio)
            buf, page = world.latent_buffer(layer_id)
            out[("latent", layer_id)] = (first, _v4_rows(buf, full[first] // ratio, page))
            if ratio == 4:
                buf, page = world.index_buffer(layer_id)
                out[("index_k", layer_id)] = (first, _index_rows(buf, full[first] // ratio, page))
    return out

