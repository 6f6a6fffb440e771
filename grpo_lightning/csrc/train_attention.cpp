// The learning step's causal self-attention as one kernel forward and one backward (grpo_lightning/fused_attention.py):
// the rotary embedding of queries and keys, the scores, their softmax and the weighted sum of values, with grouped
// key/value heads read in place. Eager attention makes about a dozen PyTorch operations of it (rotate_half,
// repeat_kv, two batched products, the mask, the softmax, transposes), and as many again in its backward.
//
// Layout: q (B, T, H * hd), k and v (B, T, KV * hd), as the projections give them; the output is (B, T, H * hd), as
// the output projection reads it. Query head h reads key/value head h / (H / KV). cos, sin: (B or 1, T, hd). mask:
// an empty tensor, or (B or 1, T, T) added to the scores. Query i attends to keys 0..i (a causal language model): where the
// mask leaves a query at least one key, eager attention's weights on later keys are exactly 0 too (its mask there
// is the float32 minimum, whose exp underflows to 0).
//
// Every product here is a sum of rows scaled by coefficients, sum_k c[k] * M[k, a0 : a0 + 16], accumulated in one
// vector register (combine16): a query's scores against 16 keys (keys laid out transposed), a block of 16 output
// features, and each gradient. head_dim must be a multiple of 16; T is padded to one inside.
#include "kernels.h"

#include <ATen/Parallel.h>
#if defined(__AVX2__)  // x86 only: other CPUs (ARM) have no such header, and take the plain loop
#include <immintrin.h>
#endif

#include <limits>
#include <vector>

