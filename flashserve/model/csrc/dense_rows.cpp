// Float32 products of a few rows on the CPU (flashserve.model.cpu_kernels): out = x @ W.T for x [M, K] (M a
// decode batch: 2 to 32 rows) against W [N, K] copied once at start-up into panels of 16 output columns,
// panels [ceil(N / 16), K, 16] (zero past N). Each k reads one 64-byte line of a panel and multiplies it by up to
// MR rows' x[r, k], broadcast: no horizontal sums, and the panels stream in order with the next lines requested
// ahead. torch's mm (MKL) copies W into its own panels on every call instead; at 16 rows with W evicted from the
// caches (2 threads, us): 256x512 47 against 19 here, 64x512 28 against 7.4, the 32000x512 head 8783 against
// 1705 (oneDNN's reordered copy: 1997).
//
// Panels of bfloat16 (pack_panels of a weight whose values bfloat16 holds exactly, such as a checkpoint's bf16 LM
// head) are read as such and widened in registers: the same sums, half the bytes. Their 16 values of one k are
// stored in the order of COLUMN_SLOT, so that AVX2 widens each half with one instruction (a shift or a mask).
//
// Stream panels (pack_stream_panels, for weights that stream from memory on AVX2 CPUs, such as a float32 LM head):
// [ceil(N / 6), K, 6], six columns a line. A pass reads each line once: up to 16 rows sit in the lanes of two
// registers (x transposed) and each of the six columns' weight, broadcast, multiplies them: 12 sums in registers,
// the weight's bytes requested at a steady rate while the multiply-adds run. Over 16-column panels the rows take
// three passes (6 + 5 + 5): the first waits on memory and the other two leave it idle. The peers checkpoint's
// 32000x512 head, evicted, 2 threads, Zen 3: 16 rows 1.29-1.36x, 8 rows 1.2-1.4x; up to 4 rows the columns stay
// in lanes (6 of 8), 2 and 4 rows 1.09-1.10x.
//
// Every output is one thread's sum over k in order (one fused multiply-add per k with AVX-512 or AVX2): the
// result does not depend on the number of threads. FLASHSERVE_NO_AVX512 / FLASHSERVE_NO_SIMD select the
// narrower paths (the tests build all three).
#include "isa.h"
#include <cstdint>
#include <type_traits>

