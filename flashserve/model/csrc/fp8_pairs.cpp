// FP8 pair products on the CPU (flashserve.model.cpu_kernels): row p of x times the block-FP8 matrix of expert
// experts[p], read as stored: out[p, n] = sum_k x[p, k] * e4m3(q[e, n, k]) * 2^(s[e, n / rb, k / cb] - 127). A
// dense layer is one expert (E = 1) that every row uses; a grouped projection is G experts, one a group. The
// released checkpoints store their dense layers this way, and decoding a whole matrix into float32 before each
// product (torch's code) moved about 17 bytes a value where this reads one: at V4.1-Flash's sizes it was nine
// tenths of a decode step. Each 16 codes (AVX-512; 8 with AVX2) are decoded by integer arithmetic (normal numbers
// by moving their bits into a float32's, subnormals as their 3-bit mantissa times 2^-9) and multiplied by their
// block's power-of-two scale, which is exact, so every weight equals what flashserve.model.packed.decode gives.
// Pairs are grouped by expert so each matrix row is decoded once for up to ROWS rows of x; four matrix rows at a
// time. Every output is summed by one thread in a fixed order (16 or 8 lanes over k, then the lanes in order):
// the result does not depend on the number of threads. Layout (contiguous): x [T, K] float32, each row in
// k = P / T consecutive pairs; experts [P] int64 in [0, E); q [E, N, K] uint8 E4M3 codes; s [E, ceil(N / rb),
// ceil(K / cb)] uint8 UE8M0; out [P, N] float32. cb % 8 == 0.
#include "isa.h"
#include "pairs.h"
#include "fp8.h"
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace {

#if defined(FS_AVX512)
constexpr int64_t ROWS = 8;   // rows of x sharing one decode of the bytes (prescaled: sums in 32 registers)
#else
constexpr int64_t ROWS = 4;   // rows of x sharing one decode of the bytes
#endif
constexpr int64_t FEW = 4;    // rows a call of the unscaled path and of AVX2's prescaled one (16 registers);
                              // AVX-512: products16 requests the bytes itself for up to this many (more: compute-bound)
constexpr int64_t QUAD = 4;   // matrix rows multiplied at a time
constexpr int64_t TILE = 64;  // matrix rows per work item
constexpr int64_t AHEAD = 16;  // matrix rows requested ahead of the four multiplied
#if defined(FS_AVX512)
constexpr int64_t AHEAD_BYTES = 16384;  // at least this far ahead products16 requests the rows' bytes
#endif

// sum plus the last columns k .. K - 1 of one matrix row (q, its scale row sc, one scale a cb columns) times x,
// one by one: every path's sums end this way
inline float tail_sum(float sum, const uint8_t* q, const uint8_t* sc, int64_t cb, const float* x, int64_t k,
                      int64_t K) {
    for (int64_t t = k; t < K; ++t) sum += e4m3(q[t]) * e8m0(sc[t / cb]) * x[t];
    return sum;
}

#if defined(FS_AVX2) || defined(FS_AVX512)
// eight E4M3 codes as float32, the same values as e4m3()
inline __m256 e4m3x8(const uint8_t* q) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i mag = _mm256_and_si256(v, _mm256_set1_epi32(0x7F));
    const __m256 normal =
        _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
    const __m256i is_sub = _mm256_cmpeq_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x78)), _mm256_setzero_si256());
    const __m256 f = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(is_sub));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
    return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
}
#endif

#if defined(FS_AVX2) && defined(__F16C__)
// sixteen E4M3 codes as float32 times 2^-8, through IEEE halves: a code's sign moved to bit 15 and its exponent
// and mantissa to bits 13..7 make a half worth the code's value times 2^-8, subnormals included (both formats'
// subnormals have the exponent field 0; 0x7F gives 480 x 2^-8, as e4m3() gives 480), and F16C widens halves to
// float32 exactly. Two instructions fewer per value than e4m3x8's integer arithmetic: one dense layer of
// V4.1-Flash's size at one row, 2 threads, about 1.5x.
inline void e4m3x16_scaled_down(const uint8_t* q, __m256& lo, __m256& hi) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi16(v, 8), _mm256_set1_epi16(static_cast<int16_t>(0x8000)));
    const __m256i rest = _mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16(0x3F80));
    const __m256i h = _mm256_or_si256(sign, rest);
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// eight weights: halves (the codes times 2^-8) times their block's scale, with the 2^8 folded into the scale where
// the product stays a finite float (b <= 246), which is exact, so each weight equals e4m3(code) * e8m0(b)
inline __m256 scaled(__m256 halves, uint8_t b) {
    if (b <= 246) return _mm256_mul_ps(halves, _mm256_set1_ps(e8m0(b) * 256.f));
    return _mm256_mul_ps(_mm256_mul_ps(halves, _mm256_set1_ps(256.f)), _mm256_set1_ps(e8m0(b)));
}
#endif

