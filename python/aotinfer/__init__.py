"""aotinfer: ahead-of-time compiled CUDA kernels for LLM inference, with FlashInfer's Python API.

Importing is cheap and side-effect free: no CUDA call, no torch import and no shared object
loaded. Each op loads the build of its kernel module that matches the input's GPU on first use
(see _loader.py). aotinfer's torch custom ops (torch.ops.aotinfer.*) are defined as soon as torch
and aotinfer are both imported, in either order (see _kernels.py).
"""

from . import _kernels as _kernels
from ._arch import NoCompatibleBuild
from ._version import __version__
from .activation import gelu_and_mul, gelu_tanh_and_mul, silu_and_mul
from .cascade import MultiLevelCascadeAttentionWrapper, merge_state, merge_state_in_place, merge_states
from .decode import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    fast_decode_plan,
    single_decode_with_kv_cache,
)
from .norm import fused_add_rmsnorm, gemma_fused_add_rmsnorm, gemma_rmsnorm, layernorm, rmsnorm
from .norm_quant import fused_add_rmsnorm_quant, layernorm_quant, rmsnorm_quant
from .mla import BatchMLAPagedAttentionWrapper
from .page import append_paged_kv_cache, append_paged_mla_kv_cache, get_batch_indices_positions, get_seq_lens
from .prefill import (
    BatchAttentionWithAttentionSinkWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    single_prefill_with_kv_cache,
    single_prefill_with_kv_cache_return_lse,
)
from .quantization import packbits, segment_packbits
from .rope import (
    apply_llama31_rope,
    apply_llama31_rope_inplace,
    apply_llama31_rope_pos_ids,
    apply_llama31_rope_pos_ids_inplace,
    apply_rope,
    apply_rope_inplace,
    apply_rope_pos_ids,
    apply_rope_pos_ids_inplace,
    apply_rope_with_cos_sin_cache,
    apply_rope_with_cos_sin_cache_inplace,
    mla_rope_quantize_fp8,
    rope_quantize_fp8,
)
from .sampling import (
    chain_speculative_sampling,
    min_p_sampling_from_probs,
    sampling_from_logits,
    sampling_from_probs,
    softmax,
    top_k_mask_logits,
    top_k_renorm_probs,
    top_k_sampling_from_probs,
    top_k_top_p_sampling_from_logits,
    top_k_top_p_sampling_from_probs,
    top_p_renorm_probs,
    top_p_sampling_from_probs,
)
from .scale import scale
from .utils import BackendSupportedError

__all__ = [
    "BackendSupportedError",
    "BatchAttentionWithAttentionSinkWrapper",
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchMLAPagedAttentionWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper",
    "NoCompatibleBuild",
    "__version__",
    "append_paged_kv_cache",
    "append_paged_mla_kv_cache",
    "apply_llama31_rope",
    "apply_llama31_rope_inplace",
    "apply_llama31_rope_pos_ids",
    "apply_llama31_rope_pos_ids_inplace",
    "apply_rope",
    "apply_rope_inplace",
    "apply_rope_pos_ids",
    "apply_rope_pos_ids_inplace",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "chain_speculative_sampling",
    "fast_decode_plan",
    "fused_add_rmsnorm",
    "fused_add_rmsnorm_quant",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm",
    "get_batch_indices_positions",
    "get_seq_lens",
    "layernorm",
    "layernorm_quant",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "min_p_sampling_from_probs",
    "mla_rope_quantize_fp8",
    "packbits",
    "rmsnorm",
    "rmsnorm_quant",
    "rope_quantize_fp8",
    "sampling_from_logits",
    "sampling_from_probs",
    "scale",
    "segment_packbits",
    "silu_and_mul",
    "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "softmax",
    "top_k_mask_logits",
    "top_k_renorm_probs",
    "top_k_sampling_from_probs",
    "top_k_top_p_sampling_from_logits",
    "top_k_top_p_sampling_from_probs",
    "top_p_renorm_probs",
    "top_p_sampling_from_probs",
]

_kernels.on_aotinfer_imported()
