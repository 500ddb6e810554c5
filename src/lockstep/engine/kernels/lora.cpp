// Many LoRA adapters over one frozen base in one call: each row gets its own adapter's update.
//
// For the rows of adapter a (in their order in the batch) and each projection p of the group,
// delta = ((x_a A_p^T) B_p^T) * scale_p, both products through gemm's fixed plan on the adapter's
// rows gathered and zero-padded to a multiple of 8, exactly as engine/model.py's per-op path
// computes linear(linear(x, A), B) * scale on a batch of its own; then y[r] = y[r] + delta[r]
// (a projection of the group the adapter lacks adds +0, as the per-op path's zero slice does). A
// product's row has the same bits whatever the number of rows, so a row's result depends on its
// own input and its own adapter only: never on which other adapters or rows share the call, nor on
// the thread count (threads take whole adapters; gemm is serial inside a parallel region, and
// its tile plan never depends on the threads anyway). No reduction is split, nothing is atomic.

#include "lora.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <tuple>
#include <vector>

namespace lockstep {

namespace {

constexpr int64_t ROW_TILE = 8;

int64_t padded_rows(int64_t n) { return std::max(ROW_TILE, (n + ROW_TILE - 1) / ROW_TILE * ROW_TILE); }

}  // namespace

AdapterTable::AdapterTable(const std::vector<std::vector<FactorSpec>>& layers) {
  for (size_t i = 0; i < layers.size(); ++i) {
    std::vector<LoraFactor> row;
    for (size_t p = 0; p < layers[i].size(); ++p) {
      LoraFactor f;
      if (layers[i][p].has_value()) {
        const auto& [a, b, scale] = *layers[i][p];
        TORCH_CHECK(a.scalar_type() == torch::kFloat32 && b.scalar_type() == torch::kFloat32 && a.device().is_cpu() &&
                        b.device().is_cpu(), "layer ", i, " projection ", p, ": LoRA factors must be float32 CPU tensors");
        TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && b.size(1) == a.size(0), "layer ", i, " projection ", p,
                    ": A must be (rank, in) and B (out, rank)");
        TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "layer ", i, " projection ", p, ": factors must be contiguous");
        f = LoraFactor{a, b, static_cast<float>(scale), true};
      }
      row.push_back(f);
    }
    layers_.push_back(std::move(row));
  }
}

const LoraFactor& AdapterTable::at(int64_t layer, int64_t proj) const {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "adapter table: no layer ", layer);
  TORCH_CHECK(proj >= 0 && proj < static_cast<int64_t>(layers_[layer].size()), "adapter table: no projection ", proj);
  return layers_[layer][proj];
}

namespace {

// Adapter a's update on its rows (ascending), added into out (M x N, row-major).
void add_adapter(float* out, int64_t N, const float* x, int64_t K, const std::vector<int64_t>& rows, const AdapterTable& t,
                 int64_t layer, const std::vector<int64_t>& projs, const std::vector<int64_t>& widths) {
  bool any = false;
  for (int64_t p : projs) any = any || t.at(layer, p).present;
  if (!any) return;  // no slice of this group: the rows keep the base's bits
  const int64_t n = static_cast<int64_t>(rows.size()), Mp = padded_rows(n);
  std::vector<float> xa(Mp * K, 0.f);
  for (int64_t i = 0; i < n; ++i) std::copy(x + rows[i] * K, x + (rows[i] + 1) * K, xa.data() + i * K);
  int64_t offset = 0;
  for (size_t j = 0; j < projs.size(); ++j) {
    const LoraFactor& f = t.at(layer, projs[j]);
    const int64_t w = widths[j];
    if (!f.present) {
      for (int64_t i = 0; i < n; ++i) {
        float* o = out + rows[i] * N + offset;
        for (int64_t c = 0; c < w; ++c) o[c] = o[c] + 0.f;
      }
      offset += w;
      continue;
    }
    const int64_t r = f.a.size(0);
    TORCH_CHECK(f.a.size(1) == K && f.b.size(0) == w, "layer ", layer, " projection ", projs[j], ": LoRA factors (",
                f.b.size(0), " x ", r, ") (", r, " x ", f.a.size(1), ") do not fit a ", K, " -> ", w, " projection");
    std::vector<float> u(Mp * r), d(Mp * w);
    fixed_plan_gemm(false, true, Mp, r, K, xa.data(), K, f.a.data_ptr<float>(), K, u.data());
    fixed_plan_gemm(false, true, Mp, w, r, u.data(), r, f.b.data_ptr<float>(), r, d.data());
    const float s = f.scale;
    for (int64_t i = 0; i < n; ++i) {
      float* o = out + rows[i] * N + offset;
      const float* di = d.data() + i * w;
      for (int64_t c = 0; c < w; ++c) o[c] = o[c] + di[c] * s;  // (delta * scale), then y + it: two roundings
    }
    offset += w;
  }
}

}  // namespace

