// Fused residual add + LayerNorm for bfloat16 CPU tensors, forward and backward.
//
// Built on first use by ln_lightning/norm/_cpu_kernels.py (torch.utils.cpp_extension). Why it
// exists: aten's bfloat16 CPU LayerNorm rounds mean/rstd to the input dtype and loses most
// of the weight gradient's precision, and the add and the norm are separate passes. Here each row
// is read once per direction: the forward writes h = x + residual and y = LN(h) in one pass over
// the inputs; the backward writes dh = dLN + dresidual in one pass, with the weight/bias gradients
// accumulated in float32 per fixed block of rows and summed in block order (deterministic,
// independent of the thread count). Statistics are float32, taken of (h - h[0]) per row so that
// a constant row normalises to exact zeros and large offsets do not cancel.
//
// The input gradient, dh = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) with g = dy * w, is computed
// as its orthogonal parts, dh = rstd * ((g - mean(g) - q x_hat) + t q x_hat) with
// q = sum(g x_hat) / sum(x_hat^2) and t = eps * rstd^2 (= 1 - mean(x_hat^2) exactly): the textbook form
// takes g's component along x_hat times 1 - mean(x_hat^2) as a difference of nearly equal terms, which
// cancels at width 2 (where g - mean(g) is all along x_hat) and whenever g lies near x_hat. At width 2
// the perpendicular part is 0 in exact arithmetic, and dh = rstd * t * (g - mean(g)).
//
// Layout contract (checked on the Python side, _cpu_kernels.usable_forward/usable_backward):
// 2-D contiguous (rows, n) tensors, n >= 1; x and dy bfloat16; residual bfloat16 or float32; h and
// dresidual bfloat16 or float32 (float32 when the stream is kept in float32); weight and bias
// float32 or absent; mean/rstd float32 (rows,).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

