// Fused residual add + LayerNorm or RMSNorm for CPU tensors, forward and backward: one source, the norm chosen by
// the template flag RMS (flash-attn's IS_RMS_NORM), as one extension.
//
// Built on first use by ln_lightning/norm/_cpu_kernels.py (torch.utils.cpp_extension). Why it exists: aten's
// bfloat16 CPU LayerNorm rounds mean/rstd to the input dtype and loses most of the weight gradient's precision;
// aten has no fused add + RMSNorm, and eager RMSNorm (HF's LlamaRMSNorm, or F.rms_norm) is five to eight
// elementwise passes each way; and the residual add is one more pass. Here each row is read once per direction:
// the forward writes h = x + residual and y = norm(h) in one pass over the inputs; the backward takes its row sums,
// then writes dh = dnorm + dresidual in one pass, with the weight (and bias) gradients accumulated in float32 per
// fixed block of rows and summed in block order (deterministic, independent of the thread count). The forward's
// statistics are float32.
//
// LayerNorm (RMS = false): statistics of (h - h[0]) per row, so that a constant row normalises to exact zeros and
// large offsets do not cancel; y = x_hat * w + b. RMSNorm (RMS = true): rstd = 1 / sqrt(mean(h^2) + eps) and
// y = cast(h * rstd) * (offset + w), where round_normed rounds h * rstd to the input dtype before the weight
// multiply (HF LlamaRMSNorm's `weight * hidden.to(input_dtype)`); otherwise the product is taken in float32 and
// rounded once (nn.RMSNorm, Gemma, OLMo 2).
//
// The input gradient, with g = dy * w (RMSNorm: dy * (offset + w)) and n the normalised row (x_hat, or h * rstd),
// is the textbook rstd * (g [- mean(g)] - n * mean(g * n)), computed as its two orthogonal parts,
// dh = rstd * ((g [- mean(g)] - q n) + t q n), q = sum(g n) / sum(n n), t = eps * rstd^2 (= 1 - mean(n^2)
// exactly). The textbook form takes g's component along n times 1 - mean(n^2) as a difference of nearly equal
// terms, which loses everything when the row is narrow (RMSNorm width 1: 1 - n^2 = eps / (h^2 + eps), 2.5e-6 at
// h = 2; LayerNorm width 2, where g - mean(g) is all along x_hat) or g lies near n. Here that factor is t, exact to
// rounding; at those widths there is no perpendicular part and dh = rstd * t * (g [- mean(g)]).
// RMSNorm also rounds the perpendicular part g - q n about once: it cancels when g lies near n (a constant row,
// and more so with Gemma's 1 + w, which makes g larger against the result: issue 32, 1.2-1.9x our 2x-torch bound
// on single rows), so q n is taken as (sum(g h) / sum(h h)) h, rstd cancelling, with the two row sums in double
// and g - q h as fused multiply-adds by q split into two floats.
// LayerNorm's perpendicular part g - mean(g) - q x_hat cancels the same way when g lies near span{1, x_hat}: near
// x_hat, or near x_hat plus a constant, which makes mean(g) large against it; a constant row's rstd = 1/sqrt(eps)
// ~ 316 magnifies what it loses (issue 32: float sums and float g - a - q x_hat reached 5-6.7x the bound on single
// rows at width 2, 1.05-2x elsewhere; and a width-1 row, whose exact derivative is 0, came out as rounding noise
// times 316). So the backward takes four row sums in double, of v = h - h[0] (the forward's centring: exact for a
// bfloat16 stream) and g = dy * w (exact in double): g's projection onto span{1, v} = span{1, x_hat} is
// alpha + beta v, with beta (v - mean(v)) = q x_hat, and the two parts fold into two constants,
// dh = rstd * (g - alpha' - beta' v), alpha' = alpha + t beta mean(v), beta' = (1 - t) beta. In floats, alpha' and
// beta' are float pairs, g - alpha'_hi one fused multiply-add (dy * w exact inside it, whatever else the compiler
// fuses) and beta' v off that by two more: a constant row (beta = 0) gets g - mean(g) to about one rounding of the
// result, a width-1 row exactly 0, other rows lose at most half a unit of beta v, as torch does rounding g itself.
// Width 2 keeps its branch, dh = rstd * t * (g - mean(g)) in double. The weight and bias gradients are summed in
// the same last pass, from x_hat as the forward computed it. The sums run as double vectors and the last pass in
// float ones: the backward takes about the time it took with float sums (benchmarks/bench_norm.py).
//
// Layout contract (checked on the Python side, _cpu_kernels.usable_forward/usable_backward and their rms_
// twins): 2-D contiguous (rows, n) tensors, n >= 1; x and dy bfloat16 (LayerNorm) or float32/bfloat16 (RMSNorm),
// the same dtype T; residual T or float32; h and dresidual T or float32 (float32 when the stream is kept in
// float32); weight and bias float32 or absent; mean/rstd float32 (rows,).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#ifdef __AVX__
#include <immintrin.h>
#endif

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

