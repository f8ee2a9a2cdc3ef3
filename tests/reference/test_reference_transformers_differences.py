"""Where transformers departs from the official reference (SPEC §8), shown rather than copied.

dsv4 follows the official inference code; these tests document each difference with a measurement, so a
future transformers release that changes behaviour shows up here.
"""


import pytest
import torch

import dsv4
from dsv4.config import LayerKind

pytest.importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf  # noqa: E402
from support.hf import hf_config, random_hf_attention  # noqa: E402

TINY = dsv4.ModelConfig.preset("tiny")


def _rotate_f64(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    # The angle as the reference forms it (FP32 product), everything after it in FP64.
    ang = (pos.float()[:, None] * inv_freq.float()[None, :]).double()[:, None, :]
    u = x[..., -64:].double().unflatten(-1, (32, 2))
    re, im = u[..., 0], u[..., 1]
    rot = torch.stack((re * ang.cos() - im * ang.sin(), re * ang.sin() + im * ang.cos()), -1).flatten(-2)
    return torch.cat((x[..., :-64].double(), rot), -1)


def test_hf_rounds_cos_sin_to_bf16() -> None:
    """SPEC §8.3: transformers casts cos/sin to the activation dtype (BF16) before rotating; the reference keeps
    them in FP32. dsv4's BF16 output is within one BF16 rounding of the FP64 rotation (relative norm error below
    2^-9); transformers' is not, and the two disagree on a large fraction of rope elements."""
    torch.manual_seed(0)
    cfg = hf_config(TINY)
    rotary = hf.DeepseekV4RotaryEmbedding(cfg)
    pos = torch.arange(60000, 60064)
    x = torch.randn(64, 1, 512).to(torch.bfloat16)  # [S, heads, D]
    cos, sin = rotary(x, pos[None], layer_type="main")
    theirs = hf.apply_rotary_pos_emb(x.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
    inv = dsv4.reference.rope_inv_freq(TINY, LayerKind.SWA)
    ours = dsv4.reference.apply_rope(x, pos, inv)
    exact = _rotate_f64(x, pos, inv)
    err = lambda a: ((a.double() - exact)[..., -64:].norm() / exact[..., -64:].norm()).item()  # noqa: E731
    assert err(ours) < 2**-9 < err(theirs)
    assert (ours != theirs)[..., -64:].float().mean().item() > 0.1  # of the rope elements


def test_hf_compressor_pools_in_model_dtype() -> None:
    """SPEC §8.2: transformers runs the compressor projections and the weighted sum in the model dtype (BF16);
    the reference projects and pools in FP32 and rounds once. In BF16, transformers' HCA entries are measurably
    further from an FP64 computation than dsv4's official path."""
    li = 2  # HCA
    module = random_hf_attention(TINY, li, seed=0)
    w = dsv4.AttentionWeights.from_hf_module(module)
    x = torch.randn(64, TINY.hidden_size).to(torch.bfloat16)
    comp = module.compressor.to(torch.bfloat16)
    pos = torch.arange(64)[None]
    with torch.no_grad():
        theirs, _ = comp(x[None], None, pos, None, li)
    theirs = theirs[0, 0].float()  # [n, D]
    inv = dsv4.reference.rope_inv_freq(TINY, LayerKind.HCA)
    ours = dsv4.reference.compress(x, w.compressor, False, inv, TINY.norm_eps, torch.bfloat16).float()
    w64 = dsv4.AttentionWeights.from_hf_module(module).to(dtype=torch.float64)
    exact = dsv4.reference.compress(x.double(), w64.compressor, False, inv, TINY.norm_eps, torch.float64)
    err = lambda a: ((a.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert err(ours) < 2 ** -8
    assert err(theirs) > 1.5 * err(ours)
