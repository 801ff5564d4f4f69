// The written arithmetic's attention over the KV cache (docs/determinism.md, "Attention"), whole:
// the tiled algorithm of gemma_jax/tiled_attention.py under the spec, in one kernel.
//
// For a query row r (token t, query head g of KV head k) at position qp and the cache's S slots
// cut into tiles of `tile` slots (slot s at position kp[s], -1 when empty; visible when
// 0 <= kp <= qp and, with a window W, qp - kp < W):
//   1. scores s = q . key per slot, one FMA chain over H per chunk (chains.h), chunks added in
//      order; with a soft-cap c, s = tanh(s * (1 / c)) * c (the spec's tanh);
//   2. per tile, the max over its visible slots (MASKED when it has none: the row did not see
//      the tile); m = the max over tiles;
//   3. p = exp(s - m) (the spec's exp) where visible, else +0;
//   4. per tile, its row sum (a pairwise tree over the tile's slots) and p . v (one FMA chain
//      over the tile's slots, every slot of the tile in order);
//   5. over the tiles the row saw, in slot order: l = l + sum, acc = acc + p . v, from +0;
//   6. out = acc * (1 / l) (1 / 1 for a row that saw nothing: +0 out).
// A tile no row of a work item sees contributes nothing to any of its rows (step 5 adds only
// what a row saw, and its max is the smallest value), so tiles past the context, or outside
// every row's window, are not computed at all: the work follows the context, the bits do not
// follow the cache's size or how many tiles exist.
//
// Every operation is an IEEE binary32 operation in the FP environment of ffi.cc (subnormals
// flushed), written without FMA contraction (-ffp-contract=off): the loops here are plain
// elementwise loops the compiler may vectorize, which changes how many outputs are computed at
// once, never the operations of any one.
#ifndef GEMMA_SPEC_ATTENTION_H_
#define GEMMA_SPEC_ATTENTION_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "chains.h"
#include "constants.h"  // generated from gemma_jax/spec/functions.py (native_build.py)

