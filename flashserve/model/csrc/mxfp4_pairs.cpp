// MXFP4 pair products on the CPU (flashserve.model.cpu_kernels): row p of x times the MXFP4 matrix of expert
// experts[p], decoded from its bytes as they are read. Pairs are grouped by expert so that each expert's bytes
// are decoded once for up to ROWS rows. AVX-512 decodes 128 values (four blocks) from one 64-byte load with eight
// permutes of the 16-value E2M1 table and multiplies each lane's sum of products by its block's scale; AVX2 looks
// up the unscaled values' bfloat16 bytes with byte shuffles (no lane-crossing permute) and multiplies each block's
// sum of products by its scale. Two matrix rows share each load of the rows where few rows use an expert. Every
// output is summed by one thread in a fixed order: the result does not depend on the number of threads.
//
// Layout (all contiguous): x [T, K] float32, each row in k = P / T consecutive pairs (a token's routed experts);
// experts [P] int64 in [0, E); q [E, N, K/2] uint8, two E2M1 codes a byte, the low nibble the even column;
// s [E, N, K/32] uint8 UE8M0 scales; out [P, N] float32, or [2, P, N] with the up projection's (q2, s2) beside
// the gate's, decoded in the same pass over the pairs. K % 32 == 0.
// Built by torch's extension API for this CPU; FLASHSERVE_NO_AVX512 / FLASHSERVE_NO_SIMD select
// the narrower paths (the tests build all three).
#include "isa.h"
#include "pairs.h"
#include "fp4.h"
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;  // values per scale
constexpr int64_t ROWS = 8;    // pairs sharing one decode
#if defined(FS_AVX512)
constexpr int64_t PAIR_ROWS = 4;  // at most this many rows take two matrix rows at a time (4 registers a row)
#else
constexpr int64_t PAIR_ROWS = ROWS;  // AVX2: one sum a row, and more rows than 4 still gained 1.04x at 16 rows
#endif
constexpr int64_t TILE = 64;   // matrix rows per work item: 16 KB of bytes read in order (16 rows: 1.2x slower)
constexpr int64_t AHEAD = 4;   // matrix rows prefetched ahead of the one multiplied (AVX2, scalar)


// Bytes and scales of `count` matrix rows (a hint: addresses past the end are not read). Each step's layers
// evict the experts from the caches: one projection cycled through 24 weight sets with a 65 MB stream between
// rounds took 233 us a call without hints and 16-row tiles, 177 with (64 pairs, 16 x 256x512, 2 threads).
inline void prefetch_rows(const uint8_t* q, const uint8_t* s, int64_t count, int64_t K) {
    for (int64_t l = 0; l < count * K / 2; l += 64) __builtin_prefetch(q + l);
    __builtin_prefetch(s);
}

#if defined(FS_AVX2)
// The high and the low byte of each E2M1 value's bfloat16 (its float32's upper half: every E2M1 value is exact in
// bfloat16), codes 0 .. 15, one copy a 128-bit lane
struct Bf16Bytes {
    alignas(32) uint8_t high[32], low[32];
    Bf16Bytes() {
        for (int c = 0; c < 32; ++c) {
            uint32_t bits;
            std::memcpy(&bits, &E2M1[c % 16], sizeof bits);
            high[c] = static_cast<uint8_t>(bits >> 24);
            low[c] = static_cast<uint8_t>(bits >> 16);
        }
    }
};
const Bf16Bytes BF16_BYTES;

// The 32 unscaled values of one block (16 code bytes) as float32, in four registers of 8 in the order the kernel
// lays x's blocks out (X_ORDER): two byte shuffles look up each code's bfloat16 halves, and interleaving them with
// zeros makes float32s; every instruction stays within its 128-bit lane (a lane-crossing permute a value took
// twice the time on an AMD EPYC, Zen 3).
inline void decode32(const uint8_t* q, __m256 (&f)[4]) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), nibble = _mm_set1_epi8(0x0F);
    const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), _mm_and_si128(bytes, nibble));
    const __m256i high = _mm256_shuffle_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(BF16_BYTES.high)), codes);
    const __m256i low = _mm256_shuffle_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(BF16_BYTES.low)), codes);
    const __m256i first = _mm256_unpacklo_epi8(low, high), second = _mm256_unpackhi_epi8(low, high), zero = _mm256_setzero_si256();
    f[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, first));
    f[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, first));
    f[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, second));
    f[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, second));
}

