// Fused fp32 CPU kernels of lockstep's invariant forward, shared by the sampler and the trainer.
//
// THE RULE. Every output element is computed by one thread, through one code path, and every
// reduction behind it runs in one fixed order that depends only on the reduction's own length
// (the hidden size, the head size, the number of keys visible to a query): never on the batch
// size, a row's place in the batch, padding, the KV cache's capacity or the thread count. Threads
// split the work only between independent outputs (rows, heads, query positions); no reduction
// is ever split between threads. The file is compiled with -ffp-contract=off and without
// -ffast-math, so the compiler may vectorise across independent lanes but never reassociates a
// sum or fuses a multiply-add differently at two call sites. Hence a token's result is the same
// bits in a KV-cache decode step and in a padded full-sequence forward, which is what lets the
// sampler's logprobs equal the trainer's.
//
// Matrix products follow the same rule through a fixed plan (gemm below): the output is cut into
// tiles of fixed size, each computed by one single-threaded sgemm call, so neither the thread
// count nor MKL's own threading choices (MKL_DYNAMIC may take fewer threads than asked when the
// machine is busy, and at 3+ threads small products change their reduction order even in strict
// CNR mode) can change a bit. A row's tile always has a multiple of ROW_TILE rows (MKL's kernel
// for a single row differs), and a column always falls in the same tile of the same width.
//
// The backward passes of rms_norm, rope and log_softmax are composed from torch ops in
// engine/fused.py (gradients are not compared bit for bit with anything); silu_mul's and
// attention's are passes here, and the linear layers' backward uses gemm too, so a training step is
// reproducible from one process to the next.

#include "fused.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t LANES = 8;

// The reduction order of every sum here: LANES partial sums over whole blocks of the terms, the
// tail added to the first lanes in order, the lanes folded pairwise. It depends on n only.
template <typename Term>
inline float lane_sum(int64_t n, Term term) {
  float acc[LANES] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int64_t l = 0; l < LANES; ++l) acc[l] += term(i + l);
  }
  for (int64_t l = 0; i < n; ++i, ++l) acc[l] += term(i);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// exp(x) in plain IEEE arithmetic (Cephes' expf: a range reduction by ln 2 in two parts, a degree-6
// polynomial, a scale by 2^n through the exponent bits), so that a loop over an array vectorises
// (glibc's expf is a scalar call) and a lane computes the same bits as the scalar tail. Within 2
// ulp of exp; 0 below -87.3, +inf above 88.7, NaN stays NaN.
inline float fast_exp(float x) {
  const float xc = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::nearbyint(xc * 1.44269504088896341f);  // (floor does not vectorise with GCC 12)
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  const float scale = __builtin_bit_cast(float, bits);
  const float e = y * scale;
  return x < -87.3f ? 0.f : (x > 88.7f ? std::numeric_limits<float>::infinity() : (x != x ? x : e));
}

// out[i] = fast_exp(in[i] - shift), vectorised across i.
inline void exp_shifted(const float* in, float shift, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = fast_exp(in[i] - shift);
}

inline float dot(const float* a, const float* b, int64_t n) {
  return lane_sum(n, [=](int64_t i) { return a[i] * b[i]; });
}

inline void rms_norm_row(const float* x, const float* w, float* y, int64_t n, float eps, float* rstd_out) {
  const float mean = dot(x, x, n) / static_cast<float>(n);
  const float r = 1.f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
  if (rstd_out) *rstd_out = r;
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

int64_t grain(int64_t work_per_item) {
  // Enough items per task that a task is worth scheduling (~16k flops); 1 at most per item.
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, work_per_item));
}

}  // namespace

// -- matrix products through a fixed plan ---------------------------------------------------------

extern "C" {
// From the MKL inside libtorch_cpu; weak, so that a torch without MKL still loads this module
// (and gemm then takes the plain loops below).
__attribute__((weak)) void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                                  const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                                  const float* beta, float* c, const int* ldc);
// The C interface (by value); in libtorch_cpu the lowercase name is the Fortran one (by pointer).
__attribute__((weak)) int MKL_Set_Num_Threads_Local(int nt);
}