namespace gemma_spec {

// A constant of gemma_jax/spec/functions.py, rounded as NumPy rounds a Python float to binary32
// (the decimal to binary64, then to binary32), not as a float literal would be.
constexpr float C(double x) { return static_cast<float>(x); }

// The masked score of gemma_jax.numerics.MASKED: exp(MASKED - max) is exactly 0.
constexpr float kMasked = -2.3819763e38f;

// The elementwise functions below are written once over a vector type V (isa.cc; `Scalar` here
// for the portable path and every path's tail): V::T, V::M (a lane mask), kLanes, load, store,
// splat, add, sub, mul, div, min, max, abs, neg, lt, gt, eq (-> M), select(m, a, b) (a where m),
// truncated(x) (x truncated toward zero, |x| < 2^31, as a float) and pow2(n) (2^n for integral n
// in [-126, 127], built from its exponent bits). Each is one IEEE binary32 operation per lane (or
// exact), so a lane computes what the scalar code computes. mul follows the spec's flush rule
// where the hardware's differs (chains.h, Mul), as each path's V does (isa.cc).
struct Scalar {
  using T = float;
  using M = bool;
  static constexpr int kLanes = 1;
  static T load(const float* p) { return *p; }
  static void store(float* p, T v) { *p = v; }
  static T splat(float x) { return x; }
  static T add(T a, T b) { return a + b; }
  static T sub(T a, T b) { return a - b; }
  static T mul(T a, T b) { return Mul(a, b); }
  static T div(T a, T b) { return a / b; }
  static T min(T a, T b) { return b < a ? b : a; }
  static T max(T a, T b) { return a < b ? b : a; }
  static T abs(T a) { return std::fabs(a); }
  static T neg(T a) { return -a; }
  static M lt(T a, T b) { return a < b; }
  static M gt(T a, T b) { return a > b; }
  static M eq(T a, T b) { return a == b; }
  static T select(M m, T a, T b) { return m ? a : b; }
  static T truncated(T x) { return static_cast<float>(static_cast<int32_t>(x)); }
  static T pow2(T n) {
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
  }
};

// floor(x), exactly (a -0 stays -0), for |x| < 2^31.
template <class V>
inline typename V::T Floor(typename V::T x) {
  const auto t = V::truncated(x);
  const auto down = V::sub(t, V::select(V::gt(t, x), V::splat(C(1.0)), V::splat(C(0.0))));
  return V::select(V::eq(x, V::splat(0.0f)), x, down);
}

// ((c0 x + c1) x + c2) ...: a multiply, then an add, per coefficient after the first.
template <class V, int N>
inline typename V::T Horner(const double (&c)[N], typename V::T x) {
  auto p = V::splat(C(c[0]));
  for (int i = 1; i < N; ++i) p = V::add(V::mul(p, x), V::splat(C(c[i])));
  return p;
}


// The spec's exp (gemma_jax.spec.functions.exp).
template <class V>
inline typename V::T Exp(typename V::T x) {
  x = V::max(V::min(x, V::splat(C(kExpHi))), V::splat(C(kExpLo)));
  const auto n = Floor<V>(V::add(V::mul(x, V::splat(C(kLog2e))), V::splat(C(0.5))));
  auto r = V::sub(x, V::mul(n, V::splat(C(kLn2Hi))));
  r = V::sub(r, V::mul(n, V::splat(C(kLn2Lo))));
  auto y = V::mul(Horner<V>(kExpP, r), V::mul(r, r));
  y = V::add(V::add(y, r), V::splat(C(1.0)));
  return V::mul(y, V::pow2(n));
}

// The spec's tanh (gemma_jax.spec.functions.tanh).
template <class V>
inline typename V::T Tanh(typename V::T x) {
  const auto z = V::mul(x, x);
  const auto small = V::add(V::mul(V::mul(Horner<V>(kTanhP, z), z), x), x);
  const auto e = Exp<V>(V::add(V::abs(x), V::abs(x)));
  auto big = V::sub(V::splat(C(1.0)), V::div(V::splat(C(2.0)), V::add(e, V::splat(C(1.0)))));
  big = V::select(V::lt(x, V::splat(C(0.0))), V::neg(big), big);
  return V::select(V::lt(V::abs(x), V::splat(C(kTanhSmall))), small, big);
}

// The spec's sin and cos of one angle (gemma_jax.spec.functions.sin_cos).
inline void SinCos(float angle, float* sin, float* cos) {
  using S = Scalar;
  const float k = Floor<S>(S::add(S::mul(angle, C(kTwoOverPi)), C(0.5)));
  float r = angle;
  for (double part : kPio2Parts) r = S::sub(r, S::mul(k, C(part)));
  const float z = S::mul(r, r);
  const float s = S::add(S::mul(S::mul(Horner<S>(kSinP, z), z), r), r);
  float c = S::mul(S::mul(Horner<S>(kCosP, z), z), z);
  c = S::add(S::sub(c, S::mul(C(0.5), z)), C(1.0));
  switch (static_cast<int32_t>(k) & 3) {  // the quadrant picks signs and which is which
    case 0: *sin = s; *cos = c; break;
    case 1: *sin = c; *cos = S::neg(s); break;
    case 2: *sin = S::neg(s); *cos = S::neg(c); break;
    default: *sin = S::neg(c); *cos = s; break;
  }
}

// The relative RoPE mode's table (gemma_jax.rope.RelativeScores): the sin and cos of the float
// mode's angle of every integer offset d in [0, size) for the `pairs` pairs of a head, the
// angle of pair i fl(d * inverse[i]), times fl(1 / scale) where scale is not 1, and 0 for pairs
// at or past `rotated`. Stored by pair, offsets descending (`at`), so that the slots of a tile,
// whose offsets from one query fall by one per slot, read one run forward.
struct OffsetTable {
  int64_t pairs = 0, size = 0;
  // [pairs, size]: entry (i, size - 1 - d), then `size` zeros, so that a run read for a tile
  // of at most `size` slots stays inside the arrays where its last slots are past the query
  // (negative offsets: slots it does not see, whatever they read).
  std::vector<float> sin, cos;
  int64_t at(int64_t pair, int64_t d) const { return pair * size + (size - 1 - d); }
};

// The table of at least `size` offsets for these angles, made once per process and extended as
// larger offsets are met (a pure function of its key: the same bits whenever it is made).
std::shared_ptr<const OffsetTable> Offsets(const float* inverse, int64_t pairs,
                                           int64_t rotated, float scale, int64_t size);

// f(V, i) over i in [0, n): whole vectors, then the tail one lane at a time.
template <class V, class F>
inline void Lanes(int64_t n, F f) {
  int64_t i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) f(V(), i);
  for (; i < n; ++i) f(Scalar(), i);
}