// Element access in float32. bfloat16 is converted with integer bit operations (round to
// nearest even, NaN kept) so that the loops below vectorise.
inline float ld(const float* p, int64_t j) { return p[j]; }
inline float ld(const c10::BFloat16* p, int64_t j) {
  uint32_t u = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[j]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void st(float* p, int64_t j, float v) { p[j] = v; }
inline void st(c10::BFloat16* p, int64_t j, float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  reinterpret_cast<uint16_t*>(p)[j] = static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}
// The value a float rounds to when stored as T (the new residual is normalised as stored).
template <typename T> inline float round_as(float v) { T t; st(&t, 0, v); return ld(&t, 0); }

inline float fold(const float* acc) {
  float s = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

// The same sum as a tree (8 + 4 + 2 + 1 adds, vectorisable): the backward folds two or three accumulators per
// row before it can start its last pass, and at narrow widths the serial fold's latency was a visible share.
inline float fold_tree(const float* acc) {
  float t[kLanes / 2];
  for (int64_t l = 0; l < kLanes / 2; ++l) t[l] = acc[l] + acc[l + kLanes / 2];
  for (int64_t w = kLanes / 4; w >= 1; w /= 2)
    for (int64_t l = 0; l < w; ++l) t[l] += t[l + w];
  return t[0];
}

template <typename T, typename R, typename H>
void forward_rows(const T* __restrict__ x, const R* __restrict__ res, H* __restrict__ h, T* __restrict__ y,
                  const float* __restrict__ w, const float* __restrict__ b, float* mean_out, float* rstd_out,
                  int64_t rows, int64_t n, float eps) {
  const int64_t grain = std::max<int64_t>(1, 32768 / n);
  const int64_t nv = n - n % kLanes;
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    float* __restrict__ v = buf.data();
    for (int64_t r = begin; r < end; ++r) {
      const T* __restrict__ xr = x + r * n;
      const R* __restrict__ rr = res ? res + r * n : nullptr;
      H* __restrict__ hr = h ? h + r * n : nullptr;
      // Statistics of (h - h[0]): a constant row gives exact zeros, a large offset costs nothing.
      const float shift = round_as<H>(ld(xr, 0) + (rr ? ld(rr, 0) : 0.f));
      float acc[kLanes] = {0};
      if (rr) {
        for (int64_t j0 = 0; j0 < nv; j0 += kLanes)
          for (int64_t l = 0; l < kLanes; ++l) {
            const int64_t j = j0 + l;
            st(hr, j, ld(xr, j) + ld(rr, j));
            v[j] = ld(hr, j) - shift;
            acc[l] += v[j];
          }
        for (int64_t j = nv; j < n; ++j) { st(hr, j, ld(xr, j) + ld(rr, j)); v[j] = ld(hr, j) - shift; acc[0] += v[j]; }
      } else if (hr) {  // residual_in_fp32 without a residual: the stream is x in float32
        for (int64_t j0 = 0; j0 < nv; j0 += kLanes)
          for (int64_t l = 0; l < kLanes; ++l) {
            const int64_t j = j0 + l;
            st(hr, j, ld(xr, j));
            v[j] = ld(hr, j) - shift;
            acc[l] += v[j];
          }
        for (int64_t j = nv; j < n; ++j) { st(hr, j, ld(xr, j)); v[j] = ld(hr, j) - shift; acc[0] += v[j]; }
      } else {
        for (int64_t j0 = 0; j0 < nv; j0 += kLanes)
          for (int64_t l = 0; l < kLanes; ++l) {
            const int64_t j = j0 + l;
            v[j] = ld(xr, j) - shift;
            acc[l] += v[j];
          }
        for (int64_t j = nv; j < n; ++j) { v[j] = ld(xr, j) - shift; acc[0] += v[j]; }
      }
      const float m = fold(acc) / n;
      float acc2[kLanes] = {0};
      for (int64_t j0 = 0; j0 < nv; j0 += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) { const float d = v[j0 + l] - m; acc2[l] += d * d; }
      for (int64_t j = nv; j < n; ++j) { const float d = v[j] - m; acc2[0] += d * d; }
      const float rs = 1.f / std::sqrt(fold(acc2) / n + eps);
      mean_out[r] = m;
      rstd_out[r] = rs;
      T* __restrict__ yr = y + r * n;
      if (w && b) { for (int64_t j = 0; j < n; ++j) st(yr, j, (v[j] - m) * rs * w[j] + b[j]); }
      else if (w) { for (int64_t j = 0; j < n; ++j) st(yr, j, (v[j] - m) * rs * w[j]); }
      else if (b) { for (int64_t j = 0; j < n; ++j) st(yr, j, (v[j] - m) * rs + b[j]); }
      else { for (int64_t j = 0; j < n; ++j) st(yr, j, (v[j] - m) * rs); }
    }
  });
}

