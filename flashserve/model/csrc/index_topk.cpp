// The lightning indexer's top-k on the CPU (flashserve.model.cpu_kernels.index_topk), for compiled steps: scores
// the FP4 index keys where the paged cache stores them and keeps the best entries as it goes. The step it replaces
// read the whole cache through the page table, unpacked every key to floats, stored [T] scores, and then took the
// top-k in about ten passes over them (tiny-v41 at 32K context: 9.9 ms a step against 1.6 at 1K).
//
// Semantics, per query row r of sequence b = r / S (spec §2.8):
//   score(j) = sum_h w[r,h] * relu(q[r,h,:] . K_j) * d^-1/2      for entries j < limit[r] (the visible ones)
//   K_j: record j of the sequence, page table[b, j / epp], slot j % epp: d/2 bytes of E2M1 codes (low nibble
//        the even dim) and d/32 UE8M0 scales, one per 32 dims.
//   idx[r] = the k best visible entries (higher score, then lower index), ascending; when fewer than k are
//            visible, the lowest other entries fill the row with valid = 0 (what top_k over -inf scores picks).
//   listed mode (C > 0): only the entries of the blocks cand[r, 0..C) (-1: none) are scored, block size `block`.
//   pool (n_blocks > 0, dense mode): the n_blocks best blocks of `block` entries by their best score, the block
//            of entry limit-1 counted as +inf, blocks with no visible entry never; ascending, -1 past the end.
// Each head's dot product is exact when the query is FP4-rounded too (integer multiples of one power of two,
// summed in float); the heads are summed in order. Ties keep the lower index in every chunking, so the result
// does not depend on the number of threads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <utility>
#include <vector>
// FS_AVX512 / FS_AVX2: csrc/isa.h, prepended by the loader

namespace {

constexpr int64_t TILE = 8;           // entries scored together, one per vector lane
constexpr int64_t CHUNK = 4096;       // entries a work item scores at least (a fork costs a few microseconds)
constexpr int64_t DMAX = 1024;        // largest head dim
using Entry = std::pair<float, int64_t>;  // (score, index)

// a better than b: a higher score, or the same score and a lower index
inline bool better(const Entry& a, const Entry& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); }

// The k best entries seen, worst on top of a heap
struct Best {
    int64_t k;
    std::vector<Entry> heap;
    explicit Best(int64_t k_) : k(k_) { heap.reserve(static_cast<size_t>(k_)); }
    void offer(float s, int64_t j) {
        if (k == 0) return;
        const Entry e{s, j};
        if (static_cast<int64_t>(heap.size()) < k) {
            heap.push_back(e);
            std::push_heap(heap.begin(), heap.end(), better);
        } else if (better(e, heap.front())) {
            std::pop_heap(heap.begin(), heap.end(), better);
            heap.back() = e;
            std::push_heap(heap.begin(), heap.end(), better);
        }
    }
    float floor() const { return static_cast<int64_t>(heap.size()) < k ? -INFINITY : heap.front().first; }
};

// Values of E2M1 codes times two (the scale table halves them back)
constexpr float HALF_STEPS[16] = {0, 1, 2, 3, 4, 6, 8, 12, -0.f, -1, -2, -3, -4, -6, -8, -12};

struct Scales {  // UE8M0 byte -> 2^(b - 127) / 2 (built from the bits, as quant.e8m0_to_float)
    float v[256];
    Scales() {
        for (int b = 0; b < 256; ++b) v[b] = (b == 0 ? std::ldexp(1.f, -127) : std::ldexp(1.f, b - 127)) * 0.5f;
        v[255] = INFINITY;
    }
};
const Scales SCALES;

struct Problem {
    const float *q, *w;
    const uint8_t* pages;
    const int64_t *table, *limit, *cand;
    int64_t R, S, H, d, P, epp, rec, C, k, block, n_blocks;
    float inv_sqrt_d;

    int64_t entries() const { return P * epp; }
    // how many entries row r scores: j < limit (dense), or the listed blocks' (some may be absent)
    int64_t span(int64_t r) const { return C ? C * block : std::min(limit[r], entries()); }
};

