// int8 pair products on the CPU (flashserve.model.cpu_kernels): row p of x times the int8 matrix of expert
// experts[p], each matrix row scaled by its own float32 scale: out[p, n] = scale[e, n] * sum_k q[e, n, k] x[p, k].
// A dense product is one expert (E = 1) that every row uses. With AVX2 only, inductor's code for the same
// product converts the bytes one at a time: the peers checkpoint's 32000x512 int8 head at one row took 11.5 ms
// compiled against 2.7 for its float32 weights; here each 8 bytes are widened and converted by two instructions.
// Pairs are grouped by expert, so each expert's bytes are converted once for up to ROWS rows; four matrix rows
// are multiplied at a time (four independent sums a row). Every output is summed by one thread in a fixed
// order (8 lanes over k, then the lanes in order, then scaled): the result does not depend on the number of
// threads. Layout: x [T, K] float32, each row in k = P / T consecutive pairs; experts [P] int64 in [0, E);
// q [E, N, K] int8; scale [E, N] float32; out [P, N] float32. K % 8 == 0 for the vector path. With
// matrices = 2 the same pairs also multiply (q2, scale2) (a MoE's up projection beside its gate) into out[P + p]:
// one call, one fork of the threads, where two took one each.
#include "isa.h"
#include "pairs.h"
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace {

constexpr int64_t ROWS = 4;  // rows of x sharing one conversion of the bytes (4 x 4 sums in 16 registers)
constexpr int64_t QUAD = 4;  // matrix rows multiplied at a time
constexpr int64_t TILE = 64;  // matrix rows per work item
// Matrix rows requested ahead of the four multiplied. One row of x against 41 MB of int8 matrices (the peers
// checkpoint's head and 48 of 1024x512), 2 threads, Zen 3: 12 GB/s without, 19.5-24.7 GB/s with 16 rows ahead
// (1.7-1.9x; 4 rows ahead 1.4x, 32 rows as 16)
constexpr int64_t AHEAD = 16;

// Matrix rows q[0 .. J) (row stride K) against R rows of xs; sums[j][r] unscaled. J and R are template
// arguments so that the loops unroll and the sums stay in registers.
template <int64_t J, int64_t R>
inline void row_products(const int8_t* q, const float* const* xs, int64_t K, float (*sums)[ROWS]) {
    int64_t k = 0;
#if defined(FS_AVX2) || defined(FS_AVX512)
    __m256 acc[J][R];
    for (int64_t j = 0; j < J; ++j)
        for (int64_t r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
        __m256 w[J];
        for (int64_t j = 0; j < J; ++j)
            w[j] = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j * K + k))));
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
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, acc[j][r]);
            for (float v : lanes) sum += v;
#endif
            for (int64_t t = k; t < K; ++t) sum += static_cast<float>(q[j * K + t]) * xs[r][t];
            sums[j][r] = sum;
        }
}

// J matrix rows at q against R (1 .. ROWS) rows of xs
template <int64_t J>
inline void rows_products(const int8_t* q, const float* const* xs, int64_t R, int64_t K, float (*sums)[ROWS]) {
    with_rows<ROWS>(R, [&](auto r) { row_products<J, decltype(r)::value>(q, xs, K, sums); });
}

// R <= ROWS rows of xs times matrix rows n0 .. n1 of one expert (q at its first row), scaled, into out[r][n]:
// QUAD matrix rows at a time, the last ones of a height that is not a multiple of QUAD one at a time
inline void tile_products(const int8_t* q, const float* scale, int64_t n0, int64_t n1, const float* const* xs,
                          int64_t R, int64_t K, float* const* out) {
    float sums[QUAD][ROWS];
    for (int64_t n = n0; n < n1;) {
        const int8_t* qn = q + n * K;
        for (int64_t l = 0; l < QUAD * K; l += 64) __builtin_prefetch(qn + AHEAD * K + l);  // a hint: no fault
        const int64_t m = n1 - n < QUAD ? 1 : QUAD;
        if (m == QUAD)
            rows_products<QUAD>(qn, xs, R, K, sums);
        else
            rows_products<1>(qn, xs, R, K, sums);
        for (int64_t j = 0; j < m; ++j)
            for (int64_t r = 0; r < R; ++r) out[r][n + j] = sums[j][r] * scale[n + j];
        n += m;
    }
}

}  // namespace

