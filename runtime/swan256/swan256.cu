// swan256: DeepSeek-V4 sparse decode (FlashInfer SM120/SM121 "decode-dsv4" kernel) over the
// engine's 256-token SWA pages, read in place.
//
// This file is our binding only. The kernel, its planner (execution::resolve_attention) and its
// launch template (execution::launch_decode) come from the pinned FlashInfer's installed headers
// and its installed csrc/sparse_mla_sm120/attention_resolve.cu, which the build compiles as a
// dependency (runtime/swan256/build.py). Nothing of FlashInfer is copied here.
//
// What this binding fixes at compile time, and checks on every call:
//   * page size SWAN_PAGE_TOKENS (256) tokens, rows of 584 B (576 B nope+rope, 8 B scale footer),
//     page stride ceil(256 * 584 / 576) * 576 = 149,760 B: the 4-D NHD view [N, 256, 1, 584] with
//     strides (149760, 584, 584, 1). Any other cache geometry is refused (the adapter routes such
//     calls to the engine's stock split to 64-token pages).
//   * model DSV4 (d_qk 512, d_v 512, UE8M0 64-wide groups), decode variant 0 (split-K + merge),
//     FP8 numeric route, ordinary implementation, at most 64 query rows.
//   * the head specialisations selected by SWAN_HEAD_MASK (FlashInfer's decode set by default).
// The extra (compressed C4A/C128A) cache is passed through exactly as the stock path does.

#include <flashinfer/attention/sparse_mla_sm120/execution/decode_launch.cuh>

#include <climits>
#include <cstdint>
#include <string>

#include "sparse_mla_sm120/attention_descriptor.h"
#include "sparse_mla_sm120/attention_validation.h"

#ifndef SWAN_PAGE_TOKENS
#define SWAN_PAGE_TOKENS 256
#endif
#ifndef SWAN_MODULE_TAG
#define SWAN_MODULE_TAG "swan256"
#endif
#ifndef SWAN_FLASHINFER_VERSION
#define SWAN_FLASHINFER_VERSION "unknown"
#endif
// Head specialisations compiled in, one bit each for 8, 16, 32, 64, 128 and 0 (FlashInfer's
// runtime-head instantiation). nvcc splits -D values at commas, hence a mask, not a list.
#ifndef SWAN_HEAD_MASK
#define SWAN_HEAD_MASK 0x3F
#endif

using tvm::ffi::Optional;

