// Shared by the fused CPU kernels (decode_step.cpp, train_step.cpp, train_attention.cpp; bound in bindings.cpp): their
// declarations and the vectorizable exp they use (grpo_lightning/fused_decode.py builds them as one extension).
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace grpo_kernels {

// exp(x) for float32 as one vectorizable expression (the compiler vectorizes no std::exp without -ffast-math,
// which would also drop NaN and infinity semantics): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' degree-6
// polynomial (within 2 ulp of std::exp), times 2^n built in the exponent bits. x is clamped to where 2^n is a
// normal float: exp(-87.3) ~ 1e-38 stands for anything smaller, exp(88.3) ~ 2e38 for anything larger.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln 2 in two parts, for an exact reduction
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// The same exp, a vector at a time in intrinsics: 16 lanes where AVX-512 is present (Intel Xeons since Skylake-SP,
// AMD Zen 4 and later), 8 where AVX2 is the widest vector unit (AMD Zen 2/3, most laptops; or a build held to AVX2).
// GCC vectorizes exp_approx's loops itself, but turns the clamp into compares and blends and, in silu(gate) * up,
// computes the clamped case's result too, with a second division; it leaves the row maximum's std::max scalar.
// Measured: on 2 Zen 3 cores silu_mul_forward took 1.3-1.4 ns an element through GCC's AVX2 loop, slower than
// PyTorch's own silu and product (0.9), and 3.5x faster written out (benchmarks/MEASUREMENTS.md, "exp in AVX2
// intrinsics"); on 2 cores of an Intel Xeon with AVX-512, GCC's AVX-512 loops took 5.4 ms for a (1056, 1536)
// silu_mul_forward (PyTorch: 1.2 ms), the 16-lane intrinsics 0.55 ms, and the log-softmax's forward over (1056, 49152)
// 56 ms against 19 ms ("The kernels' exp in AVX-512 intrinsics"). Every lane is exp_approx's arithmetic, step for step,
// with the FMAs where GCC contracts them in exp_approx; the kernels' tests hold every path to float64 references.
// NaN passes through: max and min return their second operand, x, where it is NaN.
// The rows below are written once, over vec::F (a vector of vec::kLanes floats) and the few operations on it they use.
#if defined(__AVX512F__)
#define GRPO_KERNELS_VEXP 16
#include <immintrin.h>
// vec: one vector of floats (F) and of doubles (D), and the operations the rows use; zero_below(d, floor, v) is v
// where d >= floor or d is NaN, 0 where d < floor; sum and max_lanes fold the lanes in order.
namespace vec {
using F = __m512;
using D = __m512d;
constexpr int64_t kLanes = 16;
inline F set(float x) { return _mm512_set1_ps(x); }
inline F load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F div(F a, F b) { return _mm512_div_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
inline F min(F a, F b) { return _mm512_min_ps(a, b); }
inline F max(F a, F b) { return _mm512_max_ps(a, b); }
inline F floor(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline F negate(F x) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}
inline F pow2(F n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline F zero_below(F d, F floor, F v) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, floor, _CMP_NLT_UQ), v); }
inline D dzero() { return _mm512_setzero_pd(); }
inline void dstore(double* p, D v) { _mm512_storeu_pd(p, v); }
inline void add_widened(D& lo, D& hi, F v) {
  lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
  hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}
}  // namespace vec
#elif defined(__AVX2__) && defined(__FMA__)  // the same operations on AVX2's 8 lanes
#define GRPO_KERNELS_VEXP 8
#include <immintrin.h>
namespace vec {
using F = __m256;
using D = __m256d;
constexpr int64_t kLanes = 8;
inline F set(float x) { return _mm256_set1_ps(x); }
inline F load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F div(F a, F b) { return _mm256_div_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
inline F min(F a, F b) { return _mm256_min_ps(a, b); }
inline F max(F a, F b) { return _mm256_max_ps(a, b); }
inline F floor(F x) { return _mm256_floor_ps(x); }
inline F negate(F x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.f)); }
inline F pow2(F n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline F zero_below(F d, F floor, F v) { return _mm256_andnot_ps(_mm256_cmp_ps(d, floor, _CMP_LT_OQ), v); }
inline D dzero() { return _mm256_setzero_pd(); }
inline void dstore(double* p, D v) { _mm256_storeu_pd(p, v); }
inline void add_widened(D& lo, D& hi, F v) {
  lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}
}  // namespace vec
#endif