// One tile's keys, slot c's H values at keys + c * ldk, transposed into out [H, tile] (a slot's
// values down a column), so that a vector lane holds one slot's chain: blocks of kLanes slots by
// kLanes values turned in registers (V::transpose), the edges one value at a time. Values only
// move: no arithmetic, so no bit can depend on how.
template <class V>
inline void TransposeKeys(const float* keys, int64_t ldk, int64_t h, int64_t tile, float* out) {
  constexpr int L = V::kLanes;
  int64_t c0 = 0;
  if constexpr (L > 1) {
    for (; c0 + L <= tile; c0 += L) {
      int64_t d0 = 0;
      for (; d0 + L <= h; d0 += L) {
        typename V::T r[L];
        for (int i = 0; i < L; ++i) r[i] = V::load(keys + (c0 + i) * ldk + d0);
        V::transpose(r);
        for (int i = 0; i < L; ++i) V::store(out + (d0 + i) * tile + c0, r[i]);
      }
      for (; d0 < h; ++d0)
        for (int i = 0; i < L; ++i) out[d0 * tile + c0 + i] = keys[(c0 + i) * ldk + d0];
    }
  }
  for (; c0 < tile; ++c0)
    for (int64_t d = 0; d < h; ++d) out[d * tile + c0] = keys[c0 * ldk + d];
}

// What one call attends: q [B, T, N, H] (scaled), the layer's cache k, v [B, S, K, H] and slot
// positions kpos [B, S], query positions qpos [B, T] (-1: a padding row), into out [B, T, N, H].
// keys_t: the keys of every tile transposed, [B K, S / tile, H, tile] (tiles no row sees may be
// left unwritten), so that a vector lane holds one slot's chain; or null, where each group's
// rows are one work item (a decode step), which then transposes each tile it reads itself, into
// its scratch (AttendScratch::keys: in cache, where the whole call's transposed keys are not).
struct Attend {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* qpos;
  const int32_t* kpos;
  const float* keys_t;
  float* out;
  int64_t batch, tokens, heads, kv_heads, head_dim, slots, tile, chunk;
  int64_t window;  // 0: none
  float softcap;   // 0: none
  // The relative RoPE mode (null: q and k are rotated already, scores are q . k): each slot's
  // key turned back by the angle of its offset from the query, R(-a(qp - kp)) k (an invisible
  // slot by offset 0's), then scored.
  const OffsetTable* offsets;
};

// Per work item: its rows' scores [rows, S] (then p), p . v of one tile [rows, H], and the
// running sums.
struct AttendScratch {
  float* scores;
  float* pv;
  float* acc;
  float* l;
  float* q;
  uint8_t* saw;    // [rows, S / tile]
  float* tree;     // [tile]
  float* visible;  // [S]: 1 where the row sees the slot, else 0
  float* turned;   // [H, tile]: one tile's keys turned for one query position
  float* gathered; // [1]: NaN (the cos and sin of a seen slot's offset past the table)
  int64_t* runs;   // [3 tile]: the runs of a tile's offsets (TurnTile)
  float* keys;     // [H, tile]: one tile's keys transposed, where Attend::keys_t is null
};

