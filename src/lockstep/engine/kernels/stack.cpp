// The decoder stack in one call: every dense layer of the invariant forward, outside autograd.
//
// A decode step on the per-op path makes some fifteen Python-level calls per layer (each kernel,
// the LoRA updates, the reshapes); at the built-in model's size that Python work was a fifth of the
// step. DecoderStack holds one model's weights (the fused q|k|v and gate|up copies, the norms, the
// LoRA factors) and runs all its layers per call. It composes the very kernels of fused.cpp, in
// the order and with the tensor shapes of InvariantLM._hidden_fused, so its bits are that path's:
// the trainer, which runs the per-op path under autograd, still agrees bit for bit (tested).
// Mixture-of-experts layers are not here; such a model keeps the per-op path. Besides the LoRA it
// holds (a peft model's, on every row), a call may bring adapters of its own, one per row
// (lora.cpp: a shared base serving many tenants), added after the same products as on the per-op
// path.

#include "fused.h"
#include "lora.h"

#include <string>
#include <utility>

namespace lockstep {
namespace {

using OptTensor = c10::optional<torch::Tensor>;

// The active LoRA adapters of one projection: delta(x) = sum over adapters of (x A^T) B^T * scale.
struct Lora {
  std::vector<torch::Tensor> a, b;
  std::vector<double> scale;
  int64_t out_features = 0;
};

// engine/fused.py's linear: any leading shape, through the fixed tile plan.
torch::Tensor lin(const torch::Tensor& x, const torch::Tensor& w, const OptTensor& bias) {
  auto lead = x.sizes().vec();
  lead.back() = w.size(0);
  return lockstep::linear(x.reshape({-1, x.size(-1)}), w, bias).reshape(lead);
}

// model.lora_delta: undefined when the projection has no adapter.
torch::Tensor lora_delta(const Lora& l, const torch::Tensor& x) {
  torch::Tensor out;
  for (size_t i = 0; i < l.a.size(); ++i) {
    auto d = lin(lin(x, l.a[i], c10::nullopt), l.b[i], c10::nullopt) * l.scale[i];
    out = out.defined() ? out + d : d;
  }
  return out;
}

// One call's per-row adapters (lora.cpp): tables[rows[r]] is flat row r's adapter (-1: none).
struct RowLora {
  std::vector<AdapterTable*> tables;
  torch::Tensor rows;
  int64_t layer = 0;
  // y (..., N) of x (..., K) with each row's adapter update for projections projs (model.py's
  // _RowLora: the same function on the per-op path).
  torch::Tensor apply(torch::Tensor y, const torch::Tensor& x, const std::vector<int64_t>& projs,
                      const std::vector<int64_t>& widths) const {
    if (tables.empty()) return y;
    auto y2 = y.reshape({-1, y.size(-1)}).contiguous();
    lora_add_(y2, x.reshape({-1, x.size(-1)}), rows, tables, layer, projs, widths);
    return y2.view(y.sizes());
  }
};

// model.apply_linear.
torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w, const OptTensor& bias, const Lora& l,
                      const RowLora& rl, int64_t proj) {
  auto y = lin(x, w, bias);
  auto d = lora_delta(l, x);
  y = d.defined() ? y + d : y;
  return rl.apply(y, x, {proj}, {w.size(0)});
}

// model.apply_fused: one product for several projections of x, LoRA updates added per slice (zeros
// for a projection without one, as the per-op path does).
torch::Tensor project_fused(const torch::Tensor& x, const torch::Tensor& w, const OptTensor& bias,
                            const std::vector<const Lora*>& parts, const RowLora& rl, const std::vector<int64_t>& projs) {
  auto y = lin(x, w, bias);
  if (!rl.tables.empty()) {
    std::vector<int64_t> widths;
    for (const Lora* l : parts) widths.push_back(l->out_features);
    return rl.apply(y, x, projs, widths);  // (a peft model brings no per-row adapters: model.py checks)
  }
  std::vector<torch::Tensor> deltas;
  bool any = false;
  for (const Lora* l : parts) {
    deltas.push_back(lora_delta(*l, x));
    any = any || deltas.back().defined();
  }
  if (!any) return y;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!deltas[i].defined()) {
      auto shape = x.sizes().vec();
      shape.back() = parts[i]->out_features;
      deltas[i] = x.new_zeros(shape);
    }
  }
  return y + torch::cat(deltas, -1);
}

// Slots of a layer's tensor list, in the order engine/model.py passes them.
enum Slot { IN_NORM, QKV_W, QKV_B, Q_NORM, K_NORM, O_W, O_B, POST_NORM, GU_W, GU_B, DOWN_W, DOWN_B, SLOTS };
// Projections that may carry LoRA, in the order of a layer's LoRA lists.
enum Proj { Q, K, V, O, GATE, UP, DOWN, PROJS };

struct Layer {
  std::vector<OptTensor> t;
  Lora lora[PROJS];
  const torch::Tensor& w(Slot s) const { return *t[s]; }
};

