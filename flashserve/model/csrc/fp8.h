#pragma once
// Shared by the kernels that read block FP8 (included by fp8_pairs.cpp and fp8_panels.cpp): one E4M3 code as
// float32, as flashserve.model.packed.decode gives it; their UE8M0 scales decode with fp4.h's e8m0.
#include <cstdint>
#include <cstring>

#include "fp4.h"

namespace {

// one E4M3 code as float32 (0x7F / 0xFF, NaN in E4M3, are not weights: they decode as 480 here)
inline float e4m3(uint8_t b) {
    const uint32_t mag = b & 0x7Fu;
    float f;
    if (mag & 0x78u) {  // normal: exponent e + 120 in float32's bias, mantissa in place
        const uint32_t bits = (mag << 20) + (120u << 23);
        std::memcpy(&f, &bits, sizeof f);
    } else {
        f = static_cast<float>(mag) * 0x1p-9f;  // subnormal: m * 2^-9
    }
    return (b & 0x80u) ? -f : f;
}

}  // namespace
