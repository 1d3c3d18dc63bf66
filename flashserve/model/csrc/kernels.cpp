// The kernels in one translation unit, so torch's headers (most of a build's time) are parsed once, not once a
// source; mxfp4_pairs.cpp is a unit of its own, compiled beside this one (in one unit with the others, gcc inlined
// less of its decode: 7-13% slower at 16 rows). The headers come first, at global scope; each source then sits in
// a namespace of its own, which keeps the sources' file-local names (their anonymous namespaces) apart.
#include "isa.h"
#include "pairs.h"
#include "fp4.h"
#include "fp8.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace fs_ops {
#include "ops.cpp"
}
namespace fs_dense_rows {
#include "dense_rows.cpp"
}
namespace fs_int8_pairs {
#include "int8_pairs.cpp"
}
namespace fs_fp8_pairs {
#include "fp8_pairs.cpp"
}
namespace fs_fp8_panels {
#include "fp8_panels.cpp"
}
namespace fs_attend_rows {
#include "attend_rows.cpp"
}
namespace fs_sinkhorn {
#include "sinkhorn.cpp"
}
namespace fs_index_topk {
#include "index_topk.cpp"
}
