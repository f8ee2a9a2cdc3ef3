"""Bit-exact storage codecs for DeepSeek-V4 attention (plain torch, any device).

Formats:

* FP8 E4M3, block 64, UE8M0 power-of-two scales (official KV format, SPEC §2.4): ``quantize_fp8_block`` & co.
* FP8 E4M3 per token with an fp32 scale (the seeds' format): ``quantize_fp8_per_token`` & co.
* FP8 E4M3 indexer key with one fp32 scale per 128 values (vLLM's default): ``quantize_fp8_key`` & co.
* MXFP4: E2M1, block 32, UE8M0 scales with the ceil rule (official indexer format): ``quantize_mxfp4`` & co.
* NVFP4: E2M1, block 16, E4M3 scales (the seeds' indexer format, sign kept): ``quantize_nvfp4`` & co.
* Normalized Sylvester Walsh-Hadamard transform (indexer q/k): ``hadamard_transform``.
* Byte layouts (SPEC §7.2, §11): 584-B KV entry and page, 68-B MXFP4 key and page, 132-B FP8 key.
"""

from .fp4 import (E2M1_MAX, E2M1_VALUES, MXFP4_AMAX_FLOOR, NVFP4_SCALE_FLOOR, dequantize_mxfp4, dequantize_nvfp4,
                  e2m1_decode, e2m1_encode, pack_nibbles, qdq_mxfp4, qdq_nvfp4, quantize_mxfp4, quantize_nvfp4,
                  unpack_nibbles)
from .fp8 import (E4M3_MAX, FP8_BLOCK_AMAX_FLOOR, FP8_KEY_AMAX_FLOOR, FP8_PER_TOKEN_AMAX_FLOOR, dequantize_fp8_block,
                  dequantize_fp8_key, dequantize_fp8_per_token, e4m3_decode, e4m3_encode, pow2_from_exponent,
                  pow2_scale, qdq_fp8_block, qdq_fp8_key, qdq_fp8_per_token, quantize_fp8_block, quantize_fp8_key,
                  quantize_fp8_per_token, ue8m0_decode, ue8m0_encode, ue8m0_exponent)
from .hadamard import hadamard_matrix, hadamard_transform
from .layouts import (FP8_KEY_BYTES, INDEXER_KEY_DIM, KV_DATA_BYTES, KV_DIM, KV_ENTRY_BYTES, KV_FP8_BLOCK,
                      KV_NOPE_DIM, KV_ROPE_DIM, KV_SCALE_BYTES, MXFP4_KEY_BYTES, decode_fp8_keys, decode_kv_entries,
                      decode_mxfp4_keys, encode_fp8_keys, encode_kv_entries, encode_mxfp4_keys, kv_page_bytes,
                      kv_page_views, mxfp4_page_bytes, mxfp4_page_views)

__all__ = [
    # fp8
    "E4M3_MAX", "FP8_BLOCK_AMAX_FLOOR", "FP8_PER_TOKEN_AMAX_FLOOR", "FP8_KEY_AMAX_FLOOR",
    "ue8m0_exponent", "pow2_from_exponent", "pow2_scale", "ue8m0_encode", "ue8m0_decode",
    "e4m3_encode", "e4m3_decode",
    "quantize_fp8_block", "dequantize_fp8_block", "qdq_fp8_block",
    "quantize_fp8_per_token", "dequantize_fp8_per_token", "qdq_fp8_per_token",
    "quantize_fp8_key", "dequantize_fp8_key", "qdq_fp8_key",
    # fp4
    "E2M1_MAX", "E2M1_VALUES", "MXFP4_AMAX_FLOOR", "NVFP4_SCALE_FLOOR",
    "e2m1_encode", "e2m1_decode", "pack_nibbles", "unpack_nibbles",
    "quantize_mxfp4", "dequantize_mxfp4", "qdq_mxfp4",
    "quantize_nvfp4", "dequantize_nvfp4", "qdq_nvfp4",
    # hadamard
    "hadamard_matrix", "hadamard_transform",
    # layouts
    "KV_NOPE_DIM", "KV_ROPE_DIM", "KV_DIM", "KV_DATA_BYTES", "KV_SCALE_BYTES", "KV_ENTRY_BYTES", "KV_FP8_BLOCK",
    "INDEXER_KEY_DIM", "MXFP4_KEY_BYTES", "FP8_KEY_BYTES",
    "kv_page_bytes", "encode_kv_entries", "decode_kv_entries", "kv_page_views",
    "encode_mxfp4_keys", "decode_mxfp4_keys", "mxfp4_page_bytes", "mxfp4_page_views",
    "encode_fp8_keys", "decode_fp8_keys",
]
