// FP8 panel products on the CPU (flashserve.model.cpu_kernels): fp8_pairs' products (row p of x times the
// block-FP8 matrix of expert experts[p]) over a copy of the codes laid out in column panels at start-up, as
// dense_rows reads float weights: panels [E, ceil(N / 16), K, 16] uint8, panel j holding columns 16j .. 16j + 15
// (code 0 past N) k by k. Each k reads one 16-byte line of a panel, decodes its 16 codes in three integer
// instructions and a multiply by the block's power-of-two scale (two above 2^7; see Factors), and multiplies them by
// up to PASS rows' x[r, k], broadcast: no horizontal sums, and the decode is shared by the pass's rows. fp8_pairs
// reads the codes as stored, sixteen columns of one matrix row at a time, and sums each output's lanes at its
// end; at 16 rows it ran at about 40% of the machine's multiply-add rate (V4-Flash's dense layers, 2 threads, AMD
// EPYC, AVX-512).
//
// Each output is the sum, in order, of its column blocks' sums, each block's sum one fused multiply-add a k in
// order from zero, on every path and for any number of rows or threads: a row's products do not depend on the
// rows beside it. Each weight is what flashserve.model.packed.decode gives (e4m3(code) * 2^(b - 127) for its
// block's scale b, rounded as that product rounds), whatever the thread's denormal flags (cleared while the kernel
// runs, as subnormal codes decode to subnormal floats). Layout (contiguous): x [T, K] float32, each row in
// k = P / T consecutive pairs; experts [P] int64 in [0, E); s [E, ceil(N / rb), ceil(K / cb)] uint8 UE8M0;
// out [P, N] float32. rb % 16 == 0 (a panel lies in one row block).
#include "isa.h"
#include "pairs.h"
#include "fp8.h"
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace {

constexpr int64_t LANES = 16;       // columns a panel
constexpr int64_t TILE = 8;         // panels a work item (128 columns)
// rows of x a pass over a panel: 16 rows as 12 + 4 made 184-197 G multiply-adds a second on V4-Flash's shapes (2
// threads), one pass of 16 by one panel 166-186, two of 8 by two panels 156-180
constexpr int64_t PASS = 12;
constexpr int64_t AHEAD = 512;      // panel lines (k) requested ahead: 8 KB a panel

// The factors that turn a code's "tiny" float (its value times 2^-120, see decode16) into its weight for a block
// scale b: tiny * lo for b <= 134 (2^(b - 7), a normal float: every product exact), else (tiny * lo) * hi with
// lo = 2^127 (exact) and hi = 2^(b - 134), infinite for b = 255 (e8m0's 2^128), rounded once as
// e4m3(code) * e8m0(b) rounds.
struct Factors {
    float lo = 1.f, hi = 1.f;
    bool two = false;
    Factors() = default;
    explicit Factors(uint8_t b)
        : lo(b <= 134 ? e8m0(static_cast<uint8_t>(b + 120)) : 0x1p127f),
          hi(b <= 134 ? 1.f : b == 255 ? INFINITY : e8m0(static_cast<uint8_t>(b - 7))), two(b > 134) {}
};

// A hint a cache line (four lines of a panel), AHEAD lines ahead in the order the lines are read: P panels side
// by side (panels j .. j + P - 1 lie one after another), then the next P; no fault past the end. Requesting
// each panel's own lines ahead left the start of every group of panels unrequested: 32768x1024 at 4 rows 0.77x
// fp8_pairs, where the kernel is 1.0x or faster at every other shape.
template <int64_t P>
inline void request(const uint8_t* const* pan, int64_t k, int64_t K) {
    const int64_t ahead = k + AHEAD, skip = ahead >= K ? (P - 1) * K * LANES : 0;
    for (int64_t p = 0; p < P; ++p) __builtin_prefetch(pan[p] + ahead * LANES + skip);
}

#if defined(FS_AVX512)
// sixteen codes as their values times 2^-120: sign-extended to 32 bits and moved up by 20, a code's sign lands in
// bit 31 (the mask clears its copies in bits 27..30) and its exponent and mantissa in bits 26..20 (exponent field
// 0: the subnormal m 2^-129, the code's m 2^-9 times 2^-120)
inline __m512 decode16(const uint8_t* line) {
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line)));
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_slli_epi32(v, 20), _mm512_set1_epi32(static_cast<int32_t>(0x87F00000u))));
}