// A block's 32 products with one row of x (laid out in X_ORDER), unscaled, in 8 lanes: (f0 x0 + f1 x1) + (f2 x2 +
// f3 x3), two chains
inline __m256 block_sum(const __m256 (&f)[4], const float* x) {
    const __m256 a = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(x + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(x)));
    const __m256 b = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(x + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(x + 16)));
    return _mm256_add_ps(a, b);
}

// Where the AVX2 path reads each column of a block of x: decode32's order (even columns from the low nibbles, odd
// ones from the high, four of each a register)
constexpr int X_ORDER[32] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                             16, 18, 20, 22, 17, 19, 21, 23, 24, 26, 28, 30, 25, 27, 29, 31};
#endif

// One matrix row (n) of one expert against R <= ROWS rows of xs (AVX2, scalar), each 32-block of xs laid out as
// decode32 reads it (AVX2: X_ORDER) or as [16 even columns | 16 odd columns] (scalar) so that the low and the high
// nibbles meet their inputs in order.
// R is a template argument so that the loops over rows unroll and the sums stay in registers.
template <int64_t R>
inline void row_products(const uint8_t* q, const uint8_t* s, const float* const* xs, int64_t K, float* sums) {
    const int64_t blocks = K / BLOCK;
#if defined(FS_AVX2)
    __m256 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m256 f[4];
        decode32(q + b * 16, f);
        const __m256 scale = _mm256_set1_ps(e8m0(s[b]));
        for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(block_sum(f, xs[r] + b * BLOCK), scale, acc[r]);
    }
    for (int64_t r = 0; r < R; ++r) sums[r] = lane_sum(acc[r]);
#else
    for (int64_t r = 0; r < R; ++r) sums[r] = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
        const float scale = e8m0(s[b]);
        for (int64_t j = 0; j < 16; ++j) {
            const float lo = E2M1[q[b * 16 + j] & 15] * scale, hi = E2M1[q[b * 16 + j] >> 4] * scale;
            for (int64_t r = 0; r < R; ++r) sums[r] += lo * xs[r][b * BLOCK + j] + hi * xs[r][b * BLOCK + 16 + j];
        }
    }
#endif
}

#if defined(FS_AVX512)
// A 128-value chunk of a matrix row (64 code bytes, four blocks) is decoded a nibble of each 32-bit word at a
// time: lane j of nibble i holds column 8j + i, so eight permutes (and seven shifts) decode 128 values from one
// load, where a block at a time takes a widening load, two permutes and a broadcast scale for 32. Rows of x are
// laid out to match (chunk_layout), the chunk's products are summed unscaled in each lane and the sum is
// multiplied by the lane's block scale (lanes 4b .. 4b + 3 are block b's): the products as exact, summed in
// another order than the block path's. Six experts of V4.1-Flash's size (2304x5120 gate, up and down), one row,
// weights evicted, an AMD EPYC with AVX-512, alternating: 29-34 GB/s a block at a time with a row's hints at its
// start, 39-40 with the hints spread, 45-47 by chunks (one thread: 18-20, 20-24, 27-30; a plain read 40-45).
constexpr int64_t CHUNK = 128;
constexpr int64_t AHEAD_BYTES = 8192;  // how far ahead of a chunk its matrix row's bytes are requested

// x's columns c .. c + 127 in the chunk's order: dst[16 i + j] = src[8 j + i]
inline void chunk_layout(const float* src, float* dst) {
    for (int64_t i = 0; i < 8; ++i)
        for (int64_t j = 0; j < 16; ++j) dst[16 * i + j] = src[8 * j + i];
}

// The block scales of a chunk's lanes (its four scale bytes at s) as float32: lane j has 2^(s[j / 4] - 127)
inline __m512 chunk_scales(const uint8_t* s) {
    uint32_t word;
    std::memcpy(&word, s, sizeof word);
    const __m512i shifts = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
    const __m512i e = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word)), shifts),
                                       _mm512_set1_epi32(0xFF));
    const __mmask16 zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());  // 2^-127: a subnormal, as e8m0
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(_mm512_slli_epi32(e, 23), zero, _mm512_set1_epi32(0x00400000)));
}

