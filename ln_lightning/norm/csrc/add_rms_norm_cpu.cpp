// Fused residual add + RMSNorm for float32 and bfloat16 CPU tensors, forward and backward.
//
// Built on first use by ln_lightning/norm/_cpu_kernels.py (torch.utils.cpp_extension), as its own
// extension next to the LayerNorm one. Why it exists: eager RMSNorm (HF's LlamaRMSNorm, or
// F.rms_norm) is five to eight elementwise passes each way, and the residual add is one more; here
// each row is read once per direction. The forward writes h = x + residual and
// y = cast(h * rstd) * (offset + w) in one pass; the backward writes dh = dRMS + dresidual in one
// pass, with the weight gradient accumulated in float32 per fixed block of rows and summed in
// block order (deterministic, independent of the thread count). Statistics are float32.
//
// The input gradient, dh = rstd * (g - n * mean(g * n)) with n = h * rstd and g = dy * (offset + w),
// is computed as its two orthogonal parts, dh = rstd * ((g - q n) + t q n), q = sum(g n) / sum(n n),
// t = eps * rstd^2 (= 1 - mean(n^2) exactly). The textbook form cancels: along n it computes g's
// component times 1 - mean(n^2) as a difference of two nearly equal terms, which loses everything
// when the row is narrow (width 1: g * (1 - n^2), 1 - n^2 = eps / (h^2 + eps), 2.5e-6 at h = 2) or
// g lies near n. Here that factor is t, exact to rounding; at width 1 there is no perpendicular
// part (g - q n is 0 in exact arithmetic) and dh = rstd * t * g.
// The perpendicular part g - q n cancels too when g lies near n (a constant row, and more so with Gemma's
// 1 + w, which makes g larger against the result: issue 32, 1.2-1.6x our 2x-torch bound at width 2). So
// q n is taken as (sum(g h) / sum(h h)) h, rstd cancelling, with the two row sums in double and g - q h as
// fused multiply-adds by q split into two floats: the perpendicular part is rounded about once, instead of
// carrying a few float roundings of g.
//
// round_normed: round h * rstd to the input dtype before the weight multiply (HF LlamaRMSNorm's
// cast order `weight * hidden.to(input_dtype)`); otherwise the product is taken in float32 and
// rounded once (nn.RMSNorm, Gemma, OLMo 2).
//
// Layout contract (checked on the Python side, _cpu_kernels.rms_usable_forward/backward):
// 2-D contiguous (rows, n) tensors, n >= 1; x and dy float32 or bfloat16 (the same dtype T);
// residual T or float32; h and dresidual T or float32; weight float32 or absent; rstd float32.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kSerialElems = 1 << 17;

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
template <typename T> inline float round_as(float v) { T t; st(&t, 0, v); return ld(&t, 0); }