namespace {

constexpr int64_t ROW_TILE = 8;
// A multiple of ROW_TILE. Each tile's sgemm packs its weight panel afresh, so taller tiles pack it
// fewer times: 512 rows against 128 cut a 20M model's training products by ~9% (4,096 rows).
constexpr int64_t TILE_ROWS = 512;

// A tile's width: a function of the weight's shape (n outputs, k inputs) only, never of the rows
// or the threads, so a column is always computed in the same tile. At least 16384 / k columns, so
// that a single-threaded sgemm on a decode step's few rows runs well (64 columns over
// k = 128 ran at a third of it; over k = 512, at 90%), else a quarter of n to give the threads
// several tiles; between 64 and 512, in steps of 64.
int64_t tile_cols(int64_t n, int64_t k) {
  const int64_t want = std::max<int64_t>(16384 / std::max<int64_t>(k, 1), n / 4);
  return std::min<int64_t>(512, std::max<int64_t>(64, (want + 63) / 64 * 64));
}

bool have_mkl() { return sgemm_ != nullptr && MKL_Set_Num_Threads_Local != nullptr; }

// One tile, single-threaded: C (m x n, row stride ldc) = op(A) @ op(B), where op(A) is (m x k) and
// op(B) is (k x n). a_t: A is stored (k x m) and op(A) = A^T; b_t: B is stored (n x k) and
// op(B) = B^T. Row-major throughout; sgemm_ is column-major, so it computes C^T = op(B)^T op(A)^T.
void tile(bool a_t, bool b_t, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float* c, int64_t ldc) {
  if (have_mkl()) {
    const char ta = b_t ? 'T' : 'N', tb = a_t ? 'T' : 'N';
    const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
    const int LDA = static_cast<int>(ldb), LDB = static_cast<int>(lda), LDC = static_cast<int>(ldc);
    const float one = 1.f, zero = 0.f;
    sgemm_(&ta, &tb, &M, &N, &K, &one, b, &LDA, a, &LDB, &zero, c, &LDC);
    return;
  }
  for (int64_t i = 0; i < m; ++i) {  // no MKL: plain loops, k in order for every output
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.f;
      for (int64_t p = 0; p < k; ++p) acc += (a_t ? a[p * lda + i] : a[i * lda + p]) * (b_t ? b[j * ldb + p] : b[p * ldb + j]);
      c[i * ldc + j] = acc;
    }
  }
}

// C (m x n) = op(A) @ op(B) (see tile), every tile single-threaded, tiles spread over the threads.
// For a row's bits not to depend on m, m must be a multiple of ROW_TILE (linear pads it).
void gemm(bool a_t, bool b_t, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float* c) {
  const int64_t cols_per_tile = tile_cols(n, k);
  const int64_t row_tiles = (m + TILE_ROWS - 1) / TILE_ROWS, col_tiles = (n + cols_per_tile - 1) / cols_per_tile;
  at::parallel_for(0, row_tiles * col_tiles, 1, [&](int64_t begin, int64_t end) {
    const int before = have_mkl() ? MKL_Set_Num_Threads_Local(1) : 0;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i0 = (t / col_tiles) * TILE_ROWS, j0 = (t % col_tiles) * cols_per_tile;
      const int64_t rows = std::min(TILE_ROWS, m - i0), cols = std::min(cols_per_tile, n - j0);
      const float* at = a_t ? a + i0 : a + i0 * lda;
      const float* bt = b_t ? b + j0 * ldb : b + j0;
      tile(a_t, b_t, rows, cols, k, at, lda, bt, ldb, c + i0 * n + j0, n);
    }
    if (have_mkl()) MKL_Set_Num_Threads_Local(before);
  });
}

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

}  // namespace