namespace {

constexpr int64_t LANES = 16;  // output columns per panel
constexpr int64_t AHEAD = 128;  // panel lines (one k each) requested ahead (8 KB; 64: the head 1843 against 1662 us)
#if defined(FS_AVX512)
constexpr int64_t MR = 8;  // rows of x per pass over a panel: 8 sums of 16 columns in registers (16 rows: slower)
#elif defined(FS_AVX2)
// 6 rows x 2 halves of 8 columns: 12 of the 16 registers, so that more sums are in flight than the FMA units'
// latency needs (4 rows: exactly as many). 16 rows, 2 threads, evicted, Zen 3: 1.26-1.31x 4 rows a pass on the
// peers checkpoint's shapes (the 32000x512 head 5.12 -> 4.07 ms), the same sums.
constexpr int64_t MR = 6;
#else
constexpr int64_t MR = 8;
#endif

using bf16 = uint16_t;  // a bfloat16's bits: the high half of a float32's

// Where column c (0 .. 15) of one k sits among a bfloat16 panel's 16 values: even slots 0 .. 7, odd slots 8 .. 15,
// so that a 32-bit lane holds column j in its low half and column 8 + j in its high half
constexpr int64_t COLUMN_SLOT(int64_t c) { return c < 8 ? 2 * c : 2 * (c - 8) + 1; }

inline float widen(bf16 v) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

// Column c of the panel line at k
inline float panel_value(const float* panel, int64_t k, int64_t c) { return panel[k * LANES + c]; }
inline float panel_value(const bf16* panel, int64_t k, int64_t c) { return widen(panel[k * LANES + COLUMN_SLOT(c)]); }

#if defined(FS_AVX512)
// One panel line as 16 float32 lanes: float32 in column order; bfloat16 in COLUMN_SLOT order
inline __m512 load_line(const float* line) { return _mm512_loadu_ps(line); }
inline __m512 load_line(const bf16* line) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// Stores lanes (load_line's order for W) to out[0 .. cols)
inline void store_lanes(const float*, __m512 acc, float* out, int64_t cols) {
    const __mmask16 mask = cols >= LANES ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
    _mm512_mask_storeu_ps(out, mask, acc);
}
inline void store_lanes(const bf16*, __m512 acc, float* out, int64_t cols) {
    alignas(64) float lanes[LANES];
    _mm512_store_ps(lanes, acc);
    for (int64_t c = 0; c < cols; ++c) out[c] = lanes[COLUMN_SLOT(c)];
}
#elif defined(FS_AVX2)
// One panel line as columns 0 .. 7 (lo) and 8 .. 15 (hi)
inline void load_line(const float* line, __m256& lo, __m256& hi) {
    lo = _mm256_loadu_ps(line);
    hi = _mm256_loadu_ps(line + 8);
}
inline void load_line(const bf16* line, __m256& lo, __m256& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif

// Rows x[0 .. R) (row stride K) times one panel; writes out[r, 0 .. cols) (row stride N).
template <int64_t R, typename W>
inline void panel_rows(const float* x, int64_t K, const W* panel, float* out, int64_t N, int64_t cols) {
#if defined(FS_AVX512)
    __m512 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        __builtin_prefetch(panel + (k + AHEAD) * LANES);  // a hint: past the end it reads nothing
        const __m512 w = load_line(panel + k * LANES);
        for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w, acc[r]);
    }
    for (int64_t r = 0; r < R; ++r) store_lanes(panel, acc[r], out + r * N, cols);
#elif defined(FS_AVX2)
    __m256 lo[R], hi[R];
    for (int64_t r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        __builtin_prefetch(panel + (k + AHEAD) * LANES);
        __m256 wl, wh;
        load_line(panel + k * LANES, wl, wh);
        for (int64_t r = 0; r < R; ++r) {
            const __m256 xr = _mm256_set1_ps(x[r * K + k]);
            lo[r] = _mm256_fmadd_ps(xr, wl, lo[r]);
            hi[r] = _mm256_fmadd_ps(xr, wh, hi[r]);
        }
    }
    for (int64_t r = 0; r < R; ++r) {
        alignas(32) float lanes[LANES];
        _mm256_store_ps(lanes, lo[r]);
        _mm256_store_ps(lanes + 8, hi[r]);
        for (int64_t c = 0; c < cols; ++c) out[r * N + c] = lanes[c];
    }
#else
    for (int64_t r = 0; r < R; ++r) {
        float acc[LANES] = {};
        for (int64_t k = 0; k < K; ++k)
            for (int64_t c = 0; c < LANES; ++c) acc[c] += x[r * K + k] * panel_value(panel, k, c);
        for (int64_t c = 0; c < cols; ++c) out[r * N + c] = acc[c];
    }
#endif
}

#if defined(FS_AVX512)
// Rows 0 .. R of x, stored k-major (xt[k * M + r]), times two adjacent panels: each broadcast x[r, k] feeds two
// multiply-adds (32 columns), and the row values of one k share a cache line. Writes out[r, 0 .. 16 + cols).
// Each output's sum is the one panel_rows makes, term for term. The 32000x512 head at 16 rows, evicted, 2 threads:
// 4.70 ms one panel at a time, 3.78 two (Xeon, Ice Lake); with a few panels a thread it was no faster.
template <int64_t R, typename W>
inline void panel_pair_rows(const float* xt, int64_t M, int64_t K, const W* panel, const W* ahead,
                            float* out, int64_t N, int64_t cols) {
    const W* second = panel + K * LANES;
    __m512 acc0[R], acc1[R];
    for (int64_t r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        __builtin_prefetch(ahead + k * LANES);
        __builtin_prefetch(ahead + (K + k) * LANES);
        const __m512 w0 = load_line(panel + k * LANES), w1 = load_line(second + k * LANES);
        for (int64_t r = 0; r < R; ++r) {
            const __m512 b = _mm512_set1_ps(xt[k * M + r]);
            acc0[r] = _mm512_fmadd_ps(b, w0, acc0[r]);
            acc1[r] = _mm512_fmadd_ps(b, w1, acc1[r]);
        }
    }
    for (int64_t r = 0; r < R; ++r) {
        store_lanes(panel, acc0[r], out + r * N, LANES);
        store_lanes(panel, acc1[r], out + r * N + LANES, cols);
    }
}
#endif