template <typename A>
inline A fold(const A* acc) {
  A s = 0;
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

// Four doubles as one vector (GCC/Clang vector extension; plain SSE pairs where AVX is not enabled): the LayerNorm
// backward's row sums in double.
typedef double D4 __attribute__((vector_size(32)));
typedef float F4 __attribute__((vector_size(16)));
inline D4 widen(const float* p) {
#ifdef __AVX__
  return _mm256_cvtps_pd(_mm_loadu_ps(p));  // GCC 12 lowers the generic conversion below to halves
#else
  F4 f;
  std::memcpy(&f, p, sizeof f);
  return __builtin_convertvector(f, D4);
#endif
}
inline D4 load4(const double* p) { D4 d; std::memcpy(&d, p, sizeof d); return d; }
// The sum of 8 lanes (a: lanes 0-3, b: 4-7) in fold_tree's order.
inline double fold8(D4 a, D4 b) {
  const D4 t = a + b;
  return (t[0] + t[2]) + (t[1] + t[3]);
}

// Below this many elements per thread, waking the pool costs more than the work (milliseconds when other
// processes hold the cores): the RMSNorm kernels' grain. The LayerNorm forward keeps its own (32768 / n rows).
constexpr int64_t kSerialElems = 1 << 17;

// The norm's parameters as the row loops read them.
struct Params {
  const float* w;  // weight, or nullptr
  const float* b;  // LayerNorm's bias, or nullptr
  float offset;  // RMSNorm: the weight is applied as offset + w
  bool round_normed;  // RMSNorm: round h * rstd to T before the weight multiply
};

template <bool RMS, typename T, typename R, typename H>
void forward_rows(const T* __restrict__ x, const R* __restrict__ res, H* __restrict__ h, T* __restrict__ y,
                  const Params p, float* mean_out, float* rstd_out, int64_t rows, int64_t n, float eps) {
  const int64_t grain = std::max<int64_t>(1, (RMS ? kSerialElems : 32768) / n);
  const int64_t nv = n - n % kLanes;
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(RMS ? 2 * n : n);
    float* __restrict__ v = buf.data();
    float* __restrict__ weff = v + n;  // RMSNorm: offset + w, once per chunk of rows
    if (RMS) for (int64_t j = 0; j < n; ++j) weff[j] = p.offset + (p.w ? p.w[j] : 1.f - p.offset);
    // LayerNorm sums v = h - h[0]; RMSNorm sums v^2, v = h, in double: a float sum of thousands of squares
    // (a constant row 8200 wide) drifted by ~1e-5 relative, past 2x torch's (cascaded) error in y and dh.
    using Acc = std::conditional_t<RMS, double, float>;
    auto add = [](Acc& a, float vj) { if constexpr (RMS) a += static_cast<double>(vj) * vj; else a += vj; };
    for (int64_t r = begin; r < end; ++r) {
      const T* __restrict__ xr = x + r * n;
      const R* __restrict__ rr = res ? res + r * n : nullptr;
      H* __restrict__ hr = h ? h + r * n : nullptr;
      // LayerNorm's statistics are of (h - h[0]): a constant row gives exact zeros, a large offset costs nothing.
      const float shift = RMS ? 0.f : round_as<H>(ld(xr, 0) + (rr ? ld(rr, 0) : 0.f));
      Acc acc[kLanes] = {0};
      if (rr) {
        for (int64_t j0 = 0; j0 < nv; j0 += kLanes)
          for (int64_t l = 0; l < kLanes; ++l) {
            const int64_t j = j0 + l;
            st(hr, j, ld(xr, j) + ld(rr, j));
            v[j] = ld(hr, j) - shift;  // normalise the residual exactly as stored
            add(acc[l], v[j]);
          }
        for (int64_t j = nv; j < n; ++j) { st(hr, j, ld(xr, j) + ld(rr, j)); v[j] = ld(hr, j) - shift; add(acc[0], v[j]); }
      } else if (hr) {  // residual_in_fp32 without a residual: the stream is x in float32
        for (int64_t j0 = 0; j0 < nv; j0 += kLanes)
          for (int64_t l = 0; l < kLanes; ++l) {
            const int64_t j = j0 + l;
            st(hr, j, ld(xr, j));
            v[j] = ld(hr, j) - shift;
            add(acc[l], v[j]);
          }
        for (int64_t j = nv; j < n; ++j) { st(hr, j, ld(xr, j)); v[j] = ld(hr, j) - shift; add(acc[0], v[j]); }
      } else {
        for (int64_t j0 = 0; j0 < nv; j0 += kLanes)
          for (int64_t l = 0; l < kLanes; ++l) {
            const int64_t j = j0 + l;
            v[j] = ld(xr, j) - shift;
            add(acc[l], v[j]);
          }
        for (int64_t j = nv; j < n; ++j) { v[j] = ld(xr, j) - shift; add(acc[0], v[j]); }
      }
      T* __restrict__ yr = y + r * n;
      if constexpr (RMS) {
        const float rs = static_cast<float>(1. / std::sqrt(fold(acc) / n + eps));
        rstd_out[r] = rs;
        if (p.round_normed) { for (int64_t j = 0; j < n; ++j) st(yr, j, round_as<T>(v[j] * rs) * weff[j]); }
        else { for (int64_t j = 0; j < n; ++j) st(yr, j, v[j] * rs * weff[j]); }
      } else {
        const float m = fold(acc) / n;
        float acc2[kLanes] = {0};
        for (int64_t j0 = 0; j0 < nv; j0 += kLanes)
          for (int64_t l = 0; l < kLanes; ++l) { const float d = v[j0 + l] - m; acc2[l] += d * d; }
        for (int64_t j = nv; j < n; ++j) { const float d = v[j] - m; acc2[0] += d * d; }
        const float rs = 1.f / std::sqrt(fold(acc2) / n + eps);
        mean_out[r] = m;
        rstd_out[r] = rs;
        const float* __restrict__ w = p.w;
        const float* __restrict__ b = p.b;
        if (w && b) { for (int64_t j = 0; j < n; ++j) st(yr, j, (v[j] - m) * rs * w[j] + b[j]); }
        else if (w) { for (int64_t j = 0; j < n; ++j) st(yr, j, (v[j] - m) * rs * w[j]); }
        else if (b) { for (int64_t j = 0; j < n; ++j) st(yr, j, (v[j] - m) * rs + b[j]); }
        else { for (int64_t j = 0; j < n; ++j) st(yr, j, (v[j] - m) * rs); }
      }
    }
  });
}

