// The lightning indexer's top-k on the CPU (flashserve.model.cpu_kernels.index_topk), for fixed-shape steps: scores
// the FP4 index keys where the paged cache stores them and keeps the best entries as it goes. The step it replaces
// read the whole cache through the page table, unpacked every key to floats, stored [T] scores, and then took the
// top-k in about ten passes over them (tiny-v41's compiled step at 32K context: 9.9 ms against 1.6 at 1K on a
// Zen 3; docs/engine-speed.md#the-c-kernels).
//
// Semantics, per query row r of sequence b = r / S (docs/architecture.md#indexer-and-candidate-pool):
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
#include "isa.h"
#include "fp4.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <utility>
#include <vector>

namespace {

#if defined(FS_AVX512) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FS_ZMM 1  // 16 entries a register, four byte products summed by one instruction (VNNI)
constexpr int64_t TILE = 16;  // entries scored together, one per vector lane
#else
constexpr int64_t TILE = 8;
#endif
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
    float floor() const {  // what an entry must reach to be offered (k = 0: nothing is)
        return k == 0 ? INFINITY : static_cast<int64_t>(heap.size()) < k ? -INFINITY : heap.front().first;
    }
};


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
// order load_keys unpacks the keys to, four at a time.
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
                if (n != std::nearbyint(n) || std::fabs(n) > 12.f || n * st != v[i]) return;
                bytes[8 * (i / 8) + 4 * (i % 2) + (i % 8) / 2] = static_cast<int8_t>(n);  // load_keys' order
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
                    kt[2 * i][e] = E2M1[rec[blk * 16 + i] & 15];
                    kt[2 * i + 1][e] = E2M1[rec[blk * 16 + i] >> 4];
                }
                sc[e] = e8m0(rec[d / 2 + blk]);
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
// e8m0(b) / 2 by byte (the integer path's codes are doubled): a lookup measured 1.04x over decoding each lane
struct HalfScales {
    float v[256];
    HalfScales() {
        for (int b = 0; b < 256; ++b) v[b] = e8m0(static_cast<uint8_t>(b)) * 0.5f;
    }
};
const HalfScales HALF_SCALES;

// The vector operations of the integer path, for one register of keys: 16 entries a register where the CPU has
// AVX-512 with byte shuffles and VNNI (half the instructions an entry), else 8
#if defined(FS_ZMM)
struct Vec {
    using I = __m512i;
    using F = __m512;
    static constexpr int64_t LANES = 16;
    static I set1(int32_t x) { return _mm512_set1_epi32(x); }
    static F set1(float x) { return _mm512_set1_ps(x); }
    static F zero() { return _mm512_setzero_ps(); }
    static I dot4(I acc, I a, I b) { return _mm512_dpbusd_epi32(acc, a, b); }  // acc + four u8 x s8 products
    static I add(I a, I b) { return _mm512_add_epi32(a, b); }
    static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F add(F a, F b) { return _mm512_add_ps(a, b); }
    static F max(F a, F b) { return _mm512_max_ps(a, b); }
    static F load(const float* p) { return _mm512_load_ps(p); }
    static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
    // 16 code bytes of four records, one in each 128-bit lane
    static I lanes(__m128i a, __m128i b, __m128i c, __m128i d) {
        return _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(a), b, 1), c, 2), d, 3);
    }
    static I lo32(I a, I b) { return _mm512_unpacklo_epi32(a, b); }
    static I hi32(I a, I b) { return _mm512_unpackhi_epi32(a, b); }
    static I lo64(I a, I b) { return _mm512_unpacklo_epi64(a, b); }
    static I hi64(I a, I b) { return _mm512_unpackhi_epi64(a, b); }
    // 2 * value + 12 of the low (high = false) or high nibbles of a's bytes
    static I nibbles(I a, bool high) {
        const I lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
        return _mm512_shuffle_epi8(lut, _mm512_and_si512(high ? _mm512_srli_epi16(a, 4) : a, _mm512_set1_epi8(0x0F)));
    }
    template <class S>
    static F gather(S v) { return _mm512_setr_ps(v(0), v(1), v(2), v(3), v(4), v(5), v(6), v(7), v(8), v(9), v(10),
                                                 v(11), v(12), v(13), v(14), v(15)); }
};
#else
struct Vec {
    using I = __m256i;
    using F = __m256;
    static constexpr int64_t LANES = 8;
    static I set1(int32_t x) { return _mm256_set1_epi32(x); }
    static F set1(float x) { return _mm256_set1_ps(x); }
    static F zero() { return _mm256_setzero_ps(); }
    static I add(I a, I b) { return _mm256_add_epi32(a, b); }
    static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F add(F a, F b) { return _mm256_add_ps(a, b); }
    static F max(F a, F b) { return _mm256_max_ps(a, b); }
    static F load(const float* p) { return _mm256_load_ps(p); }
    static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
    static I lanes(__m128i a, __m128i b) { return _mm256_set_m128i(b, a); }
    static I lo32(I a, I b) { return _mm256_unpacklo_epi32(a, b); }
    static I hi32(I a, I b) { return _mm256_unpackhi_epi32(a, b); }
    static I lo64(I a, I b) { return _mm256_unpacklo_epi64(a, b); }
    static I hi64(I a, I b) { return _mm256_unpackhi_epi64(a, b); }
    static I nibbles(I a, bool high) {
        const I lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                       12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
        return _mm256_shuffle_epi8(lut, _mm256_and_si256(high ? _mm256_srli_epi16(a, 4) : a, _mm256_set1_epi8(0x0F)));
    }
    template <class S>
    static F gather(S v) { return _mm256_setr_ps(v(0), v(1), v(2), v(3), v(4), v(5), v(6), v(7)); }
};
#endif
using I = Vec::I;
using F = Vec::F;
constexpr int64_t LANES = Vec::LANES;
static_assert(LANES == TILE, "a tile is one register of keys");

