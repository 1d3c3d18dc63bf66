// Shared by the kernels in this folder (flashserve.model.cpu_kernels prepends it to each source before
// compiling): which vector path to build. FLASHSERVE_NO_AVX512 / FLASHSERVE_NO_SIMD select the narrower ones.
#include <cstdint>
#if !defined(FLASHSERVE_NO_SIMD) && (defined(__AVX512F__) || defined(__AVX2__))
#include <immintrin.h>
#endif
#if !defined(FLASHSERVE_NO_SIMD) && !defined(FLASHSERVE_NO_AVX512) && defined(__AVX512F__)
#define FS_AVX512 1
#elif !defined(FLASHSERVE_NO_SIMD) && defined(__AVX2__) && defined(__FMA__)
#define FS_AVX2 1
#endif