inline float fold(const float* acc) {
  float s = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

// The same sum as a tree (8 + 4 + 2 + 1 adds, vectorisable): the backward folds two or three accumulators per
// row before it can start its last pass, and at narrow widths the serial fold's latency was a visible share.
template <typename A>
inline A fold_tree(const A* acc) {
  A t[kLanes / 2];
  for (int64_t l = 0; l < kLanes / 2; ++l) t[l] = acc[l] + acc[l + kLanes / 2];
  for (int64_t w = kLanes / 4; w >= 1; w /= 2)
    for (int64_t l = 0; l < w; ++l) t[l] += t[l + w];
  return t[0];
}

template <typename T, typename R, typename H>
void forward_rows(const T* __restrict__ x, const R* __restrict__ res, H* __restrict__ h, T* __restrict__ y,
                  const float* __restrict__ w, float offset, bool round_normed, float* rstd_out, int64_t rows,
                  int64_t n, float eps) {
  // At least kSerialElems elements per thread: below that, waking the pool costs more than the
  // work (milliseconds when other processes hold the cores).
  const int64_t grain = std::max<int64_t>(1, kSerialElems / n);
  const int64_t nv = n - n % kLanes;
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(2 * n);
    float* __restrict__ v = buf.data();
    float* __restrict__ weff = v + n;  // offset + w, once per chunk of rows
    for (int64_t j = 0; j < n; ++j) weff[j] = offset + (w ? w[j] : 1.f - offset);
    for (int64_t r = begin; r < end; ++r) {
      const T* __restrict__ xr = x + r * n;
      const R* __restrict__ rr = res ? res + r * n : nullptr;
      H* __restrict__ hr = h ? h + r * n : nullptr;
      float acc[kLanes] = {0};
      if (rr) {
        for (int64_t j0 = 0; j0 < nv; j0 += kLanes)
          for (int64_t l = 0; l < kLanes; ++l) {
            const int64_t j = j0 + l;
            st(hr, j, ld(xr, j) + ld(rr, j));
            v[j] = ld(hr, j);  // normalise the residual exactly as stored
            acc[l] += v[j] * v[j];
          }
        for (int64_t j = nv; j < n; ++j) { st(hr, j, ld(xr, j) + ld(rr, j)); v[j] = ld(hr, j); acc[0] += v[j] * v[j]; }
      } else if (hr) {  // residual_in_fp32 without a residual: the stream is x in float32
        for (int64_t j0 = 0; j0 < nv; j0 += kLanes)
          for (int64_t l = 0; l < kLanes; ++l) {
            const int64_t j = j0 + l;
            st(hr, j, ld(xr, j));
            v[j] = ld(hr, j);
            acc[l] += v[j] * v[j];
          }
        for (int64_t j = nv; j < n; ++j) { st(hr, j, ld(xr, j)); v[j] = ld(hr, j); acc[0] += v[j] * v[j]; }
      } else {
        for (int64_t j0 = 0; j0 < nv; j0 += kLanes)
          for (int64_t l = 0; l < kLanes; ++l) {
            const int64_t j = j0 + l;
            v[j] = ld(xr, j);
            acc[l] += v[j] * v[j];
          }
        for (int64_t j = nv; j < n; ++j) { v[j] = ld(xr, j); acc[0] += v[j] * v[j]; }
      }
      const float rs = 1.f / std::sqrt(fold(acc) / n + eps);
      rstd_out[r] = rs;
      T* __restrict__ yr = y + r * n;
      if (round_normed) { for (int64_t j = 0; j < n; ++j) st(yr, j, round_as<T>(v[j] * rs) * weff[j]); }
      else { for (int64_t j = 0; j < n; ++j) st(yr, j, v[j] * rs * weff[j]); }
    }
  });
}

