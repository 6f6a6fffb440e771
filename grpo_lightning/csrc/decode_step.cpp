// The operations between the matrix products of one decode step (one new token per row, float32), fused:
// each is one pass over its data where PyTorch's eager forward makes several (grpo_lightning/fused_decode.py).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <vector>

namespace grpo_kernels {
namespace {

// RMS norm of one row, as the models compute it: (x * rsqrt(mean(x^2) + eps)) * weight.
inline void norm_row(const float* x, const float* weight, float* out, int64_t width, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t j = 0; j < width; ++j) squares += x[j] * x[j];
  const float scale = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
#pragma omp simd
  for (int64_t j = 0; j < width; ++j) out[j] = weight[j] * (x[j] * scale);
}

// x * cos + (x2, x1) * signed_sin: rotate_half's sign lives in signed_sin (fast_decode.LeanDecoder).
inline void rotate(const float* x, const float* cos, const float* sin, float* out, int64_t head_dim) {
  const int64_t half = head_dim / 2;
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) out[j] = x[j] * cos[j] + x[j + half] * sin[j];
#pragma omp simd
  for (int64_t j = half; j < head_dim; ++j) out[j] = x[j] * cos[j] + x[j - half] * sin[j];
}

}  // namespace

// hidden += delta (where given), in place; returns norm(hidden). hidden (B, d), delta (B, d), weight (d,).
torch::Tensor add_rms_norm(torch::Tensor hidden, c10::optional<torch::Tensor> delta, torch::Tensor weight,
                           double eps) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.scalar_type() == at::kFloat);
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  auto out = torch::empty_like(hidden);
  float* h = hidden.data_ptr<float>();
  const float* d = nullptr;
  int64_t delta_stride = 0;
  if (delta.has_value()) {
    TORCH_CHECK(delta->dim() == 2 && delta->size(1) == width && delta->stride(1) == 1);
    d = delta->data_ptr<float>();
    delta_stride = delta->stride(0);
  }
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = h + r * width;
      if (d) {
        const float* add = d + r * delta_stride;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) row[j] += add[j];
      }
      norm_row(row, w, o + r * width, width, e);
    }
  });
  return out;
}

// One decode step's attention for every row. qkv (B, (heads + 2 kv) * hd): the joined projection's output.
// keys, values (B, kv, L, hd): the caches; this position's rotated key and its value are written at `position`.
// cos, sin (L, hd): rotary tables by position. pads (B,) int64 or empty: a row's left-padding columns (its
// rotary positions count from its first real token, and it sees no padding key). Returns (B, heads * hd).
torch::Tensor decode_attention(torch::Tensor qkv, torch::Tensor keys, torch::Tensor values, torch::Tensor cos,
                               torch::Tensor sin, torch::Tensor pads, int64_t position, int64_t kv_heads,
                               int64_t groups, double scaling) {
  const int64_t rows = qkv.size(0), head_dim = keys.size(3), length = keys.size(2);
  const int64_t heads = kv_heads * groups;
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (heads + 2 * kv_heads) * head_dim);
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && cos.is_contiguous() && sin.is_contiguous());
  TORCH_CHECK(position < length);
  auto out = torch::empty({rows, heads * head_dim}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const int64_t in_stride = qkv.stride(0);
  float* k_cache = keys.data_ptr<float>();
  float* v_cache = values.data_ptr<float>();
  const float *cos_table = cos.data_ptr<float>(), *sin_table = sin.data_ptr<float>();
  const int64_t* pad = pads.numel() ? pads.data_ptr<int64_t>() : nullptr;
  float* o = out.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    // The query heads of one key/value head are served together: each cached key and value is read once for all.
    std::vector<float> queries(groups * head_dim), weights(groups * (position + 1));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, k = item % kv_heads;
      const int64_t first = pad ? pad[r] : 0;  // the first key this row sees
      const int64_t span = position + 1 - first;
      const int64_t rotary_at = position - first;
      const float *c = cos_table + rotary_at * head_dim, *s = sin_table + rotary_at * head_dim;
      const float* row = in + r * in_stride;
      float* cached_keys = k_cache + ((r * kv_heads + k) * length + first) * head_dim;  // from the first visible
      float* cached_values = v_cache + ((r * kv_heads + k) * length + first) * head_dim;
      rotate(row + (heads + k) * head_dim, c, s, cached_keys + rotary_at * head_dim, head_dim);
      const float* value = row + (heads + kv_heads + k) * head_dim;
      std::copy(value, value + head_dim, cached_values + rotary_at * head_dim);
      for (int64_t g = 0; g < groups; ++g)
        rotate(row + (k * groups + g) * head_dim, c, s, queries.data() + g * head_dim, head_dim);
      for (int64_t t = 0; t < span; ++t) {
        const float* key = cached_keys + t * head_dim;
        for (int64_t g = 0; g < groups; ++g) {
          const float* query = queries.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t j = 0; j < head_dim; ++j) dot += query[j] * key[j];
          weights[g * span + t] = dot * scale;
        }
      }
      for (int64_t g = 0; g < groups; ++g) {  // softmax over the visible keys
        float* w = weights.data() + g * span;
        float top = w[0];
        for (int64_t t = 1; t < span; ++t) top = std::max(top, w[t]);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < span; ++t) {
          w[t] = exp_approx(w[t] - top);
          total += w[t];
        }