inline bool Visible(int32_t qp, int32_t kp, int64_t window) {
  return kp >= 0 && kp <= qp && (window == 0 || qp - kp < window);
}

// s = tanh(s * inverse) * cap over n scores (the spec's soft-cap).
template <class V>
inline void Softcap(float* s, int64_t n, float cap, float inverse) {
  Lanes<V>(n, [&](auto v, int64_t i) {
    using W = decltype(v);
    W::store(s + i, W::mul(Tanh<W>(W::mul(W::load(s + i), W::splat(inverse))), W::splat(cap)));
  });
}

// The max over the visible of n scores (kMasked when none is; visible[i]: 1 or 0), taken lane by
// lane, then across lanes (a max is exact in any order).
template <class V>
inline float VisibleMax(const float* s, const float* visible, int64_t n) {
  auto most = V::splat(kMasked);
  float tail = kMasked;
  Lanes<V>(n, [&](auto v, int64_t i) {
    using W = decltype(v);
    const auto x = W::select(W::gt(W::load(visible + i), W::splat(0.0f)), W::load(s + i),
                             W::splat(kMasked));
    if constexpr (W::kLanes == 1) tail = tail < x ? x : tail;
    else most = W::max(most, x);
  });
  float lanes[V::kLanes];
  V::store(lanes, most);
  for (float x : lanes) tail = tail < x ? x : tail;
  return tail;
}

// s = exp(s - m) where visible, else +0, over n scores.
template <class V>
inline void Probabilities(float* s, const float* visible, int64_t n, float m) {
  Lanes<V>(n, [&](auto v, int64_t i) {
    using W = decltype(v);
    const auto e = Exp<W>(W::sub(W::load(s + i), W::splat(m)));
    W::store(s + i, W::select(W::gt(W::load(visible + i), W::splat(0.0f)), e, W::splat(0.0f)));
  });
}

// The pairwise tree sum of gemma_jax.numerics.tree_sum over x[0 .. n) (n >= 1), in `tree`.
inline float TreeSum(const float* x, int64_t n, float* tree) {
  std::memcpy(tree, x, sizeof(float) * n);
  while (n > 1) {
    const int64_t h = n / 2;
    for (int64_t i = 0; i < h; ++i) tree[i] = tree[i] + tree[h + i];
    if (n % 2) tree[h] = tree[2 * h];  // the odd element rides along
    n = h + n % 2;
  }
  return tree[0];
}

// Whether any row with a position in [qlo, qhi] may see a slot of a tile whose non-empty slots'
// positions lie in [klo, khi] (klo > khi: the tile is empty). False only where none can.
inline bool MaySee(int32_t qlo, int32_t qhi, int32_t klo, int32_t khi, int64_t window) {
  if (klo > khi || qlo > qhi || klo > qhi) return false;
  return window == 0 || static_cast<int64_t>(qlo) - khi < window;
}