// The LayerNorm backward's last pass over a row: dh = rs * (g - a - b v) with g = dy * w and v = h - shift, a and b
// each a float pair (see backward_row_ln); and the row's share of the weight and bias gradients, which see x_hat as
// the forward computed it. Each combination of what is asked for is compiled on its own (template flags), its
// pointers restrict and its constants by value, so that the loop vectorises.
struct LnRow { float shift, m, rs, a_hi, a_lo, b_hi, b_lo; };

template <bool DR, bool DH, bool DW, bool DB, typename T, typename H>
void ln_last_pass(const T* __restrict__ dyr, const H* __restrict__ hr, const H* __restrict__ drr, H* __restrict__ dhr,
                  const float* __restrict__ w, float* __restrict__ dwp, float* __restrict__ dbp, const LnRow c,
                  int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float v = ld(hr, j) - c.shift, d = ld(dyr, j);
    if constexpr (DH) {
      // g - a_hi by a fused multiply-add (dy * w exact in it), then the rest.
      const float dn = c.rs * std::fma(-c.b_lo, v, std::fma(-c.b_hi, v, std::fma(d, w[j], -c.a_hi) - c.a_lo));
      if constexpr (DR) st(dhr, j, dn + ld(drr, j));
      else st(dhr, j, dn);
    }
    if constexpr (DW) dwp[j] += d * ((v - c.m) * c.rs);
    if constexpr (DB) dbp[j] += d;
  }
}