// Block blk of n <= LANES keys (records recs), quad-major: kq[2c + h] lane e holds, for code bytes 4c .. 4c + 3 of
// entry e, their low (h = 0: dims 8c, 8c + 2, 8c + 4, 8c + 6) or high nibbles (h = 1: the odd dims between) as
// 2 * value + 12 (unsigned bytes). The code bytes are transposed before they are unpacked: half the shuffles
// of transposing the unpacked bytes. Returns the keys' scales / 2.
inline F load_keys(const uint8_t* const* recs, int64_t n, int64_t blk, int64_t d, I* kq) {
    const auto codes = [&](int64_t e) {
        return _mm_loadu_si128(reinterpret_cast<const __m128i*>(recs[e < n ? e : 0] + blk * 16));
    };
    I r[4];  // entries e, e + 4, e + 8, ... in its 128-bit lanes
    for (int64_t e = 0; e < 4; ++e)
#if defined(FS_ZMM)
        r[e] = Vec::lanes(codes(e), codes(e + 4), codes(e + 8), codes(e + 12));
#else
        r[e] = Vec::lanes(codes(e), codes(e + 4));
#endif
    // in each lane, a 4x4 transpose of 32-bit words: u[c] holds word c of the lane's four entries
    const I t0 = Vec::lo32(r[0], r[1]), t1 = Vec::hi32(r[0], r[1]), t2 = Vec::lo32(r[2], r[3]), t3 = Vec::hi32(r[2], r[3]);
    const I u[4] = {Vec::lo64(t0, t2), Vec::hi64(t0, t2), Vec::lo64(t1, t3), Vec::hi64(t1, t3)};
    for (int64_t c = 0; c < 4; ++c) kq[2 * c] = Vec::nibbles(u[c], false), kq[2 * c + 1] = Vec::nibbles(u[c], true);
    // built in registers: scalar stores read back as one vector would wait on store forwarding
    return Vec::gather([&](int64_t e) { return HALF_SCALES.v[recs[e < n ? e : 0][d / 2 + blk]]; });
}

// Integer dot products of four heads (quads qw[i][0..8)) with the keys kq, plus init[i]
inline void four_heads(const I* kq, const int32_t* const* qw, const I* init, I* acc) {
#if defined(FS_ZMM)
    // four products summed into 32 bits by one instruction; two sums a head, so that each waits on four
    // instructions, not eight (VNNI's accumulation is in the instruction's latency)
    I odd[4];
    for (int64_t i = 0; i < 4; ++i) acc[i] = init[i], odd[i] = Vec::set1(0);
    for (int64_t g = 0; g < 8; g += 2)
        for (int64_t i = 0; i < 4; ++i) {
            acc[i] = Vec::dot4(acc[i], kq[g], Vec::set1(qw[i][g]));
            odd[i] = Vec::dot4(odd[i], kq[g + 1], Vec::set1(qw[i][g + 1]));
        }
    for (int64_t i = 0; i < 4; ++i) acc[i] = Vec::add(acc[i], odd[i]);
#else
    for (int64_t i = 0; i < 4; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t g = 0; g < 8; ++g)  // pairs summed into 16 bits: at most 8 * 2 * 24 * 12 = 4608
        for (int64_t i = 0; i < 4; ++i)
            acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(kq[g], _mm256_set1_epi32(qw[i][g])));
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < 4; ++i) acc[i] = _mm256_add_epi32(_mm256_madd_epi16(acc[i], ones), init[i]);
#endif
}

