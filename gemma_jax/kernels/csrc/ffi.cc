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
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "attention.h"
#include "chains.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;
using gemma_spec::Problem;

using gemma_spec::Attend;
using gemma_spec::AttendScratch;

using PanelFn = void (*)(const Problem*, int64_t, int64_t, int64_t, int64_t);
using StreamFn = void (*)(const Problem*, int64_t, int64_t, int64_t, int64_t, float*);
using AttendFn = void (*)(const Attend*, int64_t, int64_t, int64_t, const int64_t*, int64_t,
                          const AttendScratch*);
using TransposeFn = void (*)(const float*, int64_t, int64_t, int64_t, float*);

#define GEMMA_SPEC_DECLARE(isa)                                                             \
  void gemma_spec_panel_##isa(const Problem*, int64_t, int64_t, int64_t, int64_t);          \
  void gemma_spec_stream_##isa(const Problem*, int64_t, int64_t, int64_t, int64_t, float*); \
  void gemma_spec_attend_##isa(const Attend*, int64_t, int64_t, int64_t, const int64_t*,    \
                               int64_t, const AttendScratch*);                              \
  void gemma_spec_transpose_##isa(const float*, int64_t, int64_t, int64_t, float*);         \
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

// One instruction set's two loop shapes (chains.h): register tiles, and row streaming; its
// attention, and its transposition of a tile's keys (attention.h).
struct Path {
  PanelFn panel;
  StreamFn stream;
  AttendFn attend;
  TransposeFn transpose;
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
      return {gemma_spec_panel_avx2, gemma_spec_stream_avx2, gemma_spec_attend_avx2,
              gemma_spec_transpose_avx2};
    case kAvx512:
      return {gemma_spec_panel_avx512, gemma_spec_stream_avx512, gemma_spec_attend_avx512,
              gemma_spec_transpose_avx512};
#endif
#if defined(__aarch64__)
    case kNeon:
      return {gemma_spec_panel_neon, gemma_spec_stream_neon, gemma_spec_attend_neon,
              gemma_spec_transpose_neon};
#endif
    default:
      return {gemma_spec_panel_portable, gemma_spec_stream_portable,
              gemma_spec_attend_portable, gemma_spec_transpose_portable};
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

// The rows of x a call computes: the first `valid` (the rest of the output is +0). A prefill
// call has a fixed row count and as many real rows as its tokens; a row's chain does not depend on
// the rows beside it, so the padding rows are not computed at all.
int64_t ValidRows(const ffi::Buffer<ffi::S32>& valid, int64_t rows) {
  if (valid.element_count() == 0) return rows;
  return std::clamp<int64_t>(valid.typed_data()[0], 0, rows);
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::Buffer<ffi::S32> valid, ffi::ResultBuffer<ffi::F32> out, int64_t chunk,
                  int64_t isa, int64_t parts) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("spec matmul: shapes do not contract");
  const int64_t k = xd[1], n = wd[1], m = ValidRows(valid, xd[0]);
  std::memset(out->typed_data() + m * n, 0, sizeof(float) * (xd[0] - m) * n);
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
                        ffi::Buffer<ffi::S32> valid, ffi::ResultBuffer<ffi::F32> out,
                        int64_t chunk, int64_t isa, int64_t parts) {
  auto xd = x.dimensions(), wd = wp.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1] || wd[2] != kPanel)
    return ffi::Error::InvalidArgument("spec packed matmul: shapes do not contract");
  const int64_t k = xd[1], panels = wd[0], n = panels * kPanel, m = ValidRows(valid, xd[0]);
  std::memset(out->typed_data() + m * n, 0, sizeof(float) * (xd[0] - m) * n);
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

