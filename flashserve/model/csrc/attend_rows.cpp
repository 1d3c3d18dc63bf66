// A few query rows' attention on the CPU (flashserve.model.cpu_kernels.attend_rows): for each query row (b, s), one
// softmax over the window keys it may see, the compressed entries it may see (or picked) and each head's sink, and
// the keys' and entries' probability-weighted sum (V4's keys are their own values). Only the keys and entries a
// row may see are read and multiplied: a decode step's fixed shapes give every row the indexer's 512 picks and
// the whole window, most of which a short context masks (V4-Flash's sparse layer at 16 rows and 48 tokens: 11-13
// ms of MKL's bmm a step for about a twentieth of its products unmasked).
//
// Layout (contiguous, float32): q [B, S, H, D]; window keys win [B, T, D] with win_ok [B, S, T] (bool); entries
// ent [B, Se, E, D], Se = 1 (one list for every row: a dense compressed cache) or S (each row its own picks), with
// ent_ok [B, S, E]; sink [H]; out [B, S, H, D]. Each logit is the dot product over d in order times `scale`; a row
// with nothing visible gets zeros (its sink takes the whole probability).
#include "isa.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t HB = 16;  // heads a vector (the heads are padded to a multiple of it)

#if defined(FS_AVX512)
// Logits of keys rows[0 .. KG) for the heads of NH vectors (qt: q transposed [D, Hp], heads from column h0):
// lg[j * Hp + h0 ..], each one sum over d in order
template <int64_t KG, int64_t NH>
inline void logits(const float* const* rows, const float* qt, int64_t Hp, int64_t h0, int64_t D, float scale,
                   float* lg) {
    __m512 acc[KG][NH];
    for (int64_t j = 0; j < KG; ++j)
        for (int64_t v = 0; v < NH; ++v) acc[j][v] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
        __m512 qv[NH];
        for (int64_t v = 0; v < NH; ++v) qv[v] = _mm512_load_ps(qt + d * Hp + h0 + v * HB);
        for (int64_t j = 0; j < KG; ++j) {
            const __m512 k = _mm512_set1_ps(rows[j][d]);
            for (int64_t v = 0; v < NH; ++v) acc[j][v] = _mm512_fmadd_ps(qv[v], k, acc[j][v]);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < KG; ++j)
        for (int64_t v = 0; v < NH; ++v) _mm512_store_ps(lg + j * Hp + h0 + v * HB, _mm512_mul_ps(acc[j][v], sc));
}

// out[h, d0 .. d0 + 16 ND) for heads h0 .. h0 + NHD: the sum over the n keys of p[j * Hp + h] * rows[j][d], in
// order of j
template <int64_t NHD, int64_t ND>
inline void values(const float* const* rows, int64_t n, const float* p, int64_t Hp, int64_t h0, int64_t d0,
                   float* out, int64_t D) {
    __m512 acc[NHD][ND];
    for (int64_t h = 0; h < NHD; ++h)
        for (int64_t v = 0; v < ND; ++v) acc[h][v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
        __m512 kv[ND];
        for (int64_t v = 0; v < ND; ++v) kv[v] = _mm512_loadu_ps(rows[j] + d0 + 16 * v);
        for (int64_t h = 0; h < NHD; ++h) {
            const __m512 ph = _mm512_set1_ps(p[j * Hp + h0 + h]);
            for (int64_t v = 0; v < ND; ++v) acc[h][v] = _mm512_fmadd_ps(kv[v], ph, acc[h][v]);
        }
    }
    for (int64_t h = 0; h < NHD; ++h)
        for (int64_t v = 0; v < ND; ++v) _mm512_storeu_ps(out + (h0 + h) * D + d0 + 16 * v, acc[h][v]);
}
#endif

// One query row: q [H, D] against the n key rows (pointers), out [H, D]
void attend_row(const float* q, const float* const* rows, int64_t n, const float* sink, int64_t H, int64_t D,
                float scale, float* out, float* qt, float* lg) {
    const int64_t Hp = (H + HB - 1) / HB * HB;
    // q transposed: qt[d * Hp + h] (zero past H)
    for (int64_t d = 0; d < D; ++d)
        for (int64_t h = 0; h < Hp; ++h) qt[d * Hp + h] = h < H ? q[h * D + d] : 0.f;
    int64_t j = 0;
#if defined(FS_AVX512)
    const int64_t vecs = Hp / HB;
    for (; j + 4 <= n; j += 4)
        for (int64_t v = 0; v < vecs; v += 4) {
            const int64_t nv = vecs - v < 4 ? vecs - v : 4;
            if (nv == 4) logits<4, 4>(rows + j, qt, Hp, v * HB, D, scale, lg + j * Hp);
            else if (nv == 3) logits<4, 3>(rows + j, qt, Hp, v * HB, D, scale, lg + j * Hp);
            else if (nv == 2) logits<4, 2>(rows + j, qt, Hp, v * HB, D, scale, lg + j * Hp);
            else logits<4, 1>(rows + j, qt, Hp, v * HB, D, scale, lg + j * Hp);
        }
    for (; j < n; ++j)
        for (int64_t v = 0; v < vecs; ++v) logits<1, 1>(rows + j, qt, Hp, v * HB, D, scale, lg + j * Hp);
#else
    for (; j < n; ++j)
        for (int64_t h = 0; h < H; ++h) {
            float acc = 0.f;
            for (int64_t d = 0; d < D; ++d) acc = std::fma(qt[d * Hp + h], rows[j][d], acc);
            lg[j * Hp + h] = acc * scale;
        }
#endif
    // softmax over the keys and the sink, a head at a time: probabilities in place of the logits
    for (int64_t h = 0; h < H; ++h) {
        float m = sink[h];
        for (int64_t i = 0; i < n; ++i) m = lg[i * Hp + h] > m ? lg[i * Hp + h] : m;
        float sum = std::exp(sink[h] - m);
        for (int64_t i = 0; i < n; ++i) {
            const float e = std::exp(lg[i * Hp + h] - m);
            lg[i * Hp + h] = e;
            sum += e;
        }
        for (int64_t i = 0; i < n; ++i) lg[i * Hp + h] /= sum;
    }
    int64_t h = 0;
#if defined(FS_AVX512)
    if (D % 64 == 0)
        for (; h + 4 <= H; h += 4)
            for (int64_t d0 = 0; d0 < D; d0 += 64) values<4, 4>(rows, n, lg, Hp, h, d0, out, D);
#endif
    for (; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
            float acc = 0.f;
            for (int64_t i = 0; i < n; ++i) acc = std::fma(rows[i][d], lg[i * Hp + h], acc);
            out[h * D + d] = acc;
        }
}