// The keys of one tile (keys_t [H, tile]) turned for a query at position qp, into turned
// [H, tile] (consecutive: whether kp[c] = kp[0] + c for every c): every slot c the row sees, at
// offset d = qp - kp[c] (an offset past the cache's S slots reads NaN, as the XLA formulation
// does), pair i of its key (k1, k2) = (key[i], key[i + H/2]) with (c, s) the table's cos and sin
// at d and s' = -s:
//   turned[i] = k1 c - k2 s',  turned[i + H/2] = k2 c + k1 s'  (each product rounded).
// (The XLA formulation turns the slots a row does not see by offset 0: their scores are masked
// either way, so they are not turned here.)
template <class V>
inline void TurnTile(const Attend& a, const float* keys_t, const int32_t* kp, bool consecutive,
                     int32_t qp, const AttendScratch& w) {
  const OffsetTable& table = *a.offsets;
  const int64_t tile = a.tile, half = a.head_dim / 2, slots = a.slots;
  // The slots the row sees, as runs whose offsets fall by one per slot (a tile the context
  // fills is one run; a ring's oldest and newest, two): a run reads the table (offsets
  // descending) as one forward run from its first slot's offset. A slot the row does not see
  // is not turned: its turned key is whatever the buffer holds, and its score is masked. A seen
  // slot at an offset past the cache's S slots reads NaN, as the XLA formulation's table does.
  int64_t* runs = w.runs;  // (first slot, end, first slot's offset; -1: NaN) per run
  int64_t count = 0;
  // A tile of consecutive positions (the usual case): the seen slots are one range, found in
  // constant time.
  if (consecutive && static_cast<int64_t>(qp) - kp[0] < slots) {
    // Seen: kp[0] + c <= qp and, with a window W, qp - (kp[0] + c) < W.
    const int64_t hi = std::min<int64_t>(tile, static_cast<int64_t>(qp) - kp[0] + 1);
    const int64_t lo = a.window == 0 ? 0 : std::max<int64_t>(
        0, static_cast<int64_t>(qp) - kp[0] - a.window + 1);
    if (lo < hi) {
      runs[0] = lo, runs[1] = hi, runs[2] = static_cast<int64_t>(qp) - kp[0] - lo;
      count = 1;
    }
  }
  for (int64_t c = 0; c < tile && !consecutive;) {
    if (!Visible(qp, kp[c], a.window)) {
      ++c;
      continue;
    }
    const int64_t d = static_cast<int64_t>(qp) - kp[c];
    int64_t e = c + 1;
    if (d < slots) {
      while (e < tile && Visible(qp, kp[e], a.window) &&
             static_cast<int64_t>(qp) - kp[e] == d - (e - c)) ++e;
    }
    runs[3 * count] = c, runs[3 * count + 1] = e, runs[3 * count + 2] = d < slots ? d : -1;
    ++count;
    c = e;
  }
  for (int64_t i = 0; i < half; ++i) {
    const float* k1 = keys_t + i * tile;
    const float* k2 = keys_t + (i + half) * tile;
    float* t1 = w.turned + i * tile;
    float* t2 = w.turned + (i + half) * tile;
    for (int64_t r = 0; r < count; ++r) {
      const int64_t c0 = runs[3 * r], length = runs[3 * r + 1] - c0, d = runs[3 * r + 2];
      // The run's cos and sin, slot c0 + j at entry j (NaN for a slot past the table).
      const float* cos = d >= 0 ? table.cos.data() + table.at(i, d) : w.gathered;
      const float* sin = d >= 0 ? table.sin.data() + table.at(i, d) : w.gathered;
      Lanes<V>(length, [&](auto v, int64_t j) {
        using W = decltype(v);
        const int64_t c = c0 + j;
        // k1 c - k2 (-s) and k2 c + k1 (-s), the rotation by -a: a product with -s is the
        // product with s negated, and subtracting a negated value is adding it, bit for bit.
        const auto x1 = W::load(k1 + c), x2 = W::load(k2 + c);
        const auto co = W::load(cos + j), si = W::load(sin + j);
        W::store(t1 + c, W::add(W::mul(x1, co), W::mul(x2, si)));
        W::store(t2 + c, W::sub(W::mul(x2, co), W::mul(x1, si)));
      });
    }
  }
}

// The scores of rows against one tile's keys turned for a query at position qp, the turning
// fused into the score chains (no turned tile is written and read back): for a tile of
// consecutive positions kp[c] = kp0 + c whose seen slots are one run [lo, hi) at offsets
// d = qp - kp0 - c (TurnTile's usual case), the turned key of slot c, term k, is computed where
// the chain needs it, with the operations and roundings TurnTile writes, then chained as Panel
// chains it. Slot c reads the table at cos + c (a run from the first seen slot's entry), so the
// slots outside [lo, hi), which no row here sees, read other finite entries of the table, and
// their scores, masked, are whatever they come to (as TurnTile leaves them). `cos`, `sin`: the
// table's entries of pair 0 at slot 0 (pair i at + i * size).
struct TurnedTile {
  const float* keys_t;  // [H, tile]
  const float* cos;
  const float* sin;
  int64_t size, half, tile;
};