// Row r's query in integers, where it allows: each 32-dim block of a head is n * step with integers |n| <= 12
// (an FP4-rounded query always is: E2M1 values times a power of two, here doubled). Bytes are stored in the
// order the keys are unpacked to (the even dims, then the odd ones) and read four at a time.
struct IntQuery {
    bool ok = false;
    std::vector<int32_t> quads;  // [H][blocks][8]: four int8 each
    std::vector<float> step;     // [H][blocks]
    std::vector<int32_t> corr;   // [H][blocks]: 12 * sum of n (the keys are unpacked as 2 * value + 12)

    IntQuery(const float* q, int64_t H, int64_t d) : quads(H * d / 4), step(H * d / 32), corr(H * d / 32) {
        for (int64_t hb = 0; hb < H * d / 32; ++hb) {
            const float* v = q + hb * 32;
            float m = 0.f;
            for (int64_t i = 0; i < 32; ++i) m = std::fabs(v[i]) > m ? std::fabs(v[i]) : m;
            int e = 0;
            std::frexp(m, &e);  // m = f 2^e, f in [0.5, 1): its largest value then is 8 .. 16 steps
            const float st = m > 0.f && std::isfinite(m) ? std::ldexp(1.f, e - 4) : 1.f;
            if (!std::isfinite(m) || st == 0.f) return;
            int8_t bytes[32];
            int32_t sum = 0;
            for (int64_t i = 0; i < 32; ++i) {
                const float n = v[i] / st;
                if (n != std::nearbyint(n) || std::fabs(n) > 12.f) return;
                bytes[i % 2 ? 16 + i / 2 : i / 2] = static_cast<int8_t>(n);
                sum += static_cast<int32_t>(n);
            }
            std::memcpy(&quads[hb * 8], bytes, 32);
            step[hb] = st;
            corr[hb] = 12 * sum;
        }
        ok = true;
    }
};

// Scores of n <= TILE entries (records recs[0..n)) for one query row (q [H, d], w [H]) into out[0..TILE)
void tile_scores_float(const float* q, const float* w, const uint8_t* const* recs, int64_t n, int64_t H, int64_t d,
                       float inv_sqrt_d, float* out) {
    const int64_t blocks = d / 32;
    alignas(32) float kt[32][TILE];  // one 32-dim block of the keys, dim-major: lane e is entry e
    alignas(32) float sc[TILE];
    for (int64_t e = 0; e < TILE; ++e) out[e] = 0.f;
    for (int64_t h = 0; h < H; ++h) {
        float dots[TILE];
        for (int64_t blk = 0; blk < blocks; ++blk) {
            for (int64_t e = 0; e < TILE; ++e) {
                const uint8_t* rec = recs[e < n ? e : 0];
                for (int64_t i = 0; i < 16; ++i) {
                    kt[2 * i][e] = HALF_STEPS[rec[blk * 16 + i] & 15];
                    kt[2 * i + 1][e] = HALF_STEPS[rec[blk * 16 + i] >> 4];
                }
                sc[e] = SCALES.v[rec[d / 2 + blk]];
            }
            const float* qh = q + h * d + blk * 32;
            for (int64_t e = 0; e < TILE; ++e) {
                float a = 0.f;
                for (int64_t i = 0; i < 32; ++i) a += qh[i] * kt[i][e];
                dots[e] = blk ? dots[e] + a * sc[e] : a * sc[e];
            }
        }
        for (int64_t e = 0; e < TILE; ++e) out[e] += (dots[e] > 0.f ? dots[e] * inv_sqrt_d : 0.f) * w[h];
    }
}

