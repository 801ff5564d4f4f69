// The native kernels' edge cases on every path this CPU runs (tests/test_native_edges.py writes
// the cases and compares the outputs with the spec's interpreter). In the FP environment of the
// kernels (ffi.cc's FlushScope): MXCSR FTZ and DAZ on x86, FPCR.FZ on aarch64.
//
//   driver CASES OUT     prints the paths run, one per line; writes every path's outputs of
//                        every case, in order, as float32 to OUT
//   driver --fmaf        (x86) where fmaf resolves (glibc picks a routine per CPU: with FMA
//                        one instruction, without a software routine) and its first bytes
//
// CASES: records of int64 kind, ints, floats, outputs (counts), then the ints (int64) and the
// floats (float32) (path.cc says what each kind holds).
#include <cstdint>
#include <cstdio>
#include <vector>

#if defined(__x86_64__)
#include <dlfcn.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#endif

#define GEMMA_EDGE_DECLARE(isa) \
  extern "C" void edge_case_##isa(int64_t, const int64_t*, const float*, int64_t, float*);
GEMMA_EDGE_DECLARE(portable)
#if defined(__x86_64__)
GEMMA_EDGE_DECLARE(avx2)
GEMMA_EDGE_DECLARE(avx512)
#else
GEMMA_EDGE_DECLARE(neon)
#endif

using CaseFn = void (*)(int64_t, const int64_t*, const float*, int64_t, float*);

struct Case {
  int64_t kind;
  std::vector<int64_t> ints;
  std::vector<float> floats;
  int64_t n_out;
};

int main(int argc, char** argv) {
#if defined(__x86_64__)
  if (argc == 2 && std::strcmp(argv[1], "--fmaf") == 0) {
    float (*volatile f)(float, float, float) = fmaf;
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(f), &info)) return 1;
    const unsigned char* code = reinterpret_cast<const unsigned char*>(f);
    std::printf("%s+%#lx %02x%02x%02x%02x\n", info.dli_fname,
                static_cast<unsigned long>(reinterpret_cast<uintptr_t>(f) -
                                           reinterpret_cast<uintptr_t>(info.dli_fbase)),
                code[0], code[1], code[2], code[3]);
    return 0;
  }
#endif
  if (argc != 3) {
    std::fprintf(stderr, "usage: driver CASES OUT\n");
    return 2;
  }
#if defined(__x86_64__)
  _mm_setcsr((_mm_getcsr() & ~0x6000u) | 0x8040u);  // FTZ | DAZ, round to nearest
#elif defined(__aarch64__)
  uint64_t fpcr;
  __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
  fpcr = (fpcr & ~(uint64_t{3} << 22)) | (uint64_t{1} << 24);  // FZ, round to nearest
  __asm__ volatile("msr fpcr, %0" : : "r"(fpcr));
#endif
  std::FILE* in = std::fopen(argv[1], "rb");
  if (!in) {
    std::fprintf(stderr, "error: cannot read %s\n", argv[1]);
    return 2;
  }
  std::vector<Case> cases;
  for (int64_t head[4]; std::fread(head, sizeof(int64_t), 4, in) == 4;) {
    Case c{head[0], std::vector<int64_t>(head[1]), std::vector<float>(head[2]), head[3]};
    if (std::fread(c.ints.data(), sizeof(int64_t), head[1], in) != size_t(head[1]) ||
        std::fread(c.floats.data(), sizeof(float), head[2], in) != size_t(head[2])) {
      std::fprintf(stderr, "error: %s ends inside a case\n", argv[1]);
      return 2;
    }
    cases.push_back(std::move(c));
  }
  std::fclose(in);
  std::vector<std::pair<const char*, CaseFn>> paths;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma"))
    paths.push_back({"avx512", edge_case_avx512});
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    paths.push_back({"avx2", edge_case_avx2});
#else
  paths.push_back({"neon", edge_case_neon});
#endif
  paths.push_back({"portable", edge_case_portable});
  std::FILE* out = std::fopen(argv[2], "wb");
  for (const auto& [name, run] : paths) {
    std::printf("%s\n", name);
    for (const Case& c : cases) {
      std::vector<float> o(c.n_out);
      run(c.kind, c.ints.data(), c.floats.data(), c.n_out, o.data());
      std::fwrite(o.data(), sizeof(float), o.size(), out);
    }
  }
  return std::fclose(out) == 0 ? 0 : 1;
}
