#pragma once
// Shared by the pair kernels (included by mxfp4_pairs.cpp,
// int8_pairs.cpp and fp8_pairs.cpp): (row, expert) pairs grouped by expert, the work items over them, and the
// loop that runs a kernel's tile function over those items.
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// Pairs grouped by expert (a counting sort): pairs first[e] .. first[e + 1] - 1 of order use expert e.
// An index outside [0, E) throws std::out_of_range ("<kernel>: expert index out of range").
struct ExpertGroups {
    std::vector<int64_t> first, order;

    ExpertGroups(const int64_t* experts, int64_t P, int64_t E, const char* kernel) : first(E + 1, 0), order(P) {
        for (int64_t p = 0; p < P; ++p) {
            if (experts[p] < 0 || experts[p] >= E)
                throw std::out_of_range(std::string(kernel) + ": expert index out of range");
            ++first[experts[p] + 1];
        }
        for (int64_t e = 0; e < E; ++e) first[e + 1] += first[e];
        std::vector<int64_t> next(first.begin(), first.end() - 1);
        for (int64_t p = 0; p < P; ++p) order[next[experts[p]]++] = p;
    }

    // Work items e * tiles + t: each expert with pairs, by tiles of its matrix rows
    std::vector<int64_t> items(int64_t tiles) const {
        std::vector<int64_t> out;
        for (int64_t e = 0; e + 1 < static_cast<int64_t>(first.size()); ++e)
            if (first[e + 1] > first[e])
                for (int64_t t = 0; t < tiles; ++t) out.push_back(e * tiles + t);
        return out;
    }
};

// The pair kernels' outer loop, on `threads` threads: every (expert, TILE matrix rows) work item of each of
// `matrices` matrices, the expert's pairs ROWS at a time: tile(m, e, n0, n1, rows, R, outs) with rows[r] the row
// of x (x [P / k, K]) and outs[r] the row of out (out [matrices, P, N]) of each of the R pairs.
template <int64_t ROWS, int64_t TILE, typename Tile>
inline void pair_tiles(const ExpertGroups& groups, const float* x, float* out, int64_t P, int64_t k, int64_t N,
                       int64_t K, int64_t matrices, int64_t threads, Tile&& tile) {
    const int64_t tiles = (N + TILE - 1) / TILE;
    const std::vector<int64_t> items = groups.items(tiles);
    const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n_items * matrices; ++i) {  // the first matrix's items, then the second's
        const int64_t m = i / n_items, item = items[i % n_items];
        const int64_t e = item / tiles, n0 = (item % tiles) * TILE, n1 = n0 + TILE < N ? n0 + TILE : N;
        for (int64_t c0 = groups.first[e]; c0 < groups.first[e + 1]; c0 += ROWS) {
            const int64_t R = groups.first[e + 1] - c0 < ROWS ? groups.first[e + 1] - c0 : ROWS;
            const float* rows[ROWS];
            float* outs[ROWS];
            for (int64_t r = 0; r < R; ++r) {
                const int64_t p = groups.order[c0 + r];
                rows[r] = x + (p / k) * K;
                outs[r] = out + (m * P + p) * N;
            }
            tile(m, e, n0, n1, rows, R, outs);
        }
    }
}

}  // namespace