namespace lockstep {

void fixed_plan_gemm(bool a_t, bool b_t, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                     int64_t ldb, float* c) {
  gemm(a_t, b_t, m, n, k, a, lda, b, ldb, c);
}

// x (M, K) @ weight (N, K)^T (+ bias (N)) -> (M, N), rows padded to ROW_TILE inside.
torch::Tensor linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  check_f32(x, "x");
  check_f32(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear: x (M, K), weight (N, K)");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), Mp = std::max(ROW_TILE, round_up(M, ROW_TILE));
  if (Mp != M) x = torch::cat({x, x.new_zeros({Mp - M, K})});
  auto y = torch::empty({Mp, N}, x.options());
  gemm(false, true, Mp, N, K, x.data_ptr<float>(), K, weight.data_ptr<float>(), K, y.data_ptr<float>());
  if (Mp != M) y = y.narrow(0, 0, M);
  if (bias.has_value() && bias->defined()) y = y + *bias;
  return y;
}

// The linear layer's backward through the same plan: (dx = dy @ weight, dweight = dy^T @ x).
std::vector<torch::Tensor> linear_backward(torch::Tensor dy, torch::Tensor x, torch::Tensor weight, bool need_dx,
                                           bool need_dw) {
  check_f32(dy, "dy");
  dy = dy.contiguous();
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t M = dy.size(0), N = dy.size(1), K = x.size(1);
  torch::Tensor dx, dw;
  if (need_dx) {
    const int64_t Mp = std::max(ROW_TILE, round_up(M, ROW_TILE));
    auto dyp = Mp != M ? torch::cat({dy, dy.new_zeros({Mp - M, N})}) : dy;
    dx = torch::empty({Mp, K}, dy.options());
    gemm(false, false, Mp, K, N, dyp.data_ptr<float>(), N, weight.data_ptr<float>(), K, dx.data_ptr<float>());
    if (Mp != M) dx = dx.narrow(0, 0, M);
  }
  if (need_dw) {
    dw = torch::empty({N, K}, dy.options());  // (its rows need no padding: only reproducibility matters here)
    gemm(true, false, N, K, M, dy.data_ptr<float>(), N, x.data_ptr<float>(), K, dw.data_ptr<float>());
  }
  return {dx, dw};
}

// Column sums of x (M, N) in row order (a bias's gradient), one thread per column block.
torch::Tensor column_sum(torch::Tensor x) {
  check_f32(x, "x");
  x = x.contiguous();
  const int64_t M = x.size(0), N = x.size(1);
  auto out = torch::zeros({N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, M)), [&](int64_t begin, int64_t end) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = begin; j < end; ++j) op[j] += xp[i * N + j];
  });
  return out;
}

// x (N, H) contiguous -> (y (N, H), rstd (N)).
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_f32(x, "x");
  check_f32(w, "weight");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t H = x.size(-1), N = x.numel() / H;
  TORCH_CHECK(w.numel() == H, "weight has ", w.numel(), " elements, expected ", H);
  auto y = torch::empty_like(x);
  auto rstd = torch::empty({N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *rp = rstd.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, grain(3 * H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * H, wp, yp + r * H, H, e, rp + r);
  });
  return {y, rstd};
}

// (x + delta, rms_norm(x + delta)): the residual add and the next norm in one pass.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps) {
  check_f32(x, "x");
  check_f32(delta, "delta");
  check_f32(w, "weight");
  TORCH_CHECK(x.sizes() == delta.sizes(), "x and delta differ in shape");
  x = x.contiguous();
  delta = delta.contiguous();
  w = w.contiguous();
  const int64_t H = x.size(-1), N = x.numel() / H;
  auto s = torch::empty_like(x);
  auto y = torch::empty_like(x);
  auto rstd = torch::empty({N}, x.options());
  const float *xp = x.data_ptr<float>(), *dp = delta.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *sp = s.data_ptr<float>(), *yp = y.data_ptr<float>(), *rp = rstd.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, grain(4 * H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < H; ++i) sp[r * H + i] = xp[r * H + i] + dp[r * H + i];
      rms_norm_row(sp + r * H, wp, yp + r * H, H, e, rp + r);
    }
  });
  return {s, y, rstd};
}

// gate_up (N, 2I) contiguous -> silu(gate) * up (N, I), silu(g) = g / (1 + exp(-g)) (fast_exp).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_f32(gate_up, "gate_up");
  gate_up = gate_up.contiguous();
  const int64_t I2 = gate_up.size(-1), N = gate_up.numel() / I2, I = I2 / 2;
  TORCH_CHECK(I2 % 2 == 0, "gate_up's last dimension must be even");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto y = torch::empty(sizes, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, grain(8 * I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * I2;
      const float* u = g + I;
      float* out = yp + r * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) out[i] = (g[i] / (1.f + fast_exp(-g[i]))) * u[i];
    }
  });
  return y;
}