// M matrix rows (qm[m], sm[m]: bytes and scales) against R rows of xs (chunk_layout's order): sums[m][r]. Whole
// chunks first, then the blocks past the last chunk (K % 128) a block at a time ([16 even | 16 odd] columns).
template <int64_t M, int64_t R>
inline void chunk_products(const uint8_t* const* qm, const uint8_t* const* sm, const float* const* xs, int64_t K,
                           float (*sums)[ROWS]) {
    const int64_t chunks = K / CHUNK;
    const __m512 table = _mm512_load_ps(E2M1);
    __m512 acc[M][R];
    for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
        __m512i codes[M];
        __m512 t[M][R];
        for (int64_t m = 0; m < M; ++m) {
            // a hint a chunk, AHEAD_BYTES ahead: spread out, where a burst of a row's hints at its start kept a
            // thread at 18-20 GB/s
            __builtin_prefetch(qm[m] + c * (CHUNK / 2) + AHEAD_BYTES);
            if (c % 16 == 0) __builtin_prefetch(sm[m] + c * (CHUNK / BLOCK) + AHEAD_BYTES / 16);
            codes[m] = _mm512_loadu_si512(qm[m] + c * (CHUNK / 2));
        }
        for (int64_t i = 0; i < 8; ++i) {
            for (int64_t m = 0; m < M; ++m) {
                const __m512 w = _mm512_permutexvar_ps(codes[m], table);  // the permute reads the low 4 bits only
                codes[m] = _mm512_srli_epi32(codes[m], 4);
                for (int64_t r = 0; r < R; ++r) {
                    const __m512 x = _mm512_loadu_ps(xs[r] + c * CHUNK + 16 * i);
                    t[m][r] = i ? _mm512_fmadd_ps(w, x, t[m][r]) : _mm512_mul_ps(w, x);
                }
            }
        }
        for (int64_t m = 0; m < M; ++m) {
            const __m512 scale = chunk_scales(sm[m] + c * (CHUNK / BLOCK));
            for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(t[m][r], scale, acc[m][r]);
        }
    }
    for (int64_t b = chunks * (CHUNK / BLOCK); b < K / BLOCK; ++b)
        for (int64_t m = 0; m < M; ++m) {
            const __m512 scaled = _mm512_mul_ps(table, _mm512_set1_ps(e8m0(sm[m][b])));
            const __m512i codes =
                _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qm[m] + b * 16)));
            const __m512 lo = _mm512_permutexvar_ps(codes, scaled);
            const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), scaled);
            for (int64_t r = 0; r < R; ++r) {
                acc[m][r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xs[r] + b * BLOCK), acc[m][r]);
                acc[m][r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xs[r] + b * BLOCK + 16), acc[m][r]);
            }
        }
    for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < R; ++r) sums[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}
#elif defined(FS_AVX2)
// Two matrix rows (n and n + 1 of one matrix, or row n of the gate and of the up projection) against up to
// ROWS rows of xs: two matrix rows share each load of xs and each row's sums are those
// row_products makes, in the same order. One projection of the peers checkpoint (16 x 256x512 and 512x256,
// weights evicted, 1 thread, AMD EPYC Zen 3): 1.12-1.15x one row at a time at 16 rows, 1.2-1.3x at 1 to 8.
template <int64_t R>
inline void row_pair_products(const uint8_t* q0, const uint8_t* s0, const uint8_t* q1, const uint8_t* s1,
                              const float* const* xs, int64_t K, float* sums0, float* sums1) {
    const int64_t blocks = K / BLOCK;
    __m256 acc0[R], acc1[R];
    for (int64_t r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m256 f0[4], f1[4];
        decode32(q0 + b * 16, f0);
        decode32(q1 + b * 16, f1);
        const __m256 scale0 = _mm256_set1_ps(e8m0(s0[b])), scale1 = _mm256_set1_ps(e8m0(s1[b]));
        for (int64_t r = 0; r < R; ++r) {
            acc0[r] = _mm256_fmadd_ps(block_sum(f0, xs[r] + b * BLOCK), scale0, acc0[r]);
            acc1[r] = _mm256_fmadd_ps(block_sum(f1, xs[r] + b * BLOCK), scale1, acc1[r]);
        }
    }
    for (int64_t r = 0; r < R; ++r) {
        sums0[r] = lane_sum(acc0[r]);
        sums1[r] = lane_sum(acc1[r]);
    }
}
#endif

