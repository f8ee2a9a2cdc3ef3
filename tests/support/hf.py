"""Helpers to build and run ``transformers``' DeepSeek-V4 attention and a tiny causal LM next to dsv4 (test-only
dependency)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

import dsv4


def hf_config(cfg: dsv4.ModelConfig):
    from transformers import DeepseekV4Config

    hc = DeepseekV4Config(**cfg.to_hf_dict())
    hc._attn_implementation = "eager"
    return hc


def random_hf_attention(cfg: dsv4.ModelConfig, layer_idx: int, seed: int):
    """A transformers DeepseekV4Attention (FP32) with freshly drawn weights at realistic scales."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    torch.manual_seed(seed)
    module = DeepseekV4Attention(hf_config(cfg), layer_idx).float().eval()
    realistic_attention_weights(module.named_parameters())
    return module


def tiny_causal_lm(seed: int = 0):
    """A tiny transformers DeepseekV4ForCausalLM (the ``tiny`` preset's attention, FP32) with realistic-scale
    attention weights (MoE kept tiny)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    d = dsv4.ModelConfig.preset("tiny").to_hf_dict()
    d.update(vocab_size=32, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=16)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**d)).float().eval()
    realistic_attention_weights((n, p) for n, p in model.named_parameters() if ".self_attn." in n)
    return model


def realistic_attention_weights(params: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
    """Draw the attention parameters ``params`` (name, parameter) afresh from torch's global generator at the
    scales of a trained model: matrices N(0, 1/fan_in), position biases N(0, 0.25), sinks N(1, 1), norm weights
    N(1, 0.01)."""
    with torch.no_grad():
        for name, p in params:
            if p.dim() == 2:
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
            elif "position_bias" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif "sinks" in name:
                p.copy_(torch.randn_like(p) + 1.0)
            else:  # norm weights
                p.copy_(1.0 + 0.1 * torch.randn_like(p))


def run_hf_attention(module, cfg: dsv4.ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """Eager, no cache, positions 0..S-1, sliding-window causal mask. ``x``: [S, d] → [S, d]."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    S = x.shape[0]
    hidden = x[None].to(torch.float32)
    position_ids = torch.arange(S)[None]
    rotary = DeepseekV4RotaryEmbedding(module.config)
    pe = {t: rotary(hidden, position_ids, layer_type=t) for t in ("main", "compress")}
    i = torch.arange(S)[:, None]
    j = torch.arange(S)[None, :]
    allowed = (j <= i) & (j > i - cfg.window)
    mask = torch.zeros(S, S).masked_fill(~allowed, float("-inf"))[None, None]
    with torch.no_grad():
        out, _ = module(hidden, pe, position_ids, mask, past_key_values=None)
    return out[0]