#if defined(FS_AVX2) || defined(FS_AVX512)
// eight E4M3 codes as float32 times 2^-120, in three instructions: sign-extended to 32 bits and moved up by 20, a
// code's sign lands in bit 31 (the mask clears its copies in bits 27..30) and its exponent and mantissa in bits
// 26..20, where a float32 with exponent field e and mantissa m is worth (1 + m / 8) 2^(e - 127): the code's
// normal value times 2^-120. A code with exponent field 0 makes the float32 subnormal m 2^-129, its value m 2^-9
// times 2^-120 (0x7F gives 480 2^-120, as e4m3() gives 480).
inline __m256 e4m3x8_tiny(const uint8_t* q) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    return _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_slli_epi32(v, 20), _mm256_set1_epi32(static_cast<int32_t>(0x87F00000u))));
}

// row_products (below) against rows of x already multiplied by their column blocks' scales times 2^120 (xt: the
// same rows, each column block of x times 2^(b - 7) for its scale b, every product exact; see prescale): the
// weights' scales leave the inner loop, which is three integer instructions and one FMA per eight weights. Each
// product w * x is the one row_products forms, as an FMA forms it exactly: tiny(code) * (x * 2^(b - 7)) =
// e4m3(code) * 2^(b - 127) * x; the sums take them in row_products' order (eight lanes over k, then the lanes in
// order, then the last K % 8 columns one by one from the unscaled rows), so the results are the same bits. One
// dense layer of V4.1-Flash's size (16384 x 5120) at one row, 2 threads, AMD EPYC (AVX2): see docs/engine-speed.md.
template <int64_t J, int64_t R>
inline void prescaled_row_products(const uint8_t* q, const uint8_t* const* sc, int64_t cb, const float* const* xs,
                                   const float* const* xt, int64_t K, float (*sums)[ROWS]) {
    __m256 acc[J][R];
    for (int64_t j = 0; j < J; ++j)
        for (int64_t r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 w[J];
        for (int64_t j = 0; j < J; ++j) w[j] = e4m3x8_tiny(q + j * K + k);
        for (int64_t r = 0; r < R; ++r) {
            const __m256 xv = _mm256_loadu_ps(xt[r] + k);
            for (int64_t j = 0; j < J; ++j) acc[j][r] = _mm256_fmadd_ps(w[j], xv, acc[j][r]);
        }
    }
    for (int64_t j = 0; j < J; ++j)
        for (int64_t r = 0; r < R; ++r) sums[j][r] = tail_sum(lane_sum(acc[j][r]), q + j * K, sc[j], cb, xs[r], k, K);
}

// The least nonzero and the largest magnitude of each row of x [T, K] (ok[t]: every value finite)
struct RowRanges {
    std::vector<float> least, most;
    std::vector<char> ok;
    RowRanges(const float* x, int64_t T, int64_t K) : least(T, FLT_MAX), most(T, 0.f), ok(T, 1) {
        const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(FLT_MAX), zero = _mm256_setzero_ps();
        for (int64_t t = 0; t < T; ++t) {
            const float* row = x + t * K;
            __m256 most8 = zero, least8 = big, bad = zero;
            int64_t c = 0;
            for (; c + 8 <= K; c += 8) {
                const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(row + c));
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));  // infinite or NaN
                most8 = _mm256_max_ps(most8, a);
                least8 = _mm256_min_ps(least8, _mm256_blendv_ps(big, a, _mm256_cmp_ps(a, zero, _CMP_GT_OQ)));
            }
            alignas(32) float m8[8], l8[8];
            _mm256_store_ps(m8, most8);
            _mm256_store_ps(l8, least8);
            float most_t = 0.f, least_t = FLT_MAX;
            bool ok_t = _mm256_movemask_ps(bad) == 0;
            for (int i = 0; i < 8; ++i) {
                most_t = m8[i] > most_t ? m8[i] : most_t;
                least_t = l8[i] < least_t ? l8[i] : least_t;
            }
            for (; c < K; ++c) {
                const float a = std::fabs(row[c]);
                ok_t = ok_t && a <= FLT_MAX;
                most_t = a > most_t ? a : most_t;
                if (a > 0.f && a < least_t) least_t = a;
            }
            most[t] = most_t;
            least[t] = least_t;
            ok[t] = ok_t;
        }
    }
};

