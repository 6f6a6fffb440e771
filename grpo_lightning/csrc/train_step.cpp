// The learning step's elementwise work between its matrix products, forward and backward, each one pass over
// its data where PyTorch's eager autograd makes several, and the transposes its weight gradients need
// (grpo_lightning/fused_training.py). float32, rows of a contiguous last dimension.
#include "kernels.h"

#include <ATen/Parallel.h>
#if defined(__AVX2__)  // x86 only: other CPUs (ARM) have no such header, and take the element loop
#include <immintrin.h>
#endif

namespace grpo_kernels {

// x (rows, d), weight (d,) -> (weight * (x * r), r) with r = 1 / sqrt(mean(x^2) + eps) per row: the models' RMS norm,
// and what its backward needs besides x.
std::tuple<torch::Tensor, torch::Tensor> rms_norm_forward(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x: contiguous (rows, d) float32");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == at::kFloat);
  const int64_t rows = x.size(0), width = x.size(1);
  auto out = torch::empty_like(x);
  auto inverse_rms = torch::empty({rows}, x.options());
  const float *in = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float *o = out.data_ptr<float>(), *r_out = inverse_rms.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = in + i * width;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t j = 0; j < width; ++j) squares += row[j] * row[j];
      const float r = 1.f / std::sqrt(squares / static_cast<float>(width) + e);
      r_out[i] = r;
      float* out_row = o + i * width;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) out_row[j] = w[j] * (row[j] * r);
    }
  });
  return {out, inverse_rms};
}

// The gradients of rms_norm_forward: with xh = x * r and g = grad_out * weight,
// dx = r * (g - xh * sum(g * xh) / d) per row, and dweight = the sum over rows of grad_out * xh (accumulated in
// float64 per thread, then summed; an empty tensor where weight_grad is false).
std::tuple<torch::Tensor, torch::Tensor> rms_norm_backward(torch::Tensor grad_out, torch::Tensor x, torch::Tensor weight,
                                                           torch::Tensor inverse_rms, bool weight_grad) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && grad_out.is_contiguous() && grad_out.sizes() == x.sizes());
  TORCH_CHECK(grad_out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat);
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == width && weight.scalar_type() == at::kFloat);
  TORCH_CHECK(inverse_rms.is_contiguous() && inverse_rms.numel() == rows && inverse_rms.scalar_type() == at::kFloat);
  auto grad_x = torch::empty_like(x);
  const int64_t threads = at::get_num_threads();
  auto partial = torch::zeros({weight_grad ? threads : 0, width}, x.options().dtype(at::kDouble));
  const float *dy = grad_out.data_ptr<float>(), *in = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  const float* r_in = inverse_rms.data_ptr<float>();
  float* dx = grad_x.data_ptr<float>();
  double* sums = weight_grad ? partial.data_ptr<double>() : nullptr;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    double* acc = sums ? sums + at::get_thread_num() * width : nullptr;
    for (int64_t i = begin; i < end; ++i) {
      const float *dy_row = dy + i * width, *row = in + i * width;
      const float r = r_in[i];
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < width; ++j) dot += dy_row[j] * w[j] * (row[j] * r);
      const float mean_dot = dot / static_cast<float>(width);
      float* dx_row = dx + i * width;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) dx_row[j] = r * (dy_row[j] * w[j] - (row[j] * r) * mean_dot);
      if (acc) {
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) acc[j] += static_cast<double>(dy_row[j] * (row[j] * r));
      }
    }
  });
  auto grad_weight = weight_grad ? partial.sum(0).to(at::kFloat) : torch::empty({0}, x.options());
  return {grad_x, grad_weight};
}

// silu(gate) * up for gate, up (rows, f), each with rows of stride(1) == 1 -> (rows, f) contiguous.
torch::Tensor silu_mul_forward(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 && up.stride(1) == 1);
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat);
  const int64_t rows = gate.size(0), width = gate.size(1), gate_stride = gate.stride(0), up_stride = up.stride(0);
  auto out = torch::empty({rows, width}, gate.options());
  const float *g = gate.data_ptr<float>(), *u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float *g_row = g + i * gate_stride, *u_row = u + i * up_stride;
      silu_mul_row(g_row, u_row, o + i * width, width);
    }
  });
  return out;
}

// The gradients of silu_mul_forward, (d gate, d up): with s = sigmoid(gate),
// d up = grad_out * gate * s and d gate = grad_out * up * s * (1 + gate * (1 - s)).
std::tuple<torch::Tensor, torch::Tensor> silu_mul_backward(torch::Tensor grad_out, torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 && up.stride(1) == 1);
  TORCH_CHECK(grad_out.is_contiguous() && grad_out.sizes() == gate.sizes() && grad_out.scalar_type() == at::kFloat);
  const int64_t rows = gate.size(0), width = gate.size(1), gate_stride = gate.stride(0), up_stride = up.stride(0);
  auto grad_gate = torch::empty({rows, width}, gate.options());
  auto grad_up = torch::empty({rows, width}, gate.options());
  const float *dh = grad_out.data_ptr<float>(), *g = gate.data_ptr<float>(), *u = up.data_ptr<float>();
  float *dg = grad_gate.data_ptr<float>(), *du = grad_up.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float *dh_row = dh + i * width, *g_row = g + i * gate_stride, *u_row = u + i * up_stride;
      silu_mul_grad_row(dh_row, g_row, u_row, dg + i * width, du + i * width, width);
    }
  });
  return {grad_gate, grad_up};
}