// Panels pan[0 .. P) (their lines k0 .. k1, one column block: factors f[p]) times R rows of xt (x k-major: xt[k *
// RS + r]): the block's sums, added to tot[p][r]
template <int64_t P, int64_t R, bool TWO>
inline void block_products(const uint8_t* const* pan, const Factors* f, const float* xt, int64_t RS, int64_t K,
                           int64_t k0, int64_t k1, float (*tot)[R][LANES]) {
    __m512 acc[P][R];
    for (int64_t p = 0; p < P; ++p)
        for (int64_t r = 0; r < R; ++r) acc[p][r] = _mm512_setzero_ps();
    __m512 lo[P], hi[P];
    for (int64_t p = 0; p < P; ++p) {
        lo[p] = _mm512_set1_ps(f[p].lo);
        hi[p] = _mm512_set1_ps(f[p].hi);
    }
    for (int64_t k = k0; k < k1; ++k) {
        if (k % 4 == 0) request<P>(pan, k, K);
        __m512 w[P];
        for (int64_t p = 0; p < P; ++p) {
            w[p] = _mm512_mul_ps(decode16(pan[p] + k * LANES), lo[p]);
            if constexpr (TWO) w[p] = _mm512_mul_ps(w[p], hi[p]);
        }
        for (int64_t r = 0; r < R; ++r) {
            const __m512 b = _mm512_set1_ps(xt[k * RS + r]);
            for (int64_t p = 0; p < P; ++p) acc[p][r] = _mm512_fmadd_ps(w[p], b, acc[p][r]);
        }
    }
    for (int64_t p = 0; p < P; ++p)
        for (int64_t r = 0; r < R; ++r)
            _mm512_store_ps(tot[p][r], _mm512_add_ps(_mm512_load_ps(tot[p][r]), acc[p][r]));
}
#elif defined(FS_AVX2)
// decode16's values as two halves (columns 0 .. 7, 8 .. 15)
inline void decode16(const uint8_t* line, __m256& a, __m256& b) {
    const __m256i keep = _mm256_set1_epi32(static_cast<int32_t>(0x87F00000u));
    const __m256i va = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(line)));
    const __m256i vb = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(line + 8)));
    a = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(va, 20), keep));
    b = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(vb, 20), keep));
}

template <int64_t P, int64_t R, bool TWO>
inline void block_products(const uint8_t* const* pan, const Factors* f, const float* xt, int64_t RS, int64_t K,
                           int64_t k0, int64_t k1, float (*tot)[R][LANES]) {
    __m256 acc[P][R][2];
    for (int64_t p = 0; p < P; ++p)
        for (int64_t r = 0; r < R; ++r) acc[p][r][0] = acc[p][r][1] = _mm256_setzero_ps();
    __m256 lo[P], hi[P];
    for (int64_t p = 0; p < P; ++p) {
        lo[p] = _mm256_set1_ps(f[p].lo);
        hi[p] = _mm256_set1_ps(f[p].hi);
    }
    for (int64_t k = k0; k < k1; ++k) {
        if (k % 4 == 0) request<P>(pan, k, K);
        __m256 w[P][2];
        for (int64_t p = 0; p < P; ++p) {
            decode16(pan[p] + k * LANES, w[p][0], w[p][1]);
            for (int h = 0; h < 2; ++h) {
                w[p][h] = _mm256_mul_ps(w[p][h], lo[p]);
                if constexpr (TWO) w[p][h] = _mm256_mul_ps(w[p][h], hi[p]);
            }
        }
        for (int64_t r = 0; r < R; ++r) {
            const __m256 b = _mm256_set1_ps(xt[k * RS + r]);
            for (int64_t p = 0; p < P; ++p)
                for (int h = 0; h < 2; ++h) acc[p][r][h] = _mm256_fmadd_ps(w[p][h], b, acc[p][r][h]);
        }
    }
    for (int64_t p = 0; p < P; ++p)
        for (int64_t r = 0; r < R; ++r)
            for (int h = 0; h < 2; ++h)
                _mm256_store_ps(tot[p][r] + 8 * h, _mm256_add_ps(_mm256_load_ps(tot[p][r] + 8 * h), acc[p][r][h]));
}
#endif

