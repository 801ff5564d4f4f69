// The written arithmetic's contractions (docs/determinism.md, spec version 1) as native loops.
//
// Every output is computed as the spec writes it: for each contraction chunk of C terms, the
// chain acc = fma(a[k], b[k], acc) for k in order from acc = +0, one rounding per FMA; the chunk
// results added in chunk order (the first chunk's result is taken as it is, not added to +0,
// which would turn a -0 into +0). Three rules make the bits independent of the machine:
//   - each output's chain runs k in order, inside one vector lane or one scalar register;
//   - vector lanes only ever hold independent outputs (columns n), never parts of one sum;
//   - work is split over rows and columns, never over a contraction.
// So the instruction set (vector width) and the thread count change how many outputs are
// computed at once, never the operations of any one output. Subnormal inputs read as zero and
// subnormal results are flushed (the caller sets the FP environment: MXCSR FTZ and DAZ on x86,
// FPCR.FZ on aarch64; see ffi.cc).
//
// This header is compiled once per instruction set (isa_*.cc), each with its own vector type V:
//   V::T, V::kLanes, zero(), load(p), store(p, v), splat(x), fma(a, b, c) (a * b + c rounded
//   once), add(a, b).
#ifndef GEMMA_SPEC_CHAINS_H_
#define GEMMA_SPEC_CHAINS_H_

#include <cmath>
#include <cstdint>