template <typename T, typename H>
void backward_rows(const T* __restrict__ dy, const H* __restrict__ h, const H* __restrict__ dres, H* __restrict__ dh,
                   const float* __restrict__ w, float offset, bool round_normed, const float* rstd,
                   float* dw_part, int64_t blocks, int64_t rows, int64_t n, float eps) {
  const int64_t nv = n - n % kLanes;
  // Small calls run on one thread (see forward_rows). The result does not depend on it: the
  // blocks, not the threads, fix the summation order.
  const int64_t grain = std::max<int64_t>(1, blocks * kSerialElems / std::max<int64_t>(1, rows * n));
  at::parallel_for(0, blocks, grain, [&](int64_t bbegin, int64_t bend) {
    std::vector<float> buf(2 * n);
    float* __restrict__ xh = buf.data();
    float* __restrict__ weff = xh + n;  // g = dy * weff is recomputed where it is used: cheaper than storing it
    for (int64_t j = 0; j < n; ++j) weff[j] = offset + (w ? w[j] : 1.f - offset);
    for (int64_t blk = bbegin; blk < bend; ++blk) {
      const int64_t r0 = rows * blk / blocks, r1 = rows * (blk + 1) / blocks;
      float* __restrict__ dwp = dw_part ? dw_part + blk * n : nullptr;
      for (int64_t r = r0; r < r1; ++r) {
        const T* __restrict__ dyr = dy + r * n;
        const H* __restrict__ hr = h + r * n;
        const float rs = rstd[r];
        // q n = (sum(g h) / sum(h h)) h: the row sums in double (each product of two floats is exact there), so
        // that g - q n, which cancels when g lies near n, is rounded once (see the header).
        double acc_c[kLanes] = {0}, acc_h[kLanes] = {0};
        for (int64_t j0 = 0; j0 < nv; j0 += kLanes)
          for (int64_t l = 0; l < kLanes; ++l) {
            const int64_t j = j0 + l;
            const float hv = ld(hr, j);
            xh[j] = hv * rs;
            acc_c[l] += static_cast<double>(ld(dyr, j) * weff[j]) * hv;
            acc_h[l] += static_cast<double>(hv) * hv;
          }
        for (int64_t j = nv; j < n; ++j) {
          const float hv = ld(hr, j);
          xh[j] = hv * rs; acc_c[0] += static_cast<double>(ld(dyr, j) * weff[j]) * hv; acc_h[0] += static_cast<double>(hv) * hv;
        }
        // dh = rs * ((g - q n) + t q n): see the header. A zero row (shh = 0) has q = 0: dh = rs * g.
        const double shh = fold_tree(acc_h);
        const double qh = shh > 0. ? fold_tree(acc_c) / shh : 0.;
        const float t = eps * rs * rs, tq = static_cast<float>(t * qh);
        H* __restrict__ dhr = dh + r * n;
        const H* __restrict__ drr = dres ? dres + r * n : nullptr;
        // q as a float pair (q_hi + q_lo = q to 2^-48) and g - q h as two fused multiply-adds: vector floats
        // throughout, and the perpendicular part as accurate as if q h were exact.
        const float q_hi = static_cast<float>(qh), q_lo = static_cast<float>(qh - q_hi);
        auto perp = [&](int64_t j) {
          const float hv = ld(hr, j);
          return std::fma(-q_lo, hv, std::fma(-q_hi, hv, ld(dyr, j) * weff[j]));
        };
        if (n == 1) {  // the row spans the space: g is all along n
          const float v = rs * t * (ld(dyr, 0) * weff[0]);
          st(dhr, 0, drr ? v + ld(drr, 0) : v);
        } else if (drr) {
          for (int64_t j = 0; j < n; ++j) st(dhr, j, rs * (perp(j) + tq * ld(hr, j)) + ld(drr, j));
        } else {
          for (int64_t j = 0; j < n; ++j) st(dhr, j, rs * (perp(j) + tq * ld(hr, j)));
        }
        // The weight saw the normalised value as the forward used it (rounded, for Llama's order).
        if (dwp) {
          if (round_normed) { for (int64_t j = 0; j < n; ++j) dwp[j] += ld(dyr, j) * round_as<T>(xh[j]); }
          else { for (int64_t j = 0; j < n; ++j) dwp[j] += ld(dyr, j) * xh[j]; }
        }
      }
    }
  });
}

template <typename F>
void dispatch(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "ln_lightning CPU RMSNorm kernel: ", what, " must be float32 or bfloat16, got ", t);
  }
}

void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.size(0) == rows && t.size(1) == n && t.is_contiguous(),
              "ln_lightning CPU RMSNorm kernel: ", name, " must be a contiguous CPU tensor of shape (", rows, ", ",
              n, ")");
}

void check_weight(const c10::optional<at::Tensor>& t, int64_t n) {
  if (t.has_value())
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->numel() == n && t->is_contiguous(),
                "ln_lightning CPU RMSNorm kernel: weight must be a contiguous float32 CPU tensor of ", n, " elements");
}

template <typename T>
const T* optional_ptr(const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<T>() : nullptr; }

// The stream's dtype is T or float32: anything else is a caller bug.
void check_stream(at::ScalarType s, at::ScalarType t, const char* name) {
  TORCH_CHECK(s == t || s == at::kFloat, "ln_lightning CPU RMSNorm kernel: ", name, " must be ", t,
              " or float32, got ", s);
}

}  // namespace