// Panels pan[0 .. P) (columns of one row block each: their scale rows sc[p]) times R rows of xt, all K: out[r]
// at each panel's first column (cols[p] of its 16 columns written). Each output is the sum of its column blocks'
// sums in order, each block's sum one multiply-add a k in order from zero: rounding grows with the block's and the
// blocks' count, not with K (one sum over all of K = 1024: about 5x the error)
template <int64_t P, int64_t R>
inline void panel_products(const uint8_t* const* pan, const uint8_t* const* sc, int64_t cb, const float* xt,
                           int64_t RS, int64_t K, float* const* out, const int64_t* cols) {
    alignas(64) float tot[P][R][LANES] = {};
    for (int64_t k0 = 0; k0 < K; k0 += cb) {
        const int64_t k1 = k0 + cb < K ? k0 + cb : K;
#if defined(FS_AVX2) || defined(FS_AVX512)
        Factors f[P];
        bool two = false;
        for (int64_t p = 0; p < P; ++p) {
            f[p] = Factors(sc[p][k0 / cb]);
            two = two || f[p].two;
        }
        if (two)
            block_products<P, R, true>(pan, f, xt, RS, K, k0, k1, tot);
        else
            block_products<P, R, false>(pan, f, xt, RS, K, k0, k1, tot);
#else
        for (int64_t p = 0; p < P; ++p) {
            const float scale = e8m0(sc[p][k0 / cb]);
            for (int64_t r = 0; r < R; ++r)
                for (int64_t c = 0; c < LANES; ++c) {
                    float acc = 0.f;
                    for (int64_t k = k0; k < k1; ++k)  // each weight exact, or rounded as e4m3 * e8m0 rounds
                        acc = std::fma(e4m3(pan[p][k * LANES + c]) * scale, xt[k * RS + r], acc);
                    tot[p][r][c] += acc;
                }
        }
#endif
    }
    for (int64_t p = 0; p < P; ++p)
        for (int64_t r = 0; r < R; ++r)
            for (int64_t c = 0; c < cols[p]; ++c) out[r][p * LANES + c] = tot[p][r][c];
}

// Panels at a time for R rows of a pass: enough sums in flight for the multiply-adds' latency, within the
// registers (AVX-512: P x R sums of 32; AVX2: 2 P x R of 16)
#if defined(FS_AVX512)
constexpr int64_t panels_for(int64_t R) { return R <= 2 ? 8 : R <= 4 ? 4 : R <= 12 ? 2 : 1; }
#elif defined(FS_AVX2)
constexpr int64_t panels_for(int64_t R) { return R <= 1 ? 4 : R <= 3 ? 2 : 1; }
constexpr int64_t AVX2_PASS = 6;  // rows a pass: 12 sums of the 16 registers
#else
constexpr int64_t panels_for(int64_t) { return 1; }
#endif

// Panels j0 .. j1 of one expert times its R rows of xt (a pass: R <= PASS), P at a time (the last ones one at a
// time); out[r] at column 0
template <int64_t R>
inline void tile_products(const uint8_t* panels, const uint8_t* s, int64_t rb, int64_t cb, int64_t j0, int64_t j1,
                          int64_t N, int64_t K, const float* xt, int64_t RS, float* const* out) {
    constexpr int64_t P = panels_for(R);
    const int64_t sk = (K + cb - 1) / cb;
    const auto run = [&](auto count, int64_t j) {
        constexpr int64_t PP = decltype(count)::value;
        const uint8_t* pan[PP];
        const uint8_t* sc[PP];
        int64_t cols[PP];
        float* outs[R];
        for (int64_t p = 0; p < PP; ++p) {
            pan[p] = panels + (j + p) * K * LANES;
            sc[p] = s + ((j + p) * LANES / rb) * sk;
            cols[p] = N - (j + p) * LANES < LANES ? N - (j + p) * LANES : LANES;
        }
        for (int64_t r = 0; r < R; ++r) outs[r] = out[r] + j * LANES;
        panel_products<PP, R>(pan, sc, cb, xt, RS, K, outs, cols);
    };
    int64_t j = j0;
    for (; j + P <= j1; j += P) run(std::integral_constant<int64_t, P>{}, j);
    for (; j < j1; ++j) run(std::integral_constant<int64_t, 1>{}, j);
}

// The MXCSR bits that make subnormal inputs read as zero (DAZ) and results flush to zero (FTZ)
constexpr unsigned DENORMAL_FLAGS = 0x8040;

