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

// The same exp, 8 lanes at a time in AVX2 intrinsics, where AVX2 is the widest vector unit (AMD Zen 2/3, most
// laptops; or a build held to AVX2). GCC vectorizes exp_approx's loops there, but turns the clamp into compares and
// blends, and in silu(gate) * up computes the clamped case's result too, with a second division: on 2 Zen 3 cores
// silu_mul_forward took 1.3-1.4 ns an element, slower than PyTorch's own silu and product (0.9). Written out, the loop
// does each step once: 3.5x faster alone (benchmarks/MEASUREMENTS.md, "exp in AVX2 intrinsics"). Every lane is
// exp_approx's arithmetic, step for step, with the FMAs where GCC contracts them in exp_approx (in a standalone test,
// bit for bit the same over [-100, 100]); the kernels' tests hold both paths to float64 references.
// NaN passes through: max_ps and min_ps return their second operand, x, where it is NaN.
// Where AVX-512 is present, GCC's own AVX-512 loops run as before (not measured against these).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define GRPO_KERNELS_EXP8 1
#include <immintrin.h>

inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

// The rows the kernels' exp is spent on, each with exp8's loop where it is built and exp_approx's otherwise (and for
// the last n % 8 entries).

// out[j] = gate[j] * up[j] / (1 + exp(-gate[j])): silu(gate) * up, the gated MLP's activation.
inline void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t j = 0;
#ifdef GRPO_KERNELS_EXP8
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; j + 8 <= n; j += 8) {
    const __m256 g = _mm256_loadu_ps(gate + j);
    const __m256 e = exp8(_mm256_xor_ps(g, sign));
    _mm256_storeu_ps(out + j, _mm256_div_ps(_mm256_mul_ps(g, _mm256_loadu_ps(up + j)), _mm256_add_ps(one, e)));
  }
#endif
#pragma omp simd
  for (int64_t k = j; k < n; ++k) out[k] = gate[k] * up[k] / (1.f + exp_approx(-gate[k]));
}

// silu_mul_row's gradients: with s = sigmoid(gate), d up = dh * gate * s, d gate = dh * up * s * (1 + gate * (1 - s)).
inline void silu_mul_grad_row(const float* dh, const float* gate, const float* up, float* d_gate, float* d_up,
                              int64_t n) {
  int64_t j = 0;
#ifdef GRPO_KERNELS_EXP8
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; j + 8 <= n; j += 8) {
    const __m256 g = _mm256_loadu_ps(gate + j), d = _mm256_loadu_ps(dh + j);
    const __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, sign))));
    _mm256_storeu_ps(d_up + j, _mm256_mul_ps(d, _mm256_mul_ps(g, s)));
    const __m256 slope = _mm256_mul_ps(s, _mm256_fmadd_ps(g, _mm256_sub_ps(one, s), one));
    _mm256_storeu_ps(d_gate + j, _mm256_mul_ps(_mm256_mul_ps(d, _mm256_loadu_ps(up + j)), slope));
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
#ifdef GRPO_KERNELS_EXP8
  __m256 acc[4] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY),
                   _mm256_set1_ps(-INFINITY)};
  for (; j + 32 <= n; j += 32)
    for (int u = 0; u < 4; ++u) acc[u] = _mm256_max_ps(_mm256_loadu_ps(row + j + 8 * u), acc[u]);  // x NaN: acc kept
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(acc[0], acc[1]), _mm256_max_ps(acc[2], acc[3])));
  for (float lane : lanes) top = std::max(top, lane);
#endif
#pragma omp simd reduction(max : top)
  for (int64_t k = j; k < n; ++k) top = std::max(top, row[k]);
  return top;
}

// sum_j exp(row[j] - shift): the normaliser of a softmax.
inline float sum_exp_row(const float* row, float shift, int64_t n) {
  float total = 0.f;
  int64_t j = 0;
#ifdef GRPO_KERNELS_EXP8
  const __m256 s = _mm256_set1_ps(shift);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();  // two chains of additions, not one
  for (; j + 16 <= n; j += 16) {
    acc0 = _mm256_add_ps(acc0, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), s)));
    acc1 = _mm256_add_ps(acc1, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j + 8), s)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(acc0, acc1));
  for (float lane : lanes) total += lane;
#endif
#pragma omp simd reduction(+ : total)
  for (int64_t k = j; k < n; ++k) total += exp_approx(row[k] - shift);
  return total;
}

// For a sampling step, over one row of logits: out[j] = exp(row[j] - top), exactly 0 where row[j] - top < -87.3
// (-inf included: such a token is never drawn; exp_approx would give its floor, 1e-38), and, summed in float64,
// *total = sum_j out[j] and *weighted = sum_j out[j] * (row[j] - top) (0 * -inf counted as 0, its true term).
// sampling.softmax_parts takes it only where exp8 is built: the element loop alone, summing in float64, would be
// slower than PyTorch's vectorized passes.
inline void sampling_exp_row(const float* row, float top, float* out, int64_t n, double* total, double* weighted) {
  double sum = 0.0, dot = 0.0;
  int64_t j = 0;
#ifdef GRPO_KERNELS_EXP8
  const __m256 t = _mm256_set1_ps(top), floor = _mm256_set1_ps(-87.3f);
  __m256d sums[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()}, dots[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()};
  for (; j + 8 <= n; j += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(row + j), t);
    const __m256 below = _mm256_cmp_ps(d, floor, _CMP_LT_OQ);  // false for NaN: NaN passes on
    const __m256 e = _mm256_andnot_ps(below, exp8(d));
    _mm256_storeu_ps(out + j, e);
    const __m256 ed = _mm256_andnot_ps(below, _mm256_mul_ps(e, d));
    sums[0] = _mm256_add_pd(sums[0], _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    sums[1] = _mm256_add_pd(sums[1], _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    dots[0] = _mm256_add_pd(dots[0], _mm256_cvtps_pd(_mm256_castps256_ps128(ed)));
    dots[1] = _mm256_add_pd(dots[1], _mm256_cvtps_pd(_mm256_extractf128_ps(ed, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(sums[0], sums[1]));
  for (double lane : lanes) sum += lane;
  _mm256_store_pd(lanes, _mm256_add_pd(dots[0], dots[1]));
  for (double lane : lanes) dot += lane;
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
#ifdef GRPO_KERNELS_EXP8
  const __m256 s = _mm256_set1_ps(shift), c = _mm256_set1_ps(scale);
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, _mm256_mul_ps(c, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), s))));
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