// Where a pass over panels 2i and 2i + 1 requests lines ahead: the first pass AHEAD lines past its own (they come
// from memory), a later one (more than MR rows; its own lines are in the caches by then) the next pair's, so that
// memory keeps streaming while it runs. The 32000x512 head at 16 rows, evicted, 2 threads, alternating in one
// process: 4.82 -> 4.57 and 4.69 -> 4.41 ms. Single panels (smaller weights) keep requesting their own lines
// ahead: there the next panel's lines made 256x512 3-6% slower.
template <typename W>
inline const W* pair_ahead(const W* panel, int64_t m, int64_t K) {
    return m == 0 ? panel + AHEAD * LANES : panel + 2 * K * LANES;
}

// Rows a pass over a panel: MR, or with AVX2 as many in each pass as the fewest passes allow (8 rows: 4 + 4, not
// 6 + 2, whose 2-row pass waits on the latency of its 4 sums: the head at 8 rows 0.93x)
inline int64_t pass_rows(int64_t M) {
#if defined(FS_AVX2)
    const int64_t passes = (M + MR - 1) / MR;
    return (M + passes - 1) / passes;
#else
    return MR;
#endif
}

// Rows x[0 .. M) times panel p (one thread's share of a call), pass_rows(M) rows a pass.
template <typename W>
inline void one_panel(const float* x, const W* panels, float* out, int64_t M, int64_t N, int64_t K, int64_t p) {
    const W* panel = panels + p * K * LANES;
    const int64_t cols = N - p * LANES < LANES ? N - p * LANES : LANES;
    const int64_t per = pass_rows(M);
    for (int64_t m = 0; m < M; m += per) {
        const float* xm = x + m * K;
        float* om = out + m * N + p * LANES;
        with_rows<MR>(M - m < per ? M - m : per,
                  [&](auto r) { panel_rows<decltype(r)::value, W>(xm, K, panel, om, N, cols); });
    }
}

#if defined(FS_AVX512)
constexpr int64_t PAIRED_PANELS = 64;  // a call of at least this many panels takes them two at a time

// Panels 2i and 2i + 1 (see panel_pair_rows) for rows xt (x k-major).
template <typename W>
inline void two_panels(const float* xt, const W* panels, float* out, int64_t M, int64_t N, int64_t K,
                       int64_t i) {
    const int64_t p = 2 * i;
    const W* panel = panels + p * K * LANES;
    const int64_t cols = N - (p + 1) * LANES < LANES ? N - (p + 1) * LANES : LANES;
    for (int64_t m = 0; m < M; m += MR) {
        const float* xm = xt + m;
        float* om = out + m * N + p * LANES;
        with_rows<MR>(M - m < MR ? M - m : MR,
                  [&](auto r) {
                      panel_pair_rows<decltype(r)::value, W>(xm, M, K, panel, pair_ahead(panel, m, K), om, N, cols);
                  });
    }
}
#endif

template <typename W>
void rows_times_panels(const float* x, const W* panels, float* out, int64_t M, int64_t N, int64_t K,
                       int64_t threads) {
    const int64_t count = (N + LANES - 1) / LANES;
#if defined(FS_AVX512)
    if (count >= PAIRED_PANELS) {
        const auto buf = aligned_floats(M * K, false);  // x k-major
        float* const xt = buf.get();
        for (int64_t r = 0; r < M; ++r)
            for (int64_t k = 0; k < K; ++k) xt[k * M + r] = x[r * K + k];
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < count / 2; ++i) two_panels(xt, panels, out, M, N, K, i);
        if (count % 2) one_panel(x, panels, out, M, N, K, count - 1);  // the last one alone
        return;
    }
#endif
    // static: each thread streams one contiguous run of panels
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < count; ++p) one_panel(x, panels, out, M, N, K, p);
}

// ---- stream panels ----
constexpr int64_t STREAM_LANES = 6;  // columns a stream panel line holds
constexpr int64_t STREAM_AHEAD = 512;  // lines requested ahead (12 KB: a panel of K = 512)

#if defined(FS_AVX512) || defined(FS_AVX2)
// Requests the 8 lines of k0 .. k0 + 7 that come STREAM_AHEAD lines later (3 cache lines)
inline void stream_request(const float* panel, int64_t k0) {
    const float* ahead = panel + (k0 + STREAM_AHEAD) * STREAM_LANES;
    for (int64_t b = 0; b < 8 * STREAM_LANES; b += 16) __builtin_prefetch(ahead + b);
}

