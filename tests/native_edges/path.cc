// One instruction-set path of the native kernels (gemma_jax/kernels/csrc/isa.cc, compiled with
// the same -DGEMMA_SPEC_ISA_<path>=1 and flags) and an entry that runs one case of
// tests/test_native_edges.py on it: its elementwise operations (multiply, divide, FMA, the
// spec's exp and tanh, lane by lane through the path's vectors and the scalar tail), or its
// panel, stream or attention entry point.
#include <cstring>
#include <type_traits>
#include <vector>

#include "isa.cc"

namespace {

// op(a, b, c) over n values: whole vectors of W, then the tail with gemma_spec::Scalar.
template <class W>
void Ops(int64_t op, const float* a, const float* b, const float* c, float* out, int64_t n) {
  gemma_spec::Lanes<W>(n, [&](auto lanes, int64_t i) {
    using X = decltype(lanes);
    const auto x = X::load(a + i), y = X::load(b + i), z = X::load(c + i);
    typename X::T r;
    switch (op) {
      case 0: r = X::mul(x, y); break;
      case 1: r = X::div(x, y); break;
      case 2:
        if constexpr (std::is_same_v<X, gemma_spec::Scalar>) r = gemma_spec::Fma(x, y, z);
        else r = X::fma(x, y, z);
        break;
      case 3: r = gemma_spec::Exp<X>(x); break;
      default: r = gemma_spec::Tanh<X>(x); break;
    }
    X::store(out + i, r);
  });
}

}  // namespace

// kind 0: ops (ints: op; floats: a, b, c of n each); 1, 2: x [rows, terms] @ w [terms, cols] by
// the panel or the stream entry (ints: rows, terms, cols, chunk); 3: attention (ints: B, T, N,
// K, H, S, tile, chunk, window, query positions [B, T], slot positions [B, S]; floats: soft-cap,
// q [B, T, N, H], k, v [B, S, K, H]) on keys transposed here by the path's transposition; 4: the
// same attention where each work item transposes the tiles it reads itself (a decode step's
// way: Attend::keys_t null). Writes the case's outputs to out.
extern "C" void GEMMA_SPEC_CAT(edge_case_, GEMMA_SPEC_NAME)(int64_t kind, const int64_t* ints,
                                                          const float* floats, int64_t n_out,
                                                          float* out) {
  if (kind == 0) {
    const int64_t n = n_out;
    GEMMA_SPEC_RUN(Ops<W>(ints[0], floats, floats + n, floats + 2 * n, out, n));
  } else if (kind == 1 || kind == 2) {
    const int64_t rows = ints[0], terms = ints[1], cols = ints[2], chunk = ints[3];
    const gemma_spec::Problem p{floats, terms, floats + rows * terms, cols, out, cols,
                                rows, terms, cols, chunk};
    if (kind == 1) {
      GEMMA_SPEC_CAT(gemma_spec_panel_, GEMMA_SPEC_NAME)(&p, 0, rows, 0, cols);
    } else {
      std::vector<float> part(rows * cols);
      GEMMA_SPEC_CAT(gemma_spec_stream_, GEMMA_SPEC_NAME)(&p, 0, rows, 0, cols, part.data());
    }
  } else {
    const int64_t b_len = ints[0], t_len = ints[1], heads = ints[2], kv = ints[3], h = ints[4],
                  s_len = ints[5], tile = ints[6], chunk = ints[7], window = ints[8];
    std::vector<int32_t> qpos(ints + 9, ints + 9 + b_len * t_len);
    std::vector<int32_t> kpos(ints + 9 + b_len * t_len, ints + 9 + b_len * t_len + b_len * s_len);
    const float* q = floats + 1;
    const float* k = q + b_len * t_len * heads * h;
    const float* v = k + b_len * s_len * kv * h;
    const int64_t n = s_len / tile, groups = b_len * kv, rows = t_len * (heads / kv);
    std::vector<float> keys_t(groups * n * h * tile);  // [groups, n, H, tile]
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t j = 0; j < n; ++j)
        GEMMA_SPEC_CAT(gemma_spec_transpose_, GEMMA_SPEC_NAME)(
            k + ((g / kv * s_len + j * tile) * kv + g % kv) * h, kv * h, h, tile,
            keys_t.data() + (g * n + j) * h * tile);
    gemma_spec::Attend a{};
    a.q = q, a.k = k, a.v = v, a.qpos = qpos.data(), a.kpos = kpos.data();
    a.keys_t = kind == 4 ? nullptr : keys_t.data();
    a.out = out, a.batch = b_len, a.tokens = t_len, a.heads = heads;
    a.kv_heads = kv, a.head_dim = h, a.slots = s_len, a.tile = tile, a.chunk = chunk;
    a.window = window, a.softcap = floats[0];
    std::vector<int64_t> tiles(n);  // every tile (one no row sees contributes nothing)
    for (int64_t j = 0; j < n; ++j) tiles[j] = j;
    constexpr int64_t kRows = 32;  // rows per work item, as ffi.cc's kAttendRows
    std::vector<float> f(kRows * s_len + 3 * kRows * h + 2 * kRows + tile + s_len + h * tile);
    std::vector<uint8_t> saw(kRows * n);
    float* rest = f.data() + kRows * s_len + 3 * kRows * h;
    gemma_spec::AttendScratch w{f.data(), f.data() + kRows * s_len,
                                f.data() + kRows * s_len + kRows * h, rest,
                                f.data() + kRows * s_len + 2 * kRows * h, saw.data(),
                                rest + 2 * kRows, rest + 2 * kRows + tile};
    w.keys = rest + 2 * kRows + tile + s_len;  // [H, tile]: a tile transposed (kind 4)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t r0 = 0; r0 < rows; r0 += kRows)
        GEMMA_SPEC_CAT(gemma_spec_attend_, GEMMA_SPEC_NAME)(
            &a, g, r0, std::min(kRows, rows - r0), tiles.data(), n, &w);
  }
}