// Term k of the turned keys of slots [c, c + lanes): pair i = k mod H/2, (k1, k2) its two
// halves, k1 c - k2 (-s) for k < H/2, k2 c + k1 (-s) past it (each product rounded; TurnTile).
template <class W>
inline typename W::T TurnedTerm(const TurnedTile& t, int64_t k, int64_t c) {
  const int64_t i = k < t.half ? k : k - t.half;
  const auto x1 = W::load(t.keys_t + i * t.tile + c);
  const auto x2 = W::load(t.keys_t + (i + t.half) * t.tile + c);
  const auto co = W::load(t.cos + i * t.size + c), si = W::load(t.sin + i * t.size + c);
  return k < t.half ? W::add(W::mul(x1, co), W::mul(x2, si))
                    : W::sub(W::mul(x2, co), W::mul(x1, si));
}

// Panel's Tile with B the turned keys: MR rows by NV vectors of slots, one chunk at a time. A
// pair's two terms come from the same four loads (its key halves, cos and sin): term i < H/2 is
// chained where it is made and term i + H/2 waits in `second` (half x NV vectors, in L1) until
// the chains reach it (every term below H/2 comes first, whatever the chunks).
template <class V, int MR, int NV>
inline void TurnedScoresTile(const Problem& p, const TurnedTile& t, int64_t row0, int64_t col0,
                             float* second) {
  using T = typename V::T;
  const float* a = p.a + row0 * p.lda;
  float* o = p.o + row0 * p.ldo + col0;
  for (int64_t k0 = 0; k0 < p.terms; k0 += p.chunk) {
    T acc[MR][NV];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NV; ++j) acc[i][j] = V::zero();
    for (int64_t k = k0; k < k0 + p.chunk; ++k) {
      T bv[NV];
      if (k < t.half) {
        for (int j = 0; j < NV; ++j) {
          const int64_t c = col0 + j * V::kLanes;
          const auto x1 = V::load(t.keys_t + k * t.tile + c);
          const auto x2 = V::load(t.keys_t + (k + t.half) * t.tile + c);
          const auto co = V::load(t.cos + k * t.size + c), si = V::load(t.sin + k * t.size + c);
          bv[j] = V::add(V::mul(x1, co), V::mul(x2, si));  // TurnedTerm's, term k
          V::store(second + (k * NV + j) * V::kLanes,
                   V::sub(V::mul(x2, co), V::mul(x1, si)));  // term k + H/2
        }
      } else {
        for (int j = 0; j < NV; ++j) bv[j] = V::load(second + ((k - t.half) * NV + j) * V::kLanes);
      }
      for (int i = 0; i < MR; ++i) {
        const T av = V::splat(a[i * p.lda + k]);
        for (int j = 0; j < NV; ++j) acc[i][j] = V::fma(av, bv[j], acc[i][j]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NV; ++j) {
        float* out = o + i * p.ldo + j * V::kLanes;
        V::store(out, k0 == 0 ? acc[i][j] : V::add(V::load(out), acc[i][j]));
      }
  }
}

template <class V, int NV>
inline void TurnedScoresRows(const Problem& p, const TurnedTile& t, int64_t rows, int64_t col0,
                             float* second) {
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) TurnedScoresTile<V, 4, NV>(p, t, i, col0, second);
  for (; i + 2 <= rows; i += 2) TurnedScoresTile<V, 2, NV>(p, t, i, col0, second);
  for (; i < rows; ++i) TurnedScoresTile<V, 1, NV>(p, t, i, col0, second);
}

