// The one TORCH_LIBRARY(npu, m): every schema of opennpu's torch_npu-compatible ops.
// Schemas are copied from the torch_npu contract (shared/spec/torch_npu_api.md), keyword names
// included, so torch.ops.npu.<op>(...) calls written for Ascend bind unchanged.
// Kernels register per device in csrc/ops/<family>/<family>.cpp (CPU) and *_cuda.cu (CUDA);
// fake kernels and autograd live in src/opennpu/ops/<family>.py.
#include <torch/library.h>

#include "common/checks.h"
#include "common/cpu_dispatch.h"
#include "common/half_gemm.h"
#include "common/stream_store.h"
#include "common/random.h"

// The argument lists of npu_fused_infer_attention_score (v1) and _v2, shared by the op, its
// workspace query and opennpu's CUDA routing ops (_fia_decode / _fia_portable: the same
// arguments, so a call's boxed stack passes to either unchanged; ops/attention).
#define OPENNPU_FIA_V1_ARGS \
  "(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, " \
  "Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, " \
  "SymInt[]? actual_seq_lengths_kv=None, Tensor? dequant_scale1=None, " \
  "Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? quant_scale2=None, " \
  "Tensor? quant_offset2=None, Tensor? antiquant_scale=None, " \
  "Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, " \
  "Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, " \
  "Tensor? value_antiquant_offset=None, Tensor? block_table=None, " \
  "Tensor? query_padding_size=None, Tensor? kv_padding_size=None, " \
  "Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, " \
  "SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, " \
  "Tensor? key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, " \
  "float scale=1.0, int pre_tokens=2147483647, int next_tokens=2147483647, " \
  "str input_layout=\"BSH\", int num_key_value_heads=0, int sparse_mode=0, " \
  "int inner_precise=0, int block_size=0, int antiquant_mode=0, " \
  "int key_antiquant_mode=0, int value_antiquant_mode=0, bool softmax_lse_flag=False)"
#define OPENNPU_FIA_V2_ARGS \
  "(Tensor query, Tensor key, Tensor value, *, Tensor? query_rope=None, " \
  "Tensor? key_rope=None, Tensor? pse_shift=None, Tensor? atten_mask=None, " \
  "SymInt[]? actual_seq_qlen=None, SymInt[]? actual_seq_kvlen=None, " \
  "Tensor? block_table=None, Tensor? dequant_scale_query=None, " \
  "Tensor? dequant_scale_key=None, Tensor? dequant_offset_key=None, " \
  "Tensor? dequant_scale_value=None, Tensor? dequant_offset_value=None, " \
  "Tensor? dequant_scale_key_rope=None, Tensor? quant_scale_out=None, " \
  "Tensor? quant_offset_out=None, Tensor? quant_scale_p=None, " \
  "Tensor? learnable_sink=None, int num_query_heads=1, int num_key_value_heads=0, " \
  "float softmax_scale=1.0, int pre_tokens=2147483647, int next_tokens=2147483647, " \
  "str input_layout=\"BSH\", int sparse_mode=0, int block_size=0, " \
  "int query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, " \
  "int inner_precise=0, bool return_softmax_lse=False, int? query_dtype=None, " \
  "int? key_dtype=None, int? value_dtype=None, int? query_rope_dtype=None, " \
  "int? key_rope_dtype=None, int? key_shared_prefix_dtype=None, " \
  "int? value_shared_prefix_dtype=None, int? dequant_scale_query_dtype=None, " \
  "int? dequant_scale_key_dtype=None, int? dequant_scale_value_dtype=None, " \
  "int? dequant_scale_key_rope_dtype=None, int? out_dtype=None)"

