"""A randomly initialised transformers ``DeepseekV4ForCausalLM`` of a dsv4 ``ModelConfig``'s attention geometry.

For examples, tests and benchmarks without a checkpoint. transformers' own initialisation (N(0, 0.02), zero sinks
and position biases) leaves the attention nearly uniform and the logits nearly flat; here the attention weights
get realistic scales (projections N(0, 1/fan_in), norm weights near 1, sinks and position biases O(1)), the
embeddings unit scale and the output head logits of std ~3, so that generated tokens depend on the context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..config import ModelConfig

__all__ = ["left_padded_prompts", "random_causal_lm"]


def random_causal_lm(
    cfg: ModelConfig,
    seed: int = 0,
    *,
    vocab_size: int = 128,
    experts: int = 4,
    expert_dim: int = 32,
    hc_mult: int = 2,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    **config_changes: Any,
):
    """A ``DeepseekV4ForCausalLM`` (eval mode, eager attention) whose main layers have ``cfg``'s attention.

    Args:
        cfg: attention geometry and layer pattern (``cfg.to_hf_dict()``; MTP blocks are not built).
        seed: weights are a function of it (drawn on ``device``).
        vocab_size, experts (2 active per token), expert_dim, hc_mult: the parts dsv4 does not serve, kept small.
        dtype, device: where the model lives.
        config_changes: further ``DeepseekV4Config`` fields.
    Token ids: pad 0, bos 2, no EOS (``generate()`` runs to its length unless given ``eos_token_id``).
    """
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    d = cfg.to_hf_dict()
    d.update(vocab_size=vocab_size, n_routed_experts=experts, num_experts_per_tok=min(2, experts),
             moe_intermediate_size=expert_dim, hc_mult=hc_mult, pad_token_id=0, eos_token_id=None, bos_token_id=2)
    d.update(config_changes)
    hc = DeepseekV4Config(**d)
    hc._attn_implementation = "eager"
    torch.manual_seed(seed)
    with torch.device(device):
        model = DeepseekV4ForCausalLM(hc)
    g = torch.Generator(device=device).manual_seed(seed)

    def randn_like(p: torch.Tensor) -> torch.Tensor:
        return torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32).to(p.dtype)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".self_attn." not in name:
                continue
            if p.dim() == 2 and "position_bias" not in name:
                p.copy_(randn_like(p) * p.shape[1] ** -0.5)
            elif "position_bias" in name:
                p.copy_(0.5 * randn_like(p))
            elif "sinks" in name:
                p.copy_(randn_like(p) + 1.0)
            else:  # norm weights
                p.copy_(1.0 + 0.1 * randn_like(p))
        model.model.embed_tokens.weight.copy_(randn_like(model.model.embed_tokens.weight))
        model.lm_head.weight.copy_(randn_like(model.lm_head.weight) * 3 * cfg.hidden_size**-0.5)
    model.generation_config.eos_token_id = None
    return model.to(dtype).eval()


def left_padded_prompts(lengths: Sequence[int], vocab: int, generator: torch.Generator,
                        device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of random prompts of ``lengths`` tokens, left-padded as ``generate()`` takes them.

    Token ids are drawn row by row from ``[3, vocab)`` (``torch.randint`` with ``generator``; ids 0–2 stay free for
    special tokens). Returns int64 ``input_ids`` ``[B, max(lengths)]`` (0 in the padding) and the matching
    ``attention_mask`` (1 on real tokens), on ``device``."""
    L = max(lengths)
    ids = torch.zeros(len(lengths), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, L - n:] = torch.randint(3, vocab, (n,), generator=generator)
        mask[b, L - n:] = 1
    return ids.to(device), mask.to(device)
