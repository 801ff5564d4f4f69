// XLA FFI handlers of the written arithmetic's contractions (chains.h), registered as CPU custom
// calls by gemma_jax/kernels/native_dot.py:
//   gemma_spec_matmul  x [M, K] @ w [K, N] -> [M, N], chunks of `chunk` terms added in order
//                      (every projection, and the logits against the transposed table)
//   gemma_spec_matmul_packed  the same with w in column panels [N / 64, K, 64] (MatmulPacked)
//   gemma_spec_scores  q [G, R, H] . k [G, T, S, H] -> [G, T, R, S], over H in chunks
//                      (attention's scores, one [R, S] block per KV tile t)
//   gemma_spec_values  p [G, T, R, S] @ v [G, T, S, H] -> [G, T, R, H], one chain over S
// Attributes: `isa` (0: the best this CPU has; 1 portable, 2 avx2, 3 avx512, 4 neon) and
// `parts` (0: as many work items at once as XLA's intra-op pool has threads). Neither decides a
// bit: outputs are split into items by rows and columns, and each output's chain is the same
// operations in the same order whoever computes it.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "chains.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;
using gemma_spec::Problem;

using PanelFn = void (*)(const Problem*, int64_t, int64_t, int64_t, int64_t);
using StreamFn = void (*)(const Problem*, int64_t, int64_t, int64_t, int64_t, float*);

#define GEMMA_SPEC_DECLARE(isa)                                                             \
  void gemma_spec_panel_##isa(const Problem*, int64_t, int64_t, int64_t, int64_t);          \
  void gemma_spec_stream_##isa(const Problem*, int64_t, int64_t, int64_t, int64_t, float*); \
  int64_t gemma_spec_calls_##isa();
extern "C" {
GEMMA_SPEC_DECLARE(portable)
#if defined(__x86_64__)
GEMMA_SPEC_DECLARE(avx2)
GEMMA_SPEC_DECLARE(avx512)
#endif
#if defined(__aarch64__)
GEMMA_SPEC_DECLARE(neon)
#endif
}

// One instruction set's two loop shapes (chains.h): register tiles, and row streaming.
struct Path {
  PanelFn panel;
  StreamFn stream;
};

namespace {

enum Isa : int64_t { kAuto = 0, kPortable = 1, kAvx2 = 2, kAvx512 = 3, kNeon = 4 };
constexpr const char* kIsaNames[] = {"auto", "portable", "avx2", "avx512", "neon"};

bool Supported(int64_t isa) {
  switch (isa) {
    case kPortable:
      return true;
#if defined(__x86_64__)
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
#endif
#if defined(__aarch64__)
    case kNeon:
      return true;
#endif
    default:
      return false;
  }
}

int64_t Best() {
  for (int64_t isa : {kAvx512, kAvx2, kNeon})
    if (Supported(isa)) return isa;
  return kPortable;
}

Path PathOf(int64_t isa) {
  switch (isa) {
#if defined(__x86_64__)
    case kAvx2:
      return {gemma_spec_panel_avx2, gemma_spec_stream_avx2};
    case kAvx512:
      return {gemma_spec_panel_avx512, gemma_spec_stream_avx512};
#endif
#if defined(__aarch64__)
    case kNeon:
      return {gemma_spec_panel_neon, gemma_spec_stream_neon};
#endif
    default:
      return {gemma_spec_panel_portable, gemma_spec_stream_portable};
  }
}

ffi::ErrorOr<Path> Resolve(int64_t isa) {
  if (isa == kAuto) isa = Best();
  if (isa < kPortable || isa > kNeon)
    return ffi::Unexpected(
        ffi::Error::InvalidArgument("spec dot: unknown isa " + std::to_string(isa)));
  if (!Supported(isa))
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        std::string("spec dot: this CPU cannot run the ") + kIsaNames[isa] + " path"));
  return PathOf(isa);
}

// The FP environment of the written arithmetic for the scope of one work item: subnormal
// inputs read as zero and subnormal results flushed to a zero of their sign, rounding to
// nearest even.
class FlushScope {
 public:
  FlushScope() {
#if defined(__x86_64__)
    saved_ = _mm_getcsr();
    _mm_setcsr((saved_ & ~0x6000u) | 0x8040u);  // FTZ | DAZ, round to nearest
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    fpcr = (fpcr & ~(uint64_t{3} << 22)) | (uint64_t{1} << 24);  // FZ, round to nearest
    __asm__ volatile("msr fpcr, %0" : : "r"(fpcr));
#endif
  }
  ~FlushScope() {
#if defined(__x86_64__)
    _mm_setcsr(static_cast<unsigned>(saved_));
#elif defined(__aarch64__)
    __asm__ volatile("msr fpcr, %0" : : "r"(saved_));
#endif
  }

 private:
  uint64_t saved_ = 0;
};