namespace grpo_kernels {
namespace {

constexpr int64_t kLanes = 16;

// out[0:16] = sum_{k < count} c[k * c_stride] * m[k * m_stride + 0:16], with four independent accumulators (one
// would chain every multiply-add on the last one's latency); in vector registers where the CPU has them (an array
// accumulator under `omp simd` goes through memory at every step, 7x slower here).
inline void combine16(const float* c, int64_t c_stride, const float* m, int64_t m_stride, int64_t count, float* out) {
#if defined(__AVX512F__)
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t k = 0;
  for (; k + 4 <= count; k += 4)
    for (int u = 0; u < 4; ++u)
      acc[u] = _mm512_fmadd_ps(_mm512_set1_ps(c[(k + u) * c_stride]), _mm512_loadu_ps(m + (k + u) * m_stride), acc[u]);
  for (; k < count; ++k) acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(c[k * c_stride]), _mm512_loadu_ps(m + k * m_stride), acc[0]);
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 lo[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, hi[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t k = 0;
  for (; k + 2 <= count; k += 2)
    for (int u = 0; u < 2; ++u) {
      const __m256 ck = _mm256_set1_ps(c[(k + u) * c_stride]);
      const float* row = m + (k + u) * m_stride;
      lo[u] = _mm256_fmadd_ps(ck, _mm256_loadu_ps(row), lo[u]);
      hi[u] = _mm256_fmadd_ps(ck, _mm256_loadu_ps(row + 8), hi[u]);
    }
  for (; k < count; ++k) {
    const __m256 ck = _mm256_set1_ps(c[k * c_stride]);
    lo[0] = _mm256_fmadd_ps(ck, _mm256_loadu_ps(m + k * m_stride), lo[0]);
    hi[0] = _mm256_fmadd_ps(ck, _mm256_loadu_ps(m + k * m_stride + 8), hi[0]);
  }
  _mm256_storeu_ps(out, _mm256_add_ps(lo[0], lo[1]));
  _mm256_storeu_ps(out + 8, _mm256_add_ps(hi[0], hi[1]));
#else
  float acc[kLanes] = {};
  for (int64_t k = 0; k < count; ++k)
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += c[k * c_stride] * m[k * m_stride + l];
  std::copy(acc, acc + kLanes, out);
#endif
}

// x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x[half:], x[:half]): the models' rotary embedding.
inline void rotate(const float* x, const float* c, const float* s, int64_t hd, float* out) {
  const int64_t half = hd / 2;
#pragma omp simd
  for (int64_t a = 0; a < half; ++a) out[a] = x[a] * c[a] - x[a + half] * s[a];
#pragma omp simd
  for (int64_t a = half; a < hd; ++a) out[a] = x[a] * c[a] + x[a - half] * s[a];
}

// The adjoint of rotate: dx[b] = dy[b] cos[b] + dy[b + half] sin[b + half] for b < half, and
// dy[b] cos[b] - dy[b - half] sin[b - half] for b >= half.
inline void rotate_back(const float* dy, const float* c, const float* s, int64_t hd, float* dx) {
  const int64_t half = hd / 2;
#pragma omp simd
  for (int64_t b = 0; b < half; ++b) dx[b] = dy[b] * c[b] + dy[b + half] * s[b + half];
#pragma omp simd
  for (int64_t b = half; b < hd; ++b) dx[b] = dy[b] * c[b] - dy[b - half] * s[b - half];
}

// rows (T, hd) at a row stride -> (hd, padded) transposed, zero beyond T.
inline void transpose_rows(const float* rows, int64_t stride, int64_t tokens, int64_t hd, int64_t padded, float* out) {
  std::fill(out, out + hd * padded, 0.f);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t a = 0; a < hd; ++a) out[a * padded + t] = rows[t * stride + a];
}

struct Shape {
  int64_t batch, tokens, padded, heads, kv_heads, hd, groups, table_stride;  // table_stride: cos/sin's, 0 if shared
};

Shape check_shapes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& cos,
                   const torch::Tensor& sin, int64_t heads, int64_t kv_heads) {
  for (const auto* t : {&q, &k, &v, &cos, &sin})
    TORCH_CHECK(t->dim() == 3 && t->is_contiguous() && t->scalar_type() == at::kFloat,
                "attention operands: contiguous (B, T, width) float32");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  const int64_t batch = q.size(0), tokens = q.size(1), hd = q.size(2) / heads;
  TORCH_CHECK(q.size(2) == heads * hd && hd % kLanes == 0, "q: (B, T, heads * head_dim), head_dim a multiple of 16");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == batch && k.size(1) == tokens && k.size(2) == kv_heads * hd,
              "k, v: (B, T, kv_heads * head_dim)");
  TORCH_CHECK(cos.sizes() == sin.sizes() && (cos.size(0) == batch || cos.size(0) == 1) && cos.size(1) == tokens &&
                  cos.size(2) == hd,
              "cos, sin: (B or 1, T, head_dim)");
  const int64_t padded = (tokens + kLanes - 1) / kLanes * kLanes;
  return {batch, tokens, padded, heads, kv_heads, hd, heads / kv_heads, cos.size(0) == 1 ? 0 : tokens * hd};
}

}  // namespace