// xt[r] = xs[r] with column block kb times 2^(srow[kb] - 7), if every such product is exact: a power of two times
// x is exact when it is a normal float or zero, which holds for all of a row when it holds for its largest and its
// least nonzero magnitude. False (xt not complete) if not, or if a scale is above 134 (2^(b - 7) not a float).
inline bool prescale(const uint8_t* srow, int64_t cb, const float* const* xs, const int64_t* ts,
                     const RowRanges& ranges, int64_t R, int64_t K, float* xt) {
    for (int64_t kb = 0; kb * cb < K; ++kb) {
        if (srow[kb] > 134) return false;
        const float c = e8m0(static_cast<uint8_t>(srow[kb] + 120));  // 2^(b - 7)
        for (int64_t r = 0; r < R; ++r) {
            const int64_t t = ts[r];
            if (!ranges.ok[t] || !(ranges.most[t] * c <= FLT_MAX) ||
                (ranges.least[t] < FLT_MAX && !(ranges.least[t] * c >= FLT_MIN)))
                return false;
        }
    }
    for (int64_t r = 0; r < R; ++r)
        for (int64_t c0 = 0; c0 < K; c0 += cb) {
            const int64_t end = c0 + cb < K ? c0 + cb : K;  // the columns past K's last multiple of 8 are not read
            const __m256 scale = _mm256_set1_ps(e8m0(static_cast<uint8_t>(srow[c0 / cb] + 120)));
            for (int64_t c = c0; c + 8 <= end; c += 8)
                _mm256_storeu_ps(xt + r * K + c, _mm256_mul_ps(_mm256_loadu_ps(xs[r] + c), scale));
        }
    return true;
}
#endif

#if defined(FS_AVX512)
// sixteen E4M3 codes as float32, the same values as e4m3()
inline __m512 e4m3x16(const uint8_t* q) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi32(0x7F));
    const __m512 normal =
        _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));
    const __mmask16 is_sub = _mm512_testn_epi32_mask(v, _mm512_set1_epi32(0x78));
    const __m512 f = _mm512_mask_blend_ps(is_sub, normal, sub);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
}