#if defined(FS_AVX2) || defined(FS_AVX512)
// r[g] lane e <- r[e] lane g (32-bit lanes)
inline void transpose8(__m256i* r) {
    __m256 a[8], t[8], u[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_castsi256_ps(r[i]);
    for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(a[i], a[i + 1]), t[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_castps_si256(_mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        r[i + 4] = _mm256_castps_si256(_mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}

// tile_scores_float for a query in integers: each head's block is 32 int8 products summed by maddubs over the
// keys' codes (2 * value + 12, unsigned), exact in 16 bits, then scaled; the same values as the float path
void tile_scores_int(const IntQuery& iq, const float* w, const uint8_t* const* recs, int64_t n, int64_t H, int64_t d,
                     float inv_sqrt_d, float* out) {
    const int64_t blocks = d / 32;
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    const __m256i ones = _mm256_set1_epi16(1);
    alignas(32) float dots[64][TILE];
    __m256 total = _mm256_setzero_ps();
    for (int64_t h0 = 0; h0 < H; h0 += 64) {
        const int64_t hn = H - h0 < 64 ? H - h0 : 64;
        for (int64_t blk = 0; blk < blocks; ++blk) {
            __m256i kq[TILE];  // entry e's 32 codes, then (transposed) quad g of every entry
            alignas(32) float sc[TILE];
            for (int64_t e = 0; e < TILE; ++e) {
                const uint8_t* rec = recs[e < n ? e : 0];
                const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + blk * 16));
                const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(c, 4), low), _mm_and_si128(c, low));
                kq[e] = _mm256_shuffle_epi8(lut, nib);
                sc[e] = SCALES.v[rec[d / 2 + blk]];
            }
            transpose8(kq);
            const __m256 scv = _mm256_load_ps(sc);
            for (int64_t h = 0; h < hn; h += 4) {
                const int64_t m = hn - h < 4 ? hn - h : 4;
                __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                                  _mm256_setzero_si256()};
                const int32_t* qw[4];
                for (int64_t i = 0; i < 4; ++i) qw[i] = &iq.quads[((h0 + h + (i < m ? i : 0)) * blocks + blk) * 8];
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                for (int64_t g = 0; g < 8; ++g)  // four products summed into 32 bits by one instruction
                    for (int64_t i = 0; i < 4; ++i) acc[i] = _mm256_dpbusd_epi32(acc[i], kq[g], _mm256_set1_epi32(qw[i][g]));
#else
                for (int64_t g = 0; g < 8; ++g)  // pairs summed into 16 bits: at most 8 * 2 * 24 * 12 = 4608
                    for (int64_t i = 0; i < 4; ++i)
                        acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(kq[g], _mm256_set1_epi32(qw[i][g])));
                for (int64_t i = 0; i < 4; ++i) acc[i] = _mm256_madd_epi16(acc[i], ones);
#endif
                for (int64_t i = 0; i < m; ++i) {
                    const int64_t hb = (h0 + h + i) * blocks + blk;
                    const __m256i sum = _mm256_sub_epi32(acc[i], _mm256_set1_epi32(iq.corr[hb]));
                    const __m256 dot = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(iq.step[hb])), scv);
                    _mm256_store_ps(dots[h + i], blk ? _mm256_add_ps(_mm256_load_ps(dots[h + i]), dot) : dot);
                }
            }
        }
        const __m256 inv = _mm256_set1_ps(inv_sqrt_d), zero = _mm256_setzero_ps();
        for (int64_t h = 0; h < hn; ++h) {
            const __m256 s = _mm256_mul_ps(_mm256_max_ps(_mm256_load_ps(dots[h]), zero), inv);
            total = _mm256_add_ps(total, _mm256_mul_ps(s, _mm256_set1_ps(w[h0 + h])));
        }
    }
    _mm256_storeu_ps(out, total);
}
#endif

// Scores the entries [i0, i1) of row r's span into `best`, and (dense mode) their blocks into `blocks`; i0 is a
// multiple of the block size
void score_range(const Problem& p, const IntQuery& iq, int64_t r, int64_t i0, int64_t i1, Best& best, Best& blocks) {
    const float* q = p.q + r * p.H * p.d;
    const float* w = p.w + r * p.H;
    const int64_t* pages_of = p.table + (r / p.S) * p.P;
    const int64_t lim = p.limit[r], T = p.entries();
    const int64_t newest = lim > 0 ? (lim - 1) / p.block : -1;
    const int64_t page_bytes = p.epp * p.rec;
    float bmax = -INFINITY;  // the current block's best score (dense mode)
    int64_t m = i0 / p.block, left = p.block;  // the current block, and its entries still to come
    int64_t col = i0 / p.epp, slot = i0 % p.epp;  // dense mode: where entry i0 is
    const uint8_t* recs[TILE];
    int64_t js[TILE];
    alignas(32) float s[TILE];
    for (int64_t i = i0; i < i1; i += TILE) {
        int64_t n = 0;
        for (int64_t t = i; t < i1 && t < i + TILE; ++t) {
            int64_t j = t;
            if (p.C) {  // listed: the t-th entry of the listed blocks, if present and visible
                const int64_t mb = p.cand[r * p.C + t / p.block];
                j = mb * p.block + t % p.block;
                if (mb < 0 || j >= lim || j >= T) continue;
                recs[n] = p.pages + pages_of[j / p.epp] * page_bytes + (j % p.epp) * p.rec;
            } else {
                recs[n] = p.pages + pages_of[col] * page_bytes + slot * p.rec;
                if (++slot == p.epp) slot = 0, ++col;
            }
            js[n++] = j;
        }
        if (!n) continue;
#if defined(FS_AVX2) || defined(FS_AVX512)
        if (iq.ok)
            tile_scores_int(iq, w, recs, n, p.H, p.d, p.inv_sqrt_d, s);
        else
#endif
            tile_scores_float(q, w, recs, n, p.H, p.d, p.inv_sqrt_d, s);
        for (int64_t e = 0; e < n; ++e) {
            if (s[e] >= best.floor()) best.offer(s[e], js[e]);
            if (p.n_blocks) {
                bmax = s[e] > bmax ? s[e] : bmax;
                if (--left == 0 || js[e] + 1 == i1) {
                    blocks.offer(m == newest ? INFINITY : bmax, m);
                    bmax = -INFINITY, ++m, left = p.block;
                }
            }
        }
    }
}

