// The Python module of the fused CPU kernels (grpo_lightning/fused_decode.py loads it).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace grpo_kernels;
  m.def("add_rms_norm", &add_rms_norm);
  m.def("decode_attention", &decode_attention);
  m.def("silu_mul", &silu_mul);
  m.def("sampling_softmax", &sampling_softmax);
#ifdef GRPO_KERNELS_VEXP
  m.attr("vector_exp_lanes") = GRPO_KERNELS_VEXP;  // 16 (AVX-512) or 8 (AVX2): sampling_softmax is worth taking
#else
  m.attr("vector_exp_lanes") = 0;  // exp_approx's element loops only (sampling.softmax_parts keeps PyTorch's passes)
#endif
  m.def("rms_norm_forward", &rms_norm_forward);
  m.def("rms_norm_backward", &rms_norm_backward);
  m.def("silu_mul_forward", &silu_mul_forward);
  m.def("silu_mul_backward", &silu_mul_backward);
  m.def("pick_log_softmax_forward", &pick_log_softmax_forward);
  m.def("pick_log_softmax_backward", &pick_log_softmax_backward);
  m.def("transpose_copy", &transpose_copy);
  m.def("causal_attention_forward", &causal_attention_forward);
  m.def("causal_attention_backward", &causal_attention_backward);
}