// R <= ROWS rows of xs times matrix rows n0 .. n1 of one expert (q, s at its first row); out[r] at row n's
// column. With a second matrix (q2, s2: the up projection beside the gate), its products go to out2.
inline void tile_products(const uint8_t* q, const uint8_t* s, const uint8_t* q2, const uint8_t* s2, int64_t n0,
                          int64_t n1, const float* const* rows, int64_t R, int64_t K, float* const* out,
                          float* const* out2) {
    const int64_t qrow = K / 2, srow = K / BLOCK;
#if defined(FS_AVX512)
    with_rows<ROWS>(R, [&](auto count) {
        constexpr int64_t RR = decltype(count)::value;
        float sums[2][ROWS];
        for (int64_t n = n0; n < n1;) {
            // two matrix rows a pass (rows n and n + 1, or row n of both matrices) for up to PAIR_ROWS rows of x
            const bool two = RR <= PAIR_ROWS && (q2 || n + 1 < n1);
            const uint8_t* qm[2] = {q + n * qrow, q2 ? q2 + n * qrow : q + (n + 1) * qrow};
            const uint8_t* sm[2] = {s + n * srow, q2 ? s2 + n * srow : s + (n + 1) * srow};
            if (two) {
                chunk_products<2, RR>(qm, sm, rows, K, sums);
            } else {
                chunk_products<1, RR>(qm, sm, rows, K, sums);
                if (q2) chunk_products<1, RR>(qm + 1, sm + 1, rows, K, sums + 1);
            }
            for (int64_t r = 0; r < RR; ++r) {
                out[r][n] = sums[0][r];
                if (q2) out2[r][n] = sums[1][r];
                else if (two) out[r][n + 1] = sums[1][r];
            }
            n += q2 || !two ? 1 : 2;
        }
    });
#else
    float sums[ROWS], sums1[ROWS];
    int64_t n = n0;
#if defined(FS_AVX2)
    if (R <= PAIR_ROWS)
        for (; n + (q2 ? 0 : 1) < n1; n += q2 ? 1 : 2) {  // rows n and n + 1, or row n of both matrices
            const uint8_t *qa = q + n * qrow, *sa = s + n * srow;
            const uint8_t *qb = q2 ? q2 + n * qrow : qa + qrow, *sb = q2 ? s2 + n * srow : sa + srow;
            prefetch_rows(qa + AHEAD * qrow, sa + AHEAD * srow, q2 ? 1 : 2, K);
            if (q2) prefetch_rows(qb + AHEAD * qrow, sb + AHEAD * srow, 1, K);
            with_rows<ROWS>(R, [&](auto count) {
                row_pair_products<decltype(count)::value>(qa, sa, qb, sb, rows, K, sums, sums1);
            });
            for (int64_t r = 0; r < R; ++r) {
                out[r][n] = sums[r];
                (q2 ? out2[r][n] : out[r][n + 1]) = sums1[r];
            }
        }
#endif
    for (; n < n1; ++n)
        for (int64_t m = 0; m < (q2 ? 2 : 1); ++m) {
            const uint8_t *qn = (m ? q2 : q) + n * qrow, *sn = (m ? s2 : s) + n * srow;
            prefetch_rows(qn + AHEAD * qrow, sn + AHEAD * srow, 1, K);
            with_rows<ROWS>(R, [&](auto count) { row_products<decltype(count)::value>(qn, sn, rows, K, sums); });
            for (int64_t r = 0; r < R; ++r) (m ? out2 : out)[r][n] = sums[r];
        }
#endif
}