static void kernel(const float* x, const int64_t* experts, const int8_t* q, const float* scale,
                       const int8_t* q2_or_unused, const float* scale2_or_unused, float* out, int64_t P, int64_t k,
                       int64_t E, int64_t N, int64_t K, int64_t matrices, int64_t threads) {
    const ExpertGroups groups(experts, P, E, "int8_pairs");
    // matrices: 1 or 2 (the callers' only values)
    const int8_t* qs[2] = {q, matrices == 2 ? q2_or_unused : q};
    const float* scales[2] = {scale, matrices == 2 ? scale2_or_unused : scale};
    pair_tiles<ROWS, TILE>(groups, x, out, P, k, N, K, matrices, threads,
                           [&](int64_t m, int64_t e, int64_t n0, int64_t n1, const float* const* rows, int64_t R,
                               float* const* outs) {
                               tile_products(qs[m] + e * N * K, scales[m] + e * N, n0, n1, rows, R, K, outs);
                           });
}

// flashserve::int8_pairs(x, experts, q, scale) for CPU tensors on torch's dispatcher (schema: ops.cpp): a compiled
// step's C++ reaches it with no Python in between
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {
// x's rows times (q, scale): out [P, N]; with matrices = 2 also times (q2, scale2): out [2, P, N]
at::Tensor int8_products(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& q, const at::Tensor& scale,
                         const at::Tensor& q2, const at::Tensor& scale2, int64_t matrices) {
    TORCH_CHECK(q.dim() == 3 && scale.dim() == 2 && x.dim() == 2 && x.size(1) == q.size(2) &&
                    scale.size(0) == q.size(0) && scale.size(1) == q.size(1) && x.size(0) > 0 &&
                    experts.numel() % x.size(0) == 0 && q2.sizes() == q.sizes() && scale2.sizes() == scale.sizes(),
                "int8_pairs: x ", x.sizes(), ", experts ", experts.sizes(), ", q ", q.sizes(), ", scale ",
                scale.sizes(), matrices == 2 ? ", up " : "", matrices == 2 ? q2.sizes() : at::IntArrayRef(),
                matrices == 2 ? " and " : "", matrices == 2 ? scale2.sizes() : at::IntArrayRef(), " do not match");
    // scale: float32, or int32 holding float32 bits as the int8 quantization stores them (read as they are: no
    // view op in a compiled step for each of its ~90 int8 products)
    const auto float_or_bits = [](const at::Tensor& t) {
        return t.scalar_type() == at::kFloat || t.scalar_type() == at::kInt;
    };
    TORCH_CHECK(q.scalar_type() == at::kChar && q2.scalar_type() == at::kChar && float_or_bits(scale) &&
                    float_or_bits(scale2),
                "int8_pairs: q must be int8 and scale float32 (or its bits as int32)");
    const at::Tensor xs = x.to(at::kFloat).contiguous(), ex = experts.to(at::kLong).contiguous();
    const at::Tensor qc = q.contiguous(), sc = scale.contiguous();
    const at::Tensor qc2 = matrices == 2 ? q2.contiguous() : qc, sc2 = matrices == 2 ? scale2.contiguous() : sc;
    const int64_t P = ex.numel(), N = q.size(1);
    at::Tensor out = matrices == 2 ? at::empty({2, P, N}, xs.options()) : at::empty({P, N}, xs.options());
    const float* scales = static_cast<const float*>(sc.data_ptr());  // float32, or its bits as int32
    const float* scales2 = static_cast<const float*>(sc2.data_ptr());
    kernel(xs.data_ptr<float>(), ex.data_ptr<int64_t>(), qc.data_ptr<int8_t>(), scales, qc2.data_ptr<int8_t>(),
           scales2, out.data_ptr<float>(), P, P / x.size(0), q.size(0), N, x.size(1), matrices, at::get_num_threads());
    return out;
}

at::Tensor int8_pairs_op(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& q, const at::Tensor& scale) {
    return int8_products(x, experts, q, scale, q, scale, 1);
}

at::Tensor int8_gate_up_op(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& q1, const at::Tensor& s1,
                           const at::Tensor& q3, const at::Tensor& s3) {
    return int8_products(x, experts, q1, s1, q3, s3, 2);
}
}  // namespace

FS_LIBRARY_IMPL(m) {
    m.impl("int8_pairs", &int8_pairs_op);
    m.impl("int8_gate_up", &int8_gate_up_op);
}