#ifdef GRPO_KERNELS_VEXP
namespace vec {
// Folding a vector's lanes, in order (the same for either width).
inline float sum(F v) {
  float lanes[kLanes];
  store(lanes, v);
  float t = 0.f;
  for (float l : lanes) t += l;
  return t;
}
inline float max_lanes(F v, float top) {
  float lanes[kLanes];
  store(lanes, v);
  for (float l : lanes) top = std::max(top, l);
  return top;
}
inline double dsum(D v) {
  double lanes[kLanes / 2];
  dstore(lanes, v);
  double t = 0.0;
  for (double l : lanes) t += l;
  return t;
}
}  // namespace vec

// exp_approx, a vector at a time.
inline vec::F vexp(vec::F x) {
  using namespace vec;
  x = min(set(88.3f), max(set(-87.3f), x));
  const F n = floor(fmadd(x, set(1.44269504088896341f), set(0.5f)));
  F r = fnmadd(n, set(0.693359375f), x);
  r = fmadd(n, set(2.12194440e-4f), r);
  F p = set(1.9875691500e-4f);
  p = fmadd(p, r, set(1.3981999507e-3f));
  p = fmadd(p, r, set(8.3334519073e-3f));
  p = fmadd(p, r, set(4.1665795894e-2f));
  p = fmadd(p, r, set(1.6666665459e-1f));
  p = fmadd(p, r, set(5.0000001201e-1f));
  const F y = add(fmadd(mul(p, r), r, r), set(1.f));
  return mul(y, pow2(n));
}
#endif

// The rows the kernels' exp is spent on: each a vector loop where vec is built, exp_approx's element loop for the rest
// (the last n % kLanes entries, or all of them on a CPU without AVX2).

// out[j] = gate[j] * up[j] / (1 + exp(-gate[j])): silu(gate) * up, the gated MLP's activation.
inline void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t j = 0;
#ifdef GRPO_KERNELS_VEXP
  using namespace vec;
  for (; j + kLanes <= n; j += kLanes) {
    const F g = load(gate + j);
    store(out + j, div(mul(g, load(up + j)), add(set(1.f), vexp(negate(g)))));
  }
#endif
#pragma omp simd
  for (int64_t k = j; k < n; ++k) out[k] = gate[k] * up[k] / (1.f + exp_approx(-gate[k]));
}

// silu_mul_row's gradients: with s = sigmoid(gate), d up = dh * gate * s, d gate = dh * up * s * (1 + gate * (1 - s)).
inline void silu_mul_grad_row(const float* dh, const float* gate, const float* up, float* d_gate, float* d_up,
                              int64_t n) {
  int64_t j = 0;
#ifdef GRPO_KERNELS_VEXP
  using namespace vec;
  const F one = set(1.f);
  for (; j + kLanes <= n; j += kLanes) {
    const F g = load(gate + j), d = load(dh + j);
    const F s = div(one, add(one, vexp(negate(g))));
    store(d_up + j, mul(d, mul(g, s)));
    const F slope = mul(s, fmadd(g, sub(one, s), one));
    store(d_gate + j, mul(mul(d, load(up + j)), slope));
  }
#endif
#pragma omp simd
  for (int64_t k = j; k < n; ++k) {
    const float s = 1.f / (1.f + exp_approx(-gate[k]));
    d_up[k] = dh[k] * (gate[k] * s);
    d_gate[k] = dh[k] * up[k] * (s * (1.f + gate[k] * (1.f - s)));
  }
}

// max_j row[j], NaN entries skipped as std::max(top, x) skips them (-inf for an empty row). GCC leaves the loop of
// std::max scalar, one dependent comparison after another: 2-3 cycles an entry, most of a log-softmax's forward.
inline float max_row(const float* row, int64_t n) {
  float top = -INFINITY;
  int64_t j = 0;
#ifdef GRPO_KERNELS_VEXP
  using namespace vec;
  F acc[4] = {set(-INFINITY), set(-INFINITY), set(-INFINITY), set(-INFINITY)};
  for (; j + 4 * kLanes <= n; j += 4 * kLanes)
    for (int u = 0; u < 4; ++u) acc[u] = max(load(row + j + kLanes * u), acc[u]);  // x NaN: acc kept
  top = max_lanes(max(max(acc[0], acc[1]), max(acc[2], acc[3])), top);
#endif
#pragma omp simd reduction(max : top)
  for (int64_t k = j; k < n; ++k) top = std::max(top, row[k]);
  return top;
}

// sum_j exp(row[j] - shift): the normaliser of a softmax; two chains of additions, not one.
inline float sum_exp_row(const float* row, float shift, int64_t n) {
  float total = 0.f;
  int64_t j = 0;
#ifdef GRPO_KERNELS_VEXP
  using namespace vec;
  const F s = set(shift);
  F acc0 = set(0.f), acc1 = set(0.f);
  for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
    acc0 = add(acc0, vexp(sub(load(row + j), s)));
    acc1 = add(acc1, vexp(sub(load(row + j + kLanes), s)));
  }
  total = sum(add(acc0, acc1));