// Activations quantized to 8 bits (a8: the option that trades exactness for llama.cpp's speed): each 32-block of
// a row of x (in its [16 even | 16 odd] order) as int8 codes round(x / d) and the float d = max |x| / 127
// (llama.cpp's Q8_0 rounding, d kept in float32), so that a block's product with a matrix row is an integer dot
// product of its codes with the E2M1 values times 2 (every value is then an integer), times d and half the
// block's scale. Integer products need no decode to float: one byte shuffle turns 32 codes into their values.
struct QuantizedRows {
    std::vector<int8_t> q;  // [T, K]
    std::vector<float> d;   // [T, K / 32]
    QuantizedRows(const float* x, int64_t T, int64_t K) : q(T * K), d(T * K / BLOCK) {  // x [T, K] as given
        for (int64_t t = 0; t < T; ++t)
            for (int64_t b = 0; b < K / BLOCK; ++b) {
                float v[BLOCK];  // the block's even columns, then its odd ones
                for (int64_t j = 0; j < 16; ++j) {
                    v[j] = x[t * K + b * BLOCK + 2 * j];
                    v[16 + j] = x[t * K + b * BLOCK + 2 * j + 1];
                }
                float amax = 0.f;
                for (int64_t j = 0; j < BLOCK; ++j)  // a NaN stays
                    amax = std::fabs(v[j]) > amax || v[j] != v[j] ? std::fabs(v[j]) : amax;
                const float scale = amax / 127.f, inv = scale > 0.f && scale <= FLT_MAX ? 1.f / scale : 0.f;
                d[t * (K / BLOCK) + b] = scale;  // NaN or infinite with such a value in the block: so is the product
                for (int64_t j = 0; j < BLOCK; ++j) {
                    const float r = std::nearbyint(v[j] * inv);
                    q[t * K + b * BLOCK + j] = static_cast<int8_t>(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
                }
            }
    }
};

// E2M1 values times 2 as int8, codes 0 .. 15, twice (one copy a 128-bit lane)
alignas(32) const int8_t E2M1_TWICE[32] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                           0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

#if defined(FS_AVX2) || defined(FS_AVX512)
// The 32 values of one block of a matrix row (16 code bytes) as int8 twice their E2M1 value, in the [16 even |
// 16 odd] order of the quantized rows: low nibbles in the low lane, high nibbles in the high one
inline __m256i block_values(const uint8_t* q) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), low = _mm_set1_epi8(0x0F);
    const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
    return _mm256_shuffle_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(E2M1_TWICE)), codes);
}
#endif

// M matrix rows (qm[m], sm[m]: their bytes and scales) against R quantized rows of x (xq[r], xd[r]). With AVX2
// each block's 32 products are summed exactly in 8 int32 lanes (maddubs: |w| times x with w's sign, pairs of
// products in int16, at most 2 x 12 x 127 in magnitude; madd: pairs of those in int32), then added to 8 float
// lanes times d times the scale; the scalar path sums a block in one int32.
template <int64_t M, int64_t R>
inline void a8_products(const uint8_t* const* qm, const uint8_t* const* sm, const int8_t* const* xq,
                        const float* const* xd, int64_t K, float (*sums)[ROWS]) {
    const int64_t blocks = K / BLOCK;
#if defined(FS_AVX2) || defined(FS_AVX512)
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[M][R];
    for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m256i w[M], magnitude[M];
        float half_scale[M];
        for (int64_t m = 0; m < M; ++m) {
            w[m] = block_values(qm[m] + b * 16);
            magnitude[m] = _mm256_sign_epi8(w[m], w[m]);
            half_scale[m] = e8m0(sm[m][b]) * 0.5f;
        }
        for (int64_t r = 0; r < R; ++r) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + b * BLOCK));
            for (int64_t m = 0; m < M; ++m) {
                const __m256i dot =
                    _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[m], _mm256_sign_epi8(xv, w[m])), ones);
                acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(half_scale[m] * xd[r][b]),
                                            acc[m][r]);
            }
        }
    }
    for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < R; ++r) sums[m][r] = lane_sum(acc[m][r]);
#else
    for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < R; ++r) {
            float acc = 0.f;
            for (int64_t b = 0; b < blocks; ++b) {
                int32_t dot = 0;
                for (int64_t j = 0; j < 16; ++j) {
                    const uint8_t byte = qm[m][b * 16 + j];
                    dot += E2M1_TWICE[byte & 15] * xq[r][b * BLOCK + j] + E2M1_TWICE[byte >> 4] * xq[r][b * BLOCK + 16 + j];
                }
                acc += static_cast<float>(dot) * (e8m0(sm[m][b]) * 0.5f * xd[r][b]);
            }
            sums[m][r] = acc;
        }
#endif
}