// Panel(p, 0, rows, 0, tile) on the turned keys: vectors of slots, then the tail slot by slot
// (ScalarColumn's chains, the term turned by Scalar's operations: the same roundings). second:
// scratch of H/2 x kVectors x kLanes floats.
template <class V>
inline void TurnedScores(const Problem& p, const TurnedTile& t, int64_t rows, float* second) {
  constexpr int NV = V::kVectors;
  int64_t c = 0;
  for (; c + NV * V::kLanes <= t.tile; c += NV * V::kLanes)
    TurnedScoresRows<V, NV>(p, t, rows, c, second);
  for (; c + V::kLanes <= t.tile; c += V::kLanes) TurnedScoresRows<V, 1>(p, t, rows, c, second);
  for (; c < t.tile; ++c)
    for (int64_t i = 0; i < rows; ++i) {
      float out = 0.0f;
      for (int64_t k0 = 0; k0 < p.terms; k0 += p.chunk) {
        float acc = 0.0f;
        for (int64_t k = k0; k < k0 + p.chunk; ++k)
          acc = Fma(p.a[i * p.lda + k], TurnedTerm<Scalar>(t, k, c), acc);
        out = k0 == 0 ? acc : out + acc;
      }
      p.o[i * p.ldo + c] = out;
    }
}

