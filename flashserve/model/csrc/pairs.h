#pragma once
// Shared by the pair kernels (included by mxfp4_pairs.cpp,
// int8_pairs.cpp and fp8_pairs.cpp): (row, expert) pairs grouped by expert, and the work items over them.
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

}  // namespace