// The gradient of silu_mul: for s = 1 / (1 + exp(-g)), d gate = dy * u * s * (1 + g * (1 - s)) and
// d up = dy * g * s, in one pass (the torch-op version made ten temporaries the size of gate_up).
torch::Tensor silu_mul_backward(torch::Tensor dy, torch::Tensor gate_up) {
  check_f32(dy, "dy");
  check_f32(gate_up, "gate_up");
  dy = dy.contiguous();
  gate_up = gate_up.contiguous();
  const int64_t I2 = gate_up.size(-1), N = gate_up.numel() / I2, I = I2 / 2;
  TORCH_CHECK(dy.numel() == N * I, "dy must be (..., I) for gate_up (..., 2I)");
  auto grad = torch::empty_like(gate_up);
  const float *dp = dy.data_ptr<float>(), *gp = gate_up.data_ptr<float>();
  float* op = grad.data_ptr<float>();
  at::parallel_for(0, N, grain(12 * I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *g = gp + r * I2, *u = g + I, *d = dp + r * I;
      float *dg = op + r * I2, *du = dg + I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float s = 1.f / (1.f + fast_exp(-g[i]));
        dg[i] = d[i] * u[i] * s * (1.f + g[i] * (1.f - s));
        du[i] = d[i] * g[i] * s;
      }
    }
  });
  return grad;
}

// x (B, T, H, D), last dim contiguous; cos, ssin (B, T, D) contiguous (ssin: the sine with its
// first half negated) -> x * cos + roll(x, D/2) * ssin, contiguous (B, T, H, D).
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor ssin) {
  check_f32(x, "x");
  check_f32(cos, "cos");
  check_f32(ssin, "sin");
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, "x must be (B, T, H, D) with a contiguous last dim");
  cos = cos.contiguous();
  ssin = ssin.contiguous();
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.numel() == B * T * D && ssin.numel() == B * T * D, "rope tables must be (B, T, D)");
  auto y = torch::empty({B, T, H, D}, x.options());
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = ssin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t sb = x.stride(0), st = x.stride(1), sh = x.stride(2);
  at::parallel_for(0, B * T, grain(4 * H * D), [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / T, t = bt % T;
      const float* c = cp + bt * D;
      const float* s = sp + bt * D;
      for (int64_t h = 0; h < H; ++h) {
        const float* in = xp + b * sb + t * st + h * sh;
        float* out = yp + (bt * H + h) * D;
        for (int64_t d = 0; d < half; ++d) out[d] = in[d] * c[d] + in[d + half] * s[d];
        for (int64_t d = half; d < D; ++d) out[d] = in[d] * c[d] + in[d - half] * s[d];
      }
    }
  });
  return y;
}

// Row-wise log-softmax of x (N, V): max, then the sum of exp(x - max) in a fixed order, then
// x - max - log(sum).
torch::Tensor log_softmax(torch::Tensor x) {
  check_f32(x, "x");
  x = x.contiguous();
  const int64_t V = x.size(-1), N = x.numel() / V;
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, grain(8 * V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* in = xp + r * V;
      float* out = yp + r * V;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < V; ++j) m = std::max(m, in[j]);
      exp_shifted(in, m, out, V);  // scratch: the row's exps
      const float lse = std::log(lane_sum(V, [=](int64_t j) { return out[j]; }));
      for (int64_t i = 0; i < V; ++i) out[i] = (in[i] - m) - lse;
    }
  });
  return y;
}

}  // namespace lockstep

namespace {

// The counter-based RNG of engine/sampling.py (uniform, _hash32, _splitmix64), bit for bit.
constexpr uint64_t M32 = 0xFFFFFFFFull;

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

double uniform(int64_t key, uint64_t mixed_step) {
  uint64_t x = (static_cast<uint64_t>(key) ^ (mixed_step & M32)) & M32;
  x = x ^ (x >> 16);
  x = (x * 0x7FEB352Dull) & M32;
  x = x ^ (x >> 15);
  x = (x * 0x5BD1E995ull) & M32;
  x = x ^ (x >> 16);
  return (static_cast<double>(x) + 0.5) / 4294967296.0;
}

}  // namespace

