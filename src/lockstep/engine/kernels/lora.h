// Per-row LoRA over a shared base (lora.cpp): the adapter table and the update, for the decoder
// stack (stack.cpp) and the Python per-op path alike.
#pragma once

#include "fused.h"

#include <tuple>
#include <vector>

namespace lockstep {

struct LoraFactor {
  torch::Tensor a, b;  // (rank, in), (out, rank)
  float scale = 0.f;
  bool present = false;
};

using FactorSpec = c10::optional<std::tuple<torch::Tensor, torch::Tensor, double>>;

// One adapter: per layer, per projection (q, k, v, o, gate, up, down), its factors or none. Holds
// references to the tensors, so an optimizer's in-place step is seen by the next call.
class AdapterTable {
 public:
  explicit AdapterTable(const std::vector<std::vector<FactorSpec>>& layers);
  const LoraFactor& at(int64_t layer, int64_t proj) const;
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<std::vector<LoraFactor>> layers_;
};

// y[r, slice of proj p] += scale_p * (x[r] A_p^T) B_p^T for each row r whose adapter rows[r] >= 0
// has projection p: in place on y (M, N), x (M, K); projs index the tables' projections and widths
// are their output sizes (summing to N).
void lora_add_(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& rows,
               const std::vector<AdapterTable*>& tables, int64_t layer, const std::vector<int64_t>& projs,
               const std::vector<int64_t>& widths);

}  // namespace lockstep