void lora_add_(torch::Tensor& y, const torch::Tensor& x_in, const torch::Tensor& rows_in,
               const std::vector<AdapterTable*>& tables, int64_t layer, const std::vector<int64_t>& projs,
               const std::vector<int64_t>& widths) {
  TORCH_CHECK(y.scalar_type() == torch::kFloat32 && x_in.scalar_type() == torch::kFloat32, "lora_add: float32 only");
  TORCH_CHECK(y.dim() == 2 && x_in.dim() == 2 && y.size(0) == x_in.size(0), "lora_add: y (M, N), x (M, K)");
  TORCH_CHECK(y.is_contiguous(), "lora_add: y must be contiguous");
  TORCH_CHECK(projs.size() == widths.size(), "lora_add: one width per projection");
  int64_t N = 0;
  for (int64_t w : widths) N += w;
  TORCH_CHECK(N == y.size(1), "lora_add: the widths sum to ", N, ", y has ", y.size(1), " columns");
  const auto x = x_in.contiguous();
  const auto rows = rows_in.contiguous();
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.numel() == y.size(0), "lora_add: rows, int64 (M,)");
  const int64_t M = y.size(0), K = x.size(1), A = static_cast<int64_t>(tables.size());
  std::vector<std::vector<int64_t>> members(A);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    TORCH_CHECK(rp[r] >= -1 && rp[r] < A, "lora_add: row ", r, " names adapter ", rp[r], " of ", A);
    if (rp[r] >= 0) members[rp[r]].push_back(r);
  }
  std::vector<int64_t> active;
  for (int64_t a = 0; a < A; ++a) {
    if (!members[a].empty()) active.push_back(a);
  }
  float* out = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t a = active[i];
      add_adapter(out, N, xp, K, members[a], *tables[a], layer, projs, widths);
    }
  };
  // Several adapters: one thread each (gemm serial inside). One: gemm spreads its tiles. The
  // bits are the same either way.
  if (active.size() > 1) {
    at::parallel_for(0, static_cast<int64_t>(active.size()), 1, run);
  } else {
    run(0, static_cast<int64_t>(active.size()));
  }
}

torch::Tensor lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor rows, std::vector<AdapterTable*> tables,
                       int64_t layer, std::vector<int64_t> projs, std::vector<int64_t> widths) {
  auto out = y.contiguous().clone();
  lora_add_(out, x, rows, tables, layer, projs, widths);
  return out;
}

void bind_lora(pybind11::module& m) {
  pybind11::class_<AdapterTable>(m, "AdapterTable", "one LoRA adapter's factors per layer and projection")
      .def(pybind11::init<const std::vector<std::vector<FactorSpec>>&>())
      .def_property_readonly("num_layers", &AdapterTable::num_layers);
  m.def("lora_add", &lora_add, "y + each row's own adapter's LoRA update, per projection slice (a new tensor)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace lockstep