namespace lockstep {

// One token per row from the distribution logp (N, V): the inverse CDF (exp summed in float64, in
// order) at the row's uniform draw for (keys[r], steps[r]), as engine/sampling.py's choose does.
// steps (N) is each row's token index (rows of a speculative verify are at different ones).
torch::Tensor sample_rows(torch::Tensor logp, torch::Tensor keys, torch::Tensor steps) {
  check_f32(logp, "logp");
  TORCH_CHECK(keys.scalar_type() == torch::kInt64 && keys.numel() == logp.size(0), "keys must be int64 (N)");
  TORCH_CHECK(steps.scalar_type() == torch::kInt64 && steps.numel() == logp.size(0), "steps must be int64 (N)");
  logp = logp.contiguous();
  keys = keys.contiguous();
  steps = steps.contiguous();
  const int64_t N = logp.size(0), V = logp.size(1);
  auto tokens = torch::empty({N}, keys.options());
  const float* lp = logp.data_ptr<float>();
  const int64_t *kp = keys.data_ptr<int64_t>(), *sp = steps.data_ptr<int64_t>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  at::parallel_for(0, N, grain(4 * V), [&](int64_t begin, int64_t end) {
    std::vector<double> cdf(V);
    for (int64_t r = begin; r < end; ++r) {
      double total = 0.0;
      for (int64_t j = 0; j < V; ++j) cdf[j] = total += std::exp(static_cast<double>(lp[r * V + j]));
      const double u = uniform(kp[r], splitmix64(static_cast<uint64_t>(sp[r]))) * total;
      const int64_t pick = std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin();  // first cdf > u
      tp[r] = std::min(pick, V - 1);
    }
  });
  return tokens;
}

// The KV-cache write: keys[b, :, positions[b, t]] = k[b, t] and the same for values (whose rows
// may be wider: only the first D columns are written). keys (B, Hkv, L, D) with any strides (the
// fused path's cache stores them transposed, see attention), values (B, Hkv, L, >=D) and k, v
// (B, T, Hkv, D) with a contiguous last dim.
void cache_write(torch::Tensor keys, torch::Tensor values, torch::Tensor k, torch::Tensor v, torch::Tensor positions) {
  check_f32(keys, "keys");
  check_f32(values, "values");
  check_f32(k, "k");
  check_f32(v, "v");
  TORCH_CHECK(values.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "last dims must be contiguous (keys may be stored transposed)");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64, "positions must be int64");
  positions = positions.contiguous();
  const int64_t B = k.size(0), T = k.size(1), H = k.size(2), D = k.size(3), L = keys.size(2);
  TORCH_CHECK(keys.size(0) == B && keys.size(1) == H && keys.size(3) == D && values.size(2) == L &&
                  values.size(3) >= D && v.sizes() == k.sizes() && positions.size(0) == B && positions.size(1) == T,
              "cache_write: shapes do not match");
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i) TORCH_CHECK(pp[i] >= 0 && pp[i] < L, "a position is outside the cache: ", pp[i]);
  float *kc = keys.data_ptr<float>(), *vc = values.data_ptr<float>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  at::parallel_for(0, B * T, grain(2 * H * D), [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / T, t = bt % T, slot = pp[bt];
      for (int64_t h = 0; h < H; ++h) {
        const float* src = kp + b * k.stride(0) + t * k.stride(1) + h * k.stride(2);
        float* dst = kc + b * keys.stride(0) + h * keys.stride(1) + slot * keys.stride(2);
        for (int64_t d = 0; d < D; ++d) dst[d * keys.stride(3)] = src[d];
        std::copy_n(vp + b * v.stride(0) + t * v.stride(1) + h * v.stride(2), D,
                    vc + b * values.stride(0) + h * values.stride(1) + slot * values.stride(2));
      }
    }
  });
}

namespace {

constexpr int64_t KEY_BLOCK_W = 16;  // keys per register block in attention's scores
constexpr int64_t PV_LANES = 4;      // partial sums of attention's probability-weighted values

// The scores of one query against keys 0..n-1 of a (batch, kv head) pair: s[j] = (sum over d, in
// order, of q[d] * key_j[d]) * scale, with the keys read transposed, key_j[d] = kt[d * ld + j],
// a block of keys at a time in registers (4 x KEY_BLOCK_W while they last: four independent
// chains of adds hide the add's latency; a key's sum is the same whichever block it falls in).
// s and the key panel must hold round_up(n, KEY_BLOCK_W) columns; lanes past n are computed and
// ignored. The same function serves the forward and the backward, in a decode step and in a full
// sequence alike.
template <int64_t W>
inline int64_t score_blocks(const float* q, const float* kt, int64_t ld, int64_t D, int64_t j0, int64_t n, float sc,
                            float* s) {
  for (; j0 + W <= n || (W == KEY_BLOCK_W && j0 < n); j0 += W) {
    float acc[W] = {};
    for (int64_t d = 0; d < D; ++d) {
      const float qd = q[d];
      const float* kd = kt + d * ld + j0;
#pragma omp simd
      for (int64_t l = 0; l < W; ++l) acc[l] += qd * kd[l];
    }
#pragma omp simd
    for (int64_t l = 0; l < W; ++l) s[j0 + l] = acc[l] * sc;
  }
  return j0;
}

inline void scores(const float* q, const float* kt, int64_t ld, int64_t D, int64_t n, float sc, float* s) {
  const int64_t j0 = score_blocks<4 * KEY_BLOCK_W>(q, kt, ld, D, 0, n, sc, s);
  score_blocks<KEY_BLOCK_W>(q, kt, ld, D, j0, n, sc, s);
}

// A (batch, kv head) pair's keys 0..n-1 as a transposed panel (kt[d * ld + j]): the keys themselves
// when the cache stores them transposed with whole blocks of columns, else a copy into buf.
const float* key_panel(const float* kbase, int64_t sl, int64_t sd, int64_t L, int64_t D, int64_t n,
                       std::vector<float>& buf, int64_t& ld) {
  if (sl == 1 && L % KEY_BLOCK_W == 0) {
    ld = sd;
    return kbase;
  }
  ld = round_up(std::max<int64_t>(n, 1), KEY_BLOCK_W);
  if (static_cast<int64_t>(buf.size()) < D * ld) buf.assign(D * ld, 0.f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) buf[d * ld + j] = kbase[j * sl + d * sd];
  return buf.data();
}

}  // namespace

