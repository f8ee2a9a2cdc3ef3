"""The reference in official numerics: every attended key is exactly representable in the storage formats."""

import math

import pytest
import torch

import dsv4
from dsv4 import formats
from dsv4.config import LayerKind

TINY = dsv4.ModelConfig.preset("tiny")


@pytest.mark.parametrize("layer_idx", [0, 1, 2], ids=["swa", "csa", "hca"])
@pytest.mark.parametrize("S", [5, 37, 70])
def test_keys_fit_the_584B_and_68B_formats(layer_idx: int, S: int) -> None:
    w = dsv4.AttentionWeights.random(TINY, layer_idx, seed=S)
    x = torch.randn(S, TINY.hidden_size, generator=torch.Generator().manual_seed(S + 1))
    res = dsv4.reference.forward(w, TINY, layer_idx, x, numerics="official")
    assert res.y.dtype == torch.bfloat16 and torch.isfinite(res.y).all()

    for keys in (res.kv, res.entries):  # window entries and compressed entries
        if keys.shape[0] == 0:
            continue
        data, scales = formats.encode_kv_entries(keys.float())
        assert data.shape[-1] + scales.shape[-1] == formats.KV_ENTRY_BYTES == 584
        assert torch.equal(formats.decode_kv_entries(data, scales), keys.float())

    if TINY.layer_kind(layer_idx) is LayerKind.CSA:
        n = S // TINY.csa_ratio
        assert res.index_keys.shape == (n, TINY.index_head_dim)
        packed = formats.encode_mxfp4_keys(res.index_keys)
        assert packed.shape[-1] == formats.MXFP4_KEY_BYTES == 68
        assert torch.equal(formats.decode_mxfp4_keys(packed), res.index_keys)
        assert torch.equal(formats.decode_mxfp4_keys(formats.encode_mxfp4_keys(res.index_q)), res.index_q)
        assert res.index_scores.dtype == torch.bfloat16


def test_exact_numerics_do_not_round() -> None:
    """Control for the test above: FP32 entries are (almost surely) not on the FP8 grid."""
    w = dsv4.AttentionWeights.random(TINY, 2, seed=0)
    x = torch.randn(40, TINY.hidden_size)
    res = dsv4.reference.forward(w, TINY, 2, x, numerics="exact")
    data, scales = formats.encode_kv_entries(res.kv)
    assert not torch.equal(formats.decode_kv_entries(data, scales), res.kv)


def test_official_is_close_to_exact() -> None:
    """The quantized path is an approximation of the exact one, not something else (SWA/HCA: no top-k flips)."""
    for layer_idx in (0, 2):
        w = dsv4.AttentionWeights.random(TINY, layer_idx, seed=3)
        x = torch.randn(50, TINY.hidden_size)
        a = dsv4.reference.attention(w, TINY, layer_idx, x, "official").double()
        b = dsv4.reference.attention(w, TINY, layer_idx, x, "exact").double()
        assert ((a - b).norm() / b.norm()).item() < 0.08


def test_yarn_table_of_compressed_layers() -> None:
    cfg = dsv4.ModelConfig.preset("v4-flash")
    base = dsv4.reference.rope_inv_freq(cfg, LayerKind.SWA)
    plain = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    assert torch.allclose(base.double(), plain, rtol=1e-6)  # no YaRN on sliding-only layers
    comp = dsv4.reference.rope_inv_freq(cfg, LayerKind.CSA).double()
    w0 = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    corr = lambda r: 64 * math.log(65536 / (2 * math.pi * r)) / (2 * math.log(160000.0))  # noqa: E731
    assert (math.floor(corr(32)), math.ceil(corr(1))) == (15, 25)
    assert torch.allclose(comp[:16], w0[:16], rtol=1e-6)  # pairs 0..15 keep their frequency
    assert torch.allclose(comp[25:], w0[25:] / 16, rtol=1e-6)  # pairs >= 25 divided by 16
    assert math.isclose(comp[20].item(), 0.5 * w0[20].item() + 0.5 * w0[20].item() / 16, rel_tol=1e-6)


def test_rope_inverse_and_relative_phase() -> None:
    """RoPE(p) then inverse RoPE(t) leaves the phase p − t: q·k depends on relative position only."""
    inv = dsv4.reference.rope_inv_freq(TINY, LayerKind.HCA)
    q = torch.randn(1, 512, dtype=torch.float64).float()
    k = torch.randn(1, 512).float()
    dots = []
    for shift in (0, 1000):
        qr = dsv4.reference.apply_rope(q, torch.tensor([shift + 37]), inv)
        kr = dsv4.reference.apply_rope(k, torch.tensor([shift + 5]), inv)
        dots.append((qr * kr).sum().item())
    assert math.isclose(dots[0], dots[1], rel_tol=1e-4)
    back = dsv4.reference.apply_rope(dsv4.reference.apply_rope(q, torch.tensor([77]), inv), torch.tensor([77]), inv, inverse=True)
    assert torch.allclose(back, q, atol=1e-5)
    assert torch.equal(back[:, :448], q[:, :448])  # nope dims untouched


def test_input_validation() -> None:
    w = dsv4.AttentionWeights.random(TINY, 0, seed=0)
    with pytest.raises(ValueError, match="must be"):
        dsv4.reference.attention(w, TINY, 0, torch.randn(4, TINY.hidden_size + 1))
    x = torch.randn(4, TINY.hidden_size)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        dsv4.reference.attention(w, TINY, 0, x)