template <bool DH, typename T, typename H>
void ln_last_pass(const T* dyr, const H* hr, const H* drr, H* dhr, const float* w, float* dwp, float* dbp,
                  const LnRow c, int64_t n) {
  if (dwp && dbp) {
    if (drr) ln_last_pass<true, DH, true, true>(dyr, hr, drr, dhr, w, dwp, dbp, c, n);
    else ln_last_pass<false, DH, true, true>(dyr, hr, drr, dhr, w, dwp, dbp, c, n);
  } else if (dwp) {
    if (drr) ln_last_pass<true, DH, true, false>(dyr, hr, drr, dhr, w, dwp, dbp, c, n);
    else ln_last_pass<false, DH, true, false>(dyr, hr, drr, dhr, w, dwp, dbp, c, n);
  } else if (dbp) {
    if (drr) ln_last_pass<true, DH, false, true>(dyr, hr, drr, dhr, w, dwp, dbp, c, n);
    else ln_last_pass<false, DH, false, true>(dyr, hr, drr, dhr, w, dwp, dbp, c, n);
  } else {
    if (drr) ln_last_pass<true, DH, false, false>(dyr, hr, drr, dhr, w, dwp, dbp, c, n);
    else ln_last_pass<false, DH, false, false>(dyr, hr, drr, dhr, w, dwp, dbp, c, n);
  }
}

// One row's input gradient and its share of the weight/bias gradients: LayerNorm. w is the weight (or ones), wd the
// same in double.
template <typename T, typename H>
inline void backward_row_ln(const T* __restrict__ dyr, const H* __restrict__ hr, const H* __restrict__ drr,
                            H* __restrict__ dhr, const float* __restrict__ w, const double* __restrict__ wd, float m,
                            float rs, float* __restrict__ dwp, float* __restrict__ dbp, int64_t n, float eps) {
  const float shift = ld(hr, 0);
  // v = h - h[0] (exact for a bfloat16 stream) and g = dy * w (exact in double): sum(g), sum(g v), sum(v), sum(v v),
  // each in 8 lanes, two double vectors (written out: as arrays of lanes, GCC vectorised them in some instances of
  // this template and kept others scalar).
  const int64_t nv = n - n % 8;
  D4 g0 = {0, 0, 0, 0}, g1 = g0, gv0 = g0, gv1 = g0, v0 = g0, v1 = g0, vv0 = g0, vv1 = g0;
  for (int64_t j0 = 0; j0 < nv; j0 += 8) {
    float vf[8], df[8];
    for (int64_t l = 0; l < 8; ++l) { vf[l] = ld(hr, j0 + l) - shift; df[l] = ld(dyr, j0 + l); }
    const D4 va = widen(vf), vb = widen(vf + 4), ga = widen(df) * load4(wd + j0), gb = widen(df + 4) * load4(wd + j0 + 4);
    g0 += ga; g1 += gb; gv0 += ga * va; gv1 += gb * vb; v0 += va; v1 += vb; vv0 += va * va; vv1 += vb * vb;
  }
  double tail_g = 0., tail_gv = 0., tail_v = 0., tail_vv = 0.;
  for (int64_t j = nv; j < n; ++j) {
    const double v = ld(hr, j) - shift, g = ld(dyr, j) * wd[j];
    tail_g += g; tail_gv += g * v; tail_v += v; tail_vv += v * v;
  }
  // g's projection onto span{1, v} is alpha + beta v, with beta (v - mean(v)) = q x_hat. A constant row has beta = 0.
  const double inv_n = 1. / n, sg = fold8(g0, g1) + tail_g, sv = fold8(v0, v1) + tail_v, mv = sv * inv_n;
  const double scc = (fold8(vv0, vv1) + tail_vv) - sv * mv;  // sum((v - mean(v))^2)
  const double beta = scc > 0. ? ((fold8(gv0, gv1) + tail_gv) - sg * mv) / scc : 0.;
  const double alpha = sg * inv_n - beta * mv;
  const double t = static_cast<double>(eps) * rs * rs;  // = 1 - mean(x_hat^2)
  if (n == 2) {  // g - mean(g) = +-(g[0] - g[1]) / 2 is all along x_hat (or, for a constant row, t = 1)
    const double half = 0.5 * (ld(dyr, 0) * wd[0] - ld(dyr, 1) * wd[1]) * (t * rs);
    for (int64_t j = 0; j < 2; ++j) {
      const float dn = static_cast<float>(j ? -half : half);
      st(dhr, j, drr ? dn + ld(drr, j) : dn);
    }
    ln_last_pass<false>(dyr, hr, drr, dhr, w, dwp, dbp, LnRow{shift, m, rs, 0.f, 0.f, 0.f, 0.f}, n);
    return;
  }
  // dh = rs * ((g - alpha - beta v) + t beta (v - mean(v))) = rs * (g - alpha' - beta' v), alpha' = alpha +
  // t beta mean(v), beta' = (1 - t) beta: see the header. alpha' and beta' as float pairs.
  const double alpha1 = alpha + t * beta * mv, beta1 = beta - t * beta;
  const float a_hi = static_cast<float>(alpha1), b_hi = static_cast<float>(beta1);
  const LnRow c{shift, m, rs, a_hi, static_cast<float>(alpha1 - a_hi), b_hi, static_cast<float>(beta1 - b_hi)};
  ln_last_pass<true>(dyr, hr, drr, dhr, w, dwp, dbp, c, n);
}