// Causal GQA attention. q (B, T, Hq, D), last dim contiguous; keys (B, Hkv, L, D) with any strides
// (a KV cache, which the fused path stores transposed so that a decode step reads key panels in
// place, or a view of the fresh projections, copied into a panel per (batch, kv head) pair);
// values (B, Hkv, L, >=D) with a contiguous last dim; positions (B, T) int64: query (b, t) attends
// to keys 0..positions[b, t] of row b. Scores as in `scores`; softmax with fast_exp; the
// denominator and the values summed in key order. Threads split the (b, kv head) pairs. Returns
// (out (B, T, Hq, D), lse (B, T, Hq): the log-sum-exp of the scores, for the backward).
std::vector<torch::Tensor> attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor positions,
                                     double scale) {
  check_f32(q, "q");
  check_f32(k, "keys");
  check_f32(v, "values");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, keys and values must be 4-D");
  TORCH_CHECK(q.stride(3) == 1 && v.stride(3) == 1, "q's and values' last dims must be contiguous");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64, "positions must be int64");
  positions = positions.contiguous();
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), L = k.size(2), G = Hq / Hkv;
  TORCH_CHECK(Hq % Hkv == 0 && k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == L &&
                  k.size(3) == D && v.size(3) >= D,
              "shapes do not match: q (B, T, Hq, D), keys and values (B, Hkv, L, D)");
  TORCH_CHECK(positions.size(0) == B && positions.size(1) == T, "positions must be (B, T)");
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i) {
    TORCH_CHECK(pp[i] >= 0 && pp[i] < L, "a query position is outside the keys [0, ", L, "): ", pp[i]);
  }
  auto out = torch::empty({B, T, Hq, D}, q.options());
  auto lse = torch::empty({B, T, Hq}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
  const int64_t qb = q.stride(0), qt = q.stride(1), qh = q.stride(2);
  const int64_t kb = k.stride(0), kh = k.stride(1), kl = k.stride(2), kd = k.stride(3);
  const int64_t vb = v.stride(0), vh = v.stride(1), vl = v.stride(2);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv, grain(4 * T * G * L * D), [&](int64_t begin, int64_t end) {
    std::vector<float> panel, score(round_up(L, KEY_BLOCK_W)), acc(PV_LANES * D);
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / Hkv, g = bg % Hkv;
      int64_t n_max = 0;
      for (int64_t t = 0; t < T; ++t) n_max = std::max(n_max, pp[b * T + t] + 1);
      int64_t ld = 0;
      const float* kt = key_panel(kp + b * kb + g * kh, kl, kd, L, D, n_max, panel, ld);
      const float* vbase = vp + b * vb + g * vh;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t n = pp[b * T + t] + 1;  // visible keys
        for (int64_t h = g * G; h < (g + 1) * G; ++h) {
          float* e = score.data();
          scores(qp + b * qb + t * qt + h * qh, kt, ld, D, n, sc, e);
          float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
          for (int64_t j = 0; j < n; ++j) m = std::max(m, e[j]);  // a max is exact in any order
          exp_shifted(e, m, e, n);
          const float denom = lane_sum(n, [=](int64_t j) { return e[j]; });
          // sum_j e_j v_j: key j goes to partial sum j % PV_LANES (independent chains of adds),
          // the tail to the first partials, then a pairwise fold; an order that depends on n only.
          std::fill(acc.begin(), acc.end(), 0.f);
          int64_t j = 0;
          for (; j + PV_LANES <= n; j += PV_LANES) {
            for (int64_t l = 0; l < PV_LANES; ++l) {
              const float el = e[j + l];
              const float* __restrict vv = vbase + (j + l) * vl;
              float* __restrict a = acc.data() + l * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) a[d] += el * vv[d];
            }
          }
          for (int64_t l = 0; j < n; ++j, ++l) {
            const float el = e[j];
            const float* __restrict vv = vbase + j * vl;
            float* __restrict a = acc.data() + l * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += el * vv[d];
          }
          const int64_t item = (b * T + t) * Hq + h;
          float* o = op + item * D;
          const float *a0 = acc.data(), *a1 = a0 + D, *a2 = a1 + D, *a3 = a2 + D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] = ((a0[d] + a1[d]) + (a2[d] + a3[d])) / denom;
          lp[item] = m + std::log(denom);
        }
      }
    }
  });
  return {out, lse};
}