template <typename T, typename H>
void backward_rows(const T* __restrict__ dy, const H* __restrict__ h, const H* __restrict__ dres, H* __restrict__ dh,
                   const float* __restrict__ w, const float* mean, const float* rstd, float* dw_part, float* db_part,
                   int64_t blocks, int64_t rows, int64_t n, float eps) {
  const int64_t nv = n - n % kLanes;
  at::parallel_for(0, blocks, 1, [&](int64_t bbegin, int64_t bend) {
    std::vector<float> buf(n);
    float* __restrict__ xh = buf.data();  // g = dy * w is recomputed where it is used: cheaper than storing it
    for (int64_t blk = bbegin; blk < bend; ++blk) {
      const int64_t r0 = rows * blk / blocks, r1 = rows * (blk + 1) / blocks;
      float* __restrict__ dwp = dw_part ? dw_part + blk * n : nullptr;
      float* __restrict__ dbp = db_part ? db_part + blk * n : nullptr;
      for (int64_t r = r0; r < r1; ++r) {
        const T* __restrict__ dyr = dy + r * n;
        const H* __restrict__ hr = h + r * n;
        const float shift = ld(hr, 0), m = mean[r], rs = rstd[r];
        auto gv = [&](int64_t j) { return w ? ld(dyr, j) * w[j] : ld(dyr, j); };
        float acc_a[kLanes] = {0}, acc_c[kLanes] = {0}, acc_x[kLanes] = {0};
        for (int64_t j0 = 0; j0 < nv; j0 += kLanes)
          for (int64_t l = 0; l < kLanes; ++l) {
            const int64_t j = j0 + l;
            const float xv = ((ld(hr, j) - shift) - m) * rs, g = gv(j);
            xh[j] = xv;
            acc_a[l] += g;
            acc_c[l] += g * xv;
            acc_x[l] += xv * xv;
          }
        for (int64_t j = nv; j < n; ++j) {
          const float xv = ((ld(hr, j) - shift) - m) * rs, g = gv(j);
          xh[j] = xv; acc_a[0] += g; acc_c[0] += g * xv; acc_x[0] += xv * xv;
        }
        // dh = rs * ((g - a - q x_hat) + t q x_hat): see the header. A constant row has q = 0.
        const float sxx = fold_tree(acc_x);
        const float a = fold_tree(acc_a) / n, q = sxx > 0.f ? fold_tree(acc_c) / sxx : 0.f, t = eps * rs * rs, tq = t * q;
        H* __restrict__ dhr = dh + r * n;
        const H* __restrict__ drr = dres ? dres + r * n : nullptr;
        if (n == 2) {  // g - a is all along x_hat (or, for a constant row, t = 1)
          const float rt = rs * t;
          for (int64_t j = 0; j < 2; ++j) st(dhr, j, drr ? rt * (gv(j) - a) + ld(drr, j) : rt * (gv(j) - a));
        } else if (drr) {
          for (int64_t j = 0; j < n; ++j) st(dhr, j, rs * ((gv(j) - a - q * xh[j]) + tq * xh[j]) + ld(drr, j));
        } else {
          for (int64_t j = 0; j < n; ++j) st(dhr, j, rs * ((gv(j) - a - q * xh[j]) + tq * xh[j]));
        }
        if (dwp) for (int64_t j = 0; j < n; ++j) dwp[j] += ld(dyr, j) * xh[j];
        if (dbp) for (int64_t j = 0; j < n; ++j) dbp[j] += ld(dyr, j);
      }
    }
  });
}

// H (the stream's dtype) is bfloat16 or float32.
template <typename F>
void dispatch_stream(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "ln_lightning CPU kernel: the residual stream must be bfloat16 or float32, got ", t);
  }
}

void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.size(0) == rows && t.size(1) == n && t.is_contiguous(),
              "ln_lightning CPU kernel: ", name, " must be a contiguous CPU tensor of shape (", rows, ", ", n, ")");
}

void check_vector(const c10::optional<at::Tensor>& t, const char* name, int64_t n) {
  if (t.has_value())
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->numel() == n && t->is_contiguous(),
                "ln_lightning CPU kernel: ", name, " must be a contiguous float32 CPU tensor of ", n, " elements");
}

template <typename T>
T* ptr(const at::Tensor& t) { return t.numel() ? t.data_ptr<T>() : nullptr; }

template <typename T>
const T* optional_ptr(const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<T>() : nullptr; }

using BF16 = c10::BFloat16;

}  // namespace