// Runs work(i) for i in [0, items) on up to `parts` threads of XLA's pool (the calling thread
// included). Items are claimed from a shared counter; the caller waits only for items that were
// claimed, never for a task that has not started, so a busy pool cannot deadlock it.
template <class Work>
void ForEach(ffi::ThreadPool& pool, int64_t parts, int64_t items, Work work) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  int64_t threads = parts > 0 ? parts : std::max<int64_t>(1, pool.num_threads());
  threads = std::min(threads, items);
  auto run = [state, items, work]() {
    FlushScope scope;
    for (int64_t i; (i = state->next.fetch_add(1)) < items;) {
      work(i);
      if (state->done.fetch_add(1) + 1 == items) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  for (int64_t t = 1; t < threads; ++t) {
    auto task = run;
    pool.Schedule(std::move(task));
  }
  run();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == items; });
}

constexpr int64_t kRowsPerItem = 64;
constexpr int64_t kPanel = 64;  // columns of a packed weight panel
constexpr int64_t kColsPerItem = 128;
// At most this many rows stream B row by row (chains.h Stream), in column ranges whose partial
// chains fit kStreamFloats floats, and at least kItemsPerThread ranges per thread.
constexpr int64_t kStreamRows = 16;
constexpr int64_t kStreamFloats = 4096;
constexpr int64_t kItemsPerThread = 4;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> out, int64_t chunk, int64_t isa, int64_t parts) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("spec matmul: shapes do not contract");
  const int64_t m = xd[0], k = xd[1], n = wd[1];
  if (chunk < 1 || k % chunk)
    return ffi::Error::InvalidArgument("spec matmul: the chunk does not divide the terms");
  auto panel = Resolve(isa);
  if (panel.has_error()) return panel.error();
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::memset(out->typed_data(), 0, sizeof(float) * m * n);
    return ffi::Error::Success();
  }
  Problem p{x.typed_data(), k, w.typed_data(), n, out->typed_data(), n, m, k, n, chunk};
  const Path path = *panel;
  if (m <= kStreamRows) {
    const int64_t threads = parts > 0 ? parts : std::max<int64_t>(1, pool.num_threads());
    int64_t width = std::min(kStreamFloats / m, CeilDiv(n, kItemsPerThread * threads));
    width = std::max<int64_t>(64, (width + 63) / 64 * 64);
    ForEach(pool, parts, CeilDiv(n, width), [&](int64_t i) {
      thread_local std::vector<float> part;
      part.resize(m * width);
      const int64_t c = i * width;
      path.stream(&p, 0, m, c, std::min(width, n - c), part.data());
    });
    return ffi::Error::Success();
  }
  const int64_t row_items = CeilDiv(m, kRowsPerItem), col_items = CeilDiv(n, kColsPerItem);
  ForEach(pool, parts, row_items * col_items, [&](int64_t i) {
    const int64_t r = (i % row_items) * kRowsPerItem, c = (i / row_items) * kColsPerItem;
    path.panel(&p, r, std::min(kRowsPerItem, m - r), c, std::min(kColsPerItem, n - c));
  });
  return ffi::Error::Success();
}

// w packed in column panels: wp [P, K, kPanel], panel j holding columns [j kPanel, (j + 1) kPanel)
// of the [K, N] weight (N = P kPanel), each term's kPanel columns contiguous. A panel is one
// contiguous run over every term, whatever the row count: the layout the engine keeps its weights
// in (gemma_jax.kernels.native_dot.pack), so that a call streams each weight once.
ffi::Error MatmulPacked(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                        ffi::ResultBuffer<ffi::F32> out, int64_t chunk, int64_t isa,
                        int64_t parts) {
  auto xd = x.dimensions(), wd = wp.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1] || wd[2] != kPanel)
    return ffi::Error::InvalidArgument("spec packed matmul: shapes do not contract");
  const int64_t m = xd[0], k = xd[1], panels = wd[0], n = panels * kPanel;
  if (chunk < 1 || k % chunk)
    return ffi::Error::InvalidArgument("spec packed matmul: the chunk does not divide the terms");
  auto path = Resolve(isa);
  if (path.has_error()) return path.error();
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::memset(out->typed_data(), 0, sizeof(float) * m * n);
    return ffi::Error::Success();
  }
  const int64_t row_items = CeilDiv(m, kRowsPerItem);
  PanelFn fn = path->panel;
  const float* xp = x.typed_data();
  const float* w = wp.typed_data();
  float* o = out->typed_data();
  ForEach(pool, parts, row_items * panels, [&](int64_t i) {
    const int64_t r = (i % row_items) * kRowsPerItem, j = i / row_items;
    Problem p{xp, k, w + j * k * kPanel, kPanel, o + j * kPanel, n, m, k, kPanel, chunk};
    fn(&p, r, std::min(kRowsPerItem, m - r), 0, kPanel);
  });
  return ffi::Error::Success();
}

