"""The one source of swan's page layout and decode-shape constants.

Read by the adapter (routing, module checks), runtime/swan256/build.py (the -D defines and the
manifest), runtime/swan256/reference.py (the CPU reference's byte addressing) and
bench/swan_split_cost.py. Imports nothing: a device with only torch and triton can load it.

A DSV4 KV row is 584 B: 448 B fp8 e4m3 "nope" + 64 x bf16 rope (576 data bytes), then 8 scale
bytes (7 UE8M0 exponents, one per 64-wide nope tile, + 1 pad). A page stores its data rows first
and the scale footer after them, padded to a multiple of 576 B (the engine's page stride).
"""

NOPE = 448                                  # fp8 e4m3 bytes of the nope part
ROPE = 64                                   # bf16 rope elements
TILE = 64                                   # nope elements per UE8M0 scale
TILES = NOPE // TILE                        # 7
DATA_BYTES = NOPE + 2 * ROPE                # 576
SCALE_BYTES = 8                             # 7 exponents + 1 pad byte
ROW_BYTES = DATA_BYTES + SCALE_BYTES        # 584
D_QK = NOPE + ROPE                          # 512: q and dequantised k width
D_V = 512                                   # the DSV4 decode's head_dim_v


def page_stride_for(page_tokens: int) -> int:
    """The engine's padded page size in bytes: ceil(page_tokens * 584 / 576) * 576."""
    return -(-page_tokens * ROW_BYTES // DATA_BYTES) * DATA_BYTES


PAGE_TOKENS = 256                           # the engine's SWA page (asserted by its DSV4 backend)
PAGE_STRIDE = page_stride_for(PAGE_TOKENS)  # 149,760
SPLIT_PAGE_TOKENS = 64                      # what the stock `_split_kv_pages_to_64` produces
SPLIT_PAGE_STRIDE = page_stride_for(SPLIT_PAGE_TOKENS)   # 37,440

DECODE_MAX_TOKENS = 64                      # query rows of a decode call (more: engine prefill)
MAX_HEADS = 128
FLASHINFER_HEAD_SPECIALISATIONS = (8, 16, 32, 64, 128)   # others run the runtime-head kernel (0)
HEAD_KERNELS = FLASHINFER_HEAD_SPECIALISATIONS + (0,)     # bit order of SWAN_HEAD_MASK (swan256.cu)
SUPPORTED_ARCHS = {(12, 0): "sm_120a", (12, 1): "sm_121a"}

MODULE_TAG = "swan256"
MANIFEST_SCHEMA = 2                         # 2: the router key (router_key.cpp) is part of the module
ROUTER_KEY_MODULE = "swan256_router_key"   # its extension module name

assert PAGE_STRIDE == 149_760 and SPLIT_PAGE_STRIDE == 37_440 and ROW_BYTES == 584