#pragma omp simd
        for (int64_t t = 0; t < span; ++t) w[t] /= total;
      }
      float* mixed = o + (r * heads + k * groups) * head_dim;  // the group's heads lie side by side
      std::fill(mixed, mixed + groups * head_dim, 0.f);
      for (int64_t t = 0; t < span; ++t) {
        const float* value_t = cached_values + t * head_dim;
        for (int64_t g = 0; g < groups; ++g) {
          const float weight = weights[g * span + t];
          float* out_g = mixed + g * head_dim;
#pragma omp simd
          for (int64_t j = 0; j < head_dim; ++j) out_g[j] += weight * value_t[j];
        }
      }
    }
  });
  return out;
}

// silu(gate) * up, of the joined gate/up product's output (B, 2 * width): gate first, then up.
torch::Tensor silu_mul(torch::Tensor gate_up, int64_t width) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) == 2 * width);
  const int64_t rows = gate_up.size(0), stride = gate_up.stride(0);
  auto out = torch::empty({rows, width}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in + r * stride;
      silu_mul_row(gate, gate + width, o + r * width, width);
    }
  });
  return out;
}

// What a sampling step needs of softmax(logits), logits (B, V) float32 with rows of unit stride, per row in one pass
// after its maximum (sampling.softmax_parts; PyTorch's operations make six passes over the vocabulary):
// the weights exp(logits - max) (B, V), 0 where below exp's float range; log sum exp(logits) (B, 1); and the entropy
// log s - sum(e d) / s (B,), with d = logits - max, e = exp(d), s = sum e.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> sampling_softmax(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat, "logits: (B, V) float32");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto weights = torch::empty({rows, vocab}, logits.options());
  auto log_normaliser = torch::empty({rows, 1}, logits.options());
  auto entropy = torch::empty({rows}, logits.options());
  const float* in = logits.data_ptr<float>();
  float *w = weights.data_ptr<float>(), *lse = log_normaliser.data_ptr<float>(), *h = entropy.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = in + i * stride;
      const float top = max_row(row, vocab);
      double total = 0.0, weighted = 0.0;
      sampling_exp_row(row, top, w + i * vocab, vocab, &total, &weighted);
      const double log_total = std::log(total);
      lse[i] = static_cast<float>(top + log_total);  // -inf or NaN rows give NaN, as the PyTorch operations do
      h[i] = static_cast<float>(log_total - weighted / total);
    }
  });
  return {weights, log_normaliser, entropy};
}

}  // namespace grpo_kernels
