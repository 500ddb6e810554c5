// The fused kernels' entry points (fused.cpp), for the decoder stack (stack.cpp) that composes them.
#pragma once

#include <torch/extension.h>

#include <vector>

namespace lockstep {

// gemm's fixed tile plan (fused.cpp): C (m x n, row-major, contiguous) = op(A) @ op(B); a_t: A is stored
// (k x m), b_t: B is stored (n x k). A row of C has the same bits whatever m, for m a multiple of 8.
void fixed_plan_gemm(bool a_t, bool b_t, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                     int64_t ldb, float* c);
torch::Tensor linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
std::vector<torch::Tensor> linear_backward(torch::Tensor dy, torch::Tensor x, torch::Tensor weight, bool need_dx,
                                           bool need_dw);
torch::Tensor column_sum(torch::Tensor x);
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor w, double eps);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor silu_mul_backward(torch::Tensor dy, torch::Tensor gate_up);
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor ssin);
torch::Tensor log_softmax(torch::Tensor x);
torch::Tensor sample_rows(torch::Tensor logp, torch::Tensor keys, torch::Tensor steps);
void cache_write(torch::Tensor keys, torch::Tensor values, torch::Tensor k, torch::Tensor v, torch::Tensor positions);
std::vector<torch::Tensor> attention_backward(torch::Tensor dout, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                              torch::Tensor positions, torch::Tensor out, torch::Tensor lse,
                                              double scale);
std::vector<torch::Tensor> attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor positions,
                                     double scale);

// Register the AdapterTable class and lora_add (lora.cpp), the DecoderStack class (stack.cpp).
void bind_lora(pybind11::module& m);
void bind_stack(pybind11::module& m);

}  // namespace lockstep