TORCH_LIBRARY(npu, m) {
  // RMSNorm: returns (y, rstd); rstd is float32 with the normalised dims kept as size 1.
  m.def("npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)");
  // Returns (dx, dgamma); dgamma is float32 in gamma's shape.
  m.def("npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) -> (Tensor, Tensor)");
  // Gemma RMSNorm: y = x * rstd * (1 + gamma); returns (y, rstd).
  m.def("npu_gemma_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)");
  // Residual add + RMSNorm: returns (y, rstd, x1 + x2).
  m.def("npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)");
  // npu_add_rms_norm in place: x1 <- y, x2 <- x1 + x2; returns rstd (float32, keep-dim).
  m.def("npu_add_rms_norm_v2(Tensor(a!) x1, Tensor(b!) x2, Tensor gamma, float epsilon=1e-06) -> Tensor");
  // Its out-of-place form: returns (rstd, y, x1 + x2), what the in-place one writes.
  m.def("npu_add_rms_norm_v2_functional(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)");
  // add_rms_norm with the normalised output twice: returns (y1 float32, y2 in x1's dtype, rstd, x).
  m.def("npu_add_rms_norm_cast(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor, Tensor)");

  // Symmetric dynamic quantisation: scale = rowmax(|x * smooth|) / DTYPE_MAX, y = round(x * smooth
  // / scale); returns (y int8, or int32 holding 8 int4 each for dst_type=quint4x2, scale float32).
  m.def("npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, "
        "int? dst_type=None, str quant_mode=\"pertoken\", float dst_type_max=0.0) -> (Tensor, Tensor)");
  // x = x1 + x2, y = RMSNorm(x) * gamma (+ beta), then up to two dynamic quantisations of
  // y * smooth_scale_k; returns (y1, y2, x, scale1, scale2), 0-dim tensors for a disabled branch.
  m.def("npu_add_rms_norm_dynamic_quant(Tensor x1, Tensor x2, Tensor gamma, *, "
        "Tensor? smooth_scale1=None, Tensor? smooth_scale2=None, Tensor? beta=None, "
        "float epsilon=1e-6, bool[2]? output_mask=None, int? y_dtype=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Affine quantisation with given scales / zero points along `axis`: clamp(round(x / scale) +
  // zero_point) (div_mode) or clamp(round(x * scale + zero_point)); int8 / uint8 / int32 or int4.
  m.def("npu_quantize(Tensor self, Tensor scales, Tensor? zero_points, int dtype, int axis=1, "
        "bool div_mode=True) -> Tensor");
  // Quantised matmul: (x1 @ x2 (+ int32 bias)) in int32, then * scale (* pertoken_scale)
  // (+ float bias) (+ offset) in fp32, rounded once to output_dtype (int8 by default); int4
  // operands come as int32 holding eight codes each.
  m.def("npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, "
        "Tensor? pertoken_scale=None, Tensor? bias=None, int? output_dtype=None, "
        "int? x1_dtype=None, int? x2_dtype=None, int? pertoken_scale_dtype=None, "
        "int? scale_dtype=None, int[]? group_sizes=None, Tensor? y_scale=None) -> Tensor");
  // float32 scale (and offset) packed into int64 for npu_quant_matmul: fp19 bits | 1 << 46 |
  // 9-bit offset << 37.
  m.def("npu_trans_quant_param(Tensor scale, Tensor? offset=None, int? round_mode=0) -> Tensor");
  // int32 codes in [-8, 7] packed eight per int32 along the last dim, lowest bits first.
  m.def("npu_convert_weight_to_int4pack(Tensor weight, int inner_k_tiles=0) -> Tensor");
  // MX quantisation: blocks of block_size along `axis` share a power-of-two scale (float8_e8m0
  // codes, pairs of blocks interleaved); returns (y float8 or uint8 holding two fp4, mxscale uint8).
  m.def("npu_dynamic_mx_quant(Tensor input, *, int axis=-1, str round_mode=\"rint\", "
        "int dst_type=296, int block_size=32, int? scale_alg=0, float dst_type_max=0.0, "
        "float max_low_bound=0.0) -> (Tensor, Tensor)");
  // npu_dynamic_mx_quant along the last axis and along the second-to-last, blocks of 32:
  // returns (y1, mxscale1, y2, mxscale2).
  m.def("npu_dynamic_mx_quant_with_dual_axis(Tensor input, *, str round_mode=\"rint\", "
        "int dst_type=296, int scale_alg=0, float? dst_type_max=0.0) -> (Tensor, Tensor, Tensor, Tensor)");
  // MX quantisation along dim 0 of x [M, N] within the row groups of group_index (cumulative
  // ends); each group's scale rows padded to pairs: returns (y float8, mxscale [M/64 + G, N, 2]).
  m.def("npu_grouped_dynamic_mx_quant(Tensor x, Tensor group_index, *, str round_mode=\"rint\", "
        "int dst_type=23, int blocksize=32, int? scale_alg=0, float? dst_type_max=0.0) -> (Tensor, Tensor)");
  // Quantisation per row_block_size x col_block_size block with an fp32 scale per block:
  // returns (y int8 or float8, scale float32).
  m.def("npu_dynamic_block_quant(Tensor x, *, float min_scale=0.0, str round_mode=\"rint\", "
        "int dst_type=1, int row_block_size=1, int col_block_size=128, float dst_type_max=0.0) "
        "-> (Tensor y, Tensor scale)");

  // SwiGLU over halves of `dim`: silu(first) * second.
  m.def("npu_swiglu(Tensor self, int dim=-1) -> Tensor");
  // Gradient of npu_swiglu with respect to its full input.
  m.def("npu_swiglu_backward(Tensor grad_output, Tensor self, int dim=-1) -> Tensor");
  // GeGLU: returns (out, gelu); approximate 0 = erf, 1 = tanh; activate_left picks the gelu half.
  m.def("npu_geglu(Tensor self, int dim=-1, int approximate=1, bool activate_left=False) -> (Tensor, Tensor)");
  // Gradient of npu_geglu's `out` with respect to its input.
  m.def("npu_geglu_grad(Tensor grad_output, Tensor self, Tensor gelu, int dim=-1, int approximate=1, bool activate_left=False) -> Tensor");
  // FastGELU: x * sigmoid(1.702 x). fast_gelu and npu_fast_gelu are the same op.
  m.def("fast_gelu(Tensor self) -> Tensor");
  m.def("npu_fast_gelu(Tensor self) -> Tensor");
  // Gradient of (npu_)fast_gelu.
  m.def("npu_fast_gelu_backward(Tensor grad, Tensor self) -> Tensor");

  // Rotary embedding: x * r1 + rotate(x) * r2; modes 'half' and 'interleave', or x @ rotate.
  m.def("npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor");
  // Returns (dx, dr1, dr2); dr1/dr2 are reduced over the dims r1/r2 broadcast along.
  m.def("npu_rotary_mul_backward(Tensor grad, Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> (Tensor, Tensor, Tensor)");
  // DeepSeek's rope of one input: x de-interleaved (evens then odds), then x * cos + rotate_half(x) * sin.
  m.def("npu_interleave_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  // Rotary of query and key with one cos / sin, written into query and key (returned, as torch_npu).
  m.def("npu_apply_rotary_pos_emb(Tensor query, Tensor key, Tensor cos, Tensor sin, str layout='BSND', str rotary_mode='half') -> (Tensor, Tensor)");
  // MLA: RMSNorm of kv's first part, interleave-rope of its last, both written into paged / per-batch caches (in place, returned).
  m.def("npu_kv_rmsnorm_rope_cache(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, Tensor index, Tensor k_cache, Tensor ckv_cache, *, "
        "Tensor? k_rope_scale=None, Tensor? c_kv_scale=None, Tensor? k_rope_offset=None, Tensor? c_kv_offset=None, Tensor? v=None, "
        "float epsilon=1e-5, str cache_mode='Norm', bool is_output_kv=False) -> (Tensor, Tensor, Tensor, Tensor)");
  // The same with the cache writes declared; returns (k_rope, c_kv).
  m.def("npu_kv_rmsnorm_rope_cache_v2(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, Tensor index, Tensor(a!) k_cache, Tensor(b!) ckv_cache, *, "
        "Tensor? k_rope_scale=None, Tensor? c_kv_scale=None, Tensor? k_rope_offset=None, Tensor? c_kv_offset=None, Tensor? v=None, "
        "float epsilon=1e-5, str cache_mode='Norm', bool is_output_kv=False, int? k_cache_dtype=None, int? ckv_cache_dtype=None) -> (Tensor, Tensor)");
  // The same into copies of the caches; returns (k_rope, c_kv, k_cache, ckv_cache).
  m.def("npu_kv_rmsnorm_rope_cache_v2_functional(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, Tensor index, Tensor k_cache, Tensor ckv_cache, *, "
        "Tensor? k_rope_scale=None, Tensor? c_kv_scale=None, Tensor? k_rope_offset=None, Tensor? c_kv_offset=None, Tensor? v=None, "
        "float epsilon=1e-5, str cache_mode='Norm', bool is_output_kv=False, int? k_cache_dtype=None, int? ckv_cache_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)");

  // softmax(where(mask, -10000, x * scale), dim=-1); mask True = masked out, broadcast to x;
  // fixed_triu_mask=True masks columns j > i (triu(ones(H, W), 1)) and ignores `mask`.
  m.def("npu_scaled_masked_softmax(Tensor x, Tensor mask, Scalar scale=1, bool fixed_triu_mask=False) -> Tensor");
  // dx = scale * y * (dy - sum_last(dy * y)), 0 at masked positions; dtype of y_grad.
  m.def("npu_scaled_masked_softmax_backward(Tensor y_grad, Tensor y, Tensor mask, Scalar scale, bool fixed_triu_mask) -> Tensor");

  // Flash attention: Dropout(Softmax(Mask(scale * (Q K^T + pse)))) V over BSH/SBH/BSND/BNSD/TND,
  // GQA, sparse modes 0-8. Returns (attention_out, softmax_max, softmax_sum, softmax_out, seed,
  // offset, numels); the statistics are float32 with 8 copies in the last dim. The three ints are
  // SymInt (torch_npu says int; Python sees ints either way) so torch.compile(dynamic=True) can
  // carry numels = B*N*Sq*Skv symbolically instead of specialising on the shapes.
  m.def("npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
        "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, "
        "int inner_precise=0, int[]? prefix=None, int[]? actual_seq_qlen=None, "
        "int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, "
        "bool sync=False, str softmax_layout=\"\", Tensor? sink=None, Tensor? dropout_mask=None, "
        "int seed=0, int offset=0) -> (Tensor, Tensor, Tensor, Tensor, SymInt, SymInt, SymInt)");
  // Returns (dq, dk, dv, dpse, dsink); dpse / dsink are empty when pse / sink are absent.
  m.def("npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
        "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, "
        "Tensor? attention_in=None, float scale_value=1., float keep_prob=1., "
        "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, SymInt seed=0, "
        "SymInt offset=0, SymInt numels=0, int[]? prefix=None, int[]? actual_seq_qlen=None, "
        "int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, "
        "bool sync=False, str softmax_layout=\"\", Tensor? sink=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // npu_fusion_attention with pre/next_tokens, keyword-only options, MLA query_rope/key_rope
  // (scores q k^T + q_rope k_rope^T) and pse_type 0/1 (scale * qk + pse / scale * (qk + pse)).
  m.def("npu_fusion_attention_v2(Tensor query, Tensor key, Tensor value, int head_num, "
        "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "Tensor? query_rope=None, Tensor? key_rope=None, float scale=1., float keep_prob=1., "
        "int pre_tokens=2147483647, int next_tokens=2147483647, int inner_precise=0, "
        "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, "
        "int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, int pse_type=1, "
        "int[]? q_start_idx=None, int[]? kv_start_idx=None, str softmax_layout=\"\", "
        "Tensor? sink=None, Tensor? dropout_mask=None, int seed=0, int offset=0) -> (Tensor, Tensor, "
        "Tensor, Tensor, SymInt, SymInt, SymInt)");
  // Returns (dq, dk, dv, dpse, dq_rope, dk_rope, dsink); absent optional inputs give empty grads.
  m.def("npu_fusion_attention_grad_v2(Tensor query, Tensor key, Tensor value, Tensor dy, "
        "int head_num, str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, "
        "Tensor? atten_mask=None, Tensor? softmax_max=None, Tensor? softmax_sum=None, "
        "Tensor? softmax_in=None, Tensor? attention_in=None, Tensor? query_rope=None, "
        "Tensor? key_rope=None, float scale_value=1., float keep_prob=1., int pre_tokens=2147483647, "
        "int next_tokens=2147483647, int inner_precise=0, SymInt seed=0, SymInt offset=0, "
        "SymInt numels=0, "
        "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, "
        "int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, int pse_type=1, "
        "int[]? q_start_idx=None, int[]? kv_start_idx=None, str softmax_layout=\"\", "
        "Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // npu_fusion_attention with actual_seq_qlen/kvlen as host int tensors; seed and offset
  // returned as one-element int64 tensors.
  m.def("npu_fusion_attention_v3(Tensor query, Tensor key, Tensor value, int head_num, "
        "str input_layout, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "float scale=1., float keep_prob=1., int pre_tockens=2147483647, "
        "int next_tockens=2147483647, int inner_precise=0, SymInt[]? prefix=None, "
        "Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, int sparse_mode=0, "
        "bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", "
        "Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // v3 writing its six outputs; workspace is accepted and unused (the CPU kernels need none).
  m.def("npu_fusion_attention_v3.out(Tensor query, Tensor key, Tensor value, int head_num, "
        "str input_layout, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "float scale=1., float keep_prob=1., int pre_tockens=2147483647, "
        "int next_tockens=2147483647, int inner_precise=0, int[]? prefix=None, "
        "Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, int sparse_mode=0, "
        "bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", Tensor? sink=None, "
        "Tensor? workspace=None, *, Tensor(a!) attention_score, Tensor(b!) softmax_max, "
        "Tensor(c!) softmax_sum, Tensor(d!) softmax_out, Tensor(e!) seed, "
        "Tensor(f!) offset) -> (Tensor(a!), Tensor(b!), Tensor(c!), Tensor(d!), Tensor(e!), "
        "Tensor(f!))");
  // Gradient of v3: seed / offset are v3's tensors; returns (dq, dk, dv, dpse, dsink).
  m.def("npu_fusion_attention_grad_v3(Tensor query, Tensor key, Tensor value, Tensor dy, "
        "int head_num, str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, "
        "Tensor? atten_mask=None, Tensor? softmax_max=None, Tensor? softmax_sum=None, "
        "Tensor? softmax_in=None, Tensor? attention_in=None, float scale_value=1., "
        "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, "
        "int inner_precise=0, Tensor? seed=None, Tensor? offset=None, SymInt[]? prefix=None, "
        "Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, int sparse_mode=0, "
        "bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", "
        "Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // grad_v3 writing dq, dk, dv, dpse, dsink; workspace unused.
  m.def("npu_fusion_attention_grad_v3.out(Tensor query, Tensor key, Tensor value, Tensor dy, "
        "int head_num, str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, "
        "Tensor? atten_mask=None, Tensor? softmax_max=None, Tensor? softmax_sum=None, "
        "Tensor? softmax_in=None, Tensor? attention_in=None, float scale_value=1., "
        "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, "
        "int inner_precise=0, Tensor? seed=None, Tensor? offset=None, int[]? prefix=None, "
        "Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, int sparse_mode=0, "
        "bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", Tensor? sink=None, "
        "Tensor? workspace=None, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor(d!) dpse, "
        "Tensor(e!) dsink) -> (Tensor(a!), Tensor(b!), Tensor(c!), Tensor(d!), Tensor(e!))");
  // Bit-packed dropout keep mask (p = drop probability) of the Philox stream (seed, offset): the
  // mask npu_fusion_attention uses for the same (seed, offset). uint8, padded to 128 bits.
  m.def("_npu_dropout_gen_mask.Tensor(Tensor self, int[] size, float p, int seed, int offset, *, "
        "bool? parallel=True, bool? sync=None) -> Tensor");
  // Inference attention (PromptFlashAttention / IncreFlashAttention): softmax(scale * q k^T + pse + mask) v
  // over BSH/BSND/BNSD/TND/NTD/NSD, GQA, paged KV cache (block_table), MLA rope parts; returns
  // (attention_out, softmax_lse). Quantised and prefix/padding variants are rejected.
  m.def("npu_fused_infer_attention_score" OPENNPU_FIA_V1_ARGS " -> (Tensor, Tensor)");
  // The same into attention_out / softmax_lse (workspace unused).
  m.def("npu_fused_infer_attention_score.out(Tensor query, Tensor key, Tensor value, *, "
        "Tensor? pse_shift=None, Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, "
        "SymInt[]? actual_seq_lengths_kv=None, Tensor? dequant_scale1=None, "
        "Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? quant_scale2=None, "
        "Tensor? quant_offset2=None, Tensor? antiquant_scale=None, "
        "Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, "
        "Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, "
        "Tensor? value_antiquant_offset=None, Tensor? block_table=None, "
        "Tensor? query_padding_size=None, Tensor? kv_padding_size=None, "
        "Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, "
        "SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, "
        "Tensor? key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, "
        "float scale=1.0, int pre_tokens=2147483647, int next_tokens=2147483647, "
        "str input_layout=\"BSH\", int num_key_value_heads=0, int sparse_mode=0, "
        "int inner_precise=0, int block_size=0, int antiquant_mode=0, int key_antiquant_mode=0, "
        "int value_antiquant_mode=0, bool softmax_lse_flag=False, Tensor? workspace=None, "
        "Tensor(a!) attention_out, Tensor(b!) softmax_lse) -> (Tensor(a!), Tensor(b!))");
  // Workspace of npu_fused_infer_attention_score: empty uint8 (the CPU kernels need none).
  m.def("_npu_fused_infer_attention_score_get_max_workspace" OPENNPU_FIA_V1_ARGS " -> Tensor");
  // Empty outputs of npu_fused_infer_attention_score with their shapes and dtypes.
  m.def("_npu_fused_infer_attention_score_infer_output(Tensor query, Tensor value, *, "
        "str input_layout=\"BSH\", Tensor? quant_scale2=None, Tensor? block_table=None, "
        "int num_heads=1, int num_key_value_heads=0, bool softmax_lse_flag=False, "
        "Tensor? query_rope=None) -> (Tensor, Tensor)");
  // npu_fused_infer_attention_score with v2 names (actual_seq_qlen, softmax_scale, ...) and learnable_sink.
  m.def("npu_fused_infer_attention_score_v2" OPENNPU_FIA_V2_ARGS " -> (Tensor, Tensor)");
  // The same into attention_out / softmax_lse (workspace unused).
  m.def("npu_fused_infer_attention_score_v2.out(Tensor query, Tensor key, Tensor value, "
        "*, Tensor? query_rope=None, Tensor? key_rope=None, Tensor? pse_shift=None, "
        "Tensor? atten_mask=None, SymInt[]? actual_seq_qlen=None, "
        "SymInt[]? actual_seq_kvlen=None, Tensor? block_table=None, "
        "Tensor? dequant_scale_query=None, Tensor? dequant_scale_key=None, "
        "Tensor? dequant_offset_key=None, Tensor? dequant_scale_value=None, "
        "Tensor? dequant_offset_value=None, Tensor? dequant_scale_key_rope=None, "
        "Tensor? quant_scale_out=None, Tensor? quant_offset_out=None, "
        "Tensor? quant_scale_p=None, Tensor? learnable_sink=None, int num_query_heads=1, "
        "int num_key_value_heads=0, float softmax_scale=1.0, int pre_tokens=2147483647, "
        "int next_tokens=2147483647, str input_layout=\"BSH\", int sparse_mode=0, "
        "int block_size=0, int query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, "
        "int inner_precise=0, bool return_softmax_lse=False, int? query_dtype=None, "
        "int? key_dtype=None, int? value_dtype=None, int? query_rope_dtype=None, "
        "int? key_rope_dtype=None, int? key_shared_prefix_dtype=None, "
        "int? value_shared_prefix_dtype=None, int? dequant_scale_query_dtype=None, "
        "int? dequant_scale_key_dtype=None, int? dequant_scale_value_dtype=None, "
        "int? dequant_scale_key_rope_dtype=None, int? out_dtype=None, Tensor? workspace=None, "
        "Tensor(a!) attention_out, Tensor(b!) softmax_lse) -> (Tensor(a!), Tensor(b!))");
  // Workspace of npu_fused_infer_attention_score_v2: empty uint8 (the CPU kernels need none).
  m.def("_npu_fused_infer_attention_score_v2_get_max_workspace" OPENNPU_FIA_V2_ARGS " -> Tensor");
  // Empty outputs of npu_fused_infer_attention_score_v2 with their shapes and dtypes.
  m.def("_npu_fused_infer_attention_score_v2_infer_output(Tensor query, Tensor value, *, "
        "int? query_dtype=None, int? value_dtype=None, str input_layout=\"BSH\", "
        "Tensor? quant_scale_out=None, Tensor? block_table=None, int num_query_heads=1, "
        "int num_key_value_heads=0, bool return_softmax_lse=False, Tensor? query_rope=None, "
        "int? out_dtype=None) -> (Tensor, Tensor)");

  // FFN: act(x @ W1 + b1) @ W2 + b2, dense or with experts (rows split by expert_tokens counts or
  // expert_tokens_index cumulative ends), plus the int8 (scale, offset, deq_scale1/2) and
  // weight-only int8 (antiquant_scale/offset) paths. Inference only: no autograd formula.
  m.def("npu_ffn(Tensor x, Tensor weight1, Tensor weight2, str activation, *, int[]? expert_tokens=None, "
        "int[]? expert_tokens_index=None, Tensor? bias1=None, Tensor? bias2=None, Tensor? scale=None, "
        "Tensor? offset=None, Tensor? deq_scale1=None, Tensor? deq_scale2=None, "
        "Tensor? antiquant_scale1=None, Tensor? antiquant_scale2=None, Tensor? antiquant_offset1=None, "
        "Tensor? antiquant_offset2=None, int? inner_precise=None, ScalarType? output_dtype=None) -> Tensor");

  // Confusion transpose: transpose_first ? self.permute(perm).view(shape) : self.view(shape).permute(perm),
  // always a new contiguous tensor.
  m.def("npu_confusion_transpose(Tensor self, int[] perm, int[] shape, bool transpose_first) -> Tensor");
  // Gradient of npu_confusion_transpose: called with the input's shape and !transpose_first; returns `shape`.
  m.def("npu_confusion_transpose_backward(Tensor grad, int[] perm, SymInt[] shape, bool transpose_first) -> Tensor");

  // MoE gating: softmax over the last dim, then its top k (ties to the lower expert). Returns
  // (y in x's dtype, expert_idx int32 (num_experts where `finished`), row_idx int32 = j * rows + i).
  m.def("npu_moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1) -> (Tensor, Tensor, Tensor)");
  // Gating v2: renorm 0 = the top k of the float32 softmax (ranked unrounded), renorm 1 = the
  // softmax of the top k logits. Returns (y in x's dtype, expert_idx int32 (num_experts where
  // `finished`), the float32 softmax [x.shape] with renorm 0 and output_softmax, else empty [0]).
  m.def("npu_moe_gating_top_k_softmax_v2(Tensor x, *, int k=1, Tensor? finished=None, int? renorm=0, bool? output_softmax=False) -> (Tensor, Tensor, Tensor)");
  // MoE routing: stable sort of the (token, slot) pairs by expert. Returns (expanded_x
  // [min(active_num, N) * k, H], expanded_row_idx [N * k], expanded_expert_idx [N * k]).
  // active_num is SymInt (torch_npu says int) so torch.compile(dynamic=True) can pass the token
  // count without specialising on it.
  m.def("npu_moe_init_routing(Tensor x, Tensor row_idx, Tensor expert_idx, SymInt active_num) -> (Tensor, Tensor, Tensor)");
  // MoE routing v2: the stable expert sort of the pairs whose experts lie in active_expert_range
  // (default [0, expert_num)), dropless (the first active_num rows) or drop-pad ([expert_num,
  // expert_capacity, H]), optional int8 quantisation (quant_mode 0 static, 1 dynamic). Returns
  // (expanded_x, expanded_row_idx (expert_idx's dtype), tokens per expert (int64: cumsum,
  // counts or [expert_num, 2] (expert, count) pairs), expanded_scale float32).
  m.def("npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, int active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=-1, int[2] active_expert_range=[], int row_idx_type=0, int? x_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)");
  // Cumulative rows per expert ([num_expert], one past each expert's last row) of sorted experts.
  m.def("npu_moe_compute_expert_tokens(Tensor sorted_expert_for_source_row, int num_expert) -> Tensor");
  // MoE combine: out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] * (rows[src(i, k)] + bias[expert[i, k]]).
  // k: the slots per token when scales is None (num_rows = len(expanded_src_to_dst_row) / k).
  m.def("npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, "
        "Tensor? bias, Tensor? scales, Tensor expanded_src_to_dst_row, "
        "Tensor? export_for_source_row, int? drop_pad_mode=0, int? k=1) -> Tensor");
  // MoE dispatch (Megatron's permute): stable sort of the flattened indices [T] / [T, K] by
  // expert; returns (tokens[order[p] / K] for the first num_out_tokens positions p (> 0: at most
  // that many; <= 0: N + num_out_tokens; N = indices.numel()), sorted_indices int32 [N]: the
  // position each (token, slot) pair went to).
  m.def("npu_moe_token_permute(Tensor tokens, Tensor indices, int? num_out_tokens=None, bool padded_mode=False) -> (Tensor, Tensor)");
  // Gradient of npu_moe_token_permute: grad_tokens[t] = sum_k grad[sorted_indices[t * K + k]].
  m.def("npu_moe_token_permute_grad(Tensor tokens, Tensor grad_permuted_tokens, Tensor indices, Tensor sorted_indices, bool padded_mode=False) -> Tensor");
  // The same gradient from the sizes alone (tokens_size_0 SymInt for torch.compile(dynamic=True)).
  m.def("npu_moe_token_permute_grad_v2(Tensor grad_permuted_tokens, Tensor sorted_indices, SymInt tokens_size_0, ScalarType tokens_dtype, int num_topK, bool padded_mode=False) -> Tensor");
  // MoE combine: out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t * K + k]] (K =
  // probs.size(1), or 1 without probs); positions past permuted_tokens' rows count as dropped (0).
  m.def("npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs=None, bool padded_mode=False, int[]? restore_shape=None) -> Tensor");
  // Returns (grad_permuted_tokens, grad_probs: [T, K] in probs' dtype; 0-dim without probs).
  m.def("npu_moe_token_unpermute_grad(Tensor permuted_tokens, Tensor grad_unpermuted_tokens, Tensor sorted_indices, Tensor? probs=None, bool padded_mode=False, int[]? restore_shape=None) -> (Tensor, Tensor)");
  // The same from permuted_tokens' size and dtype; permuted_tokens itself only with probs.
  m.def("npu_moe_token_unpermute_grad_v2(Tensor grad_unpermuted_tokens, Tensor sorted_indices, SymInt permuted_tokens_size_0, ScalarType permuted_tokens_dtype, Tensor? probs=None, bool padded_mode=False, int[]? restore_shape=None, Tensor? permuted_tokens=None) -> (Tensor, Tensor)");
  // The routing-map forms ([T, E] map instead of top-k indices). Dropless: the routed pairs
  // expert-major (num_out_tokens rounded down to a multiple of T must be their count);
  // drop_and_pad: capacity = num_out_tokens / E slots per expert (routed tokens, then unrouted
  // ones). Returns (permuted_tokens, permuted_probs (empty [0] without probs), sorted_indices
  // int32: the row of each token-major pair, or each slot's token with drop_and_pad).
  m.def("npu_moe_token_permute_with_routing_map(Tensor tokens, Tensor routing_map, *, Tensor? probs=None, int? num_out_tokens=None, bool drop_and_pad=False) -> (Tensor, Tensor, Tensor)");
  // Returns (tokens_grad [T, H], probs_grad [T, E] (empty [0] without probs_grad)).
  m.def("npu_moe_token_permute_with_routing_map_grad(Tensor permuted_token_out_grad, Tensor? probs_grad, Tensor sorted_indices, Tensor routing_map, SymInt experts_num, SymInt tokens_num, bool drop_and_pad) -> (Tensor, Tensor)");
  // out [restore_shape] = per token, the sum of its permuted rows weighted by probs[token, expert].
  m.def("npu_moe_token_unpermute_with_routing_map(Tensor permuted_tokens, Tensor sorted_indices, int[] restore_shape, *, Tensor? probs=None, Tensor? routing_map=None, bool drop_and_pad=False) -> Tensor");
  // The same with what its gradient takes: (out, out_index, permuted_token_id, permute_probs).
  m.def("_npu_moe_token_unpermute_with_routing_map(Tensor permuted_tokens, Tensor sorted_indices, int[] restore_shape, *, Tensor? probs=None, Tensor? routing_map=None, bool drop_and_pad=False) -> (Tensor, Tensor, Tensor, Tensor)");
  // Returns (permuted_tokens_grad, probs_grad [T, E] in the gradient's dtype; [0] without probs).
  m.def("npu_moe_token_unpermute_with_routing_map_grad(Tensor unpermuted_tokens_grad, Tensor out_index, Tensor permuted_token_id, Tensor? routing_map, Tensor? permuted_tokens, Tensor? probs, bool drop_and_pad, int[] restore_shape) -> (Tensor, Tensor)");
  // Grouped matmul y_g = x_g @ w_g (+ b_g): groups as separate tensors or row ranges of one x
  // (group_list, a Tensor here and int[] in .List). Non-quantised paths only. output_dtype and
  // the *_dtype arguments are dtype codes (int; a torch.dtype passed from Python arrives as its
  // ScalarType number); .List keeps ScalarType? output_dtype, as op-plugin's yaml does.
  m.def("npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, "
        "Tensor[]? scale=None, Tensor[]? offset=None, Tensor[]? antiquant_scale=None, "
        "Tensor[]? antiquant_offset=None, Tensor[]? per_token_scale=None, Tensor? group_list=None, "
        "Tensor[]? activation_input=None, Tensor[]? activation_quant_scale=None, "
        "Tensor[]? activation_quant_offset=None, int? split_item=0, int? group_type=None, "
        "int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
        "int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, "
        "int? per_token_scale_dtype=None) -> Tensor[]");
  m.def("npu_grouped_matmul.List(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, "
        "Tensor[]? scale=None, Tensor[]? offset=None, Tensor[]? antiquant_scale=None, "
        "Tensor[]? antiquant_offset=None, Tensor[]? per_token_scale=None, int[]? group_list=None, "
        "Tensor[]? activation_input=None, Tensor[]? activation_quant_scale=None, "
        "Tensor[]? activation_quant_offset=None, int? split_item=0, int? group_type=None, "
        "int? group_list_type=0, int? act_type=0, ScalarType? output_dtype=None) -> Tensor[]");

  // ScatterNdUpdate: self[indices[i]] = updates[i], indices [..., a] addressing self's first a
  // dims; a copy of self, or self itself (_). Repeated indices: the last update wins.
  m.def("npu_scatter_nd_update(Tensor self, Tensor indices, Tensor updates) -> Tensor");
  m.def("npu_scatter_nd_update_(Tensor(a!) self, Tensor indices, Tensor updates) -> Tensor(a!)");
  // Paged KV cache write: token t's key / value row to slot slot_mapping[t] (block slot //
  // block_size, offset slot % block_size; negative = skip) of caches in 'Norm' [blocks,
  // block_size, ...] or 'PA_NZ' [blocks, H / last, block_size, last] layout.
  m.def("npu_scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, *, Tensor? compress_lens=None, Tensor? compress_seq_offsets=None, "
        "Tensor? seq_lens=None, str? cache_mode='PA_NZ') -> ()");
  // The same into copies of the caches, returned.
  m.def("npu_scatter_pa_kv_cache_functional(Tensor key, Tensor value, Tensor key_cache, Tensor value_cache, "
        "Tensor slot_mapping, *, Tensor? compress_lens=None, Tensor? compress_seq_offsets=None, "
        "Tensor? seq_lens=None, str? cache_mode='PA_NZ') -> (Tensor, Tensor)");
  // Paged KV cache read: the seq_lens[i] tokens of each sequence through its block_tables row
  // (from block seq_offset[i] // block_size) into consecutive rows of key / value.
  m.def("npu_gather_pa_kv_cache(Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor(a!) key, Tensor(b!) value, *, Tensor? seq_offset=None, bool is_seq_lens_cumsum=False) -> ()");
  // The same into copies of key / value, returned.
  m.def("npu_gather_pa_kv_cache_functional(Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor key, Tensor value, *, Tensor? seq_offset=None, "
        "bool is_seq_lens_cumsum=False) -> (Tensor, Tensor)");

  // Token filter (ApplyTopKTopP): per row, values below the k[b]-th largest and, of the rest, the
  // low tail whose softmax mass is <= 1 - p[b] become -inf (vLLM's apply_top_k_top_p).
  m.def("npu_top_k_top_p(Tensor logits, Tensor? p=None, Tensor? k=None) -> Tensor");
  // Top-k / top-p / min-p filters, then argmax, qSample (argmax prob / (|q| + eps)) or a
  // multinomial draw: returns (token index [B] int64, the kept logits [B, V] fp32 or empty).
  m.def("npu_top_k_top_p_sample(Tensor logits, Tensor top_k, Tensor top_p, Tensor? q=None, "
        "float? eps=1e-8, bool? is_need_logits=False, int? top_k_guess=32, Tensor? min_ps=None, "
        "int? ks_max=1024, bool? input_is_logits=True, str? post_sample='qSample', "
        "Generator? generator=None) -> (Tensor, Tensor)");
}

// torch_npu's ATB ops (op-plugin op_plugin/ops/atb/*.cpp, TORCH_LIBRARY_FRAGMENT(atb, m)), the
// namespace vllm-ascend reaches through torch_npu._npu_* and torch_npu.atb.*. Kernels:
// csrc/ops/atb/atb.cpp (on the kvcache, attention and rotary families' kernels).
TORCH_LIBRARY(atb, m) {
  // vLLM's reshape_and_cache: key[t] / value[t] ([T, kv_heads, D]) into slot slot_indices[t]
  // (block slot // block_size, offset slot % block_size; negative: skip) of the paged caches.
  m.def("_npu_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_indices) -> ()");
  // The same for a key cache alone.
  m.def("_npu_reshape_and_cache_siso(Tensor key, Tensor(a!) key_cache, Tensor slot_indices) -> ()");
  // Decode attention: query row t against the context_lens[t] keys / values its block_table row
  // addresses in the paged caches (GQA), softmax(scale * q k^T) v into out [T, N, Dv].
  m.def("_npu_paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads, "
        "int num_heads, float scale_value, Tensor block_table, Tensor context_lens, Tensor(a!) out, "
        "*,Tensor? workspace=None) -> ()");
  // The workspace _npu_paged_attention may take (empty here: the CPU kernel needs none).
  m.def("_npu_paged_attention_get_workspace(Tensor query, Tensor key_cache, Tensor value_cache, "
        "int num_kv_heads, int num_heads, float scale_value, Tensor block_table, Tensor context_lens, "
        "Tensor(a!) out) -> Tensor");
  // Prefill attention over sequences packed along tokens (seq_len), additive mask, GQA, into out.
  m.def("_npu_flash_attention(Tensor query, Tensor key, Tensor value, Tensor mask, Tensor seq_len, "
        "float scale_value, int num_heads, int num_kv_heads, Tensor(a!) out) -> ()");
  // vLLM's rotary_embedding in place on query / key (cos | sin cache rows at positions).
  m.def("_npu_rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, int head_size, "
        "Tensor cos_sin_cache, bool is_neox_style) -> ()");
  // Paged cache read: each sequence's context_lens tokens (from block seq_starts // block_size)
  // into consecutive rows of key / value.
  m.def("npu_paged_cache_load.out(Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor context_lens, *, Tensor? seq_starts=None, bool cumsum=False, Tensor(a!) key, "
        "Tensor(b!) value) -> (Tensor(a!), Tensor(b!))");
  // The same into new [tokens, heads, D] tensors.
  m.def("npu_paged_cache_load(Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor context_lens, *, Tensor? seq_starts=None, bool cumsum=False) -> (Tensor, Tensor)");
}

// opennpu's own helpers, outside the torch_npu namespace.
TORCH_LIBRARY(opennpu, m) {
  // Fused optimizer steps (csrc/ops/optim), the engine of opennpu.optim / torch_npu.optim. Each
  // call updates the parameters of one param group, of any mix of dtypes, in one multi-threaded
  // pass: params[i] with its state tensors at index i; gradients are read from params[i].grad and
  // parameters without one are skipped. state_steps are float32 counters, incremented here.
  // grad_scale multiplies every gradient as it is read (AMP unscaling fused into the step).
  m.def("_fused_adam_(Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] state_steps, *, float lr, float beta1, "
        "float beta2, float weight_decay, float eps, bool amsgrad, bool maximize, "
        "bool decoupled_weight_decay, float grad_scale=1.) -> ()");
  // fresh_buffers: indices whose momentum buffer is new (set to the gradient, not decayed).
  m.def("_fused_sgd_(Tensor(a!)[] params, Tensor(b!)[] momentum_buffers, int[] fresh_buffers, *, "
        "float lr, float momentum, float dampening, float weight_decay, bool nesterov, "
        "bool maximize, float grad_scale=1.) -> ()");
  // torch.optim.RMSprop, or with tf_style=True NpuFusedRMSpropTF's TF/timm variant.
  m.def("_fused_rmsprop_(Tensor(a!)[] params, Tensor(b!)[] square_avgs, Tensor(c!)[] grad_avgs, "
        "Tensor(d!)[] momentum_buffers, Tensor(e!)[] state_steps, *, float lr, float alpha, "
        "float eps, float weight_decay, float momentum, bool centered, bool maximize, "
        "bool tf_style=False, bool lr_in_momentum=False, bool decoupled_decay=False, "
        "float grad_scale=1.) -> ()");
  m.def("_fused_adadelta_(Tensor(a!)[] params, Tensor(b!)[] square_avgs, "
        "Tensor(c!)[] acc_deltas, Tensor(d!)[] state_steps, *, float lr, float rho, float eps, "
        "float weight_decay, bool maximize, float grad_scale=1.) -> ()");
  // LAMB with per-tensor trust ratios (two passes), or plain (use_trust_ratio=False, one pass).
  m.def("_fused_lamb_(Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] state_steps, *, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, bool use_trust_ratio, float grad_scale=1.) -> ()");
  m.def("_fused_bert_adam_(Tensor(a!)[] params, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] state_steps, *, float lr, float beta1, "
        "float beta2, float eps, float weight_decay, float max_grad_norm, str schedule, "
        "float warmup, float t_total, float grad_scale=1.) -> ()");
  m.def("_fused_adamp_(Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] state_steps, *, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, float delta, float wd_ratio, bool nesterov, "
        "float grad_scale=1.) -> ()");
  // silu(gate) * up over two tensors of one shape and dtype (npu_swiglu with its halves apart),
  // and its gradients (d gate, d up): the compile backend's fusion of Llama's MLP activation.
  m.def("_silu_mul(Tensor gate, Tensor up) -> Tensor");
  // npu_add_rms_norm writing the sum into x2's buffer (x2 <- x1 + x2); returns (y, rstd). The
  // compile backend's rewrite of npu_add_rms_norm where x2 is an intermediate nothing reads after.
  m.def("_add_rms_norm_inplace(Tensor x1, Tensor(a!) x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)");
  m.def("_silu_mul_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  // F.linear(input, weight, bias), for the compile backend's float32 linears on CPU: oneDNN where
  // it beats MKL's sgemm (ops/linear), else aten::linear.
  m.def("_linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor");
  // npu_rotary_mul_backward's dx alone, for the usual case of r1/r2 without gradients (autograd
  // calls it then): no dr1/dr2 reductions, and self is only checked, never read.
  m.def("_rotary_mul_backward_dx(Tensor grad, Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor");
  // An uninitialised CPU buffer for packed optimizer states, on huge pages where Linux allows.
  // (CompositeExplicitAutograd kernel in ops/optim/optim.cpp: it takes no tensor to dispatch on.)
  m.def("_state_buffer(int numel, ScalarType dtype) -> Tensor");
  // The norm of all of params' gradients as one vector (float32 0-dim; inf = max |g|).
  m.def("_fused_grad_norm(Tensor[] params, float norm_type=2.) -> Tensor");
  // params[i].grad *= scale.
  m.def("_fused_scale_grads_(Tensor(a!)[] params, float scale) -> ()");
  // GradScaler.unscale_ in one pass: grads *= inv_scale; found_inf = 1 if any is inf or NaN.
  m.def("_fused_unscale_grads_(Tensor(a!)[] params, Tensor(b!) found_inf, Tensor inv_scale) -> ()");

  // dst <- src byte for byte with non-temporal stores (contiguous, same shape and dtype): the
  // benchmark harness's streaming-copy memory roof (ops/transpose).
  m.def("_stream_copy_(Tensor(a!) self, Tensor src) -> Tensor(a!)");

  // The CUDA routing of npu_fused_infer_attention_score and _v2 (ops/attention/
  // infer_attention_cuda.cu): a decode call runs the C++ entry point with the CUDA decode kernel
  // (_fia_decode / _fia_v2_decode), every other call the portable composition (_fia_portable /
  // _fia_v2_portable, src/opennpu/ops/portable.py). Internal: the npu op's CUDA kernel passes
  // them its call's arguments, with the query's device current.
  m.def("_fia_decode" OPENNPU_FIA_V1_ARGS " -> (Tensor, Tensor)");
  m.def("_fia_portable" OPENNPU_FIA_V1_ARGS " -> (Tensor, Tensor)");
  m.def("_fia_v2_decode" OPENNPU_FIA_V2_ARGS " -> (Tensor, Tensor)");
  m.def("_fia_v2_portable" OPENNPU_FIA_V2_ARGS " -> (Tensor, Tensor)");
  // The streaming-store policy (common/stream_store.h): the last-level cache size found, and the
  // output size from which kernels stream (setting < 0 restores the default; returns the old one).
  m.def("_last_level_cache_bytes() -> int", []() { return opennpu::last_level_cache_bytes(); });
  m.def("_set_stream_min_bytes(int bytes) -> int",
        [](int64_t bytes) { return opennpu::set_stream_min_bytes(bytes); });

  // Strict mode: also enforce the documented Ascend limits (shapes, dtypes, ranks).
  m.def("set_strict(bool enabled) -> ()", [](bool enabled) { opennpu::set_strict_mode(enabled); });
  m.def("is_strict() -> bool", []() { return opennpu::strict_mode(); });
  // The instruction set the CPU kernels run with ("AVX512", "AVX2" or "DEFAULT").
  m.def("cpu_isa() -> str", []() { return std::string(opennpu::cpu_isa_name(opennpu::cpu_isa())); });
  // The CPU GEMM policy for dtype's products (common/half_gemm.h, OPENNPU_HALF_GEMM): "fp32"
  // where fp16 / bf16 operands are multiplied as fp32 copies, else "native".
  m.def("half_gemm(ScalarType dtype) -> str", [](at::ScalarType dtype) {
    return std::string(opennpu::half_gemm_in_fp32(dtype) ? "fp32" : "native");
  });
  // The Philox generator of fused ops with dropout: seed, and (seed, offset) of the next draw.
  m.def("manual_seed(int seed) -> ()", [](int64_t seed) { opennpu::manual_seed(static_cast<uint64_t>(seed)); });
  m.def("initial_seed() -> int", []() { return static_cast<int64_t>(opennpu::initial_seed()); });
  m.def("get_rng_state() -> int[]", []() {
    const auto [seed, offset] = opennpu::rng_state();
    return std::vector<int64_t>{static_cast<int64_t>(seed), static_cast<int64_t>(offset)};
  });
  m.def("set_rng_state(int seed, int offset) -> ()", [](int64_t seed, int64_t offset) {
    opennpu::set_rng_state(static_cast<uint64_t>(seed), static_cast<uint64_t>(offset));
  });
}
