"""Cone replay inside the engine's DeepSeek-V4 attention backend, on CPU: H (a prefix hit at F)
against R (cone's replay from s = F - N), row for row. Shared by bench/cone_forward.py and
tests/test_swa_cone_forward.py; tests and benches only, never imported in production.

Split as adapter/cpu/dsv4/ is, by what each part stands in for, and the proof's harness:

    model.py    the model (sglang.srt.models.deepseek_v4's decoder layers): the tiny stack of three
                attention layers, its shapes and projections
    indexer.py  dsv4/indexer.C4Indexer's query side (compute_q / compute_weights: fused kernels)
    world.py    one world: the engine's own DeepseekV4AttnBackend + DeepSeekV4TokenToKVPool on CPU
                (built by the engine's attention test kit), the stack's forward through it, and
                byte views of what a request reads from the pools
    proof.py    the proof's harness: the cases, H against R, the negative controls

The names below are the package's: `from adapter.cpu import cone_forward as cf; cf.Harness`.

The engine's pieces are real: `DeepseekV4AttnBackend` (built by the `dsv4` registry entry, GB10 /
SM120 dispatch, pure-torch sparse attention), `DeepSeekV4TokenToKVPool`, `ForwardBatch`, the
metadata builders, the c4 indexer (torch logits + torch top-k). Cone is installed by the
production installer, so its hooks wrap the backend's own `_build_forward_metadata` /
`init_forward_metadata_prefill`. adapter/cpu/dsv4/attention.py holds the few stand-ins.

What the harness supplies in place of the model ("a tiny stack"): three attention layers with
compress ratios 0, 4, 128 (page 256, window 128 as on the cluster). Each row's hidden state
starts from its token's embedding and adds each layer's attention output through a projection,
so a layer's queries, SWA keys, compressed latents and index keys depend on what the layers
below read — the model's receptive cone, which the floor at s shapes. The compressor stand-in
writes a group's latent / index key from the row that completes the group, at the engine's
`c4_out_loc` / `c128_out_loc` (production: the compressor kernels, which pool the group's rows
through the state pool); SWA keys go to the engine's `get_swa_out_cache_loc`. Writes use the
engine kit's `set_k_and_s_torch`.

World layout (full pages of 256 tokens; page 0 is the padding page): a document [0, D) is
prefilled once on pages 1..D/256 (with its SWA) and snapshot. Each case loads the snapshot into
two worlds:
- H: request on the document's pages for [0, F) (window resident), fresh pages for [F, L).
- R: the session's SWA was evicted: the engine clears the full->SWA mapping of freed slots to 0
  (the padding slot); the freed SWA pages and the padding page are overwritten with large noise.
  Request on the document's pages for [0, s), fresh pages for [s, L) whose latent / index pages
  hold noise (stale data); cone's Plan (as `_commit` makes it: src = the document's slots of
  [s, F)) and the real hooks do the rest.
"""
from __future__ import annotations

from adapter.cpu.cone_forward.indexer import IndexerInputs  # noqa: F401
from adapter.cpu.cone_forward.model import (CONTEXT, DIM, HEADS, INDEX_HEADS, PAGE,  # noqa: F401
                                            RATIOS, VOCAB, WINDOW, Stack)
from adapter.cpu.cone_forward.proof import (CASES, CONE_CASE, CONTROL_CASE, CONTROLS,  # noqa: F401
                                            DECODE_STEPS, DOC, DOC_CHUNK, NEIGHBOR_SALT,
                                            NOISE_SEED, NOT_IN_PRODUCTION, Case, Comparison,
                                            Harness, Run, log, run_control)
from adapter.cpu.cone_forward.world import World, request_view  # noqa: F401