// Per row of logits (N, V): the log-softmax at targets[i], and the row's log-sum-exp (what the backward needs).
// Each row is read twice (its maximum, then the sum of exp of the shifted values), from cache the second time.
std::tuple<torch::Tensor, torch::Tensor> pick_log_softmax_forward(torch::Tensor logits, torch::Tensor targets) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat, "logits: (N, V) float32");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0) && targets.scalar_type() == at::kLong);
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto picked = torch::empty({rows}, logits.options());
  auto logsumexp = torch::empty({rows}, logits.options());
  const auto targets_in = targets.contiguous();  // held: a temporary's pointer would dangle
  const float* in = logits.data_ptr<float>();
  const int64_t* target = targets_in.data_ptr<int64_t>();
  float *p = picked.data_ptr<float>(), *lse = logsumexp.data_ptr<float>();
  // A backstop, checked before the threads start: objectives._check_targets_fit refuses such targets first,
  // since an error thrown from this extension crashed the process on one GPU host (torch 2.11).
  for (int64_t i = 0; i < rows; ++i)
    TORCH_CHECK(target[i] >= 0 && target[i] < vocab, "target ", target[i], " outside the vocabulary of ", vocab);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = in + i * stride;
      const float top = max_row(row, vocab);
      if (std::isinf(top)) {  // as torch.logsumexp: +inf where a logit is +inf, -inf where all are -inf
        lse[i] = top;
      } else {
        lse[i] = std::log(sum_exp_row(row, top, vocab)) + top;  // NaN where a logit is NaN
      }
      p[i] = row[target[i]] - lse[i];
    }
  });
  return {picked, logsumexp};
}

// The gradient of pick_log_softmax_forward's first output with respect to the logits:
// grad[i, j] = grad_out[i] * ([j == targets[i]] - exp(logits[i, j] - logsumexp[i])).
torch::Tensor pick_log_softmax_backward(torch::Tensor grad_out, torch::Tensor logits, torch::Tensor targets,
                                        torch::Tensor logsumexp) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat);
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto grad = torch::empty({rows, vocab}, logits.options());
  TORCH_CHECK(grad_out.scalar_type() == at::kFloat && logsumexp.scalar_type() == at::kFloat);
  const auto lse_in = logsumexp.contiguous(), grad_in = grad_out.contiguous(), targets_in = targets.contiguous();
  const float *in = logits.data_ptr<float>(), *lse = lse_in.data_ptr<float>(), *g = grad_in.data_ptr<float>();
  const int64_t* target = targets_in.data_ptr<int64_t>();
  float* out = grad.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* grad_row = out + i * vocab;
      scaled_exp_row(in + i * stride, lse[i], -g[i], grad_row, vocab);
      grad_row[target[i]] += g[i];
    }
  });
  return grad;
}

// x^T as a new contiguous tensor, for x (rows, cols) of any strides, in parallel over the output's rows
// (PyTorch's own copy of a transposed matrix runs on one thread). Where x's rows have unit stride, blocks of
// 16 x 16 (AVX-512) or 8 x 8 (AVX2) are transposed in registers, inside tiles of 64 x 64 that stay in the
// L1 cache, and the tiles' edges element by element. Otherwise (other strides, or a CPU without AVX2) it is
// element by element in tiles of 32 x 32, as before the blocks.
namespace {

constexpr int64_t kBlockTile = 64, kElementTile = 32;

#if defined(__AVX512F__)
constexpr int64_t kBlock = 16;
// out[j * out_stride + i] = in[i * in_stride + j] for i, j < 16.
inline void transpose_block(const float* in, int64_t in_stride, float* out, int64_t out_stride) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + i * in_stride);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
  }
  for (int k = 0; k < 16; ++k) _mm512_storeu_ps(out + k * out_stride, r[k]);  // r[k]: the block's column k
}
#elif defined(__AVX2__)
constexpr int64_t kBlock = 8;
inline void transpose_block(const float* in, int64_t in_stride, float* out, int64_t out_stride) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(in + i * in_stride);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // r[0..3]: columns 0, 1, 2, 3 of rows 0-3 (low half) and 4-7 (high half of r[4..7]).
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(out + i * out_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(out + (i + 4) * out_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#else
constexpr int64_t kBlock = 0;
inline void transpose_block(const float*, int64_t, float*, int64_t) {}
#endif

}  // namespace

torch::Tensor transpose_copy(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: 2-D float32");
  const int64_t rows = x.size(0), cols = x.size(1), row_stride = x.stride(0), col_stride = x.stride(1);
  auto out = torch::empty({cols, rows}, x.options());
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const bool blocks = kBlock > 0 && col_stride == 1;
  const int64_t tile = blocks ? kBlockTile : kElementTile;
  at::parallel_for(0, (cols + tile - 1) / tile, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile_j = begin; tile_j < end; ++tile_j) {
      const int64_t j0 = tile_j * tile, j1 = std::min(cols, j0 + tile);
      for (int64_t i0 = 0; i0 < rows; i0 += tile) {
        const int64_t i1 = std::min(rows, i0 + tile);
        int64_t i_done = i0, j_done = j0;  // the part done by blocks: [i0, i_done) x [j0, j_done)
        if (blocks) {
          i_done = i0 + (i1 - i0) / std::max<int64_t>(kBlock, 1) * kBlock;
          j_done = j0 + (j1 - j0) / std::max<int64_t>(kBlock, 1) * kBlock;
          for (int64_t j = j0; j < j_done; j += kBlock)
            for (int64_t i = i0; i < i_done; i += kBlock) transpose_block(in + i * row_stride + j, row_stride, o + j * rows + i, rows);
        }
        for (int64_t j = j0; j < j1; ++j) {  // the edges: columns past the blocks, then rows past them
          float* out_row = o + j * rows;
          const float* column = in + j * col_stride;
          for (int64_t i = (j < j_done ? i_done : i0); i < i1; ++i) out_row[i] = column[i * row_stride];
        }
      }
    }
  });
  return out;
}

}  // namespace grpo_kernels