// Rows [r0, r0 + rows) of group g = b K + k (row r: token r / G, query head k G + r % G).
// tiles: the tiles some of these rows may see, ascending (the others hold nothing they see).
template <class V>
inline void AttendRows(const Attend& a, int64_t group, int64_t r0, int64_t rows,
                       const int64_t* tiles, int64_t num_tiles, const AttendScratch& w) {
  const int64_t b = group / a.kv_heads, kh = group % a.kv_heads;
  const int64_t g = a.heads / a.kv_heads, h = a.head_dim, tile = a.tile, s_len = a.slots;
  const int64_t n = s_len / tile;
  const int32_t* kpos = a.kpos + b * s_len;
  auto row_of = [&](int64_t i) {  // (token, offset of the row's q and out)
    const int64_t r = r0 + i, t = r / g;
    return std::pair<int64_t, int64_t>(t, ((b * a.tokens + t) * a.heads + kh * g + r % g) * h);
  };
  for (int64_t i = 0; i < rows; ++i)
    std::memcpy(w.q + i * h, a.q + row_of(i).second, sizeof(float) * h);
  // 1. Scores of every tile these rows may see (relative: each token's G rows against the
  // tile's keys turned for its position; rows come whole tokens at a time).
  for (int64_t j = 0; j < num_tiles; ++j) {
    const int64_t tj = tiles[j];
    const float* keys = w.keys;
    if (a.keys_t != nullptr)
      keys = a.keys_t + (group * n + tj) * h * tile;
    else
      TransposeKeys<V>(a.k + ((b * s_len + tj * tile) * a.kv_heads + kh) * h, a.kv_heads * h, h,
                       tile, w.keys);
    if (a.offsets == nullptr) {
      Problem p{w.q, h, keys, tile, w.scores + tj * tile, s_len, rows, h, tile, a.chunk};
      Panel<V, V::kVectors>(p, 0, rows, 0, tile);
      continue;
    }
    // Whether the tile's slots hold consecutive positions, once for all its rows' turns.
    const int32_t* kp = kpos + tj * tile;
    bool consecutive = kp[0] >= 0;
    for (int64_t c = 1; consecutive && c < tile; ++c) consecutive = kp[c] == kp[0] + c;
    for (int64_t i = 0; i < rows; i += g) {
      const int32_t qp = a.qpos[b * a.tokens + row_of(i).first];
      const int64_t d0 = static_cast<int64_t>(qp) - kp[0];  // slot 0's offset
      // The usual case, fused (TurnedScores): consecutive slots whose seen ones are one run of
      // offsets inside the table (TurnTile's first case, with at least one seen slot).
      const int64_t lo = a.window == 0 ? 0 : std::max<int64_t>(0, d0 - a.window + 1);
      if (consecutive && d0 >= 0 && d0 < s_len && lo < std::min<int64_t>(tile, d0 + 1)) {
        const OffsetTable& table = *a.offsets;
        const int64_t first = table.at(0, d0 - lo) - lo;  // slot c reads entry first + c
        const TurnedTile t{keys, table.cos.data() + first, table.sin.data() + first, table.size,
                           h / 2, tile};
        Problem p{w.q + i * h, h, nullptr, tile, w.scores + i * s_len + tj * tile, s_len,
                  g, h, tile, a.chunk};
        TurnedScores<V>(p, t, g, w.turned);  // (the turned tile's scratch, unused here)
        continue;
      }
      TurnTile<V>(a, keys, kp, consecutive, qp, w);
      Problem p{w.q + i * h, h, w.turned, tile, w.scores + i * s_len + tj * tile, s_len,
                g, h, tile, a.chunk};
      Panel<V, V::kVectors>(p, 0, g, 0, tile);
    }
  }
  if (a.softcap != 0.0f) {
    const float cap = a.softcap, inverse = C(1.0) / cap;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < num_tiles; ++j)
        Softcap<V>(w.scores + i * s_len + tiles[j] * tile, tile, cap, inverse);
  }
  // 2-3. Each row's max over what it sees, then p.
  for (int64_t i = 0; i < rows; ++i) {
    const int32_t qp = a.qpos[b * a.tokens + row_of(i).first];
    float* s_row = w.scores + i * s_len;
    uint8_t* saw = w.saw + i * n;
    float m = kMasked;
    for (int64_t j = 0; j < num_tiles; ++j) {
      const int64_t base = tiles[j] * tile;
      for (int64_t c = 0; c < tile; ++c)
        w.visible[base + c] = Visible(qp, kpos[base + c], a.window) ? 1.0f : 0.0f;
      const float most = VisibleMax<V>(s_row + base, w.visible + base, tile);
      saw[tiles[j]] = most > kMasked;
      m = m < most ? most : m;
    }
    for (int64_t j = 0; j < num_tiles; ++j) {
      const int64_t base = tiles[j] * tile;
      Probabilities<V>(s_row + base, w.visible + base, tile, m);
    }
    w.l[i] = 0.0f;
    std::fill(w.acc + i * h, w.acc + (i + 1) * h, 0.0f);
  }
  // 4-5. Tile after tile, in slot order: its row sums and p . v, added where the row saw it.
  for (int64_t j = 0; j < num_tiles; ++j) {
    const int64_t tj = tiles[j];
    Problem p{w.scores + tj * tile, s_len, a.v + ((b * s_len + tj * tile) * a.kv_heads + kh) * h,
              a.kv_heads * h, w.pv, h, rows, tile, h, tile};
    Panel<V, V::kVectors>(p, 0, rows, 0, h);
    for (int64_t i = 0; i < rows; ++i) {
      if (!w.saw[i * n + tj]) continue;
      w.l[i] = w.l[i] + TreeSum(w.scores + i * s_len + tj * tile, tile, w.tree);
      float* acc = w.acc + i * h;
      const float* pv = w.pv + i * h;
      for (int64_t c = 0; c < h; ++c) acc[c] = acc[c] + pv[c];
    }
  }
  // 6. 1 / l once per row, then a multiply.
  for (int64_t i = 0; i < rows; ++i) {
    const float inverse = C(1.0) / (w.l[i] > 0.0f ? w.l[i] : C(1.0));
    float* out = a.out + row_of(i).second;
    const float* acc = w.acc + i * h;
    for (int64_t c = 0; c < h; ++c) out[c] = Scalar::mul(acc[c], inverse);
  }
}

}  // namespace gemma_spec

#endif  // GEMMA_SPEC_ATTENTION_H_
