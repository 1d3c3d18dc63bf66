// Sinkhorn normalisation of mHC's small matrices on the CPU (flashserve.model.cpu_kernels.sinkhorn), for compiled
// steps: the same scalings as flashserve.model.mhc._sinkhorn_scalings, which inductor turned into one loop over
// the batch's rows per half-step, each on 4-float vectors (about 80 serial loops a site, 16 us at 16 rows).
// Here LANES matrices go through the iterations together, one lane each, so every update below is one vector
// operation for all of them. Semantics, per matrix c [n, n] (n <= NMAX):
//   v_j = 1 / (sum_i c_ij + eps);  u_i = 1
//   iters - 1 times:  u_i = u_i / (u_i * sum_j (c_ij v_j) + eps);  v_j = v_j / (v_j * sum_i (u_i c_ij) + eps)
//   out_ij = (u_i c_ij) v_j
// Sums run in index order; every operation rounds to float32 as torch's would (no fused multiply-adds: inductor's
// flags keep them apart), so the values are those of the traced scalings up to the order of their 4-term sums.
// Layout: comb and out [B, n, n] float32, contiguous.
#include "isa.h"
#include <cstdint>
#include <stdexcept>

namespace {

constexpr int64_t NMAX = 8;   // mHC's n (hc_mult) is 4
constexpr int64_t LANES = 8;  // matrices a pass: one AVX2 register of float32 each value

// Matrices b0 .. b0 + m - 1 (m <= LANES); lanes past m compute on ones and are not stored
void pass(const float* comb, float* out, int64_t b0, int64_t m, int64_t n, int64_t iters, float eps) {
    float c[NMAX][NMAX][LANES], u[NMAX][LANES], v[NMAX][LANES], s[LANES];
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j)
            for (int64_t l = 0; l < LANES; ++l) c[i][j][l] = l < m ? comb[((b0 + l) * n + i) * n + j] : 1.f;
    for (int64_t j = 0; j < n; ++j) {
        for (int64_t l = 0; l < LANES; ++l) s[l] = c[0][j][l];
        for (int64_t i = 1; i < n; ++i)
            for (int64_t l = 0; l < LANES; ++l) s[l] += c[i][j][l];
        for (int64_t l = 0; l < LANES; ++l) v[j][l] = 1.f / (s[l] + eps);
    }
    for (int64_t i = 0; i < n; ++i)
        for (int64_t l = 0; l < LANES; ++l) u[i][l] = 1.f;
    for (int64_t it = 1; it < iters; ++it) {
        for (int64_t i = 0; i < n; ++i) {  // rows of diag(u) c diag(v)
            for (int64_t l = 0; l < LANES; ++l) s[l] = c[i][0][l] * v[0][l];
            for (int64_t j = 1; j < n; ++j)
                for (int64_t l = 0; l < LANES; ++l) s[l] += c[i][j][l] * v[j][l];
            for (int64_t l = 0; l < LANES; ++l) u[i][l] = u[i][l] / (u[i][l] * s[l] + eps);
        }
        for (int64_t j = 0; j < n; ++j) {  // its columns
            for (int64_t l = 0; l < LANES; ++l) s[l] = u[0][l] * c[0][j][l];
            for (int64_t i = 1; i < n; ++i)
                for (int64_t l = 0; l < LANES; ++l) s[l] += u[i][l] * c[i][j][l];
            for (int64_t l = 0; l < LANES; ++l) v[j][l] = v[j][l] / (v[j][l] * s[l] + eps);
        }
    }
    for (int64_t l = 0; l < m; ++l)
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < n; ++j) out[((b0 + l) * n + i) * n + j] = u[i][l] * c[i][j][l] * v[j][l];
}

}  // namespace

static void kernel(const float* comb, float* out, int64_t B, int64_t n, int64_t iters, float eps) {
    if (n < 1 || n > NMAX || iters < 1) throw std::invalid_argument("sinkhorn: n must be in [1, 8] and iters >= 1");
    for (int64_t b0 = 0; b0 < B; b0 += LANES) pass(comb, out, b0, B - b0 < LANES ? B - b0 : LANES, n, iters, eps);
}

// flashserve::sinkhorn(comb, iters, eps) for CPU tensors on torch's dispatcher (schema: ops.cpp):
// a compiled step's C++ reaches it with no Python in between
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {
at::Tensor sinkhorn_op(const at::Tensor& comb, int64_t iters, double eps) {
    const int64_t n = comb.dim() >= 2 ? comb.size(-1) : 0;
    TORCH_CHECK(n >= 1 && n <= NMAX && comb.size(-2) == n && iters >= 1 && comb.scalar_type() == at::kFloat,
                "sinkhorn: comb ", comb.sizes(), " ", comb.scalar_type(), ", iters ", iters,
                ": expected float32 [.., n, n] with 1 <= n <= 8 and iters >= 1");
    const at::Tensor c = comb.contiguous();
    at::Tensor out = at::empty(c.sizes(), c.options());
    kernel(c.data_ptr<float>(), out.data_ptr<float>(), c.numel() / (n * n), n, iters, static_cast<float>(eps));
    return out;
}
}  // namespace

FS_LIBRARY_IMPL(m) { m.impl("sinkhorn", &sinkhorn_op); }