// tile_products with quantized rows: matrix rows n0 .. n1 (of both matrices where q2 is given, else two rows at a
// time) against R <= ROWS quantized rows, four at a time (two matrices by four rows of sums stay in registers).
// No prefetch hints: the hardware's stream suffices at this rate, and hints 4 or 8 rows ahead cost 1.2-1.3x (one
// 2048x4096 gate and up pair at one row, 24 experts cycled, 2 threads, AMD EPYC: 620 us without, 730-800 with)
inline void a8_tile_products(const uint8_t* q, const uint8_t* s, const uint8_t* q2, const uint8_t* s2, int64_t n0,
                             int64_t n1, const int8_t* const* xq, const float* const* xd, int64_t R, int64_t K,
                             float* const* out, float* const* out2) {
    const int64_t qrow = K / 2, srow = K / BLOCK;
    float sums[2][ROWS];
    for (int64_t n = n0; n < n1;) {
        const bool two = q2 || n + 1 < n1;
        const uint8_t* qm[2] = {q + n * qrow, q2 ? q2 + n * qrow : q + (n + 1) * qrow};
        const uint8_t* sm[2] = {s + n * srow, q2 ? s2 + n * srow : s + (n + 1) * srow};
        for (int64_t r0 = 0; r0 < R; r0 += 4) {
            with_rows<4>(R - r0 < 4 ? R - r0 : 4, [&](auto rows) {
                constexpr int64_t RR = decltype(rows)::value;
                if (two)
                    a8_products<2, RR>(qm, sm, xq + r0, xd + r0, K, sums);
                else
                    a8_products<1, RR>(qm, sm, xq + r0, xd + r0, K, sums);
            });
            for (int64_t r = r0; r < R && r < r0 + 4; ++r) {
                out[r][n] = sums[0][r - r0];
                if (two) (q2 ? out2[r][n] : out[r][n + 1]) = sums[1][r - r0];
            }
        }
        n += q2 || !two ? 1 : 2;
    }
}

}  // namespace

// Pair p = row p / k of x [P / k, K] times expert experts[p]'s matrix, its bytes at q[e] ([N, K/2]) and scales at
// s[e] ([N, K/32]), into out[p] (out [P, N]); with q2 and s2 (not null) also times the second matrix of each expert
// (the up projection beside the gate), into out[P + p]. The experts' matrices need not lie in one tensor: a
// checkpoint's mapped files hold each one where it was written.
static void kernel(const float* x, const int64_t* experts, const uint8_t* const* q, const uint8_t* const* s,
                   const uint8_t* const* q2, const uint8_t* const* s2, float* out, int64_t P, int64_t k, int64_t E,
                   int64_t N, int64_t K, int64_t threads, bool a8) {
    const ExpertGroups groups(experts, P, E, "mxfp4_pairs");
    const std::vector<int64_t>& first = groups.first;
    const std::vector<int64_t>& order = groups.order;
    // x laid out as the products read it: each 32-block as [even | odd] columns (AVX2: in decode32's order,
    // X_ORDER); AVX-512 lays each whole 128-chunk out in chunk_layout's order and the blocks past them as [even | odd]
    const int64_t T = P / k;
    const auto xs_buf = aligned_floats(T * K, false);  // every value written below
    float* const xs = xs_buf.get();
    for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < K; c += BLOCK) {
            const float* src = x + t * K + c;
            float* dst = xs + t * K + c;
#if defined(FS_AVX512)
            if (c + CHUNK <= K) {
                chunk_layout(src, dst);
                c += CHUNK - BLOCK;
                continue;
            }
            const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
            const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
            _mm512_storeu_ps(dst, _mm512_permutex2var_ps(a, even, b));
            _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(a, odd, b));
#elif defined(FS_AVX2)
            for (int64_t j = 0; j < BLOCK; ++j) dst[j] = src[X_ORDER[j]];
#else
            for (int64_t j = 0; j < 16; ++j) {
                dst[j] = src[2 * j];
                dst[16 + j] = src[2 * j + 1];
            }
#endif
        }
    const std::unique_ptr<QuantizedRows> quantized(a8 ? new QuantizedRows(x, T, K) : nullptr);
    // work items: (expert with pairs, tile of matrix rows)
    const int64_t tiles = (N + TILE - 1) / TILE;
    const std::vector<int64_t> items = groups.items(tiles);
    const int64_t n_items = static_cast<int64_t>(items.size());
    // guided: long runs of consecutive items first (each thread streams its experts' bytes in order), shorter ones
    // to balance the end. A layer's gate/up and down calls, weights evicted: 519 us dynamic, 464 guided, 464 static