// (y, h or an empty tensor when h is x itself, rstd)
std::vector<at::Tensor> add_rms_norm_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                         const c10::optional<at::Tensor>& weight, double eps, bool h_fp32,
                                         double offset, bool round_normed) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "ln_lightning CPU RMSNorm kernel: x must be (rows, n) with n >= 1");
  const int64_t rows = x.size(0), n = x.size(1);
  check_rows(x, "x", rows, n);
  if (residual.has_value()) {
    check_rows(*residual, "residual", rows, n);
    check_stream(residual->scalar_type(), x.scalar_type(), "residual");
  }
  check_weight(weight, n);
  auto y = at::empty_like(x);
  const bool store = residual.has_value() || (h_fp32 && x.scalar_type() != at::kFloat);
  const auto h_dtype = h_fp32 ? at::kFloat : x.scalar_type();
  auto h = store ? at::empty_like(x, x.options().dtype(h_dtype)) : at::empty({0}, x.options());
  auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  const float* w = optional_ptr<float>(weight);
  const auto r_dtype = residual.has_value() ? residual->scalar_type() : x.scalar_type();
  dispatch(x.scalar_type(), "x", [&](auto t_tag) {
    using T = decltype(t_tag);
    dispatch(r_dtype, "residual", [&](auto r_tag) {
      using R = decltype(r_tag);
      dispatch(h_dtype, "the stream", [&](auto h_tag) {
        using H = decltype(h_tag);
        forward_rows<T, R, H>(x.data_ptr<T>(), optional_ptr<R>(residual), store ? h.data_ptr<H>() : nullptr,
                              y.data_ptr<T>(), w, static_cast<float>(offset), round_normed, rstd.data_ptr<float>(),
                              rows, n, static_cast<float>(eps));
      });
    });
  });
  return {y, h, rstd};
}

// (dh, dweight in float32 or empty)
std::vector<at::Tensor> add_rms_norm_bwd(const at::Tensor& dy, const c10::optional<at::Tensor>& dresidual,
                                         const at::Tensor& h, const at::Tensor& rstd,
                                         const c10::optional<at::Tensor>& weight, double offset, bool round_normed,
                                         bool need_weight_grad, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.size(1) > 0, "ln_lightning CPU RMSNorm kernel: h must be (rows, n) with n >= 1");
  const int64_t rows = h.size(0), n = h.size(1);
  check_rows(dy, "dy", rows, n);
  check_rows(h, "h", rows, n);
  check_stream(h.scalar_type(), dy.scalar_type(), "h");
  if (dresidual.has_value()) {
    check_rows(*dresidual, "dresidual", rows, n);
    TORCH_CHECK(dresidual->scalar_type() == h.scalar_type(),
                "ln_lightning CPU RMSNorm kernel: dresidual must have h's dtype");
  }
  check_weight(weight, n);
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() == rows && rstd.is_contiguous(),
              "ln_lightning CPU RMSNorm kernel: rstd must be contiguous float32 of ", rows, " elements");
  auto dh = at::empty_like(h);
  // A fixed number of row blocks, not one per thread: the reduction order never depends on the
  // thread count.
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(rows, 32));
  auto opts = h.options().dtype(at::kFloat);
  auto dw_part = need_weight_grad ? at::zeros({blocks, n}, opts) : at::empty({0}, opts);
  const float* w = optional_ptr<float>(weight);
  dispatch(dy.scalar_type(), "dy", [&](auto t_tag) {
    using T = decltype(t_tag);
    dispatch(h.scalar_type(), "h", [&](auto h_tag) {
      using H = decltype(h_tag);
      backward_rows<T, H>(dy.data_ptr<T>(), h.data_ptr<H>(), optional_ptr<H>(dresidual), dh.data_ptr<H>(), w,
                          static_cast<float>(offset), round_normed, rstd.data_ptr<float>(),
                          need_weight_grad ? dw_part.data_ptr<float>() : nullptr, blocks, rows, n,
                          static_cast<float>(eps));
    });
  });
  if (!need_weight_grad) return {dh, dw_part};
  auto dw = at::zeros({n}, opts);
  float* o = dw.data_ptr<float>();
  const float* p = dw_part.data_ptr<float>();
  for (int64_t blk = 0; blk < blocks; ++blk)
    for (int64_t j = 0; j < n; ++j) o[j] += p[blk * n + j];
  return {dh, dw};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm_fwd", &add_rms_norm_fwd, "fused residual add + RMSNorm, forward");
  m.def("add_rms_norm_bwd", &add_rms_norm_bwd, "fused residual add + RMSNorm, backward");
}