// The chosen indices ascending, then (when fewer than k) the lowest others, into out[0..k); valid[i] = 1 for
// the chosen ones
void write_row(std::vector<Entry>& chosen, int64_t k, int64_t T, int64_t* out, uint8_t* valid) {
    std::vector<int64_t> js;
    for (const Entry& e : chosen) js.push_back(e.second);
    std::sort(js.begin(), js.end());
    std::vector<std::pair<int64_t, uint8_t>> row;
    for (int64_t j : js) row.push_back({j, 1});
    size_t at = 0;
    for (int64_t j = 0; static_cast<int64_t>(row.size()) < k && j < T; ++j) {
        while (at < js.size() && js[at] < j) ++at;
        if (at < js.size() && js[at] == j) continue;
        row.push_back({j, 0});
    }
    std::sort(row.begin(), row.end());
    for (int64_t i = 0; i < k; ++i) {
        out[i] = i < static_cast<int64_t>(row.size()) ? row[i].first : 0;
        valid[i] = i < static_cast<int64_t>(row.size()) ? row[i].second : 0;
    }
}

}  // namespace

extern "C" void kernel(const float* q, const float* w, const uint8_t* pages, const int64_t* table,
                       const int64_t* limit, const int64_t* cand, int64_t* idx, uint8_t* valid, int64_t* pool,
                       int64_t R, int64_t S, int64_t H, int64_t d, int64_t P, int64_t epp, int64_t rec, int64_t C,
                       int64_t k, int64_t block, int64_t n_blocks, int64_t threads) {
    if (d % 32 || d > DMAX || rec != d / 2 + d / 32 || S < 1 || k < 0 || block < 1 || (C && n_blocks))
        throw std::invalid_argument("index_topk: unsupported shapes (d a multiple of 32, records of d/2 + d/32 "
                                    "bytes, no pool in listed mode)");
    const Problem p{q, w, pages, table, limit, cand, R, S, H, d, P, epp, rec, C, k, block, n_blocks,
                    1.f / std::sqrt(static_cast<float>(d))};
    // work items: (row, range of its span), ranges of at least CHUNK entries, aligned to TILE and to blocks
    const int64_t align = TILE * block;
    std::vector<int64_t> item_row, item_lo, item_hi;
    std::vector<int64_t> first(R + 1, 0);
    for (int64_t r = 0; r < R; ++r) {
        const int64_t n = p.span(r);
        int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, n / CHUNK));
        const int64_t step = ((n + parts - 1) / parts + align - 1) / align * align;
        for (int64_t lo = 0; lo < n || lo == 0; lo += step) {
            item_row.push_back(r), item_lo.push_back(lo), item_hi.push_back(std::min(n, lo + step));
            if (step == 0) break;
        }
        first[r + 1] = static_cast<int64_t>(item_row.size());
    }
    const int64_t items = static_cast<int64_t>(item_row.size());
    std::vector<IntQuery> iqs;
    iqs.reserve(static_cast<size_t>(R));
    for (int64_t r = 0; r < R; ++r) iqs.emplace_back(q + r * H * d, H, d);
    std::vector<Best> bests(items, Best(k)), pools(items, Best(n_blocks));
    int64_t work = 0;
    for (int64_t r = 0; r < R; ++r) work += p.span(r);
    const int nt = static_cast<int>(work >= 2 * CHUNK ? std::max<int64_t>(1, std::min(threads, items)) : 1);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t i = 0; i < items; ++i)
        score_range(p, iqs[item_row[i]], item_row[i], item_lo[i], item_hi[i], bests[i], pools[i]);
    for (int64_t r = 0; r < R; ++r) {
        Best best(k), blocks(n_blocks);
        for (int64_t i = first[r]; i < first[r + 1]; ++i) {
            for (const Entry& e : bests[i].heap) best.offer(e.first, e.second);
            for (const Entry& e : pools[i].heap) blocks.offer(e.first, e.second);
        }
        write_row(best.heap, k, p.entries(), idx + r * k, valid + r * k);
        if (n_blocks) {
            std::vector<int64_t> ms;
            for (const Entry& e : blocks.heap) ms.push_back(e.second);
            std::sort(ms.begin(), ms.end());
            for (int64_t i = 0; i < n_blocks; ++i) pool[r * n_blocks + i] = i < static_cast<int64_t>(ms.size()) ? ms[i] : -1;
        }
    }
}