#pragma omp parallel for num_threads(threads) schedule(guided)
    for (int64_t i = 0; i < n_items; ++i) {
        const int64_t e = items[i] / tiles, n0 = (items[i] % tiles) * TILE, n1 = n0 + TILE < N ? n0 + TILE : N;
        for (int64_t c0 = first[e]; c0 < first[e + 1]; c0 += ROWS) {
            const int64_t R = first[e + 1] - c0 < ROWS ? first[e + 1] - c0 : ROWS;
            const float* rows[ROWS];
            float *outs[ROWS], *outs2[ROWS];
            const int8_t* rows_q[ROWS];
            const float* rows_d[ROWS];
            for (int64_t r = 0; r < R; ++r) {
                const int64_t p = order[c0 + r];
                rows[r] = xs + (p / k) * K;
                outs[r] = out + p * N;
                outs2[r] = out + (P + p) * N;
                if (quantized) {
                    rows_q[r] = quantized->q.data() + (p / k) * K;
                    rows_d[r] = quantized->d.data() + (p / k) * (K / BLOCK);
                }
            }
            if (quantized) {
                a8_tile_products(q[e], s[e], q2 ? q2[e] : nullptr, q2 ? s2[e] : nullptr, n0, n1, rows_q, rows_d, R,
                                 K, outs, outs2);
                continue;
            }
            tile_products(q[e], s[e], q2 ? q2[e] : nullptr, q2 ? s2[e] : nullptr, n0, n1, rows, R, K, outs, outs2);
        }
    }
}

