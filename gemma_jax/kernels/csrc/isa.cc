// One instruction set's chains (chains.h), compiled once per path with its own flags:
//   -DGEMMA_SPEC_ISA=avx512    -mavx512f -mfma
//   -DGEMMA_SPEC_ISA=avx2      -mavx2 -mfma
//   -DGEMMA_SPEC_ISA=neon      (aarch64; NEON is part of the base instruction set)
//   -DGEMMA_SPEC_ISA=portable  no vector extension: one scalar std::fma per term (correctly
//                              rounded by definition; a software routine on an x86 without FMA)
// Each path exports gemma_spec_panel_<isa>, gemma_spec_stream_<isa> (chains.h),
// gemma_spec_attend_<isa> and gemma_spec_transpose_<isa> (attention.h). Every build uses -ffp-contract=off and no fast-math: the
// only fused operations are the FMAs written here.
//
// The flush rule (chains.h): on x86 the hardware's is the spec's. On aarch64 FPCR.FZ flushes by
// tininess before rounding, so the NEON path runs each work item with its plain operations and
// reads FPSR.UFC, which a flush sets (the Arm ARM's FPRound): where no result was flushed, none
// was in the window where the rules part, and the plain results are the spec's; where one was,
// the work item is computed again with VExact, whose multiply and FMA decide the flush by the
// spec's rule (chains.h, SpecRounded). The portable path's operations always do so there.
#include <atomic>
#include <cfenv>
#include <climits>
#include <cmath>
#include <cstdint>

#include "attention.h"
#include "chains.h"

#define GEMMA_SPEC_CAT2(a, b) a##b
#define GEMMA_SPEC_CAT(a, b) GEMMA_SPEC_CAT2(a, b)