ffi::Error Scores(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kt,
                  ffi::ResultBuffer<ffi::F32> out, int64_t chunk, int64_t isa, int64_t parts) {
  auto qd = q.dimensions(), kd = kt.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || qd[0] != kd[0] || qd[2] != kd[3])
    return ffi::Error::InvalidArgument("spec scores: shapes do not contract");
  const int64_t g = qd[0], r = qd[1], h = qd[2], t = kd[1], s = kd[2];
  if (chunk < 1 || h % chunk)
    return ffi::Error::InvalidArgument("spec scores: the chunk does not divide the head");
  auto panel = Resolve(isa);
  if (panel.has_error()) return panel.error();
  if (g * r * t * s == 0) return ffi::Error::Success();
  const int64_t col_items = CeilDiv(s, kColsPerItem);
  PanelFn fn = panel->panel;
  const float* qp = q.typed_data();
  const float* kp = kt.typed_data();
  float* op = out->typed_data();
  ForEach(pool, parts, g * t * col_items, [&](int64_t i) {
    const int64_t c = (i % col_items) * kColsPerItem, tile = (i / col_items) % t,
                  group = i / (col_items * t), width = std::min(kColsPerItem, s - c);
    // The keys of this panel transposed, [H, width], so that a vector lane holds one slot.
    thread_local std::vector<float> packed;
    packed.resize(h * width);
    const float* keys = kp + ((group * t + tile) * s + c) * h;
    for (int64_t j = 0; j < width; ++j)
      for (int64_t d = 0; d < h; ++d) packed[d * width + j] = keys[j * h + d];
    Problem p{qp + group * r * h, h, packed.data(), width,
              op + (group * t + tile) * r * s + c, s, r, h, width, chunk};
    fn(&p, 0, r, 0, width);
  });
  return ffi::Error::Success();
}

ffi::Error Values(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> pr, ffi::Buffer<ffi::F32> v,
                  ffi::ResultBuffer<ffi::F32> out, int64_t isa, int64_t parts) {
  auto pd = pr.dimensions(), vd = v.dimensions();
  if (pd.size() != 4 || vd.size() != 4 || pd[0] != vd[0] || pd[1] != vd[1] || pd[3] != vd[2])
    return ffi::Error::InvalidArgument("spec values: shapes do not contract");
  const int64_t g = pd[0], t = pd[1], r = pd[2], s = pd[3], h = vd[3];
  auto panel = Resolve(isa);
  if (panel.has_error()) return panel.error();
  if (g * t * r * h == 0) return ffi::Error::Success();
  if (s == 0) {
    std::memset(out->typed_data(), 0, sizeof(float) * g * t * r * h);
    return ffi::Error::Success();
  }
  const int64_t col_items = CeilDiv(h, kColsPerItem);
  PanelFn fn = panel->panel;
  const float* pp = pr.typed_data();
  const float* vp = v.typed_data();
  float* op = out->typed_data();
  ForEach(pool, parts, g * t * col_items, [&](int64_t i) {
    const int64_t c = (i % col_items) * kColsPerItem, block = i / col_items;
    Problem p{pp + block * r * s, s, vp + block * s * h + c, h, op + block * r * h + c, h,
              r, s, std::min(kColsPerItem, h - c), s};
    fn(&p, 0, r, 0, p.cols);
  });
  return ffi::Error::Success();
}

}  // namespace

// Every handler: XLA's intra-op thread pool, two float32 operands, one float32 result.
static auto Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmaSpecMatmul, Matmul,
                              Binding().Attr<int64_t>("chunk").Attr<int64_t>("isa").Attr<int64_t>(
                                  "parts"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmaSpecMatmulPacked, MatmulPacked,
                              Binding().Attr<int64_t>("chunk").Attr<int64_t>("isa").Attr<int64_t>(
                                  "parts"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmaSpecScores, Scores,
                              Binding().Attr<int64_t>("chunk").Attr<int64_t>("isa").Attr<int64_t>(
                                  "parts"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmaSpecValues, Values,
                              Binding().Attr<int64_t>("isa").Attr<int64_t>("parts"));

// The path `isa` resolves to on this CPU (0: the best), or -1 where it cannot run here.
extern "C" int64_t gemma_spec_resolve(int64_t isa) {
  if (isa == kAuto) return Best();
  return isa >= kPortable && isa <= kNeon && Supported(isa) ? isa : -1;
}

// The work items path `isa` (1 portable, 2 avx2, 3 avx512, 4 neon) has run in this process,
// counted by the path's own code (isa.cc); -1 for a path this library was not built with.
extern "C" int64_t gemma_spec_path_calls(int64_t isa) {
  switch (isa) {
    case kPortable:
      return gemma_spec_calls_portable();
#if defined(__x86_64__)
    case kAvx2:
      return gemma_spec_calls_avx2();
    case kAvx512:
      return gemma_spec_calls_avx512();
#endif
#if defined(__aarch64__)
    case kNeon:
      return gemma_spec_calls_neon();
#endif
    default:
      return -1;
  }
}