#if defined(FLASHSERVE_REGISTER_OP)
// flashserve::index_topk(q, w, pages, table, limit, cand, k, block, n_blocks) for CPU tensors on torch's dispatcher
// (the schema is defined in Python): a compiled step's C++ reaches it with no Python in between
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {
std::tuple<at::Tensor, at::Tensor, at::Tensor> index_topk_op(const at::Tensor& q, const at::Tensor& w,
                                                            const at::Tensor& pages, const at::Tensor& table,
                                                            const at::Tensor& limit, const at::Tensor& cand,
                                                            int64_t k, int64_t block, int64_t n_blocks) {
    const bool shapes = q.dim() == 3 && w.dim() == 2 && pages.dim() == 3 && table.dim() == 2 && limit.dim() == 1 &&
                        cand.dim() == 2 && w.size(0) == q.size(0) && w.size(1) == q.size(1) &&
                        limit.size(0) == q.size(0) && cand.size(0) == q.size(0) && table.size(0) > 0 &&
                        q.size(0) % table.size(0) == 0 && q.size(2) % 32 == 0 && q.size(2) <= DMAX &&
                        pages.size(2) == q.size(2) / 2 + q.size(2) / 32 && k >= 0 &&
                        k <= table.size(1) * pages.size(1) && block >= 1 && n_blocks >= 0 &&
                        (cand.size(1) == 0 || n_blocks == 0);
    TORCH_CHECK(shapes, "index_topk: q ", q.sizes(), ", w ", w.sizes(), ", pages ", pages.sizes(), ", table ",
                table.sizes(), ", limit ", limit.sizes(), ", cand ", cand.sizes(), ", k ", k, ", block ", block,
                ", n_blocks ", n_blocks, " do not match");
    TORCH_CHECK(q.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && pages.scalar_type() == at::kByte &&
                    table.scalar_type() == at::kLong && limit.scalar_type() == at::kLong &&
                    cand.scalar_type() == at::kLong,
                "index_topk: q and w must be float32, pages uint8, table, limit and cand int64");
    const at::Tensor qc = q.contiguous(), wc = w.contiguous(), pc = pages.contiguous(), tc = table.contiguous();
    const at::Tensor lc = limit.contiguous(), cc = cand.contiguous();
    const int64_t R = q.size(0);
    at::Tensor idx = at::empty({R, k}, table.options());
    at::Tensor valid = at::empty({R, k}, pages.options());
    at::Tensor pool = at::empty({R, n_blocks}, table.options());
    kernel(qc.data_ptr<float>(), wc.data_ptr<float>(), pc.data_ptr<uint8_t>(), tc.data_ptr<int64_t>(),
           lc.data_ptr<int64_t>(), cc.data_ptr<int64_t>(), idx.data_ptr<int64_t>(), valid.data_ptr<uint8_t>(),
           pool.data_ptr<int64_t>(), R, R / table.size(0), q.size(1), q.size(2), table.size(1), pages.size(1),
           pages.size(2), cand.size(1), k, block, n_blocks, at::get_num_threads());
    return {idx, valid.view(at::kBool), pool};
}
}  // namespace

TORCH_LIBRARY_IMPL(flashserve, CPU, m) { m.impl("index_topk", &index_topk_op); }
#endif