// line(k) for k = 0 .. K - 1, eight at a time, each eight requesting those STREAM_AHEAD lines later in G panels
template <int G, typename F>
inline void stream_lines(const float* panel, int64_t K, F&& line) {
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        for (int g = 0; g < G; ++g) stream_request(panel + g * K * STREAM_LANES, k);
        for (int64_t i = 0; i < 8; ++i) line(k + i);
    }
    for (; k < K; ++k) line(k);
}

// Rows in lanes: xt [K, 8 * RV] (x transposed, zero past M) times G adjacent stream panels starting at column
// col0; writes out[r, col0 .. col0 + min(6G, cols)) for r < M.
template <int RV, int G>
inline void stream_rows_in_lanes(const float* xt, const float* panel, int64_t K, float* out, int64_t M, int64_t N,
                                 int64_t col0, int64_t cols) {
    constexpr int64_t C = STREAM_LANES;
    __m256 acc[RV][G * C];
    for (int v = 0; v < RV; ++v)
        for (int j = 0; j < G * C; ++j) acc[v][j] = _mm256_setzero_ps();
    auto line = [&](int64_t k) {
        __m256 xv[RV];
        for (int v = 0; v < RV; ++v) xv[v] = _mm256_loadu_ps(xt + (k * RV + v) * 8);
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < C; ++c) {
                const __m256 w = _mm256_broadcast_ss(panel + (g * K + k) * C + c);
                for (int v = 0; v < RV; ++v) acc[v][g * C + c] = _mm256_fmadd_ps(xv[v], w, acc[v][g * C + c]);
            }
    };
    stream_lines<G>(panel, K, line);
    // through a buffer with fixed indices: a store loop bounded by cols kept the sums in memory (2x slower)
    alignas(32) float lanes[RV * G * C * 8];
    for (int v = 0; v < RV; ++v)
        for (int j = 0; j < G * C; ++j) _mm256_store_ps(lanes + (v * G * C + j) * 8, acc[v][j]);
    for (int v = 0; v < RV; ++v)
        for (int64_t j = 0; j < G * C && j < cols; ++j)
            for (int64_t r = 0; r < 8 && v * 8 + r < M; ++r)
                out[(v * 8 + r) * N + col0 + j] = lanes[(v * G * C + j) * 8 + r];
}

// Columns in lanes for up to 4 rows: each line's 6 values (a masked load) times each row's x[r, k] broadcast, G
// panels at once. Writes out[r, col0 .. col0 + min(6G, cols)).
template <int R, int G>
inline void stream_columns_in_lanes(const float* x, const float* panel, int64_t K, float* out, int64_t N,
                                    int64_t col0, int64_t cols) {
    constexpr int64_t C = STREAM_LANES;
    const __m256i six = _mm256_setr_epi32(-1, -1, -1, -1, -1, -1, 0, 0);
    __m256 acc[G][R];
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < R; ++r) acc[g][r] = _mm256_setzero_ps();
    auto line = [&](int64_t k) {
        __m256 w[G];
        for (int g = 0; g < G; ++g) w[g] = _mm256_maskload_ps(panel + (g * K + k) * C, six);
        for (int r = 0; r < R; ++r) {
            const __m256 b = _mm256_broadcast_ss(x + r * K + k);
            for (int g = 0; g < G; ++g) acc[g][r] = _mm256_fmadd_ps(b, w[g], acc[g][r]);
        }
    };
    stream_lines<G>(panel, K, line);
    alignas(32) float lanes[G * R * 8];
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < R; ++r) _mm256_store_ps(lanes + (g * R + r) * 8, acc[g][r]);
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < R; ++r)
            for (int64_t c = 0; c < C && g * C + c < cols; ++c)
                out[r * N + col0 + g * C + c] = lanes[(g * R + r) * 8 + c];
}

// f(panel index, panels at once) over P stream panels, G at a time and the rest alone, split over threads
template <int G, typename F>
inline void over_stream_panels(int64_t P, int64_t threads, F&& f) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < P / G; ++i) f(i * G, std::integral_constant<int, G>{});
    for (int64_t p = P / G * G; p < P; ++p) f(p, std::integral_constant<int, 1>{});
}

