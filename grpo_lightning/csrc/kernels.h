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

// decode_step.cpp: the operations between the products of a one-token decode step
torch::Tensor add_rms_norm(torch::Tensor hidden, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps);
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor keys, torch::Tensor values, torch::Tensor cos,
                               torch::Tensor sin, torch::Tensor pads, int64_t position, int64_t kv_heads,
                               int64_t groups, double scaling);
torch::Tensor silu_mul(torch::Tensor gate_up, int64_t width);

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
