#pragma once
// Shared by the kernels in this folder (each source includes it): which vector path to build
// (FLASHSERVE_NO_AVX512 / FLASHSERVE_NO_SIMD select the narrower ones), aligned_floats for the kernels' copies of
// x, and the macros that register operators in this build's namespace.
#include <cstdint>
#if !defined(FLASHSERVE_NO_SIMD) && (defined(__AVX512F__) || defined(__AVX2__))
#include <immintrin.h>
#endif
#if !defined(FLASHSERVE_NO_SIMD) && !defined(FLASHSERVE_NO_AVX512) && defined(__AVX512F__)
#define FS_AVX512 1
#elif !defined(FLASHSERVE_NO_SIMD) && defined(__AVX2__) && defined(__FMA__)
#define FS_AVX2 1
#endif

#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>

namespace {

// n floats from a 64-byte boundary (zeroed if asked), for the copies of x the kernels make: a 32-byte load from
// them never straddles a cache line. malloc's 16-byte alignment left the MXFP4 kernel's rows of x at 16 bytes past
// a 32-byte boundary in some processes: one layer's gate/up and down measured 1.037x slower (peers shapes).
inline std::unique_ptr<float, void (*)(void*)> aligned_floats(int64_t n, bool zeroed) {
    const size_t bytes = (static_cast<size_t>(n > 0 ? n : 1) * sizeof(float) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, bytes);
    if (p == nullptr) throw std::bad_alloc();
    if (zeroed) std::memset(p, 0, bytes);
    return {static_cast<float*>(p), &std::free};
}

#if defined(FS_AVX2) || defined(FS_AVX512)
// The 8 lanes of a sum, added in order from 0
inline float lane_sum(__m256 acc) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    float sum = 0.f;
    for (float v : lanes) sum += v;
    return sum;
}
#endif

// f(std::integral_constant<int64_t, R>{}) for 1 <= R < N, else f(std::integral_constant<int64_t, N>{}): a count of
// rows as a compile-time constant, so the loops over rows unroll and the sums stay in registers
template <int64_t N, typename F>
inline void with_rows(int64_t R, F&& f) {
    if constexpr (N > 1) {
        if (R >= 1 && R < N) return with_rows<N - 1>(R, f);
    }
    f(std::integral_constant<int64_t, N>{});
}

}  // namespace

// The operator namespace of this build (flashserve.model.cpu_kernels defines FLASHSERVE_OPS): flashserve for the
// CPU's own path, which the model calls, flashserve_avx2 / flashserve_scalar for the narrower ones (tests). The
// extra level of macros expands FLASHSERVE_OPS before torch's macros paste it into their names.
#if !defined(FLASHSERVE_OPS)
#define FLASHSERVE_OPS flashserve
#endif
#define FS_LIBRARY_FRAGMENT_(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define FS_LIBRARY_FRAGMENT(m) FS_LIBRARY_FRAGMENT_(FLASHSERVE_OPS, m)
#define FS_LIBRARY_IMPL_(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)
#define FS_LIBRARY_IMPL(m) FS_LIBRARY_IMPL_(FLASHSERVE_OPS, m)