// Rows x[0 .. M) (M <= 16) times all stream panels
inline void stream_block(const float* x, const float* panels, float* out, int64_t M, int64_t N, int64_t K,
                         int64_t threads) {
    constexpr int64_t C = STREAM_LANES;
    const int64_t P = (N + C - 1) / C;
    if (M <= 4) {
        with_rows<MR>(M, [&](auto r) {
            constexpr int R = static_cast<int>(decltype(r)::value);
            if constexpr (R <= 4)
                over_stream_panels<2>(P, threads, [&](int64_t p, auto g) {
                    stream_columns_in_lanes<R, decltype(g)::value>(x, panels + p * K * C, K, out, N, p * C, N - p * C);
                });
        });
        return;
    }
    const int64_t width = M > 8 ? 16 : 8;  // rows in lanes: one register of 8 or two
    const auto buf = aligned_floats(K * width, true);  // zero past row M
    float* const xt = buf.get();
    for (int64_t r = 0; r < M; ++r)
        for (int64_t k = 0; k < K; ++k) xt[k * width + r] = x[r * K + k];
    if (width == 16)
        over_stream_panels<1>(P, threads, [&](int64_t p, auto) {
            stream_rows_in_lanes<2, 1>(xt, panels + p * K * C, K, out, M, N, p * C, N - p * C);
        });
    else
        over_stream_panels<2>(P, threads, [&](int64_t p, auto g) {
            stream_rows_in_lanes<1, decltype(g)::value>(xt, panels + p * K * C, K, out, M, N, p * C, N - p * C);
        });
}
#endif

// Rows x[0 .. M) times stream panels [ceil(N / 6), K, 6]: 16 rows at a time
void rows_times_stream_panels(const float* x, const float* panels, float* out, int64_t M, int64_t N, int64_t K,
                              int64_t threads) {
#if defined(FS_AVX512) || defined(FS_AVX2)
    for (int64_t m = 0; m < M; m += 16)
        stream_block(x + m * K, panels, out + m * N, M - m < 16 ? M - m : 16, N, K, threads);
#else
    constexpr int64_t C = STREAM_LANES;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const float* line = panels + (n / C) * K * C + n % C;
        for (int64_t r = 0; r < M; ++r) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; ++k) acc += x[r * K + k] * line[k * C];
            out[r * N + n] = acc;
        }
    }
#endif
}

}  // namespace

// layout: 0 float32 panels, 1 bfloat16 panels (bits in COLUMN_SLOT order), 2 float32 stream panels
static void kernel(const float* x, const void* panels, float* out, int64_t M, int64_t N, int64_t K,
                       int64_t layout, int64_t threads) {
    if (layout == 2)
        rows_times_stream_panels(x, static_cast<const float*>(panels), out, M, N, K, threads);
    else if (layout == 1)
        rows_times_panels(x, static_cast<const bf16*>(panels), out, M, N, K, threads);
    else
        rows_times_panels(x, static_cast<const float*>(panels), out, M, N, K, threads);
}

// flashserve::dense_rows(x, panels, n) for CPU tensors on torch's dispatcher (schema: ops.cpp):
// a compiled step's C++ reaches it with no Python in between
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {
at::Tensor dense_rows_op(const at::Tensor& x, const at::Tensor& panels, int64_t n) {
    const int64_t lanes = panels.dim() == 3 ? panels.size(2) : 0;  // 16: panels, 6: stream panels
    TORCH_CHECK(x.dim() == 2 && (lanes == LANES || lanes == STREAM_LANES) && panels.size(1) == x.size(1) &&
                    n > (panels.size(0) - 1) * lanes && n <= panels.size(0) * lanes,
                "dense_rows: x ", x.sizes(), ", panels ", panels.sizes(), ", n ", n, " do not match");
    const bool bf16_panels = panels.scalar_type() == at::kBFloat16;
    TORCH_CHECK(bf16_panels ? lanes == LANES : panels.scalar_type() == at::kFloat,
                "dense_rows: panels must be float32 or bfloat16 (stream panels float32)");
    const at::Tensor xs = x.to(at::kFloat).contiguous(), ps = panels.contiguous();
    at::Tensor out = at::empty({x.size(0), n}, xs.options());
    kernel(xs.data_ptr<float>(), ps.data_ptr(), out.data_ptr<float>(), x.size(0), n, x.size(1),
           lanes == STREAM_LANES ? 2 : bf16_panels ? 1 : 0, at::get_num_threads());
    return out;
}
}  // namespace

FS_LIBRARY_IMPL(m) { m.impl("dense_rows", &dense_rows_op); }