// tile_scores_float for a query in integers: each head's block is 32 int8 products over the keys' codes, exact,
// then scaled: the same values as the float path. Heads are summed in order, as there.
// ONE: d is one block of 32 (V4.1): no partial sums kept between blocks
template <bool ONE>
void tile_scores_int(const IntQuery& iq, const float* w, const uint8_t* const* recs, int64_t n, int64_t H, int64_t d,
                     float inv_sqrt_d, float* out) {
    const int64_t blocks = ONE ? 1 : d / 32;
    const int32_t* quads = iq.quads.data();
    const float* steps = iq.step.data();
    const int32_t* corr = iq.corr.data();
    const F inv = Vec::set1(inv_sqrt_d), zero = Vec::zero();
    I kq[8];
    F total = Vec::zero();
    alignas(64) float dots[64][LANES];  // a pass's heads (at most 64), summed over the blocks before the last
    for (int64_t h0 = 0; h0 < H; h0 += 64) {
        const int64_t hn = H - h0 < 64 ? H - h0 : 64;
        for (int64_t blk = 0; blk < blocks; ++blk) {
            const F scv = load_keys(recs, n, blk, d, kq);
            for (int64_t h = 0; h < hn; h += 4) {
                const int64_t m = hn - h < 4 ? hn - h : 4;
                const int32_t* qw[4];
                I init[4], acc[4];  // the sums start at -12 sum(n): the keys' offset taken back
                for (int64_t i = 0; i < 4; ++i) {
                    const int64_t hb = (h0 + h + (i < m ? i : 0)) * blocks + blk;
                    qw[i] = quads + hb * 8;
                    init[i] = Vec::set1(-corr[hb]);
                }
                four_heads(kq, qw, init, acc);
                for (int64_t i = 0; i < m; ++i) {
                    const int64_t hb = (h0 + h + i) * blocks + blk;
                    F dot = Vec::mul(Vec::mul(Vec::cvt(acc[i]), Vec::set1(steps[hb])), scv);
                    if (!ONE && blk) dot = Vec::add(Vec::load(dots[h + i]), dot);
                    if (!ONE && blk + 1 < blocks)
                        Vec::store(dots[h + i], dot);
                    else  // the head's score, summed in head order (V4.1's 32 dims: no store at all)
                        total = Vec::add(total, Vec::mul(Vec::mul(Vec::max(dot, zero), inv), Vec::set1(w[h0 + h + i])));
                }
            }
        }
    }
    Vec::store(out, total);
}
#endif