#endif
#pragma omp simd reduction(+ : total)
  for (int64_t k = j; k < n; ++k) total += exp_approx(row[k] - shift);
  return total;
}

// For a sampling step, over one row of logits: out[j] = exp(row[j] - top), exactly 0 where row[j] - top < -87.3
// (-inf included: such a token is never drawn; exp_approx would give its floor, 1e-38), and, summed in float64,
// *total = sum_j out[j] and *weighted = sum_j out[j] * (row[j] - top) (0 * -inf counted as 0, its true term).
// sampling.softmax_parts takes it only where vec is built: the element loop alone, summing in float64, would be
// slower than PyTorch's vectorized passes.
inline void sampling_exp_row(const float* row, float top, float* out, int64_t n, double* total, double* weighted) {
  double sum = 0.0, dot = 0.0;
  int64_t j = 0;
#ifdef GRPO_KERNELS_VEXP
  {
    using namespace vec;
    const F t = set(top), floor_ = set(-87.3f);
    D sums[2] = {dzero(), dzero()}, dots[2] = {dzero(), dzero()};
    for (; j + kLanes <= n; j += kLanes) {
      const F d = sub(load(row + j), t);
      const F e = zero_below(d, floor_, vexp(d));
      store(out + j, e);
      add_widened(sums[0], sums[1], e);
      add_widened(dots[0], dots[1], zero_below(d, floor_, mul(e, d)));
    }
    sum = dsum(sums[0]) + dsum(sums[1]);
    dot = dsum(dots[0]) + dsum(dots[1]);
  }
#endif
  for (int64_t k = j; k < n; ++k) {
    const float d = row[k] - top;
    const bool below = d < -87.3f;
    const float e = below ? 0.f : exp_approx(d);
    out[k] = e;
    sum += e;
    dot += below ? 0.0 : static_cast<double>(e * d);
  }
  *total = sum;
  *weighted = dot;
}

// out[j] = scale * exp(row[j] - shift).
inline void scaled_exp_row(const float* row, float shift, float scale, float* out, int64_t n) {
  int64_t j = 0;
#ifdef GRPO_KERNELS_VEXP
  using namespace vec;
  const F s = set(shift), c = set(scale);
  for (; j + kLanes <= n; j += kLanes) store(out + j, mul(c, vexp(sub(load(row + j), s))));
#endif
#pragma omp simd
  for (int64_t k = j; k < n; ++k) out[k] = scale * exp_approx(row[k] - shift);
}

// decode_step.cpp: the operations between the products of a one-token decode step
torch::Tensor add_rms_norm(torch::Tensor hidden, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps);
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor keys, torch::Tensor values, torch::Tensor cos,
                               torch::Tensor sin, torch::Tensor pads, int64_t position, int64_t kv_heads,
                               int64_t groups, double scaling);
torch::Tensor silu_mul(torch::Tensor gate_up, int64_t width);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> sampling_softmax(torch::Tensor logits);

// train_step.cpp: the learning step's elementwise work, forward and backward, and its transposes
std::tuple<torch::Tensor, torch::Tensor> rms_norm_forward(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> rms_norm_backward(torch::Tensor grad_out, torch::Tensor x, torch::Tensor weight,
                                                           torch::Tensor inverse_rms, bool weight_grad);
torch::Tensor silu_mul_forward(torch::Tensor gate, torch::Tensor up);
std::tuple<torch::Tensor, torch::Tensor> silu_mul_backward(torch::Tensor grad_out, torch::Tensor gate, torch::Tensor up);
std::tuple<torch::Tensor, torch::Tensor> pick_log_softmax_forward(torch::Tensor logits, torch::Tensor targets);
torch::Tensor pick_log_softmax_backward(torch::Tensor grad_out, torch::Tensor logits, torch::Tensor targets,
                                        torch::Tensor logsumexp);
torch::Tensor transpose_copy(torch::Tensor x);

// train_attention.cpp: the learning step's causal self-attention with its rotary embedding, forward and backward
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> causal_attention_forward(
    torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin, torch::Tensor mask,
    int64_t heads, int64_t kv_heads, double scaling);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> causal_attention_backward(
    torch::Tensor grad_out, torch::Tensor probs, torch::Tensor q_rot, torch::Tensor k_rot, torch::Tensor v,
    torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads, double scaling);

}  // namespace grpo_kernels