// Matrix rows q[0 .. J) against R rows of x, sixteen lanes over k then the lanes in order, then the last K % 16
// columns one by one from the unscaled rows xs (tail_sum): weights16(j, k) gives matrix row j's sixteen weights
// from column k as the rows x[r] multiply them
template <int64_t J, int64_t R, typename Weights>
inline void products16(const uint8_t* q, const uint8_t* const* sc, int64_t cb, const float* const* xs,
                       const float* const* x, int64_t K, float (*sums)[ROWS], Weights&& weights16) {
    int64_t k = 0;
    __m512 acc[J][R];
    for (int64_t j = 0; j < J; ++j)
        for (int64_t r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
    // a hint a cache line, the same column of a later group of QUAD rows (the rows lie one after another): spread
    // out, where a burst of four rows' hints before each four (tile_products: more rows than FEW, whose
    // products are compute-bound) kept one row against 4096x8192 at about 33 GB/s
    const int64_t group = QUAD * K;  // a group's bytes: the hints go a whole number of groups ahead, at least 16 KB
    const int64_t ahead = group >= AHEAD_BYTES || group == 0 ? group : (AHEAD_BYTES + group - 1) / group * group;
    for (; k + 16 <= K; k += 16) {
        if constexpr (R <= FEW) {
            if (k % 64 == 0)
                for (int64_t j = 0; j < J; ++j) __builtin_prefetch(q + j * K + k + ahead);  // a hint: no fault
        }
        __m512 w[J];
        for (int64_t j = 0; j < J; ++j) w[j] = weights16(j, k);
        for (int64_t r = 0; r < R; ++r) {
            __m512 xv = _mm512_loadu_ps(x[r] + k);
            // up to four rows: each row of x loaded once, into a register (gcc folds a load into every FMA, and
            // one row against 4096x8192 at four rows took 1.4x as long); more rows keep gcc's choice
            if constexpr (R <= FEW) __asm__("" : "+v"(xv));
            for (int64_t j = 0; j < J; ++j) acc[j][r] = _mm512_fmadd_ps(w[j], xv, acc[j][r]);
        }
    }
    for (int64_t j = 0; j < J; ++j)
        for (int64_t r = 0; r < R; ++r) {
            alignas(64) float lanes[16];
            _mm512_store_ps(lanes, acc[j][r]);
            float sum = 0.f;
            for (float v : lanes) sum += v;
            sums[j][r] = tail_sum(sum, q + j * K, sc[j], cb, xs[r], k, K);
        }
}

// row_products (below) with 16 lanes, for blocks of a multiple of 16 columns
template <int64_t J, int64_t R>
inline void row_products16(const uint8_t* q, const uint8_t* const* sc, int64_t cb, const float* const* xs, int64_t K,
                           float (*sums)[ROWS]) {
    products16<J, R>(q, sc, cb, xs, xs, K, sums, [&](int64_t j, int64_t k) {
        return _mm512_mul_ps(e4m3x16(q + j * K + k), _mm512_set1_ps(e8m0(sc[j][k / cb])));  // exact
    });
}

// prescaled_row_products with sixteen lanes, for blocks of a multiple of 16 columns: row_products16's sums, each
// weight decoded in three instructions (e4m3x8_tiny's, sixteen at a time) against the prescaled rows xt instead of
// row_products16's nine and a multiply by its scale. One row of a 8192x4096 matrix, 2 threads, AMD EPYC with
// AVX-512: see docs/engine-speed.md.
template <int64_t J, int64_t R>
inline void prescaled_row_products16(const uint8_t* q, const uint8_t* const* sc, int64_t cb, const float* const* xs,
                                     const float* const* xt, int64_t K, float (*sums)[ROWS]) {
    const __m512i keep = _mm512_set1_epi32(static_cast<int32_t>(0x87F00000u));
    products16<J, R>(q, sc, cb, xs, xt, K, sums, [&](int64_t j, int64_t k) {
        const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * K + k)));
        return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(v, 20), keep));
    });
}
#endif