// One row's input gradient (and its share of the weight gradient): RMSNorm. weff = offset + w.
template <typename T, typename H>
inline void backward_row_rms(const T* __restrict__ dyr, const H* __restrict__ hr, const H* __restrict__ drr,
                             H* __restrict__ dhr, const float* __restrict__ weff, bool round_normed, float rs,
                             float* __restrict__ xh, float* __restrict__ dwp, int64_t n, float eps) {
  const int64_t nv = n - n % kLanes;
  // q n = (sum(g h) / sum(h h)) h: the row sums in double (each product of two floats is exact there).
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

template <bool RMS, typename T, typename H>
void backward_rows(const T* __restrict__ dy, const H* __restrict__ h, const H* __restrict__ dres, H* __restrict__ dh,
                   const Params p, const float* mean, const float* rstd, float* dw_part, float* db_part,
                   int64_t blocks, int64_t rows, int64_t n, float eps) {
  // RMSNorm: small calls run on one thread (see kSerialElems). The result does not depend on it: the blocks, not
  // the threads, fix the summation order.
  const int64_t grain = RMS ? std::max<int64_t>(1, blocks * kSerialElems / std::max<int64_t>(1, rows * n)) : 1;
  at::parallel_for(0, blocks, grain, [&](int64_t bbegin, int64_t bend) {
    std::vector<float> buf(2 * n);
    std::vector<double> wbuf(RMS ? 0 : n);
    float* __restrict__ xh = buf.data();  // RMSNorm's
    float* __restrict__ weff = xh + n;  // g = dy * weff is recomputed where it is used: cheaper than storing it
    double* __restrict__ wd = wbuf.data();  // LayerNorm: weff = w (or ones), wd the same in double
    if (RMS) for (int64_t j = 0; j < n; ++j) weff[j] = p.offset + (p.w ? p.w[j] : 1.f - p.offset);
    else for (int64_t j = 0; j < n; ++j) wd[j] = weff[j] = p.w ? p.w[j] : 1.f;
    for (int64_t blk = bbegin; blk < bend; ++blk) {
      const int64_t r0 = rows * blk / blocks, r1 = rows * (blk + 1) / blocks;
      float* __restrict__ dwp = dw_part ? dw_part + blk * n : nullptr;
      float* __restrict__ dbp = db_part ? db_part + blk * n : nullptr;
      for (int64_t r = r0; r < r1; ++r) {
        const T* dyr = dy + r * n;
        const H* hr = h + r * n;
        const H* drr = dres ? dres + r * n : nullptr;
        H* dhr = dh + r * n;
        if constexpr (RMS) backward_row_rms<T, H>(dyr, hr, drr, dhr, weff, p.round_normed, rstd[r], xh, dwp, n, eps);
        else backward_row_ln<T, H>(dyr, hr, drr, dhr, weff, wd, mean[r], rstd[r], dwp, dbp, n, eps);
      }
    }
  });
}

const char* kind(bool rms) { return rms ? "ln_lightning CPU RMSNorm kernel: " : "ln_lightning CPU LayerNorm kernel: "; }

// T (x, dy) and H (the stream) are bfloat16 or float32.
template <typename F>
void dispatch(at::ScalarType t, bool rms, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, kind(rms), what, " must be float32 or bfloat16, got ", t);
  }
}

void check_rows(const at::Tensor& t, bool rms, const char* name, int64_t rows, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.size(0) == rows && t.size(1) == n && t.is_contiguous(),
              kind(rms), name, " must be a contiguous CPU tensor of shape (", rows, ", ", n, ")");
}