static void kernel(const float* x, const int64_t* experts, const uint8_t* panels, const uint8_t* s, float* out,
                   int64_t P, int64_t k, int64_t E, int64_t N, int64_t K, int64_t rb, int64_t cb, int64_t threads) {
    const ExpertGroups groups(experts, P, E, "fp8_panels");
    const int64_t J = (N + LANES - 1) / LANES, scale_rows = (N + rb - 1) / rb, scale_cols = (K + cb - 1) / cb;
    // each expert's rows of x k-major (xt[e]: [K, rows of e] from offset first[e] * K), so that a k's broadcasts
    // read one cache line
    const auto xt_buf = aligned_floats(P * K, false);
    float* const xt = xt_buf.get();
    for (int64_t e = 0; e < E; ++e) {
        const int64_t n = groups.first[e + 1] - groups.first[e];
        float* dst = xt + groups.first[e] * K;
        for (int64_t i = 0; i < n; ++i) {
            const float* row = x + (groups.order[groups.first[e] + i] / k) * K;
            for (int64_t c = 0; c < K; ++c) dst[c * n + i] = row[c];
        }
    }
    const int64_t tiles = (J + TILE - 1) / TILE;
    const std::vector<int64_t> items = groups.items(tiles);
    const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(threads)
    {
#if defined(__SSE__)
        const unsigned csr = _mm_getcsr();
        _mm_setcsr(csr & ~DENORMAL_FLAGS);
#endif
#pragma omp for schedule(guided)
        for (int64_t i = 0; i < n_items; ++i) {
            const int64_t e = items[i] / tiles, j0 = (items[i] % tiles) * TILE, j1 = j0 + TILE < J ? j0 + TILE : J;
            const int64_t first = groups.first[e], n = groups.first[e + 1] - first;
#if defined(FS_AVX2)
            constexpr int64_t pass = AVX2_PASS;
#else
            constexpr int64_t pass = PASS;
#endif
            for (int64_t r0 = 0; r0 < n; r0 += pass) {
                const int64_t R = n - r0 < pass ? n - r0 : pass;
                float* outs[PASS];
                for (int64_t r = 0; r < R; ++r) outs[r] = out + groups.order[first + r0 + r] * N;
                with_rows<pass>(R, [&](auto count) {
                    tile_products<decltype(count)::value>(panels + e * J * K * LANES,
                                                           s + e * scale_rows * scale_cols, rb, cb, j0, j1, N, K,
                                                           xt + first * K + r0, n, outs);
                });
            }
        }
#if defined(__SSE__)
        _mm_setcsr(csr);
#endif
    }
}

}  // namespace

// flashserve::fp8_panels(x, experts, panels, s, n, row_block, col_block) for CPU tensors on torch's dispatcher
// (schema: ops.cpp)
namespace {
at::Tensor fp8_panels_op(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& panels,
                         const at::Tensor& s, int64_t n, int64_t rb, int64_t cb) {
    const bool shaped = panels.dim() == 4 && panels.size(3) == LANES && s.dim() == 3 && x.dim() == 2 && n >= 1 &&
                        panels.size(1) == (n + LANES - 1) / LANES && rb >= LANES && rb % LANES == 0 && cb >= 1 &&
                        x.size(1) == panels.size(2) && s.size(0) == panels.size(0) &&
                        s.size(1) == (n + rb - 1) / rb && s.size(2) == (panels.size(2) + cb - 1) / cb &&
                        x.size(0) > 0 && experts.numel() % x.size(0) == 0;
    TORCH_CHECK(shaped, "fp8_panels: x ", x.sizes(), ", experts ", experts.sizes(), ", panels ", panels.sizes(),
                ", s ", s.sizes(), ", n ", n, ", blocks ", rb, "x", cb, " do not match");
    TORCH_CHECK(panels.scalar_type() == at::kByte && (s.scalar_type() == at::kByte ||
                                                      s.scalar_type() == at::kFloat8_e8m0fnu),
                "fp8_panels: panels must be E4M3 bytes and s UE8M0 bytes");
    const at::Tensor xs = x.to(at::kFloat).contiguous(), ex = experts.to(at::kLong).contiguous();
    const at::Tensor pc = panels.contiguous(), sc = s.contiguous();
    const int64_t P = ex.numel();
    at::Tensor out = at::empty({P, n}, xs.options());
    kernel(xs.data_ptr<float>(), ex.data_ptr<int64_t>(), pc.data_ptr<uint8_t>(),
           static_cast<const uint8_t*>(sc.data_ptr()), out.data_ptr<float>(), P, P / x.size(0), panels.size(0), n,
           x.size(1), rb, cb, at::get_num_threads());
    return out;
}
}  // namespace

FS_LIBRARY_IMPL(m) { m.impl("fp8_panels", &fp8_panels_op); }