class DecoderStack {
 public:
  // layers[i]: SLOTS tensors (None where a model has no such term); lora_ab[i][p]: the
  // projection's adapters as [A0, B0, A1, B1, ...]; lora_scale[i][p] their scalings;
  // out_features[p] each projection's output size.
  DecoderStack(std::vector<std::vector<OptTensor>> layers, std::vector<std::vector<std::vector<torch::Tensor>>> lora_ab,
               std::vector<std::vector<std::vector<double>>> lora_scale, std::vector<int64_t> out_features,
               torch::Tensor final_norm, double eps, double scale, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim)
      : final_norm_(std::move(final_norm)), eps_(eps), scale_(scale), hq_(num_heads), hkv_(num_kv_heads), d_(head_dim) {
    TORCH_CHECK(lora_ab.size() == layers.size() && lora_scale.size() == layers.size(), "one LoRA list per layer");
    TORCH_CHECK(out_features.size() == PROJS, "out_features: one per projection");
    for (size_t i = 0; i < layers.size(); ++i) {
      TORCH_CHECK(layers[i].size() == SLOTS, "layer ", i, ": expected ", int(SLOTS), " tensors");
      for (Slot s : {IN_NORM, QKV_W, O_W, POST_NORM, GU_W, DOWN_W}) {
        TORCH_CHECK(layers[i][s].has_value() && layers[i][s]->defined(), "layer ", i, ": slot ", int(s), " is required");
      }
      Layer layer{std::move(layers[i]), {}};
      TORCH_CHECK(lora_ab[i].size() == PROJS && lora_scale[i].size() == PROJS, "layer ", i, ": one LoRA list per projection");
      for (int p = 0; p < PROJS; ++p) {
        const auto& ab = lora_ab[i][p];
        TORCH_CHECK(ab.size() == 2 * lora_scale[i][p].size(), "layer ", i, ": LoRA factors and scalings do not pair up");
        for (size_t j = 0; j < ab.size(); j += 2) {
          layer.lora[p].a.push_back(ab[j]);
          layer.lora[p].b.push_back(ab[j + 1]);
        }
        layer.lora[p].scale = lora_scale[i][p];
        layer.lora[p].out_features = out_features[p];
      }
      layers_.push_back(std::move(layer));
    }
  }

  // model.InvariantLM._hidden_fused: x (B, T, hidden) embeddings, positions (B, T), the rope rows
  // cos and signed sin (B, T, D). With a cache (keys[i], values[i] per layer), token (b, t) is
  // written at positions[b, t] and attends to cached keys 0..positions[b, t]; without one (empty
  // lists) row b is a sequence from position 0. tables and rows: the call's per-row adapters (lora.cpp;
  // rows (B * T) int64, flat token row -> index into tables or -1), or empty. Returns the final
  // normed hidden states.
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor ssin,
                        std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
                        std::vector<AdapterTable*> tables, torch::Tensor rows) const {
    const bool cached = !keys.empty();
    TORCH_CHECK(!cached || (keys.size() == layers_.size() && values.size() == layers_.size()),
                "one cache tensor per layer");
    torch::NoGradGuard no_grad;
    const int64_t B = x.size(0), T = x.size(1);
    RowLora rl{std::move(tables), rows, 0};
    auto h = lockstep::rms_norm(x, layers_[0].w(IN_NORM), eps_)[0];
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      rl.layer = static_cast<int64_t>(i);
      auto qkv = project_fused(h, l.w(QKV_W), l.t[QKV_B], {&l.lora[Q], &l.lora[K], &l.lora[V]}, rl, {Q, K, V})
                     .view({B, T, hq_ + 2 * hkv_, d_});
      auto qk = qkv.narrow(2, 0, hq_ + hkv_), v = qkv.narrow(2, hq_ + hkv_, hkv_);
      if (l.t[Q_NORM].has_value()) {  // Qwen3: per-head RMSNorm before RoPE
        qk = torch::cat({lockstep::rms_norm(qk.narrow(2, 0, hq_), l.w(Q_NORM), eps_)[0],
                         lockstep::rms_norm(qk.narrow(2, hq_, hkv_), l.w(K_NORM), eps_)[0]}, 2);
      }
      qk = lockstep::rope(qk, cos, ssin);
      auto q = qk.narrow(2, 0, hq_), k = qk.narrow(2, hq_, hkv_);
      torch::Tensor ks, vs;
      if (cached) {
        ks = keys[i];
        vs = values[i];
        lockstep::cache_write(ks, vs, k, v, positions);
      } else {  // the fresh projections are the keys: query t sees keys 0..t
        ks = k.transpose(1, 2);
        vs = v.transpose(1, 2);
      }
      auto out = lockstep::attention(q, ks, vs, positions, scale_)[0];
      auto a = project(out.reshape({B, T, hq_ * d_}), l.w(O_W), l.t[O_B], l.lora[O], rl, O);
      auto xh = lockstep::add_rms_norm(x, a, l.w(POST_NORM), eps_);
      x = xh[0];
      auto gu = project_fused(xh[1], l.w(GU_W), l.t[GU_B], {&l.lora[GATE], &l.lora[UP]}, rl, {GATE, UP});
      auto m = project(lockstep::silu_mul(gu), l.w(DOWN_W), l.t[DOWN_B], l.lora[DOWN], rl, DOWN);
      const auto& next = i + 1 < layers_.size() ? layers_[i + 1].w(IN_NORM) : final_norm_;
      auto xm = lockstep::add_rms_norm(x, m, next, eps_);
      x = xm[0];
      h = xm[1];
    }
    return h;
  }

 private:
  std::vector<Layer> layers_;
  torch::Tensor final_norm_;
  double eps_, scale_;
  int64_t hq_, hkv_, d_;
};

}  // namespace

void bind_stack(pybind11::module& m) {
  pybind11::class_<DecoderStack>(m, "DecoderStack", "every dense decoder layer of the invariant forward in one call")
      .def(pybind11::init<std::vector<std::vector<OptTensor>>, std::vector<std::vector<std::vector<torch::Tensor>>>,
                          std::vector<std::vector<std::vector<double>>>, std::vector<int64_t>, torch::Tensor, double,
                          double, int64_t, int64_t, int64_t>())
      .def("forward", &DecoderStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace lockstep