// (y, h or an empty tensor when h is x itself, mean, rstd)
std::vector<at::Tensor> add_layer_norm_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                           const c10::optional<at::Tensor>& weight,
                                           const c10::optional<at::Tensor>& bias, double eps, bool h_fp32) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "ln_lightning CPU kernel: x must be (rows, n) with n >= 1");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "ln_lightning CPU kernel: x must be bfloat16, got ", x.scalar_type());
  const int64_t rows = x.size(0), n = x.size(1);
  check_rows(x, "x", rows, n);
  if (residual.has_value()) check_rows(*residual, "residual", rows, n);
  check_vector(weight, "weight", n);
  check_vector(bias, "bias", n);
  auto y = at::empty_like(x);
  const bool store = residual.has_value() || h_fp32;
  const auto h_dtype = h_fp32 ? at::kFloat : at::kBFloat16;
  auto h = store ? at::empty_like(x, x.options().dtype(h_dtype)) : at::empty({0}, x.options());
  auto mean = at::empty({rows}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  const float* w = optional_ptr<float>(weight);
  const float* b = optional_ptr<float>(bias);
  const auto r_dtype = residual.has_value() ? residual->scalar_type() : at::kBFloat16;
  dispatch_stream(r_dtype, [&](auto r_tag) {
    using R = decltype(r_tag);
    dispatch_stream(h_dtype, [&](auto h_tag) {
      using H = decltype(h_tag);
      forward_rows<BF16, R, H>(x.data_ptr<BF16>(), optional_ptr<R>(residual), store ? ptr<H>(h) : nullptr,
                               y.data_ptr<BF16>(), w, b, mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, n,
                               static_cast<float>(eps));
    });
  });
  return {y, h, mean, rstd};
}

// (dh, dweight or empty, dbias or empty); dweight/dbias in float32.
std::vector<at::Tensor> add_layer_norm_bwd(const at::Tensor& dy, const c10::optional<at::Tensor>& dresidual,
                                           const at::Tensor& h, const at::Tensor& mean, const at::Tensor& rstd,
                                           const c10::optional<at::Tensor>& weight, bool need_weight_grad,
                                           bool need_bias_grad, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.size(1) > 0, "ln_lightning CPU kernel: h must be (rows, n) with n >= 1");
  TORCH_CHECK(dy.scalar_type() == at::kBFloat16, "ln_lightning CPU kernel: dy must be bfloat16, got ", dy.scalar_type());
  const int64_t rows = h.size(0), n = h.size(1);
  check_rows(dy, "dy", rows, n);
  check_rows(h, "h", rows, n);
  if (dresidual.has_value()) {
    check_rows(*dresidual, "dresidual", rows, n);
    TORCH_CHECK(dresidual->scalar_type() == h.scalar_type(), "ln_lightning CPU kernel: dresidual must have h's dtype");
  }
  check_vector(weight, "weight", n);
  TORCH_CHECK(mean.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat && mean.numel() == rows &&
                  rstd.numel() == rows && mean.is_contiguous() && rstd.is_contiguous(),
              "ln_lightning CPU kernel: mean and rstd must be contiguous float32 of ", rows, " elements");
  auto dh = at::empty_like(h);
  // A fixed number of row blocks, not one per thread: the reduction order never depends on the
  // thread count.
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(rows, 32));
  auto opts = h.options().dtype(at::kFloat);
  auto dw_part = need_weight_grad ? at::zeros({blocks, n}, opts) : at::empty({0}, opts);
  auto db_part = need_bias_grad ? at::zeros({blocks, n}, opts) : at::empty({0}, opts);
  const float* w = optional_ptr<float>(weight);
  dispatch_stream(h.scalar_type(), [&](auto h_tag) {
    using H = decltype(h_tag);
    backward_rows<BF16, H>(dy.data_ptr<BF16>(), h.data_ptr<H>(), optional_ptr<H>(dresidual), dh.data_ptr<H>(), w,
                           mean.data_ptr<float>(), rstd.data_ptr<float>(), ptr<float>(dw_part), ptr<float>(db_part),
                           blocks, rows, n, static_cast<float>(eps));
  });
  auto sum_blocks = [&](const at::Tensor& part) {
    if (!part.numel()) return part;
    auto out = at::zeros({n}, opts);
    float* o = out.data_ptr<float>();
    const float* p = part.data_ptr<float>();
    for (int64_t blk = 0; blk < blocks; ++blk)
      for (int64_t j = 0; j < n; ++j) o[j] += p[blk * n + j];
    return out;
  };
  return {dh, sum_blocks(dw_part), sum_blocks(db_part)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_layer_norm_fwd", &add_layer_norm_fwd, "fused residual add + LayerNorm, forward");
  m.def("add_layer_norm_bwd", &add_layer_norm_bwd, "fused residual add + LayerNorm, backward");
}