// -> (out (B, T, H * hd), probabilities (B, H, T, T), rotated q, rotated k): the last three are what the backward reads.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> causal_attention_forward(
    torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin, torch::Tensor mask,
    int64_t heads, int64_t kv_heads, double scaling) {
  const Shape n = check_shapes(q, k, v, cos, sin, heads, kv_heads);
  const int64_t T = n.tokens, P = n.padded, hd = n.hd;
  const bool masked = mask.numel() > 0;
  if (masked)
    TORCH_CHECK(mask.is_contiguous() && mask.scalar_type() == at::kFloat && mask.dim() == 3 &&
                    (mask.size(0) == n.batch || mask.size(0) == 1) && mask.size(1) == T && mask.size(2) == T,
                "mask: contiguous (B or 1, T, T) float32");
  const int64_t mask_stride = masked && mask.size(0) == n.batch ? T * T : 0;
  auto out = torch::empty_like(q);
  auto probs = torch::zeros({n.batch, heads, T, T}, q.options());
  auto q_rot = torch::empty_like(q);
  auto k_rot = torch::empty_like(k);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>(), *mp = masked ? mask.data_ptr<float>() : nullptr;
  float *op = out.data_ptr<float>(), *pp = probs.data_ptr<float>(), *qr = q_rot.data_ptr<float>(), *kr = k_rot.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  const int64_t q_width = heads * hd, kv_width = kv_heads * hd;
  // One task per (sequence, key/value head): its keys are rotated and transposed once for the query heads sharing them.
  at::parallel_for(0, n.batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(P), keys_t(hd * P);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, g = task % kv_heads;
      const float *cb = cp + b * n.table_stride, *sb = sp + b * n.table_stride;
      float* k_task = kr + b * T * kv_width + g * hd;
      const float* v_task = vp + b * T * kv_width + g * hd;
      for (int64_t t = 0; t < T; ++t) rotate(kp + (b * T + t) * kv_width + g * hd, cb + t * hd, sb + t * hd, hd, k_task + t * kv_width);
      transpose_rows(k_task, kv_width, T, hd, P, keys_t.data());
      for (int64_t h = g * n.groups; h < (g + 1) * n.groups; ++h) {
        for (int64_t i = 0; i < T; ++i) {
          float* q_i = qr + (b * T + i) * q_width + h * hd;
          rotate(qp + (b * T + i) * q_width + h * hd, cb + i * hd, sb + i * hd, hd, q_i);
          const int64_t keys = i + 1;
          for (int64_t j0 = 0; j0 < keys; j0 += kLanes) combine16(q_i, 1, keys_t.data() + j0, P, hd, scores.data() + j0);
          float* s_i = scores.data();
          const float* m_i = masked ? mp + b * mask_stride + i * T : nullptr;
          float largest = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < keys; ++j) {
            s_i[j] = s_i[j] * scale + (masked ? m_i[j] : 0.f);
            // A NaN score sticks, so that the row's output is NaN, as eager attention's is (std::max would skip it).
            largest = (s_i[j] > largest || std::isnan(s_i[j])) ? s_i[j] : largest;
          }
          float* p_i = pp + ((b * heads + h) * T + i) * T;
          float* o_i = op + (b * T + i) * q_width + h * hd;
          if (largest == -std::numeric_limits<float>::infinity()) {  // no key to attend to: zeros
            std::fill(o_i, o_i + hd, 0.f);
            continue;
          }
          // exp_approx stands exp(-87.3) for anything smaller; the float32 minimum of a mask must give 0, as in eager.
          float total = 0.f;
#pragma omp simd reduction(+ : total)
          for (int64_t j = 0; j < keys; ++j) {
            const float x = s_i[j] - largest;
            p_i[j] = x < -87.3f ? 0.f : exp_approx(x);
            total += p_i[j];
          }
          const float inverse = 1.f / total;
#pragma omp simd
          for (int64_t j = 0; j < keys; ++j) p_i[j] *= inverse;
          for (int64_t a0 = 0; a0 < hd; a0 += kLanes) combine16(p_i, 1, v_task + a0, kv_width, keys, o_i + a0);
        }
      }
    }
  });
  return {out, probs, q_rot, k_rot};
}