// Matrix rows q[0 .. J) (row stride K, their scale rows sc[j], one scale a cb columns) against R rows of xs
template <int64_t J, int64_t R>
inline void row_products(const uint8_t* q, const uint8_t* const* sc, int64_t cb, const float* const* xs, int64_t K,
                         float (*sums)[ROWS]) {
#if defined(FS_AVX512)
    if (cb % 16 == 0) return row_products16<J, R>(q, sc, cb, xs, K, sums);
#endif
    int64_t k = 0;
#if defined(FS_AVX2) || defined(FS_AVX512)
    __m256 acc[J][R];
    for (int64_t j = 0; j < J; ++j)
        for (int64_t r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
#if defined(FS_AVX2) && defined(__F16C__)
    // sixteen columns at a time, each lane's sum taking the same terms in the same order as eight at a time
    const auto multiply = [&](const __m256* wl, const __m256* wh) {
        for (int64_t r = 0; r < R; ++r) {
            const __m256 xl = _mm256_loadu_ps(xs[r] + k), xh = _mm256_loadu_ps(xs[r] + k + 8);
            for (int64_t j = 0; j < J; ++j) {
                acc[j][r] = _mm256_fmadd_ps(wl[j], xl, acc[j][r]);
                acc[j][r] = _mm256_fmadd_ps(wh[j], xh, acc[j][r]);
            }
        }
    };
    const auto chunk = [&]() {  // any block width: each half's own scale
        __m256 wl[J], wh[J];
        for (int64_t j = 0; j < J; ++j) {
            e4m3x16_scaled_down(q + j * K + k, wl[j], wh[j]);
            wl[j] = scaled(wl[j], sc[j][k / cb]);
            wh[j] = scaled(wh[j], sc[j][(k + 8) / cb]);
        }
        multiply(wl, wh);
    };
    if (cb % 16 == 0) {
        // whole chunks in each block: a block's scales (the 2^8 folded in) broadcast once for its chunks, the same
        // products as chunk() (a V4 dense layer at one row: the scales were a third of the instructions)
        while (k + 16 <= K) {
            const int64_t kb = k / cb, end = (kb + 1) * cb < K ? (kb + 1) * cb : K;
            bool folded = true;
            __m256 scale[J];
            for (int64_t j = 0; j < J; ++j) {
                folded = folded && sc[j][kb] <= 246;
                scale[j] = _mm256_set1_ps(e8m0(sc[j][kb]) * 256.f);
            }
            for (; k + 16 <= end; k += 16) {
                if (!folded) {
                    chunk();
                    continue;
                }
                __m256 wl[J], wh[J];
                for (int64_t j = 0; j < J; ++j) {
                    e4m3x16_scaled_down(q + j * K + k, wl[j], wh[j]);
                    wl[j] = _mm256_mul_ps(wl[j], scale[j]);
                    wh[j] = _mm256_mul_ps(wh[j], scale[j]);
                }
                multiply(wl, wh);
            }
            if (k < end) break;  // the last block's last columns, fewer than 16: eight at a time below
        }
    } else {
        for (; k + 16 <= K; k += 16) chunk();
    }
#endif
    for (; k + 8 <= K; k += 8) {
        __m256 w[J];
        for (int64_t j = 0; j < J; ++j)
            w[j] = _mm256_mul_ps(e4m3x8(q + j * K + k), _mm256_set1_ps(e8m0(sc[j][k / cb])));  // exact
        for (int64_t r = 0; r < R; ++r) {
            const __m256 xv = _mm256_loadu_ps(xs[r] + k);
            for (int64_t j = 0; j < J; ++j) acc[j][r] = _mm256_fmadd_ps(w[j], xv, acc[j][r]);
        }
    }
#endif
    for (int64_t j = 0; j < J; ++j)
        for (int64_t r = 0; r < R; ++r) {
            float sum = 0.f;
#if defined(FS_AVX2) || defined(FS_AVX512)
            sum = lane_sum(acc[j][r]);
#endif
            sums[j][r] = tail_sum(sum, q + j * K, sc[j], cb, xs[r], k, K);
        }
}

// f(r0, Rc, part) for the rows r0 .. r0 + Rc - 1 of R, FEW at a time, part's sums then copied into sums' columns
// r0 ..: paths whose sums for more rows would not stay in the registers
template <typename F>
inline void few_at_a_time(int64_t R, int64_t m, float (*sums)[ROWS], F&& f) {
    for (int64_t r0 = 0; r0 < R; r0 += FEW) {
        const int64_t Rc = R - r0 < FEW ? R - r0 : FEW;
        float part[QUAD][ROWS];
        f(r0, Rc, part);
        for (int64_t j = 0; j < m; ++j)
            for (int64_t r = 0; r < Rc; ++r) sums[j][r0 + r] = part[j][r];
    }
}

template <int64_t J>
inline void rows_products(const uint8_t* q, const uint8_t* const* sc, int64_t cb, const float* const* xs, int64_t R,
                          int64_t K, float (*sums)[ROWS]) {
    few_at_a_time(R, J, sums, [&](int64_t r0, int64_t Rc, float (*part)[ROWS]) {
        with_rows<FEW>(Rc, [&](auto r) { row_products<J, decltype(r)::value>(q, sc, cb, xs + r0, K, part); });
    });
}

// f(J, j) for the m matrix rows of a step (m is QUAD or 1): all four at once (J = QUAD) where the rows of x are
// at most `all_up_to`, else two pairs (J = 2, j = 0 and 2), or the one row (J = 1); j is the first row's index
template <int64_t all_up_to, typename F>
inline void matrix_rows(int64_t m, int64_t R, F&& f) {
    if (m == QUAD && R <= all_up_to) {
        f(std::integral_constant<int64_t, QUAD>{}, 0);
    } else if (m == QUAD) {
        f(std::integral_constant<int64_t, 2>{}, 0);
        f(std::integral_constant<int64_t, 2>{}, 2);
    } else {
        f(std::integral_constant<int64_t, 1>{}, 0);
    }
}

#if defined(FS_AVX2) || defined(FS_AVX512)
// A tile's rows of x prescaled for one row block of scales at a time (prescale), or not where that is not exact
struct Prescaled {
    const RowRanges& ranges;
    const int64_t* ts;  // the tile's rows' indices in x
    float* xt;          // [R, K]
    int64_t block = -1;
    bool ok = false;

    // prescaled rows for matrix rows n .. n + m - 1, or nullptr if they are in two row blocks or not exact
    const float* for_rows(const uint8_t* s, int64_t sk, int64_t rb, int64_t cb, int64_t n, int64_t m,
                          const float* const* xs, int64_t R, int64_t K) {
        if (n / rb != (n + m - 1) / rb) return nullptr;
        if (n / rb != block) {
            block = n / rb;
            ok = prescale(s + block * sk, cb, xs, ts, ranges, R, K, xt);
        }
        return ok ? xt : nullptr;
    }
};
#else
struct Prescaled {};
#endif

// R <= ROWS rows of xs times matrix rows n0 .. n1 of one expert (q at its first row, s at its first scale row);
// with pre (AVX2), against the rows prescaled where that is exact
inline void tile_products(const uint8_t* q, const uint8_t* s, int64_t rb, int64_t cb, int64_t n0, int64_t n1,
                          const float* const* xs, int64_t R, int64_t K, float* const* out, Prescaled* pre) {
    const int64_t sk = (K + cb - 1) / cb;  // scales a row of blocks
    float sums[QUAD][ROWS];
    for (int64_t n = n0; n < n1;) {
        const uint8_t* qn = q + n * K;
        const int64_t m = n1 - n < QUAD ? 1 : QUAD;
        const uint8_t* sc[QUAD];
        for (int64_t j = 0; j < m; ++j) sc[j] = s + ((n + j) / rb) * sk;
#if defined(FS_AVX2) || defined(FS_AVX512)
        const float* xt_rows = pre ? pre->for_rows(s, sk, rb, cb, n, m, xs, R, K) : nullptr;
#endif
#if defined(FS_AVX512)
        // products16 requests the bytes as it goes for up to FEW rows a call: the prescaled path below
        // calls it with all R rows, the unscaled one FEW rows at a time
        if (cb % 16 != 0 || (xt_rows && R > FEW))
#endif
            for (int64_t l = 0; l < QUAD * K; l += 64) __builtin_prefetch(qn + AHEAD * K + l);  // a hint: no fault
#if defined(FS_AVX2) || defined(FS_AVX512)
        if (xt_rows) {
            const float* xt[ROWS];
            for (int64_t r = 0; r < R; ++r) xt[r] = xt_rows + r * K;
#if defined(FS_AVX512)
            // AVX-512's 32 registers: J x R sums and J weights for four matrix rows by up to four rows of x, two
            // by up to eight. Sixteen rows of an 8192x4096 matrix, eight rows a decode against four: 1.6x (one
            // matrix row by sixteen rows of x was slower still: the sixteen rows no longer stay in the L1 cache)
            if (cb % 16 == 0) {
                with_rows<ROWS>(R, [&](auto r) {
                    matrix_rows<4>(m, R, [&](auto J, int64_t j) {
                        prescaled_row_products16<decltype(J)::value, decltype(r)::value>(
                            qn + j * K, sc + j, cb, xs, xt, K, sums + j);
                    });
                });
            } else
#endif
            // four matrix rows at a time for one or two rows of x, two at a time for more: J x R sums, J weights
            // and a row of x stay within the 16 registers (four by four spilled: 1.46x slower at 4 rows)
            few_at_a_time(R, m, sums, [&](int64_t r0, int64_t Rc, float (*part)[ROWS]) {
                with_rows<FEW>(Rc, [&](auto r) {
                    matrix_rows<2>(m, Rc, [&](auto J, int64_t j) {
                        prescaled_row_products<decltype(J)::value, decltype(r)::value>(
                            qn + j * K, sc + j, cb, xs + r0, xt + r0, K, part + j);
                    });
                });
            });
        } else
#else
        (void)pre;
#endif
        if (m == QUAD)
            rows_products<QUAD>(qn, sc, cb, xs, R, K, sums);
        else
            rows_products<1>(qn, sc, cb, xs, R, K, sums);
        for (int64_t j = 0; j < m; ++j)
            for (int64_t r = 0; r < R; ++r) out[r][n + j] = sums[j][r];
        n += m;
    }
}

}  // namespace