// flashserve::mxfp4_pairs(x, experts, q, s) and flashserve::mxfp4_gate_up(x, experts, q1, s1, q3, s3) for CPU
// tensors on torch's dispatcher (schemas: ops.cpp): a compiled step's C++ reaches them with no
// Python in between
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {
void check(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& q, const at::Tensor& s) {
    const bool shaped = q.dim() == 3 && s.dim() == 3 && x.dim() == 2;
    TORCH_CHECK(shaped && x.size(1) == 2 * q.size(2) && q.size(2) % 16 == 0 && s.size(0) == q.size(0) &&
                    s.size(1) == q.size(1) && s.size(2) == q.size(2) / 16 && x.size(0) > 0 &&
                    experts.numel() % x.size(0) == 0 && (experts.dim() == 1 ? experts.numel() == x.size(0)
                                                                            : experts.size(0) == x.size(0)),
                "mxfp4_pairs: x ", x.sizes(), ", experts ", experts.sizes(), ", q ", q.sizes(), ", s ", s.sizes(),
                " do not match");
    TORCH_CHECK(q.scalar_type() == at::kByte && s.scalar_type() == at::kByte, "mxfp4_pairs: q and s must be uint8");
}

// out [matrices, P, N]: x's rows times each pair's expert in (q, s) and, if given, (q2, s2)
at::Tensor pairs(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& q, const at::Tensor& s,
                 const at::Tensor* q2, const at::Tensor* s2, bool a8) {
    const int64_t P = experts.numel(), N = q.size(1);
    const at::Tensor xs = x.to(at::kFloat).contiguous(), ex = experts.to(at::kLong).contiguous();
    const at::Tensor qc = q.contiguous(), sc = s.contiguous();
    const at::Tensor q2c = q2 ? q2->contiguous() : qc, s2c = s2 ? s2->contiguous() : sc;
    at::Tensor out = at::empty({q2 ? 2 : 1, P, N}, xs.options());
    const int64_t E = q.size(0), K = x.size(1);
    std::vector<const uint8_t*> bases[4];  // each expert's first byte of q, s, q2, s2 in the stacked tensors
    const at::Tensor* stacked[4] = {&qc, &sc, &q2c, &s2c};
    for (int m = 0; m < 4; ++m) {
        const uint8_t* base = stacked[m]->data_ptr<uint8_t>();
        const int64_t stride = N * (m % 2 ? K / BLOCK : K / 2);
        bases[m].reserve(E);
        for (int64_t e = 0; e < E; ++e) bases[m].push_back(base + e * stride);
    }
    kernel(xs.data_ptr<float>(), ex.data_ptr<int64_t>(), bases[0].data(), bases[1].data(),
           q2 ? bases[2].data() : nullptr, q2 ? bases[3].data() : nullptr, out.data_ptr<float>(), P, P / x.size(0), E,
           N, K, at::get_num_threads(), a8);
    return out;
}

// flashserve::mxfp4_mapped(x, experts, table, n, a8): the pair products of experts held one matrix an expert
// (flashserve.model.mapped_experts): table [2 * m, E] int64 holds, for each of m = 1 or 2 matrices (gate and up,
// or down), the address of each expert's bytes [n, K/2] and of its scales [n, K/32], laid out as the stacked
// tensors' rows are. out [m, P, n]. The caller keeps the tensors at those addresses alive (the module holds them).
at::Tensor mapped_op(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& table, int64_t n, bool a8) {
    TORCH_CHECK(x.dim() == 2 && x.size(1) % BLOCK == 0 && x.size(0) > 0 && experts.numel() % x.size(0) == 0,
                "mxfp4_mapped: x ", x.sizes(), " and experts ", experts.sizes(), " do not match (K a multiple of 32)");
    TORCH_CHECK(table.dim() == 2 && (table.size(0) == 2 || table.size(0) == 4) && table.scalar_type() == at::kLong &&
                    n > 0,
                "mxfp4_mapped: table ", table.sizes(), " must be int64 [2 or 4, E], n ", n, " positive");
    const at::Tensor tc = table.contiguous();
    const int64_t E = tc.size(1), P = experts.numel(), K = x.size(1);
    const auto* addr = reinterpret_cast<const uint8_t* const*>(tc.data_ptr<int64_t>());
    for (int64_t i = 0; i < tc.numel(); ++i)
        TORCH_CHECK(addr[i] != nullptr, "mxfp4_mapped: expert ", i % E, " has no matrix (table entry ", i, ")");
    const at::Tensor xs = x.to(at::kFloat).contiguous(), ex = experts.to(at::kLong).contiguous();
    const bool two = tc.size(0) == 4;
    at::Tensor out = at::empty({two ? 2 : 1, P, n}, xs.options());
    kernel(xs.data_ptr<float>(), ex.data_ptr<int64_t>(), addr, addr + E, two ? addr + 2 * E : nullptr,
           two ? addr + 3 * E : nullptr, out.data_ptr<float>(), P, P / x.size(0), E, n, K, at::get_num_threads(), a8);
    return out;
}

at::Tensor pairs_op(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& q, const at::Tensor& s,
                    bool a8) {
    check(x, experts, q, s);
    return pairs(x, experts, q, s, nullptr, nullptr, a8)[0];
}

at::Tensor gate_up_op(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& q1, const at::Tensor& s1,
                      const at::Tensor& q3, const at::Tensor& s3, bool a8) {
    check(x, experts, q1, s1);
    TORCH_CHECK(q3.sizes() == q1.sizes() && s3.sizes() == s1.sizes() && q3.scalar_type() == at::kByte &&
                    s3.scalar_type() == at::kByte,
                "mxfp4_gate_up: the up projection q ", q3.sizes(), ", s ", s3.sizes(), " does not match the gate's");
    return pairs(x, experts, q1, s1, &q3, &s3, a8);
}

at::Tensor mxfp4_pairs_op(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& q, const at::Tensor& s) {
    return pairs_op(x, experts, q, s, false);
}

at::Tensor mxfp4_pairs_a8_op(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& q,
                             const at::Tensor& s) {
    return pairs_op(x, experts, q, s, true);
}

at::Tensor mxfp4_gate_up_op(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& q1,
                            const at::Tensor& s1, const at::Tensor& q3, const at::Tensor& s3) {
    return gate_up_op(x, experts, q1, s1, q3, s3, false);
}

at::Tensor mxfp4_gate_up_a8_op(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& q1,
                               const at::Tensor& s1, const at::Tensor& q3, const at::Tensor& s3) {
    return gate_up_op(x, experts, q1, s1, q3, s3, true);
}
}  // namespace

FS_LIBRARY_IMPL(m) {
    m.impl("mxfp4_pairs", &mxfp4_pairs_op);
    m.impl("mxfp4_gate_up", &mxfp4_gate_up_op);
    m.impl("mxfp4_pairs_a8", &mxfp4_pairs_a8_op);
    m.impl("mxfp4_gate_up_a8", &mxfp4_gate_up_a8_op);
    m.impl("mxfp4_mapped", &mapped_op);
}
