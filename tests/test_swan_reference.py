"""swan byte layout: decoding in place from 256-token pages equals, bit for bit, decoding after
the engine's own `_split_kv_pages_to_64`.

The engine's split is Triton; it runs here on CPU under Triton's interpreter (TRITON_INTERPRET=1,
which must be set before the engine module is imported, hence a child process). The decode is
runtime/swan256/reference.py, which reads raw page bytes with the kernel's footer addressing.
Indices cover page edges (every 64-row boundary inside a 256-token page), the last, partially
filled pool page, invalid (-1) slots and slots past topk_length that point at garbage; every byte
no valid candidate may read is NaN, so a wrong read shows.
"""
import json

import pytest

from conftest import run_python

CHILD = r"""
import json, os, sys
assert os.environ.get("TRITON_INTERPRET") == "1"
from adapter.cpu import cpu_engine
cpu_engine.install_torchvision_shim()
import torch
from sglang.kernels.ops.attention import flash_mla_sm120 as m
from runtime.swan256 import reference as ref

P, S, SP, SS = 256, 149760, 64, 37440
assert ref.page_stride_for(P) == S and ref.page_stride_for(SP) == SS
assert (m._PBS_SRC, m._PBS_DST, m._BYTES_PER_DST_PAGE_PADDED) == (P, SP, SS)

def bits(t):
    return t.contiguous().view(torch.int64)

def make_pool(g, pages, filled):
    # NaN everywhere, then valid rows + scales for the first `filled` tokens.
    raw = torch.full((pages * S,), 0xFF, dtype=torch.uint8)
    tok = torch.arange(filled)
    base = (tok // P) * S
    row = tok % P
    nope = torch.randint(0, 0x7F, (filled, 448), dtype=torch.uint8, generator=g)   # finite e4m3
    nope |= torch.randint(0, 2, (filled, 448), dtype=torch.uint8, generator=g) << 7
    rope = (torch.randn(filled, 64, generator=g) * 4).to(torch.bfloat16).view(torch.uint8)
    scale = torch.randint(118, 136, (filled, 8), dtype=torch.uint8, generator=g)
    data_off = (base + row * 576).unsqueeze(1)
    raw[data_off + torch.arange(448)] = nope
    raw[data_off + 448 + torch.arange(128)] = rope
    raw[(base + P * 576 + row * 8).unsqueeze(1) + torch.arange(8)] = scale
    return raw

def view4(raw, page_tokens, stride):
    pages = raw.numel() // stride
    return raw.as_strided((pages, page_tokens, 1, 584), (stride, 584, 584, 1))

def make_indices(g, rows, topk, pages, filled):
    # The call's pages: four random full pages and the last, partial one (others stay untouched).
    call_pages = torch.randperm(pages - 1, generator=g)[:4].tolist()
    last = pages - 1
    edges = [0, 63, 64, 127, 128, 191, 192, 255]
    pool_tokens = [p * P + r for p in call_pages for r in range(P)]
    pool_tokens += list(range(last * P, filled))
    pool_tokens = torch.tensor(pool_tokens)
    idx = torch.full((rows, topk), -1, dtype=torch.int32)
    lengths = []
    for t in range(rows):
        chosen = [p * P + e for p in call_pages for e in edges]               # 64-row edges
        chosen += [last * P + e for e in range(0, filled - last * P, 9)][:12]  # partial page
        pick = torch.randint(0, len(pool_tokens), (topk,), generator=g)
        chosen = (chosen + pool_tokens[pick].tolist())[:topk]
        row = torch.tensor(chosen, dtype=torch.int32)
        row[torch.rand(topk, generator=g) < 0.15] = -1                        # invalid slots
        length = int(torch.randint(topk // 2, topk + 1, (1,), generator=g))
        # past topk_length: garbage pointing at unfilled (NaN) slots of the last page
        row[length:] = torch.randint(filled, pages * P, (topk - length,), generator=g).to(torch.int32)
        idx[t] = row
        lengths.append(length)
    return idx, torch.tensor(lengths, dtype=torch.int32)

report = {"seeds": []}
for seed in range(4):
    g = torch.Generator().manual_seed(seed)
    pages, rows, heads, topk = 12, 8, 16, 192
    filled = (pages - 1) * P + 100                     # last pool page holds 100 tokens
    raw = make_pool(g, pages, filled)
    kv = view4(raw, P, S)                              # the engine's [N, 256, 1, 584] view
    idx, lengths = make_indices(g, rows, topk, pages, filled)
    split = m._split_kv_pages_to_64(kv, P, touched_indices=idx)      # engine's own function
    assert tuple(split.shape[1:]) == (SP, 1, 584) and split.stride(0) == SS
    raw64 = ref.raw_bytes(split)

    # 1. the split's byte mapping, page by page (touched pages only: others are stale)
    touched = sorted({int(i) // P for i in idx.flatten().tolist() if i >= 0})
    mapping_ok = all(torch.equal(raw64[d * SS + do: d * SS + do + n], raw[p * S + so: p * S + so + n])
                     for d, do, p, so, n in ref.split_mapping(pages) if p in touched)

    # 2. every candidate reads the same bytes either way
    valid = (idx >= 0) & (torch.arange(topk).view(1, -1) < lengths.view(-1, 1))
    a_data, a_scale, _ = ref.gather_rows(raw, idx, P, S)
    b_data, b_scale, _ = ref.gather_rows(raw64, idx, SP, SS)
    rows_equal = torch.equal(a_data[valid], b_data[valid]) and torch.equal(a_scale[valid], b_scale[valid])

    # 3. decode in place == decode after the split, bit for bit (with an extra 64-token cache,
    #    which both paths pass through unchanged, and an attention sink)
    q = (torch.randn(rows, heads, 512, generator=g)).to(torch.bfloat16)
    sink = torch.randn(heads, generator=g)
    extra_raw = make_pool(g, 3, 3 * P)
    e_idx = torch.randint(-1, 3 * P, (rows, 64), generator=g).to(torch.int32)
    extra = (extra_raw, e_idx, P, S, None)
    scale = 512 ** -0.5
    out_a, lse_a = ref.sparse_decode(q, raw, idx, page_tokens=P, page_stride=S, sm_scale=scale,
                                     topk_length=lengths, attn_sink=sink, extra=extra)
    out_b, lse_b = ref.sparse_decode(q, raw64, idx, page_tokens=SP, page_stride=SS, sm_scale=scale,
                                     topk_length=lengths, attn_sink=sink, extra=extra)
    bit_exact = torch.equal(bits(out_a), bits(out_b)) and torch.equal(bits(lse_a), bits(lse_b))
    finite = bool(torch.isfinite(out_a).all())

    # 4. the reference reads the layout as the engine's own torch gather does (both views)
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    ours = ref.dequant_rows(a_data, a_scale)[valid]
    engine_256 = m._gather_and_dequant(kv.view(torch.float8_e4m3fn), safe, P)[valid]
    engine_64 = m._gather_and_dequant(split.view(torch.float8_e4m3fn), safe, SP)[valid]
    engine_reads_same = (torch.equal(engine_256.double(), ours) and torch.equal(engine_64.double(), ours))

    # 5. and decodes like the engine's torch decode (bf16 output; same semantics incl. sink)
    eng_out, _ = m._sm120_sparse_decode_fwd(q.unsqueeze(1), kv.view(torch.float8_e4m3fn),
                                            idx.unsqueeze(1), lengths, sink, 512, scale)
    no_extra, _ = ref.sparse_decode(q, raw, idx, page_tokens=P, page_stride=S, sm_scale=scale,
                                    topk_length=lengths, attn_sink=sink)
    engine_close = bool(torch.allclose(eng_out.squeeze(1).double(), no_extra, rtol=2e-2, atol=2e-2))

    # 6. teeth: a wrong mapping is caught (split buffer read with 256-token addressing; in-place
    #    pool read with the 64-token scale footer offset)
    wrong_a, _ = ref.sparse_decode(q, raw64, idx, page_tokens=P, page_stride=S, sm_scale=scale,
                                   topk_length=lengths, attn_sink=sink)
    shifted = torch.where(valid, idx + 64, idx)          # a one-sub-page shift of the mapping
    d_shift, _, _ = ref.gather_rows(raw64, shifted, SP, SS)
    wrong_detected = (not torch.equal(bits(wrong_a), bits(no_extra))
                      and not torch.equal(a_data[valid], d_shift[valid]))

    report["seeds"].append(dict(seed=seed, pages=pages, touched=len(touched), valid=int(valid.sum()),
                                invalid=int((idx < 0).sum()), mapping_ok=bool(mapping_ok),
                                rows_equal=bool(rows_equal), bit_exact=bool(bit_exact),
                                finite=finite, engine_reads_same=bool(engine_reads_same),
                                engine_close=engine_close, wrong_detected=bool(wrong_detected)))
print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    proc = run_python(CHILD, env={"TRITON_INTERPRET": "1"}, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("REPORT "):])


@pytest.mark.parametrize("check", ["mapping_ok", "rows_equal", "bit_exact", "finite",
                                   "engine_reads_same", "engine_close", "wrong_detected"])
def test_in_place_equals_split(report, check):
    assert len(report["seeds"]) == 4
    for seed in report["seeds"]:
        assert seed[check], seed
        assert 4 <= seed["touched"] < seed["pages"] and seed["invalid"] > 0 and seed["valid"] > 0