void check_vector(const c10::optional<at::Tensor>& t, bool rms, const char* name, int64_t n) {
  if (t.has_value())
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->numel() == n && t->is_contiguous(),
                kind(rms), name, " must be a contiguous float32 CPU tensor of ", n, " elements");
}

// The stream's dtype is T or float32: anything else is a caller bug.
void check_stream(at::ScalarType s, at::ScalarType t, bool rms, const char* name) {
  TORCH_CHECK(s == t || s == at::kFloat, kind(rms), name, " must be ", t, " or float32, got ", s);
}

void check_stats(const at::Tensor& t, bool rms, const char* name, int64_t rows) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == rows && t.is_contiguous(),
              kind(rms), name, " must be contiguous float32 of ", rows, " elements");
}

template <typename T>
T* ptr(const at::Tensor& t) { return t.numel() ? t.data_ptr<T>() : nullptr; }

template <typename T>
const T* optional_ptr(const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<T>() : nullptr; }

// (y, h or an empty tensor when h is x itself, mean (LayerNorm) or an empty tensor, rstd)
template <bool RMS>
std::vector<at::Tensor> add_norm_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const Params p0,
                                     const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                                     double eps, bool h_fp32) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, kind(RMS), "x must be (rows, n) with n >= 1");
  const int64_t rows = x.size(0), n = x.size(1);
  check_rows(x, RMS, "x", rows, n);
  if (residual.has_value()) {
    check_rows(*residual, RMS, "residual", rows, n);
    check_stream(residual->scalar_type(), x.scalar_type(), RMS, "residual");
  }
  check_vector(weight, RMS, "weight", n);
  check_vector(bias, RMS, "bias", n);
  const bool store = residual.has_value() || (h_fp32 && x.scalar_type() != at::kFloat);
  const auto h_dtype = h_fp32 ? at::kFloat : x.scalar_type();
  auto y = at::empty_like(x);
  auto h = store ? at::empty({rows, n}, x.options().dtype(h_dtype)) : at::empty({0}, x.options());
  auto mean = at::empty({RMS ? 0 : rows}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  Params p = p0;
  p.w = optional_ptr<float>(weight);
  p.b = optional_ptr<float>(bias);
  const auto r_dtype = residual.has_value() ? residual->scalar_type() : x.scalar_type();
  dispatch(x.scalar_type(), RMS, "x", [&](auto t_tag) {
    using T = decltype(t_tag);
    dispatch(r_dtype, RMS, "residual", [&](auto r_tag) {
      using R = decltype(r_tag);
      dispatch(h_dtype, RMS, "the stream", [&](auto h_tag) {
        using H = decltype(h_tag);
        forward_rows<RMS, T, R, H>(x.data_ptr<T>(), optional_ptr<R>(residual), store ? h.data_ptr<H>() : nullptr,
                                   y.data_ptr<T>(), p, ptr<float>(mean), rstd.data_ptr<float>(), rows, n,
                                   static_cast<float>(eps));
      });
    });
  });
  return {y, h, mean, rstd};
}