// The gradient of attention, walking the visible keys as the forward does (the torch-op version
// built the (rows x keys) probabilities with batched matmuls and took a fifth of a training step).
// For query (b, t, h) with visible keys j = 0..positions[b, t]: p_j = exp(s_j - lse) from the
// forward's log-sum-exp, ds_j = p_j (dO.v_j - dO.out) scale; then dq = sum_j ds_j k_j,
// dk_j += ds_j q and dv_j += p_j dO. Threads split the (b, kv head) pairs, each of which owns its
// keys' gradients, and walk their queries and keys in one fixed order: reproducible whatever the
// thread count. Returns (dq, d_keys, d_values) shaped like q, keys and values (values' columns past
// D get zeros).
std::vector<torch::Tensor> attention_backward(torch::Tensor dout, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                              torch::Tensor positions, torch::Tensor out, torch::Tensor lse,
                                              double scale) {
  for (const auto& [t, name] : {std::pair{&dout, "d_out"}, {&q, "q"}, {&k, "keys"}, {&v, "values"}, {&out, "out"},
                                {&lse, "lse"}}) {
    check_f32(*t, name);
  }
  dout = dout.contiguous();
  q = q.contiguous();
  out = out.contiguous();
  lse = lse.contiguous();
  positions = positions.contiguous();
  TORCH_CHECK(v.stride(3) == 1, "values' last dim must be contiguous");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64, "positions must be int64");
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), L = k.size(2), G = Hq / Hkv, Dv = v.size(3);
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() && lse.numel() == B * T * Hq &&
                  positions.numel() == B * T,
              "attention_backward: shapes do not match the forward's");
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i) TORCH_CHECK(pp[i] >= 0 && pp[i] < L, "a query position is outside the keys");
  auto dq = torch::zeros_like(q);
  auto dk = torch::zeros({B, Hkv, L, D}, q.options());
  auto dv = torch::zeros({B, Hkv, L, Dv}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dop = dout.data_ptr<float>(), *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
  float *dqp = dq.data_ptr<float>(), *dkp = dk.data_ptr<float>(), *dvp = dv.data_ptr<float>();
  const int64_t kb = k.stride(0), kh = k.stride(1), kl = k.stride(2);
  const int64_t vb = v.stride(0), vh = v.stride(1), vl = v.stride(2);
  const float sc = static_cast<float>(scale);
  const int64_t Lp = round_up(L, KEY_BLOCK_W);
  const int64_t kd = k.stride(3);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    // Values transposed like the keys' panel, and the keys' and values' gradients likewise, so that
    // the loops run along the keys.
    std::vector<float> panel, vt(D * Lp), dkt(D * Lp), dvt(D * Lp), s(Lp), dp(Lp);
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / Hkv, g = bg % Hkv;
      int64_t n_max = 0;
      for (int64_t t = 0; t < T; ++t) n_max = std::max(n_max, pp[b * T + t] + 1);
      int64_t ld = 0;
      const float* kbase = kp + b * kb + g * kh;
      const float* kt = key_panel(kbase, kl, kd, L, D, n_max, panel, ld);
      const float* vbase = vp + b * vb + g * vh;
      for (int64_t j = 0; j < n_max; ++j)
        for (int64_t d = 0; d < D; ++d) vt[d * Lp + j] = vbase[j * vl + d];
      std::fill(dkt.begin(), dkt.end(), 0.f);
      std::fill(dvt.begin(), dvt.end(), 0.f);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t n = pp[b * T + t] + 1;
        for (int64_t h = g * G; h < (g + 1) * G; ++h) {
          const int64_t item = (b * T + t) * Hq + h;
          const float *qv = qp + item * D, *dov = dop + item * D;
          const float delta = dot(dov, op + item * D, D);
          for (int64_t j0 = 0; j0 < n; j0 += KEY_BLOCK_W) {  // the forward's scores, and dO . v_j
            float sa[KEY_BLOCK_W] = {}, da[KEY_BLOCK_W] = {};
            for (int64_t d = 0; d < D; ++d) {
              const float qd = qv[d], dod = dov[d];
              const float *kr = kt + d * ld + j0, *vr = vt.data() + d * Lp + j0;
#pragma omp simd
              for (int64_t l = 0; l < KEY_BLOCK_W; ++l) {
                sa[l] += qd * kr[l];
                da[l] += dod * vr[l];
              }
            }
#pragma omp simd
            for (int64_t l = 0; l < KEY_BLOCK_W; ++l) {
              s[j0 + l] = sa[l] * sc;
              dp[j0 + l] = da[l];
            }
          }
          const float shift = lp[item];
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) {
            const float pj = fast_exp(s[j] - shift);
            s[j] = pj;                          // s now holds p
            dp[j] = pj * (dp[j] - delta) * sc;  // dp now holds ds
          }
          float* __restrict dqv = dqp + item * D;
          for (int64_t d = 0; d < D; ++d) {
            const float qd = qv[d], dod = dov[d];
            const float *__restrict ds = dp.data(), *__restrict pr = s.data();
            float *__restrict dkd = dkt.data() + d * Lp, *__restrict dvd = dvt.data() + d * Lp;
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) {
              dkd[j] += ds[j] * qd;
              dvd[j] += pr[j] * dod;
            }
          }
          if (kd == 1) {  // dq = sum_j ds_j k_j along the key rows (vectorised over d) ...
            for (int64_t j = 0; j < n; ++j) {
              const float dsj = dp[j];
              const float* __restrict kr = kbase + j * kl;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) dqv[d] += dsj * kr[d];
            }
          } else {  // ... or along the panel's rows, when the keys are stored transposed
            for (int64_t d = 0; d < D; ++d) dqv[d] = dot(dp.data(), kt + d * ld, n);
          }
        }
      }
      float *dkb = dkp + bg * L * D, *dvb = dvp + bg * L * Dv;
      for (int64_t j = 0; j < n_max; ++j) {
        for (int64_t d = 0; d < D; ++d) {
          dkb[j * D + d] = dkt[d * Lp + j];
          dvb[j * Dv + d] = dvt[d * Lp + j];
        }
      }
    }
  });
  return {dq, dk, dv};
}

}  // namespace lockstep

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lockstep's fused, batch-invariant fp32 CPU kernels (see the rule at the top of fused.cpp)";
  m.def("rms_norm", &lockstep::rms_norm, "RMSNorm rows: (y, rstd)");
  m.def("add_rms_norm", &lockstep::add_rms_norm, "(x + delta, rms_norm(x + delta), rstd)");
  m.def("silu_mul", &lockstep::silu_mul, "silu(gate) * up over (..., 2I)");
  m.def("silu_mul_backward", &lockstep::silu_mul_backward, "the gradient of silu_mul");
  m.def("rope", &lockstep::rope, "rotary embedding of (B, T, H, D)");
  m.def("attention", &lockstep::attention, "causal GQA attention over a key buffer: (out, lse)");
  m.def("attention_backward", &lockstep::attention_backward, "the gradient of attention: (dq, d_keys, d_values)");
  m.def("log_softmax", &lockstep::log_softmax, "row-wise log-softmax in a fixed order");
  m.def("sample_rows", &lockstep::sample_rows, "inverse-CDF sampling with the counter RNG");
  m.def("cache_write", &lockstep::cache_write, "write k, v into a KV cache at the given positions");
  m.def("linear", &lockstep::linear, "x @ weight^T (+ bias) through the fixed tile plan");
  m.def("linear_backward", &lockstep::linear_backward, "(dy @ weight, dy^T @ x) through the fixed tile plan");
  m.def("column_sum", &lockstep::column_sum, "column sums in row order");
  lockstep::bind_lora(m);
  lockstep::bind_stack(m);
}