static void kernel(const float* x, const int64_t* experts, const uint8_t* q, const uint8_t* s, float* out, int64_t P,
                   int64_t k, int64_t E, int64_t N, int64_t K, int64_t rb, int64_t cb, int64_t threads) {
    const ExpertGroups groups(experts, P, E, "fp8_pairs");
    const int64_t scale_rows = (N + rb - 1) / rb, scale_cols = (K + cb - 1) / cb;
#if defined(FS_AVX2) || defined(FS_AVX512)
    const RowRanges ranges(x, P / k, K);
#endif
    pair_tiles<ROWS, TILE>(groups, x, out, P, k, N, K, 1, threads,
                           [&](int64_t, int64_t e, int64_t n0, int64_t n1, const float* const* rows, int64_t R,
                               float* const* outs) {
#if defined(FS_AVX2) || defined(FS_AVX512)
                               // prescaled rows need subnormal weights read as they are: this thread's
                               // MXCSR without denormals-are-zero (torch.set_flush_denormal sets it per thread)
                               const bool prescaling = (_mm_getcsr() & 0x40) == 0;
                               int64_t ts[ROWS];
                               for (int64_t r = 0; r < R; ++r) ts[r] = (rows[r] - x) / K;
                               const auto xt = aligned_floats(prescaling ? R * K : 1, false);
                               Prescaled pre{ranges, ts, xt.get()};
                               Prescaled* use = prescaling ? &pre : nullptr;
#else
                               Prescaled* use = nullptr;
#endif
                               tile_products(q + e * N * K, s + e * scale_rows * scale_cols, rb, cb, n0, n1, rows, R,
                                             K, outs, use);
                           });
}

