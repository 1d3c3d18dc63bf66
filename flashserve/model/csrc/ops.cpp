// The operators of flashserve's CPU kernels, declared on torch's dispatcher in this build's namespace
// (FLASHSERVE_OPS, csrc/isa.h); each kernel's source registers its CPU implementation. Their fake (meta)
// implementations, for tracing, are registered from Python (flashserve.model.cpu_kernels).
#include "isa.h"

#include <torch/library.h>

FS_LIBRARY_FRAGMENT(m) {
    m.set_python_module("flashserve.model.cpu_kernels");  // where the fake implementations are
    m.def("mxfp4_pairs(Tensor x, Tensor experts, Tensor q, Tensor s) -> Tensor");
    m.def("mxfp4_gate_up(Tensor x, Tensor experts, Tensor q1, Tensor s1, Tensor q3, Tensor s3) -> Tensor");
    // the same with x rounded to int8 a 32-block (--quantization w4a8): operators of their own, not a defaulted
    // flag (inductor's C++ wrapper does not pass an argument it was not given)
    m.def("mxfp4_pairs_a8(Tensor x, Tensor experts, Tensor q, Tensor s) -> Tensor");
    m.def("mxfp4_gate_up_a8(Tensor x, Tensor experts, Tensor q1, Tensor s1, Tensor q3, Tensor s3) -> Tensor");
    // experts held one matrix an expert (a mapped checkpoint's views): their addresses in a table, [2 or 4, E]
    m.def("mxfp4_mapped(Tensor x, Tensor experts, Tensor table, int n, bool a8) -> Tensor");
    m.def("dense_rows(Tensor x, Tensor panels, int n) -> Tensor");
    m.def("int8_pairs(Tensor x, Tensor experts, Tensor q, Tensor scale) -> Tensor");
    m.def("int8_gate_up(Tensor x, Tensor experts, Tensor q1, Tensor s1, Tensor q3, Tensor s3) -> Tensor");
    m.def("fp8_pairs(Tensor x, Tensor experts, Tensor q, Tensor s, int row_block, int col_block) -> Tensor");
    // the same products over a copy of the codes in column panels [E, ceil(n / 16), K, 16] (pack_fp8_panels)
    m.def("fp8_panels(Tensor x, Tensor experts, Tensor panels, Tensor s, int n, int row_block, int col_block) -> "
          "Tensor");
    m.def("attend_rows(Tensor q, Tensor win, Tensor win_ok, Tensor ent, Tensor ent_ok, Tensor sink, float scale) -> "
          "Tensor");
    m.def("sinkhorn(Tensor comb, int iters, float eps) -> Tensor");
    m.def("index_topk(Tensor q, Tensor w, Tensor pages, Tensor table, Tensor limit, Tensor cand, int k, int block, "
          "int n_blocks) -> (Tensor, Tensor, Tensor)");
}