// The gradients of causal_attention_forward with respect to q, k and v, from the forward's probabilities and its
// rotated q and k: dV_j = sum_i p_ij dO_i; dS_ij = p_ij (dO_i . v_j - sum_j' p_ij' dO_i . v_j') (the softmax's
// backward); the rotated dq_i = scaling sum_j dS_ij k_j and dk_j = scaling sum_i dS_ij q_i, then rotated back.
// Key/value gradients sum over the query heads that share them.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> causal_attention_backward(
    torch::Tensor grad_out, torch::Tensor probs, torch::Tensor q_rot, torch::Tensor k_rot, torch::Tensor v,
    torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads, double scaling) {
  const Shape n = check_shapes(q_rot, k_rot, v, cos, sin, heads, kv_heads);
  const int64_t T = n.tokens, P = n.padded, hd = n.hd, G = n.groups;
  TORCH_CHECK(grad_out.sizes() == q_rot.sizes() && grad_out.is_contiguous() && grad_out.scalar_type() == at::kFloat);
  TORCH_CHECK(probs.is_contiguous() && probs.dim() == 4 && probs.size(0) == n.batch && probs.size(1) == heads &&
              probs.size(2) == T && probs.size(3) == T);
  auto grad_q = torch::empty_like(q_rot);
  auto grad_k = torch::empty_like(k_rot);
  auto grad_v = torch::empty_like(v);
  const float *dop = grad_out.data_ptr<float>(), *pp = probs.data_ptr<float>(), *qr = q_rot.data_ptr<float>();
  const float *kr = k_rot.data_ptr<float>(), *vp = v.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *dq = grad_q.data_ptr<float>(), *dk = grad_k.data_ptr<float>(), *dv = grad_v.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  const int64_t q_width = heads * hd, kv_width = kv_heads * hd;
  at::parallel_for(0, n.batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    // d_scores (G, T, T): scaling * dS of the task's query heads, 0 above the diagonal; values_t (hd, P).
    std::vector<float> d_scores(G * T * T), values_t(hd * P), dot_values(P), rotated(hd), acc(kLanes);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, g = task % kv_heads;
      const float *cb = cp + b * n.table_stride, *sb = sp + b * n.table_stride;
      const float* k_task = kr + b * T * kv_width + g * hd;
      transpose_rows(vp + b * T * kv_width + g * hd, kv_width, T, hd, P, values_t.data());
      std::fill(d_scores.begin(), d_scores.end(), 0.f);
      for (int64_t r = 0; r < G; ++r) {
        const int64_t h = g * G + r;
        for (int64_t i = 0; i < T; ++i) {
          const float* do_i = dop + (b * T + i) * q_width + h * hd;
          const float* p_i = pp + ((b * heads + h) * T + i) * T;
          const int64_t keys = i + 1;
          for (int64_t j0 = 0; j0 < keys; j0 += kLanes) combine16(do_i, 1, values_t.data() + j0, P, hd, dot_values.data() + j0);
          float row_dot = 0.f;  // sum_j p_ij (dO_i . v_j)
#pragma omp simd reduction(+ : row_dot)
          for (int64_t j = 0; j < keys; ++j) row_dot += p_i[j] * dot_values[j];
          float* ds_i = d_scores.data() + (r * T + i) * T;
#pragma omp simd
          for (int64_t j = 0; j < keys; ++j) ds_i[j] = p_i[j] * (dot_values[j] - row_dot) * scale;
          for (int64_t a0 = 0; a0 < hd; a0 += kLanes) combine16(ds_i, 1, k_task + a0, kv_width, keys, rotated.data() + a0);
          rotate_back(rotated.data(), cb + i * hd, sb + i * hd, hd, dq + (b * T + i) * q_width + h * hd);
        }
      }
      // Key j's gradients sum over the queries i >= j of every head of the group: columns of d_scores and probs.
      for (int64_t j = 0; j < T; ++j) {
        const int64_t queries = T - j;
        for (int64_t a0 = 0; a0 < hd; a0 += kLanes) {
          float dk_block[kLanes] = {}, dv_block[kLanes] = {};
          for (int64_t r = 0; r < G; ++r) {
            const int64_t h = g * G + r;
            combine16(d_scores.data() + (r * T + j) * T + j, T, qr + (b * T + j) * q_width + h * hd + a0, q_width, queries, acc.data());
#pragma omp simd
            for (int64_t l = 0; l < kLanes; ++l) dk_block[l] += acc[l];
            combine16(pp + ((b * heads + h) * T + j) * T + j, T, dop + (b * T + j) * q_width + h * hd + a0, q_width, queries, acc.data());
#pragma omp simd
            for (int64_t l = 0; l < kLanes; ++l) dv_block[l] += acc[l];
          }
          std::copy(dk_block, dk_block + kLanes, rotated.data() + a0);
          std::copy(dv_block, dv_block + kLanes, dv + (b * T + j) * kv_width + g * hd + a0);
        }
        rotate_back(rotated.data(), cb + j * hd, sb + j * hd, hd, dk + (b * T + j) * kv_width + g * hd);
      }
    }
  });
  return {grad_q, grad_k, grad_v};
}

}  // namespace grpo_kernels