// (dh, dweight or empty, dbias or empty); dweight/dbias in float32.
template <bool RMS>
std::vector<at::Tensor> add_norm_bwd(const at::Tensor& dy, const c10::optional<at::Tensor>& dresidual,
                                     const at::Tensor& h, const at::Tensor& mean, const at::Tensor& rstd,
                                     const c10::optional<at::Tensor>& weight, const Params p0, bool need_weight_grad,
                                     bool need_bias_grad, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.size(1) > 0, kind(RMS), "h must be (rows, n) with n >= 1");
  const int64_t rows = h.size(0), n = h.size(1);
  check_rows(dy, RMS, "dy", rows, n);
  check_rows(h, RMS, "h", rows, n);
  check_stream(h.scalar_type(), dy.scalar_type(), RMS, "h");
  if (dresidual.has_value()) {
    check_rows(*dresidual, RMS, "dresidual", rows, n);
    TORCH_CHECK(dresidual->scalar_type() == h.scalar_type(), kind(RMS), "dresidual must have h's dtype");
  }
  check_vector(weight, RMS, "weight", n);
  if (RMS) check_stats(rstd, RMS, "rstd", rows);
  else TORCH_CHECK(mean.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat && mean.numel() == rows &&
                       rstd.numel() == rows && mean.is_contiguous() && rstd.is_contiguous(),
                   kind(RMS), "mean and rstd must be contiguous float32 of ", rows, " elements");
  // Fixed blocks of rows (not one per thread) so that the float32 sums are the same for any thread count.
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(rows, 32));
  auto opts = h.options().dtype(at::kFloat);
  auto dw_part = need_weight_grad ? at::zeros({blocks, n}, opts) : at::empty({0}, opts);
  auto db_part = need_bias_grad ? at::zeros({blocks, n}, opts) : at::empty({0}, opts);
  auto dh = at::empty_like(h);
  Params p = p0;
  p.w = optional_ptr<float>(weight);
  dispatch(dy.scalar_type(), RMS, "dy", [&](auto t_tag) {
    using T = decltype(t_tag);
    dispatch(h.scalar_type(), RMS, "h", [&](auto h_tag) {
      using H = decltype(h_tag);
      backward_rows<RMS, T, H>(dy.data_ptr<T>(), h.data_ptr<H>(), optional_ptr<H>(dresidual), dh.data_ptr<H>(), p,
                               RMS ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(), ptr<float>(dw_part),
                               ptr<float>(db_part), blocks, rows, n, static_cast<float>(eps));
    });
  });
  auto sum_blocks = [&](const at::Tensor& part) {
    if (!part.numel()) return part;
    auto out = at::zeros({n}, opts);
    float* o = out.data_ptr<float>();
    const float* pp = part.data_ptr<float>();
    for (int64_t blk = 0; blk < blocks; ++blk)
      for (int64_t j = 0; j < n; ++j) o[j] += pp[blk * n + j];
    return out;
  };
  return {dh, sum_blocks(dw_part), sum_blocks(db_part)};
}

}  // namespace

// LayerNorm: x and dy bfloat16 (aten's float32 kernels are as fast: _cpu_kernels.py says why).
std::vector<at::Tensor> add_layer_norm_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                           const c10::optional<at::Tensor>& weight,
                                           const c10::optional<at::Tensor>& bias, double eps, bool h_fp32) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, kind(false), "x must be bfloat16, got ", x.scalar_type());
  return add_norm_fwd<false>(x, residual, Params{nullptr, nullptr, 0.f, false}, weight, bias, eps, h_fp32);
}

std::vector<at::Tensor> add_layer_norm_bwd(const at::Tensor& dy, const c10::optional<at::Tensor>& dresidual,
                                           const at::Tensor& h, const at::Tensor& mean, const at::Tensor& rstd,
                                           const c10::optional<at::Tensor>& weight, bool need_weight_grad,
                                           bool need_bias_grad, double eps) {
  TORCH_CHECK(dy.scalar_type() == at::kBFloat16, kind(false), "dy must be bfloat16, got ", dy.scalar_type());
  return add_norm_bwd<false>(dy, dresidual, h, mean, rstd, weight, Params{nullptr, nullptr, 0.f, false},
                             need_weight_grad, need_bias_grad, eps);
}

// RMSNorm: (y, h or empty, rstd) and (dh, dweight or empty).
std::vector<at::Tensor> add_rms_norm_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                         const c10::optional<at::Tensor>& weight, double eps, bool h_fp32,
                                         double offset, bool round_normed) {
  auto out = add_norm_fwd<true>(x, residual, Params{nullptr, nullptr, static_cast<float>(offset), round_normed},
                                weight, c10::nullopt, eps, h_fp32);
  return {out[0], out[1], out[3]};
}

std::vector<at::Tensor> add_rms_norm_bwd(const at::Tensor& dy, const c10::optional<at::Tensor>& dresidual,
                                         const at::Tensor& h, const at::Tensor& rstd,
                                         const c10::optional<at::Tensor>& weight, double offset, bool round_normed,
                                         bool need_weight_grad, double eps) {
  auto out = add_norm_bwd<true>(dy, dresidual, h, rstd, rstd, weight,
                                Params{nullptr, nullptr, static_cast<float>(offset), round_normed}, need_weight_grad,
                                false, eps);
  return {out[0], out[1]};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_layer_norm_fwd", &add_layer_norm_fwd, "fused residual add + LayerNorm, forward");
  m.def("add_layer_norm_bwd", &add_layer_norm_bwd, "fused residual add + LayerNorm, backward");
  m.def("add_rms_norm_fwd", &add_rms_norm_fwd, "fused residual add + RMSNorm, forward");
  m.def("add_rms_norm_bwd", &add_rms_norm_bwd, "fused residual add + RMSNorm, backward");
}