void kernel(const float* q, const float* win, const bool* win_ok, const float* ent, const bool* ent_ok,
            const float* sink, float* out, int64_t B, int64_t S, int64_t H, int64_t D, int64_t T, int64_t Se,
            int64_t E, float scale, int64_t threads) {
    const int64_t Hp = (H + HB - 1) / HB * HB;
    // fewer rows than threads: each row's heads split in G groups of whole vectors (a batch-1 decode on every
    // thread); each head's softmax and sums are the same whatever its group
    const int64_t G = B * S >= threads ? 1 : std::min(threads, Hp / HB), per = (Hp / HB + G - 1) / G * HB;
#pragma omp parallel num_threads(threads)
    {
        const auto qt = aligned_floats(D * Hp, false);
        const auto lg = aligned_floats((T + E) * Hp, false);
        std::vector<const float*> rows(T + E);
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < B * S * G; ++item) {
            const int64_t bs = item / G, h0 = item % G * per, h1 = h0 + per < H ? h0 + per : H;
            const int64_t b = bs / S, s = bs % S;
            int64_t n = 0;
            for (int64_t t = 0; t < T; ++t)
                if (win_ok[bs * T + t]) rows[n++] = win + (b * T + t) * D;
            const float* list = ent + (b * Se + (Se == 1 ? 0 : s)) * E * D;
            for (int64_t e = 0; e < E; ++e)
                if (ent_ok[bs * E + e]) rows[n++] = list + e * D;
            attend_row(q + (bs * H + h0) * D, rows.data(), n, sink + h0, h1 - h0, D, scale, out + (bs * H + h0) * D,
                       qt.get(), lg.get());
        }
    }
}

}  // namespace

// flashserve::attend_rows(q, win, win_ok, ent, ent_ok, sink, scale) for CPU tensors on torch's dispatcher (schema:
// ops.cpp)
namespace {
at::Tensor attend_rows_op(const at::Tensor& q, const at::Tensor& win, const at::Tensor& win_ok, const at::Tensor& ent,
                          const at::Tensor& ent_ok, const at::Tensor& sink, double scale) {
    TORCH_CHECK(q.dim() == 4 && win.dim() == 3 && win_ok.dim() == 3 && ent.dim() == 4 && ent_ok.dim() == 3 &&
                    sink.dim() == 1,
                "attend_rows: q ", q.sizes(), ", win ", win.sizes(), ", win_ok ", win_ok.sizes(), ", ent ",
                ent.sizes(), ", ent_ok ", ent_ok.sizes(), ", sink ", sink.sizes(), " do not match");
    const int64_t B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3), T = win.size(1), Se = ent.size(1),
                  E = ent.size(2);
    const bool shaped = win.size(0) == B && win.size(2) == D && win_ok.size(0) == B && win_ok.size(1) == S &&
                        win_ok.size(2) == T && ent.size(0) == B && (Se == 1 || Se == S) && ent.size(3) == D &&
                        ent_ok.size(0) == B && ent_ok.size(1) == S && ent_ok.size(2) == E && sink.size(0) == H;
    TORCH_CHECK(shaped, "attend_rows: q ", q.sizes(), ", win ", win.sizes(), ", win_ok ", win_ok.sizes(), ", ent ",
                ent.sizes(), ", ent_ok ", ent_ok.sizes(), ", sink ", sink.sizes(), " do not match");
    TORCH_CHECK(win_ok.scalar_type() == at::kBool && ent_ok.scalar_type() == at::kBool,
                "attend_rows: the masks must be bool");
    const at::Tensor qc = q.to(at::kFloat).contiguous(), wc = win.to(at::kFloat).contiguous();
    const at::Tensor ec = ent.to(at::kFloat).contiguous(), sc = sink.to(at::kFloat).contiguous();
    const at::Tensor wo = win_ok.contiguous(), eo = ent_ok.contiguous();
    at::Tensor out = at::empty({B, S, H, D}, qc.options());
    kernel(qc.data_ptr<float>(), wc.data_ptr<float>(), wo.data_ptr<bool>(), ec.data_ptr<float>(), eo.data_ptr<bool>(),
           sc.data_ptr<float>(), out.data_ptr<float>(), B, S, H, D, T, Se, E, static_cast<float>(scale),
           at::get_num_threads());
    return out;
}
}  // namespace

FS_LIBRARY_IMPL(m) { m.impl("attend_rows", &attend_rows_op); }