#if GEMMA_SPEC_ISA_avx512
#include <immintrin.h>
namespace {
struct V {
  using T = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kVectors = 4;  // 4 x 4 accumulators + 4 loads of the 32 registers
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T splat(float x) { return _mm512_set1_ps(x); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  // The elementwise operations of attention.h.
  using M = __mmask16;
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T min(T a, T b) { return _mm512_min_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T abs(T a) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a),
                                                                  _mm512_set1_epi32(0x7FFFFFFF))); }
  static T neg(T a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a),
                                                                  _mm512_set1_epi32(INT32_MIN))); }
  static M lt(T a, T b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M gt(T a, T b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static M eq(T a, T b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static T select(M m, T a, T b) { return _mm512_mask_blend_ps(m, b, a); }
  static T truncated(T x) { return _mm512_cvtepi32_ps(_mm512_cvttps_epi32(x)); }
  static T pow2(T n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  // r[i] lane j -> r[j] lane i: pairs interleaved, then pairs of pairs (each 128-bit lane a 4 x 4
  // block transposed), then the blocks moved into place.
  static void transpose(T (&r)[16]) {
    T t[16];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    T u[16];  // u[4a + c], 128-bit lane k: column 4k + c of rows 4a .. 4a + 3
    for (int i = 0; i < 16; i += 4) {
      const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 2]);
      const __m512d c = _mm512_castps_pd(t[i + 1]), d = _mm512_castps_pd(t[i + 3]);
      u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
      u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
      u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int c = 0; c < 4; ++c) {
      const T s0 = _mm512_shuffle_f32x4(u[c], u[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
      const T s1 = _mm512_shuffle_f32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
      const T s2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
      const T s3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
      r[c] = _mm512_shuffle_f32x4(s0, s2, _MM_SHUFFLE(2, 0, 2, 0));
      r[4 + c] = _mm512_shuffle_f32x4(s1, s3, _MM_SHUFFLE(2, 0, 2, 0));
      r[8 + c] = _mm512_shuffle_f32x4(s0, s2, _MM_SHUFFLE(3, 1, 3, 1));
      r[12 + c] = _mm512_shuffle_f32x4(s1, s3, _MM_SHUFFLE(3, 1, 3, 1));
    }
  }
};
}  // namespace
#define GEMMA_SPEC_NAME avx512
#elif GEMMA_SPEC_ISA_avx2
#include <immintrin.h>
namespace {
struct V {
  using T = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kVectors = 2;  // 4 x 2 accumulators of the 16 registers
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T splat(float x) { return _mm256_set1_ps(x); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  // The elementwise operations of attention.h.
  using M = __m256;
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T min(T a, T b) { return _mm256_min_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T abs(T a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
  static T neg(T a) { return _mm256_xor_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN))); }
  static M lt(T a, T b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static M gt(T a, T b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static M eq(T a, T b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
  static T select(M m, T a, T b) { return _mm256_blendv_ps(b, a, m); }
  static T truncated(T x) { return _mm256_cvtepi32_ps(_mm256_cvttps_epi32(x)); }
  static T pow2(T n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  // r[i] lane j -> r[j] lane i (as avx512's, with two 128-bit lanes).
  static void transpose(T (&r)[8]) {
    T t[8];
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    T u[8];  // u[4a + c], 128-bit lane k: column 4k + c of rows 4a .. 4a + 3
    for (int i = 0; i < 8; i += 4) {
      const __m256d a = _mm256_castps_pd(t[i]), b = _mm256_castps_pd(t[i + 2]);
      const __m256d c = _mm256_castps_pd(t[i + 1]), d = _mm256_castps_pd(t[i + 3]);
      u[i] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, b));
      u[i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, b));
      u[i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(c, d));
      u[i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(c, d));
    }
    for (int c = 0; c < 4; ++c) {
      r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
      r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
  }
};
}  // namespace
#define GEMMA_SPEC_NAME avx2
#elif GEMMA_SPEC_ISA_neon
#include <arm_neon.h>
namespace {
struct V {
  using T = float32x4_t;
  static constexpr int kLanes = 4;
  static constexpr int kVectors = 4;
  static T zero() { return vdupq_n_f32(0.0f); }
  static T load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, T v) { vst1q_f32(p, v); }
  static T splat(float x) { return vdupq_n_f32(x); }
  static T fma(T a, T b, T c) { return vfmaq_f32(c, a, b); }  // c + a * b, fused
  static T add(T a, T b) { return vaddq_f32(a, b); }
  // The elementwise operations of attention.h.
  using M = uint32x4_t;
  static T sub(T a, T b) { return vsubq_f32(a, b); }
  static T mul(T a, T b) { return vmulq_f32(a, b); }
  static T div(T a, T b) { return vdivq_f32(a, b); }
  static T min(T a, T b) { return vminq_f32(a, b); }
  static T max(T a, T b) { return vmaxq_f32(a, b); }
  static T abs(T a) { return vabsq_f32(a); }
  static T neg(T a) { return vnegq_f32(a); }
  static M lt(T a, T b) { return vcltq_f32(a, b); }
  static M gt(T a, T b) { return vcgtq_f32(a, b); }
  static M eq(T a, T b) { return vceqq_f32(a, b); }
  static T select(M m, T a, T b) { return vbslq_f32(m, a, b); }
  static T truncated(T x) { return vcvtq_f32_s32(vcvtq_s32_f32(x)); }
  static T pow2(T n) {
    const int32x4_t e = vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127));
    return vreinterpretq_f32_s32(vshlq_n_s32(e, 23));
  }
  // r[i] lane j -> r[j] lane i.
  static void transpose(T (&r)[4]) {
    const float32x4x2_t p = vtrnq_f32(r[0], r[1]), q = vtrnq_f32(r[2], r[3]);
    r[0] = vcombine_f32(vget_low_f32(p.val[0]), vget_low_f32(q.val[0]));
    r[1] = vcombine_f32(vget_low_f32(p.val[1]), vget_low_f32(q.val[1]));
    r[2] = vcombine_f32(vget_high_f32(p.val[0]), vget_high_f32(q.val[0]));
    r[3] = vcombine_f32(vget_high_f32(p.val[1]), vget_high_f32(q.val[1]));
  }
};
// V with the spec's flush rule computed (chains.h, SpecRounded), lane by lane.
struct VExact : V {
  static T SpecRounded(T r, T s) {
    return vbslq_f32(vcaltq_f32(s, vdupq_n_f32(gemma_spec::kSmall)),
                     vmulq_f32(s, vdupq_n_f32(gemma_spec::kUnscale)), r);
  }
  static T scaled(T a) { return vmulq_f32(a, vdupq_n_f32(gemma_spec::kScale)); }
  static T fma(T a, T b, T c) {
    return SpecRounded(vfmaq_f32(c, a, b), vfmaq_f32(scaled(c), scaled(a), b));
  }
  static T mul(T a, T b) { return SpecRounded(vmulq_f32(a, b), vmulq_f32(scaled(a), b)); }
};
// f(V()); again as f(VExact()) where a result was flushed on the way (FE_UNDERFLOW: FPSR.UFC).
// f writes its outputs afresh from its inputs, so the second run replaces the first.
template <class F>
void Run(F f) {
  std::fexcept_t saved;
  std::fegetexceptflag(&saved, FE_ALL_EXCEPT);
  std::feclearexcept(FE_UNDERFLOW);
  f(V());
  if (std::fetestexcept(FE_UNDERFLOW)) f(VExact());
  std::fesetexceptflag(&saved, FE_ALL_EXCEPT);
}
}  // namespace
#define GEMMA_SPEC_NAME neon
#elif GEMMA_SPEC_ISA_portable
namespace {
struct V : gemma_spec::Scalar {
  static constexpr int kVectors = 4;
  static T zero() { return 0.0f; }
  static T fma(T a, T b, T c) { return gemma_spec::Fma(a, b, c); }
  static void transpose(T (&)[1]) {}
};
}  // namespace
#define GEMMA_SPEC_NAME portable
#else
#error "define GEMMA_SPEC_ISA_<avx512|avx2|neon|portable>=1"
#endif

// Work items this path has run in this process (gemma_spec_path_calls in ffi.cc): what tells a
// test which path a request ran on, since every path gives the same bits.
static std::atomic<int64_t> calls{0};

extern "C" int64_t GEMMA_SPEC_CAT(gemma_spec_calls_, GEMMA_SPEC_NAME)() {
  return calls.load(std::memory_order_relaxed);
}

// The statement once with the path's operations W = V (then, on NEON, again with W = VExact where
// a result was flushed: Run). Elsewhere V's operations are the spec's as they stand.
#if GEMMA_SPEC_ISA_neon
#define GEMMA_SPEC_RUN(...) Run([&](auto ops) { using W = decltype(ops); __VA_ARGS__; })
#else
#define GEMMA_SPEC_RUN(...) do { using W = V; __VA_ARGS__; } while (0)
#endif

extern "C" void GEMMA_SPEC_CAT(gemma_spec_panel_, GEMMA_SPEC_NAME)(
    const gemma_spec::Problem* p, int64_t row0, int64_t rows, int64_t col0, int64_t width) {
  calls.fetch_add(1, std::memory_order_relaxed);
  GEMMA_SPEC_RUN(gemma_spec::Panel<W, V::kVectors>(*p, row0, rows, col0, width));
}

extern "C" void GEMMA_SPEC_CAT(gemma_spec_stream_, GEMMA_SPEC_NAME)(
    const gemma_spec::Problem* p, int64_t row0, int64_t rows, int64_t col0, int64_t width,
    float* part) {
  calls.fetch_add(1, std::memory_order_relaxed);
  GEMMA_SPEC_RUN(gemma_spec::Stream<W>(*p, row0, rows, col0, width, part));
}

extern "C" void GEMMA_SPEC_CAT(gemma_spec_transpose_, GEMMA_SPEC_NAME)(
    const float* keys, int64_t ldk, int64_t h, int64_t tile, float* out) {
  gemma_spec::TransposeKeys<V>(keys, ldk, h, tile, out);  // moves values: no arithmetic
}

extern "C" void GEMMA_SPEC_CAT(gemma_spec_attend_, GEMMA_SPEC_NAME)(
    const gemma_spec::Attend* a, int64_t group, int64_t r0, int64_t rows, const int64_t* tiles,
    int64_t num_tiles, const gemma_spec::AttendScratch* w) {
  calls.fetch_add(1, std::memory_order_relaxed);
  GEMMA_SPEC_RUN(gemma_spec::AttendRows<W>(*a, group, r0, rows, tiles, num_tiles, *w));
}