namespace gemma_spec {

// The flush rule. The spec flushes a result that is tiny *after* rounding (rounded to 24 bits
// with an unbounded exponent, below 2^-126): x86's MXCSR.FTZ. Arm's FPCR.FZ flushes a result that
// is tiny *before* rounding, so a result that rounds up to 2^-126 from below (exact magnitude in
// [2^-126 - 2^-151, 2^-126)) is 0 there, 2^-126 in the spec. Products and FMAs can land there; a
// quotient of binary32 numbers cannot (a / b = 2^-126 (1 - e) needs a = 2^-126 b (1 - e), and a's
// significand puts e >= 2^-24), nor can a sum (exact where it is below 2^-126), so divisions and
// additions follow the spec under either rule. Where the hardware's rule is Arm's, a product or
// FMA r = op(a, b[, c]) is decided again at a scaled exponent: s = the same operation on a and c
// scaled by 2^24 (exactly), which rounds the exact result times 2^24 at 24 bits in the normal
// range. Where |s| < 2^-101 the spec's result is s 2^-24 (an exact scaling: 2^-126 where the
// rounded result is, a zero of its sign where it is tiny); elsewhere it is r: |s| >= 2^-101 is a
// result of 2^-125 or more, and s is +-inf or NaN only where a scaled operand overflowed, which
// a result below 2^-125 cannot have (its operands are below 2^104 where it is not exactly 0).
// Subnormal inputs read as zero either way (FZ does so).
#if defined(__aarch64__)
constexpr bool kFlushBeforeRounding = true;
#else
constexpr bool kFlushBeforeRounding = false;
#endif
constexpr float kScale = 0x1p24f, kUnscale = 0x1p-24f, kSmall = 0x1p-101f;

inline float SpecRounded(float r, float s) { return std::fabs(s) < kSmall ? s * kUnscale : r; }

// a * b + c rounded once, and a * b, by the spec's flush rule.
inline float Fma(float a, float b, float c) {
  if constexpr (!kFlushBeforeRounding) return std::fma(a, b, c);
  return SpecRounded(std::fma(a, b, c), std::fma(a * kScale, b, c * kScale));
}

inline float Mul(float a, float b) {
  if constexpr (!kFlushBeforeRounding) return a * b;
  return SpecRounded(a * b, (a * kScale) * b);
}

// A [rows x terms] (row stride lda) times B [terms x cols] (row stride ldb, columns contiguous)
// into O [rows x cols] (row stride ldo), over chunks of `chunk` terms (terms % chunk == 0).
struct Problem {
  const float* a;
  int64_t lda;
  const float* b;
  int64_t ldb;
  float* o;
  int64_t ldo;
  int64_t rows, terms, cols, chunk;
};

// One output column, one scalar chain per row: the vector paths' column tail. (A template on the
// path's V so that each instruction set's copy stays its own: see isa.cc.)
template <class V>
inline void ScalarColumn(const Problem& p, int64_t row0, int64_t rows, int64_t col) {
  for (int64_t i = row0; i < row0 + rows; ++i) {
    const float* a = p.a + i * p.lda;
    float out = 0.0f;
    for (int64_t k0 = 0; k0 < p.terms; k0 += p.chunk) {
      float acc = 0.0f;
      for (int64_t k = k0; k < k0 + p.chunk; ++k) acc = Fma(a[k], p.b[k * p.ldb + col], acc);
      out = k0 == 0 ? acc : out + acc;
    }
    p.o[i * p.ldo + col] = out;
  }
}

// B's rows fetched ahead of the chains that read them, by the first row group of a panel's chunk
// (below): while the other groups chain the chunk from cache, the next rows are on their way
// from memory. A hint only: it reads no value into any output.
constexpr int64_t kAheadRows = 32;

// MR rows by NV vectors of outputs over one chunk [k0, k0 + chunk), held in registers, then
// stored (the first chunk) or added to the chunks before it. With `ahead`, each term's B row
// kAheadRows terms on is prefetched.
template <class V, int MR, int NV>
inline void Tile(const Problem& p, int64_t row0, int64_t col0, int64_t k0, bool ahead) {
  using T = typename V::T;
  const float* a = p.a + row0 * p.lda;
  float* o = p.o + row0 * p.ldo + col0;
  T acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = V::zero();
  const float* b = p.b + k0 * p.ldb + col0;
  const int64_t later = kAheadRows * p.ldb;
  for (int64_t k = k0; k < k0 + p.chunk; ++k, b += p.ldb) {
    if (ahead)
      for (int j = 0; j < NV; ++j) __builtin_prefetch(b + later + j * V::kLanes);
    T bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = V::load(b + j * V::kLanes);
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

// Rows [row0, row0 + rows) by NV vectors of columns from col0: chunk after chunk, every row group
// over the chunk while its B rows are in cache (each output's chain is its own: the order of
// the groups moves no bit).
template <class V, int NV>
inline void Rows(const Problem& p, int64_t row0, int64_t rows, int64_t col0) {
  constexpr int kRows = 4;
  for (int64_t k0 = 0; k0 < p.terms; k0 += p.chunk) {
    int64_t i = row0;
    bool ahead = true;
    for (; i + kRows <= row0 + rows; i += kRows, ahead = false)
      Tile<V, kRows, NV>(p, i, col0, k0, ahead);
    for (; i + 2 <= row0 + rows; i += 2, ahead = false) Tile<V, 2, NV>(p, i, col0, k0, ahead);
    for (; i < row0 + rows; ++i, ahead = false) Tile<V, 1, NV>(p, i, col0, k0, ahead);
  }
}

// The columns of a panel [col0, col0 + width) of rows [row0, row0 + rows).
template <class V, int NV>
inline void Panel(const Problem& p, int64_t row0, int64_t rows, int64_t col0, int64_t width) {
  int64_t c = col0;
  const int64_t end = col0 + width;
  for (; c + NV * V::kLanes <= end; c += NV * V::kLanes) Rows<V, NV>(p, row0, rows, c);
  for (; c + V::kLanes <= end; c += V::kLanes) Rows<V, 1>(p, row0, rows, c);
  for (; c < end; ++c) ScalarColumn<V>(p, row0, rows, c);
}

// kUnroll consecutive terms [k, k + kUnroll) of the chains of rows [row0, row0 + MR), columns
// [col0, col0 + vectors * kLanes), waiting in `part` (row stride `width`) between calls.
template <class V, int MR, int kUnroll>
inline void StreamTerms(const Problem& p, int64_t row0, int64_t k, bool first, int64_t col0,
                        int64_t vectors, float* part, int64_t width) {
  using T = typename V::T;
  T av[MR][kUnroll];  // the rows' terms, splatted once for every column
  for (int i = 0; i < MR; ++i)
    for (int t = 0; t < kUnroll; ++t) av[i][t] = V::splat(p.a[(row0 + i) * p.lda + k + t]);
  const float* b = p.b + k * p.ldb + col0;
  for (int64_t j = 0; j < vectors; ++j) {
    T bv[kUnroll];
    for (int t = 0; t < kUnroll; ++t) bv[t] = V::load(b + t * p.ldb + j * V::kLanes);
    for (int i = 0; i < MR; ++i) {
      float* c = part + i * width + j * V::kLanes;
      T acc = first ? V::zero() : V::load(c);
      for (int t = 0; t < kUnroll; ++t) acc = V::fma(av[i][t], bv[t], acc);
      V::store(c, acc);
    }
  }
}

template <class V, int kUnroll>
inline void StreamRows(const Problem& p, int64_t row0, int64_t rows, int64_t k, bool first,
                       int64_t col0, int64_t vectors, float* part, int64_t width) {
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4)
    StreamTerms<V, 4, kUnroll>(p, row0 + i, k, first, col0, vectors, part + i * width, width);
  for (; i < rows; ++i)
    StreamTerms<V, 1, kUnroll>(p, row0 + i, k, first, col0, vectors, part + i * width, width);
}

// The same outputs for few rows (decode steps, batch slots, logits): B is read row by row, each
// row's [col0, col0 + width) contiguous (a long run the hardware prefetches, where a register tile
// walking down a column panel touches a new page per term), and the chains wait in `part`
// [rows x width] between groups of 4 terms, taken in order.
template <class V>
inline void Stream(const Problem& p, int64_t row0, int64_t rows, int64_t col0, int64_t width,
                   float* part) {
  const int64_t vectors = width / V::kLanes, vcols = vectors * V::kLanes;
  for (int64_t k0 = 0; k0 < p.terms; k0 += p.chunk) {
    const int64_t k1 = k0 + p.chunk;
    int64_t k = k0;
    for (; k + 4 <= k1; k += 4)
      StreamRows<V, 4>(p, row0, rows, k, k == k0, col0, vectors, part, width);
    for (; k < k1; ++k)  // the chunk's last terms when it is not a multiple of 4
      StreamRows<V, 1>(p, row0, rows, k, k == k0, col0, vectors, part, width);
    for (int64_t i = 0; i < rows; ++i) {
      float* out = p.o + (row0 + i) * p.ldo + col0;
      const float* c = part + i * width;
      for (int64_t j = 0; j < vcols; j += V::kLanes)
        V::store(out + j, k0 == 0 ? V::load(c + j) : V::add(V::load(out + j), V::load(c + j)));
    }
  }
  for (int64_t c = col0 + vcols; c < col0 + width; ++c) ScalarColumn<V>(p, row0, rows, c);
}

}  // namespace gemma_spec

#endif  // GEMMA_SPEC_CHAINS_H_