namespace swan256 {

namespace fi = flashinfer::sparse_mla_sm120;
namespace ex = flashinfer::sparse_mla_sm120::execution;
using ::ModelType;   // FlashInfer declares the model enum and its traits at global scope
using KV = ::KVCacheTraits<ModelType::DSV4>;

constexpr int kPageTokens = SWAN_PAGE_TOKENS;
constexpr int kRowBytes = KV::BYTES_PER_TOKEN;               // 584
constexpr int kDataBytes = KV::D_NOPE + KV::D_ROPE * 2;      // 576 (448 fp8 nope + 64 bf16 rope)
constexpr int kScaleBytes = KV::SCALE_BYTES_PER_TOKEN;       // 8 (7 UE8M0 + 1 pad)
constexpr size_t kPageStride =
    (size_t(kPageTokens) * kRowBytes + kDataBytes - 1) / kDataBytes * kDataBytes;
constexpr int kDecodeMaxTokens = 64;

static_assert(kRowBytes == 584 && kDataBytes == 576 && kScaleBytes == 8,
              "DSV4 footer row layout changed in this FlashInfer");
static_assert(kDataBytes + kScaleBytes == kRowBytes, "footer row = data + scale");
static_assert(kPageTokens != 256 || kPageStride == 149760, "256-token page stride");
static_assert(kPageStride % 16 == 0, "page stride must stay 16B aligned for cp.async.bulk");
static_assert(kPageTokens % 64 == 0 && kPageTokens > 0, "page size must be a multiple of 64");

// FlashInfer's DSV4 decode head specialisations (visit_decode_heads); bit i of SWAN_HEAD_MASK
// compiles kFlashInferHeads[i] into this module.
constexpr int kFlashInferHeads[] = {8, 16, 32, 64, 128, 0};
constexpr int kNumHeadSlots = sizeof(kFlashInferHeads) / sizeof(int);

struct Heads {
  static constexpr bool contains(int h) {
    for (int i = 0; i < kNumHeadSlots; ++i)
      if (kFlashInferHeads[i] == h) return (SWAN_HEAD_MASK >> i) & 1;
    return false;
  }
  template <int I = 0, typename F>
  static cudaError_t visit(int h, F&& call) {
    if constexpr (I == kNumHeadSlots) {
      return cudaErrorInvalidValue;
    } else {
      constexpr int H = kFlashInferHeads[I];
      if constexpr ((SWAN_HEAD_MASK >> I) & 1) {
        if (h == H) return call(std::integral_constant<int, H>{});
      }
      return visit<I + 1>(h, call);
    }
  }
  static ffi::Array<int64_t> array() {
    ffi::Array<int64_t> out;
    for (int i = 0; i < kNumHeadSlots; ++i)
      if ((SWAN_HEAD_MASK >> i) & 1) out.push_back(kFlashInferHeads[i]);
    return out;
  }
};

// FlashInfer's own head specialisation for a head count (what its dispatch_decode launches).
inline int flashinfer_specialisation(int heads) {
  return ex::visit_decode_heads<ModelType::DSV4>(heads, [](auto h) { return int(h); });
}

inline void check_page_view(const TensorView& kv) {
  CHECK_CUDA(kv);
  CHECK_INPUT_TYPE(kv, dl_uint8);
  TVM_FFI_ICHECK(kv.ndim() == 4 && kv.size(1) == kPageTokens && kv.size(2) == 1 &&
                 kv.size(3) == kRowBytes)
      << SWAN_MODULE_TAG " serves only the 4-D view [N, " << kPageTokens << ", 1, " << kRowBytes
      << "]; got ndim=" << kv.ndim();
  TVM_FFI_ICHECK(kv.stride(0) == int64_t(kPageStride) && kv.stride(1) == kRowBytes &&
                 kv.stride(3) == 1)
      << SWAN_MODULE_TAG " requires strides (" << kPageStride << ", " << kRowBytes
      << ", *, 1); got stride(0)=" << kv.stride(0) << " stride(1)=" << kv.stride(1);
  TVM_FFI_ICHECK_EQ(reinterpret_cast<uintptr_t>(kv.data_ptr()) % 16, 0)
      << SWAN_MODULE_TAG " page pool must be 16B aligned";
}

// Metadata of one call, FlashInfer's 18-field AttentionMetadata with our compile-time page.
inline ex::AttentionMetadata metadata(int tokens, int heads, int topk, int extra_topk,
                                      int extra_page_size, size_t extra_page_stride,
                                      size_t indices_stride, size_t extra_indices_stride,
                                      size_t lse_stride, bool has_lengths, bool has_extra_lengths,
                                      bool has_sink) {
  return ex::AttentionMetadata{int(ModelType::DSV4),
                               tokens,
                               heads,
                               topk,
                               extra_topk,
                               kPageTokens,
                               extra_page_size,
                               kPageStride,
                               extra_page_stride,
                               kRowBytes,
                               indices_stride,
                               extra_indices_stride,
                               lse_stride,
                               has_lengths,
                               has_extra_lengths,
                               has_sink,
                               false,
                               0};
}

inline ex::ExecutionPlan resolve(const ex::AttentionMetadata& m, int64_t cpb, int sm_count,
                                 size_t max_shared) {
  TVM_FFI_ICHECK(m.tokens >= 1 && m.tokens <= kDecodeMaxTokens)
      << SWAN_MODULE_TAG " serves 1.." << kDecodeMaxTokens << " query rows; got " << m.tokens;
  TVM_FFI_ICHECK(cpb >= INT_MIN && cpb <= INT_MAX) << "cpb out of int range";
  const auto plan = ex::resolve_attention(m, ex::NumericRoute::FP8, int(cpb),
                                          {sm_count, max_shared});
  TVM_FFI_ICHECK(plan.numeric == ex::NumericRoute::FP8 &&
                 plan.implementation == ex::Implementation::Ordinary)
      << SWAN_MODULE_TAG " serves the ordinary FP8 decode only";
  TVM_FFI_ICHECK(Heads::contains(plan.specialized_heads))
      << SWAN_MODULE_TAG " was built without the " << plan.specialized_heads
      << "-head specialisation (heads=" << m.heads << ")";
  return plan;
}

inline ffi::Array<int64_t> plan_facts(const ex::ExecutionPlan& p) {
  return {p.cpb,
          p.chunk_capacity,
          p.active_splits,
          p.scratch_split_stride,
          p.scratch_heads,
          p.head_blocks,
          p.block_threads,
          int64_t(p.shared_bytes),
          int64_t(p.partial_bytes),
          int64_t(p.lse_bytes),
          p.specialized_heads,
          int64_t(p.numeric),
          int64_t(p.implementation)};
}

// Module facts: what this build serves (read by adapter/swan.py at install).
ffi::Map<ffi::String, ffi::Any> Info() {
  return ffi::Map<ffi::String, ffi::Any>{
      {"module_tag", ffi::String(SWAN_MODULE_TAG)},
      {"flashinfer_version", ffi::String(SWAN_FLASHINFER_VERSION)},
      {"page_tokens", int64_t(kPageTokens)},
      {"page_stride_bytes", int64_t(kPageStride)},
      {"row_bytes", int64_t(kRowBytes)},
      {"data_bytes", int64_t(kDataBytes)},
      {"scale_bytes", int64_t(kScaleBytes)},
      {"decode_max_tokens", int64_t(kDecodeMaxTokens)},
      {"d_qk", int64_t(KV::D_QK)},
      {"d_v", int64_t(KV::D_V)},
      {"heads", Heads::array()}};
}

// The execution plan our decode would launch for these shapes and a requested cpb (the cpb the
// engine's stock FlashInfer planner chose for the same call at 64-token pages). Pure host code.
ffi::Array<int64_t> Plan(int64_t tokens, int64_t heads, int64_t topk, int64_t extra_topk,
                         int64_t extra_page_size, int64_t extra_page_stride,
                         int64_t indices_stride, int64_t extra_indices_stride, int64_t lse_stride,
                         bool has_lengths, bool has_extra_lengths, bool has_sink, int64_t cpb,
                         int64_t sm_count, int64_t max_shared) {
  TVM_FFI_ICHECK(tokens > 0 && heads > 0 && topk > 0 && extra_topk >= 0 && sm_count > 0 &&
                 max_shared > 0 && tokens <= INT_MAX && heads <= INT_MAX && topk <= INT_MAX &&
                 extra_topk <= INT_MAX && extra_page_size >= 0 && extra_page_size <= INT_MAX)
      << "invalid plan request";
  const auto m = metadata(int(tokens), int(heads), int(topk), int(extra_topk),
                          int(extra_page_size), size_t(extra_page_stride), size_t(indices_stride),
                          size_t(extra_indices_stride), size_t(lse_stride), has_lengths,
                          has_extra_lengths, has_sink);
  return plan_facts(resolve(m, cpb, int(sm_count), size_t(max_shared)));
}

void Decode(TensorView q, TensorView kv_cache, TensorView indices, TensorView mid_out,
            TensorView mid_lse, TensorView output, TensorView out_lse, int64_t cpb,
            double sm_scale, Optional<TensorView> topk_length, Optional<TensorView> attn_sink,
            Optional<TensorView> extra_kv_cache, Optional<TensorView> extra_indices,
            Optional<TensorView> extra_topk_length) {
  check_page_view(kv_cache);
  TVM_FFI_ICHECK_EQ(q.ndim(), 3) << "q must be [T, H, 512]";
  TVM_FFI_ICHECK_EQ(q.size(2), KV::D_QK) << SWAN_MODULE_TAG " serves DSV4 (d_qk=512) only";
  const int num_tokens = int(q.size(0));
  const int num_heads = int(q.size(1));
  TVM_FFI_ICHECK_EQ(indices.size(-1) % 64, 0) << "indices width must be a multiple of 64";
  // Scratch capacity is checked against the resolved plan below; splits >= 1 here.
  fi::check_decode_tensors(q, kv_cache, indices, mid_out, mid_lse, output, out_lse, 1);
  fi::check_attention_vector(q, topk_length, num_tokens, dl_int32, "topk_length");
  fi::check_attention_vector(q, attn_sink, num_heads, dl_float32, "attn_sink");
  fi::check_attention_optional(q, extra_kv_cache, "extra_kv_cache");
  fi::check_attention_optional(q, extra_indices, "extra_indices");
  fi::check_attention_vector(q, extra_topk_length, num_tokens, dl_int32, "extra_topk_length");
  TVM_FFI_ICHECK(extra_kv_cache.has_value() == extra_indices.has_value())
      << "extra_kv_cache and extra_indices come together";
  TVM_FFI_ICHECK(!extra_topk_length.has_value() || extra_kv_cache.has_value())
      << "extra_topk_length requires extra_kv_cache";

  int extra_topk = 0, extra_pbs = 0;
  size_t extra_stride = 0, extra_idx_stride = 0;
  const uint8_t* extra_ptr = nullptr;
  const int32_t* extra_idx_ptr = nullptr;
  if (extra_kv_cache.has_value()) {
    const auto& ekv = extra_kv_cache.value();
    const auto& eidx = extra_indices.value();
    CHECK_INPUT_TYPE(eidx, dl_int32);
    TVM_FFI_ICHECK(eidx.ndim() == 2 || (eidx.ndim() == 3 && eidx.size(1) == 1))
        << "extra_indices must be [T, K] or [T, 1, K]";
    TVM_FFI_ICHECK(eidx.size(0) == num_tokens && eidx.size(-1) > 0 && eidx.stride(-1) == 1 &&
                   eidx.stride(0) >= eidx.size(-1))
        << "extra_indices shape/stride mismatch";
    const auto layout = fi::parse_paged_kv_layout(ekv, kRowBytes, false, "extra_kv_cache");
    TVM_FFI_ICHECK_EQ(layout.stride_kv_row, kRowBytes) << "extra rows must stay tightly packed";
    extra_topk = int(eidx.size(-1));
    extra_pbs = layout.page_block_size;
    extra_stride = layout.stride_kv_block;
    extra_idx_stride = size_t(eidx.stride(0));
    extra_ptr = static_cast<const uint8_t*>(ekv.data_ptr());
    extra_idx_ptr = static_cast<const int32_t*>(eidx.data_ptr());
  }

  ffi::CUDADeviceGuard device_guard(q.device().device_id);
  cudaStream_t stream = get_stream(q.device());
  int sm_count = 0, max_shared = 0;
  TVM_FFI_ICHECK_EQ(
      cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, q.device().device_id),
      cudaSuccess);
  TVM_FFI_ICHECK_EQ(cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                           q.device().device_id),
                    cudaSuccess);
  const auto m = metadata(num_tokens, num_heads, int(indices.size(-1)), extra_topk, extra_pbs,
                          extra_stride, size_t(indices.stride(0)), extra_idx_stride,
                          size_t(out_lse.stride(0)), topk_length.has_value(),
                          extra_topk_length.has_value(), attn_sink.has_value());
  const auto plan = resolve(m, cpb, sm_count, size_t(max_shared));
  TVM_FFI_ICHECK_EQ(plan.specialized_heads, flashinfer_specialisation(num_heads))
      << "head specialisation differs from FlashInfer's dispatch";
  fi::check_decode_scratch_capacity(q, mid_out, mid_lse, plan.chunk_capacity);

  ex::AttentionParams p{};
  p.num_heads = num_heads;
  p.topk = m.topk;
  p.q = static_cast<const bf16*>(q.data_ptr());
  p.kv = static_cast<const uint8_t*>(kv_cache.data_ptr());
  p.indices = static_cast<const int32_t*>(indices.data_ptr());
  p.mid_out = static_cast<bf16*>(mid_out.data_ptr());
  p.mid_lse = static_cast<float*>(mid_lse.data_ptr());
  p.topk_length =
      topk_length.has_value() ? static_cast<const int*>(topk_length.value().data_ptr()) : nullptr;
  p.output = static_cast<bf16*>(output.data_ptr());
  p.out_lse = static_cast<float*>(out_lse.data_ptr());
  p.attn_sink =
      attn_sink.has_value() ? static_cast<const float*>(attn_sink.value().data_ptr()) : nullptr;
  p.extra_kv = extra_ptr;
  p.extra_indices = extra_idx_ptr;
  p.extra_topk_length = extra_topk_length.has_value()
                            ? static_cast<const int*>(extra_topk_length.value().data_ptr())
                            : nullptr;
  p.extra_topk = extra_topk;
  p.extra_page_size = extra_pbs;
  p.extra_page_stride_bytes = extra_stride;
  p.num_tokens = num_tokens;
  p.allocated_splits = plan.chunk_capacity;   // as FlashInfer's execute_attention does
  p.chunks_per_block = plan.cpb;
  p.sm_scale = float(sm_scale);
  p.page_stride_bytes = kPageStride;    // compile-time page geometry
  p.indices_stride_elems = m.indices_stride;
  p.extra_indices_stride_elems = extra_idx_stride;
  p.out_lse_stride_elems = m.lse_stride;
  p.page_size = kPageTokens;
  p.extra_fp4 = false;
  p.lse_scale = 1.f;
  const cudaError_t status = Heads::visit(plan.specialized_heads, [&](auto head) {
    return ex::launch_decode<ModelType::DSV4, decltype(head)::value>(p, plan, stream);
  });
  TVM_FFI_ICHECK_EQ(status, cudaSuccess) << SWAN_MODULE_TAG ": " << cudaGetErrorString(status);
}

}  // namespace swan256

TVM_FFI_DLL_EXPORT_TYPED_FUNC(swan256_info, swan256::Info);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(swan256_plan, swan256::Plan);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(swan256_decode, swan256::Decode);