// Scores the entries [i0, i1) of row r's span into `best`, and (dense mode) their blocks into `blocks`; i0 is a
// multiple of the block size
void score_range(const Problem& p, const IntQuery& iq, int64_t r, int64_t i0, int64_t i1, Best& best, Best& blocks) {
    // the problem's fields as locals: stores to recs and js could alias them, and the loop would reload each one
    const int64_t H = p.H, d = p.d, C = p.C, epp = p.epp, rec = p.rec, block = p.block, T = p.entries();
    const bool pool = p.n_blocks > 0;
    const float inv_sqrt_d = p.inv_sqrt_d;
    const uint8_t* const pages = p.pages;
    const int64_t* const cand = p.cand + r * C;
    const float* q = p.q + r * H * d;
    const float* w = p.w + r * H;
    const int64_t* pages_of = p.table + (r / p.S) * p.P;
    const int64_t lim = std::min(p.limit[r], T);  // visible entries (candidate_pool's n_visible)
    const int64_t newest = lim > 0 ? (lim - 1) / block : -1;
    const int64_t page_bytes = epp * rec;
    float bmax = -INFINITY;  // the current block's best score (dense mode)
    int64_t m = i0 / block, left = block;  // the current block, and its entries still to come
    int64_t col = i0 / epp, slot = i0 % epp;  // dense mode: where entry i0 is
    const uint8_t* recs[TILE];
    int64_t js[TILE];
    alignas(32) float s[TILE];
    for (int64_t i = i0; i < i1; i += TILE) {
        int64_t n = 0;
        const int64_t end = i1 < i + TILE ? i1 : i + TILE;
        if (!C && end - i == TILE && slot + TILE <= epp) {  // a whole tile within one page: consecutive records
            const uint8_t* first = pages + pages_of[col] * page_bytes + slot * rec;
            for (int64_t e = 0; e < TILE; ++e) recs[e] = first + e * rec, js[e] = i + e;
            n = TILE;
            slot += TILE;
            if (slot == epp) slot = 0, ++col;
        }
        for (int64_t t = i + n; t < end; ++t) {
            int64_t j = t;
            if (C) {  // listed: the t-th entry of the listed blocks, if present and visible
                const int64_t mb = cand[t / block];
                j = mb * block + t % block;
                if (mb < 0 || j < 0 || j >= lim) continue;
                recs[n] = pages + pages_of[j / epp] * page_bytes + (j % epp) * rec;
            } else {
                recs[n] = pages + pages_of[col] * page_bytes + slot * rec;
                if (++slot == epp) slot = 0, ++col;
            }
            js[n++] = j;
        }
        if (!n) continue;
#if defined(FS_AVX2) || defined(FS_AVX512)
        if (iq.ok)
            (d == 32 ? tile_scores_int<true> : tile_scores_int<false>)(iq, w, recs, n, H, d, inv_sqrt_d, s);
        else
#endif
            tile_scores_float(q, w, recs, n, H, d, inv_sqrt_d, s);
        if (!pool) {  // most tiles hold nothing better than the k-th best so far
            float top = s[0];
            for (int64_t e = 1; e < n; ++e) top = s[e] > top ? s[e] : top;
            if (top < best.floor()) continue;
        }
        if (pool && !C && n == TILE && TILE % block == 0) {  // whole blocks: each one's best, then its entries
            for (int64_t b0 = 0; b0 < TILE; b0 += block) {
                float bm = s[b0];
                for (int64_t e = b0 + 1; e < b0 + block; ++e) bm = s[e] > bm ? s[e] : bm;
                blocks.offer(m == newest ? INFINITY : bm, m);
                ++m;
                if (bm >= best.floor())
                    for (int64_t e = b0; e < b0 + block; ++e)
                        if (s[e] >= best.floor()) best.offer(s[e], js[e]);
            }
            continue;
        }
        for (int64_t e = 0; e < n; ++e) {
            if (s[e] >= best.floor()) best.offer(s[e], js[e]);
            if (pool) {
                bmax = s[e] > bmax ? s[e] : bmax;
                if (--left == 0 || js[e] + 1 == i1) {
                    blocks.offer(m == newest ? INFINITY : bmax, m);
                    bmax = -INFINITY, ++m, left = block;
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

static void kernel(const float* q, const float* w, const uint8_t* pages, const int64_t* table,
                       const int64_t* limit, const int64_t* cand, int64_t* idx, uint8_t* valid, int64_t* pool,
                       int64_t R, int64_t S, int64_t H, int64_t d, int64_t n_pages, int64_t P, int64_t epp,
                       int64_t rec, int64_t C, int64_t k, int64_t block, int64_t n_blocks, int64_t threads) {
    if (R == 0) return;
    if (d < 32 || d % 32 || d > DMAX || rec != d / 2 + d / 32 || S < 1 || k < 0 || block < 1 || (C && n_blocks))
        throw std::invalid_argument("index_topk: unsupported shapes (d a multiple of 32, records of d/2 + d/32 "
                                    "bytes, no pool in listed mode)");
    for (int64_t i = 0; i < (R / S) * P; ++i)  // page ids come from the engine; one wrong one would read anywhere
        if (table[i] < 0 || table[i] >= n_pages) throw std::out_of_range("index_topk: page id out of range");
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

// flashserve::index_topk(q, w, pages, table, limit, cand, k, block, n_blocks) for CPU tensors on torch's dispatcher
// (schema: ops.cpp): a compiled step's C++ reaches it with no Python in between
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
                        q.size(0) % table.size(0) == 0 && q.size(2) >= 32 && q.size(2) % 32 == 0 && q.size(2) <= DMAX &&
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
           pool.data_ptr<int64_t>(), R, R / table.size(0), q.size(1), q.size(2), pages.size(0), table.size(1),
           pages.size(1), pages.size(2), cand.size(1), k, block, n_blocks, at::get_num_threads());
    return {idx, valid.view(at::kBool), pool};
}
}  // namespace

FS_LIBRARY_IMPL(m) { m.impl("index_topk", &index_topk_op); }