// Rows of one attention work item: enough to reuse each key tile, few enough to spread a prefill
// call over threads.
constexpr int64_t kAttendRows = 32;

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                     ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> qpos,
                     ffi::Buffer<ffi::S32> kpos, ffi::Buffer<ffi::F32> inverse,
                     ffi::ResultBuffer<ffi::F32> out, int64_t tile, int64_t chunk,
                     int64_t window, float softcap, int64_t relative, int64_t rotated,
                     float rope_scale, int64_t isa, int64_t parts) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  auto pd = qpos.dimensions(), sd = kpos.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || pd.size() != 2 || sd.size() != 2 ||
      kd[0] != qd[0] || vd[0] != qd[0] || kd[1] != vd[1] || kd[2] != vd[2] || kd[3] != qd[3] ||
      vd[3] != qd[3] || pd[0] != qd[0] || pd[1] != qd[1] || sd[0] != qd[0] || sd[1] != kd[1] ||
      kd[2] == 0 || qd[2] % kd[2])
    return ffi::Error::InvalidArgument("spec attention: shapes do not match");
  const int64_t b_len = qd[0], t_len = qd[1], heads = qd[2], h = qd[3], s_len = kd[1],
                kv = kd[2];
  if (tile < 1 || s_len % tile || chunk < 1 || h % chunk)
    return ffi::Error::InvalidArgument("spec attention: the tile or the chunk does not divide");
  if (relative && (h % 2 || inverse.element_count() != h / 2 || rotated < 0 || rotated > h / 2))
    return ffi::Error::InvalidArgument("spec attention: the relative mode's frequencies do not "
                                       "match the head");
  auto path = Resolve(isa);
  if (path.has_error()) return path.error();
  if (b_len * t_len * heads * h == 0) return ffi::Error::Success();
  const int64_t n = s_len / tile, groups = b_len * kv, rows = t_len * (heads / kv);
  std::shared_ptr<const gemma_spec::OffsetTable> offsets;
  if (relative) {
    FlushScope scope;  // the table's arithmetic is the spec's, in its FP environment
    offsets = gemma_spec::Offsets(inverse.typed_data(), h / 2, rotated, rope_scale, s_len);
  }
  const int32_t* qp = qpos.typed_data();
  const int32_t* kp = kpos.typed_data();
  // Each tile's positions, over its non-empty slots (lo > hi: empty).
  std::vector<int32_t> lo(b_len * n, INT32_MAX), hi(b_len * n, INT32_MIN);
  for (int64_t b = 0; b < b_len; ++b)
    for (int64_t s = 0; s < s_len; ++s) {
      const int32_t p = kp[b * s_len + s];
      if (p < 0) continue;
      lo[b * n + s / tile] = std::min(lo[b * n + s / tile], p);
      hi[b * n + s / tile] = std::max(hi[b * n + s / tile], p);
    }
  // Work items: blocks of a group's rows, each with the tiles its rows may see.
  struct Item {
    int64_t group, r0, rows, first_tile, num_tiles;
  };
  std::vector<Item> items;
  std::vector<int64_t> tiles;
  std::vector<uint8_t> needed(groups * n, 0);
  const int64_t per_head = heads / kv;
  // Whole tokens per item: a token's rows share one turned copy of the keys (relative mode).
  const int64_t per_item = per_head * std::max<int64_t>(1, kAttendRows / per_head);
  for (int64_t group = 0; group < groups; ++group) {
    const int64_t b = group / kv;
    for (int64_t r0 = 0; r0 < rows; r0 += per_item) {
      const int64_t count = std::min(per_item, rows - r0);
      int32_t qlo = INT32_MAX, qhi = INT32_MIN;
      for (int64_t r = r0; r < r0 + count; ++r) {
        const int32_t p = qp[b * t_len + r / per_head];
        if (p < 0) continue;
        qlo = std::min(qlo, p);
        qhi = std::max(qhi, p);
      }
      const int64_t first = tiles.size();
      for (int64_t j = 0; j < n; ++j)
        if (gemma_spec::MaySee(qlo, qhi, lo[b * n + j], hi[b * n + j], window)) {
          tiles.push_back(j);
          needed[group * n + j] = 1;
        }
      items.push_back({group, r0, count, first, static_cast<int64_t>(tiles.size()) - first});
    }
  }
  // The keys of every needed tile transposed, [groups, n, H, tile]; kept by the calling thread
  // between calls. Where a group's rows are one work item (a decode step: each tile is read by
  // one item only), the item transposes each tile it reads itself, into its own scratch, in
  // cache (Attend::keys_t null).
  const float* kd_ptr = k.typed_data();
  float* kt = nullptr;
  if (rows > per_item) {
    thread_local std::vector<float> keys_t;
    keys_t.resize(std::max<size_t>(keys_t.size(), groups * n * h * tile));
    std::vector<int64_t> transpose;
    for (int64_t i = 0; i < groups * n; ++i)
      if (needed[i]) transpose.push_back(i);
    kt = keys_t.data();
    const TransposeFn turn = path->transpose;
    ForEach(pool, parts, transpose.size(), [&](int64_t i) {
      const int64_t group = transpose[i] / n, j = transpose[i] % n;
      const int64_t b = group / kv, kh = group % kv;
      turn(kd_ptr + ((b * s_len + j * tile) * kv + kh) * h, kv * h, h, tile,
           kt + (group * n + j) * h * tile);
    });
  }
  const Attend a{q.typed_data(), kd_ptr, v.typed_data(), qp, kp, kt, out->typed_data(),
                 b_len, t_len, heads, kv, h, s_len, tile, chunk, window, softcap,
                 offsets.get()};
  const AttendFn attend = path->attend;
  ForEach(pool, parts, items.size(), [&](int64_t i) {
    const Item& item = items[i];
    thread_local std::vector<float> floats;
    thread_local std::vector<uint8_t> saw;
    thread_local std::vector<int64_t> runs;
    const int64_t r = item.rows;
    floats.resize(r * s_len + 3 * r * h + 2 * r + tile + s_len + 2 * h * tile + 1);
    saw.resize(r * n);
    runs.resize(3 * tile);
    float* f = floats.data();
    // l, the tree, the visible flags, the turned keys, the NaN, the tile's keys transposed
    float* rest = f + r * s_len + 3 * r * h;
    const AttendScratch w{f, f + r * s_len, f + r * s_len + r * h, rest,
                          f + r * s_len + 2 * r * h, saw.data(), rest + 2 * r,
                          rest + 2 * r + tile, rest + 2 * r + tile + s_len,
                          rest + 2 * r + tile + s_len + h * tile, runs.data(),
                          rest + 2 * r + tile + s_len + h * tile + 1};
    w.gathered[0] = std::nanf("");
    attend(&a, item.group, item.r0, item.rows, tiles.data() + item.first_tile, item.num_tiles,
           &w);
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

// The matmuls: x, the weight and the count of rows to compute (int32, one element).
static auto MatmulBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>()
      .Attr<int64_t>("chunk")
      .Attr<int64_t>("isa")
      .Attr<int64_t>("parts");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmaSpecMatmul, Matmul, MatmulBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmaSpecMatmulPacked, MatmulPacked, MatmulBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmaSpecScores, Scores,
                              Binding().Attr<int64_t>("chunk").Attr<int64_t>("isa").Attr<int64_t>(
                                  "parts"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmaSpecValues, Values,
                              Binding().Attr<int64_t>("isa").Attr<int64_t>("parts"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmaSpecAttend, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("tile")
                                  .Attr<int64_t>("chunk")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("relative")
                                  .Attr<int64_t>("rotated")
                                  .Attr<float>("rope_scale")
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("parts"));

namespace gemma_spec {

std::shared_ptr<const OffsetTable> Offsets(const float* inverse, int64_t pairs,
                                           int64_t rotated, float scale, int64_t size) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const OffsetTable>> made;
  std::string key(reinterpret_cast<const char*>(inverse), sizeof(float) * pairs);
  key.append(reinterpret_cast<const char*>(&scale), sizeof(scale));
  key += ':' + std::to_string(rotated);
  std::lock_guard<std::mutex> lock(mu);
  auto& table = made[key];
  if (table && table->size >= size) return table;
  auto grown = std::make_shared<OffsetTable>();
  grown->pairs = pairs;
  grown->size = std::max(size, table ? 2 * table->size : size);
  grown->sin.resize((pairs + 1) * grown->size);  // (zeros after the last pair: OffsetTable)
  grown->cos.resize((pairs + 1) * grown->size);
  const float inverse_scale = C(1.0) / scale;
  for (int64_t i = 0; i < pairs; ++i)
    for (int64_t d = 0; d < grown->size; ++d) {
      float angle = Scalar::mul(static_cast<float>(d), inverse[i]);
      if (scale != 1.0f) angle = Scalar::mul(angle, inverse_scale);
      if (i >= rotated) angle = 0.0f;
      SinCos(angle, &grown->sin[grown->at(i, d)], &grown->cos[grown->at(i, d)]);
    }
  table = grown;
  return table;
}

}  // namespace gemma_spec

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
