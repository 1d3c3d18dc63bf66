#pragma once
// Shared by the kernels that read FP4 (included by mxfp4_pairs.cpp and index_topk.cpp) and, for the UE8M0
// scales, by fp8.h: the E2M1 values and the UE8M0 scales, as flashserve.model.quant decodes them.
#include <cstdint>
#include <cstring>

namespace {

// E2M1 codes 0 .. 15 (sign in bit 3)
alignas(64) const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                    -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// 2^(b - 127), bit for bit what flashserve.model.quant.e8m0_to_float gives (b = 0: the subnormal 2^-127)
inline float e8m0(uint8_t b) {
    const uint32_t bits = b == 0 ? 0x00400000u : static_cast<uint32_t>(b) << 23;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

}  // namespace