// flashserve::fp8_pairs(x, experts, q, s, row_block, col_block) for CPU tensors on torch's dispatcher (schema:
// ops.cpp): a compiled step's C++ reaches it with no Python in between
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {
at::Tensor fp8_pairs_op(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& q, const at::Tensor& s,
                        int64_t rb, int64_t cb) {
    const bool shaped = q.dim() == 3 && s.dim() == 3 && x.dim() == 2 && rb >= 1 && cb >= 8 && cb % 8 == 0 &&
                        x.size(1) == q.size(2) && s.size(0) == q.size(0) && s.size(1) == (q.size(1) + rb - 1) / rb &&
                        s.size(2) == (q.size(2) + cb - 1) / cb && x.size(0) > 0 && experts.numel() % x.size(0) == 0;
    TORCH_CHECK(shaped, "fp8_pairs: x ", x.sizes(), ", experts ", experts.sizes(), ", q ", q.sizes(), ", s ",
                s.sizes(), ", blocks ", rb, "x", cb, " do not match");
    TORCH_CHECK((q.scalar_type() == at::kByte || q.scalar_type() == at::kFloat8_e4m3fn) &&
                    (s.scalar_type() == at::kByte || s.scalar_type() == at::kFloat8_e8m0fnu),
                "fp8_pairs: q must be E4M3 bytes and s UE8M0 bytes");
    const at::Tensor xs = x.to(at::kFloat).contiguous(), ex = experts.to(at::kLong).contiguous();
    const at::Tensor qc = q.contiguous(), sc = s.contiguous();
    const int64_t P = ex.numel(), N = q.size(1);
    at::Tensor out = at::empty({P, N}, xs.options());
    kernel(xs.data_ptr<float>(), ex.data_ptr<int64_t>(), static_cast<const uint8_t*>(qc.data_ptr()),
           static_cast<const uint8_t*>(sc.data_ptr()), out.data_ptr<float>(), P, P / x.size(0), q.size(0), N,
           x.size(1), rb, cb, at::get_num_threads());
    return out;
}
}  // namespace

FS_LIBRARY_IMPL(m) { m.impl("fp8_pairs", &fp8_pairs_op); }
