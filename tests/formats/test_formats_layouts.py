"""dsv4.formats.layouts: byte-level checks against hand-built vectors, page geometry, and decode(encode) == qdq."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from dsv4.formats import fp4 as F4
from dsv4.formats import fp8 as F8
from dsv4.formats import layouts as L


def test_constants():
    assert (L.KV_NOPE_DIM, L.KV_ROPE_DIM, L.KV_DATA_BYTES, L.KV_SCALE_BYTES, L.KV_ENTRY_BYTES) == (448, 64, 576, 8, 584)
    assert (L.MXFP4_KEY_BYTES, L.FP8_KEY_BYTES) == (68, 132)


@pytest.mark.parametrize("bs,expect", [(1, 1152), (64, 37440), (72, 73 * 576), (128, 130 * 576), (256, 260 * 576),
                                       (576, 584 * 576)])
def test_kv_page_bytes(bs, expect):
    assert L.kv_page_bytes(bs) == expect == math.ceil(bs * 584 / 576) * 576
    assert L.kv_page_bytes(bs) >= bs * 584
    assert L.mxfp4_page_bytes(bs) == bs * 68


def hand_kv_vector() -> tuple[torch.Tensor, list[int], list[int]]:
    """512-vector with known codes: in nope block b (scale 2**(b-3)): 448, -1, 0.5, 2**-9 (times the scale), zeros.
    Rope dims cycle through 1.0, -2.0, 0.5, 3.0 (exact BF16)."""
    x = torch.zeros(512)
    data = [0] * 576
    for b in range(7):
        s = 2.0 ** (b - 3)
        x[64 * b: 64 * b + 4] = torch.tensor([448 * s, -s, 0.5 * s, 2.0 ** -9 * s])
        data[64 * b: 64 * b + 4] = [0x7E, 0xB8, 0x30, 0x01]
    rope_vals = [1.0, -2.0, 0.5, 3.0]
    rope_bits = [0x3F80, 0xC000, 0x3F00, 0x4040]
    for j in range(64):
        x[448 + j] = rope_vals[j % 4]
        bits = rope_bits[j % 4]
        data[448 + 2 * j: 448 + 2 * j + 2] = [bits & 0xFF, bits >> 8]  # little-endian
    scales = [127 + b - 3 for b in range(7)] + [0]
    return x, data, scales


def test_kv_entry_bytes_hand_built():
    x, data, scales = hand_kv_vector()
    d, s = L.encode_kv_entries(x)
    assert d.dtype == s.dtype == torch.uint8 and d.shape == (576,) and s.shape == (8,)
    assert d.tolist() == data
    assert s.tolist() == scales
    y = L.decode_kv_entries(d, s)
    assert torch.equal(y, x)  # every value of the hand vector is exactly representable


def test_kv_entry_round_trip_equals_qdq():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 512, generator=g) * torch.tensor([1e-3, 1.0, 50.0]).view(3, 1, 1)
    x[0, 0] = 0.0
    d, s = L.encode_kv_entries(x)
    assert d.shape == (3, 5, 576) and s.shape == (3, 5, 8)
    assert (s[..., 7] == 0).all()
    y = L.decode_kv_entries(d, s)
    assert torch.equal(y[..., :448], F8.qdq_fp8_block(x[..., :448]))
    assert torch.equal(y[..., 448:], x[..., 448:].bfloat16().float())
    assert torch.equal(y[0, 0], torch.zeros(512))
    # bf16 input: rope bytes are the input's own bytes
    xb = x.bfloat16()
    d2, _ = L.encode_kv_entries(xb)
    assert torch.equal(d2[..., 448:], xb[..., 448:].contiguous().view(torch.uint8))


def test_kv_page_views_geometry():
    bs, npages = 16, 3
    pb = L.kv_page_bytes(bs)
    pages = torch.zeros(npages, pb, dtype=torch.uint8)
    data, scales = L.kv_page_views(pages, bs)
    assert data.shape == (npages, bs, 576) and scales.shape == (npages, bs, 8)
    assert data.untyped_storage().data_ptr() == pages.untyped_storage().data_ptr()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(npages, bs, 512, generator=g)
    d, s = L.encode_kv_entries(x)
    data.copy_(d)
    scales.copy_(s)
    for p in range(npages):
        for j in (0, 5, bs - 1):
            assert torch.equal(pages[p, j * 576:(j + 1) * 576], d[p, j])
            assert torch.equal(pages[p, bs * 576 + j * 8: bs * 576 + (j + 1) * 8], s[p, j])
    assert (pages[:, bs * 584:] == 0).all()  # padding untouched
    assert torch.equal(L.decode_kv_entries(*L.kv_page_views(pages, bs)), L.decode_kv_entries(d, s))
    # a single page (no batch dim) also works
    d1, s1 = L.kv_page_views(pages[1], bs)
    assert torch.equal(d1, d[1]) and torch.equal(s1, s[1])
    with pytest.raises(ValueError, match="kv_page_views"):
        L.kv_page_views(pages[:, :-1], bs)


def test_mxfp4_key_bytes_hand_built():
    x = torch.zeros(128)
    x[:4] = torch.tensor([6.0, -0.5, 1.0, 0.0])  # block 0: amax 6 -> scale 1 -> byte 127
    x[32] = 12.0  # block 1: scale 2 -> byte 128
    x[33] = -3.0  # -3 / 2 = -1.5 -> code 0xB
    x[64] = 0.75  # block 2: amax 0.75 -> 0.75 * fp32(1/6) = 0.125 -> scale 2**-3 -> byte 124; 6.0 -> code 7
    # block 3 all zero: scale 2**-126 -> byte 1
    b = L.encode_mxfp4_keys(x)
    assert b.shape == (68,) and b.dtype == torch.uint8
    assert b[0].item() == 0x97  # element 0 (code 7) in the low nibble, element 1 (code 9) in the high nibble
    assert b[1].item() == 0x02
    assert b[16].item() == 0xB7  # 12 / 2 = 6 -> code 7 low; -1.5 -> code 0xB high
    assert b[32].item() == 0x07
    assert b[2:16].tolist() == [0] * 14
    assert b[64:].tolist() == [127, 128, 124, 1]
    assert torch.equal(L.decode_mxfp4_keys(b), x)


def test_mxfp4_keys_round_trip_and_pages():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 8, 128, generator=g)
    b = L.encode_mxfp4_keys(x)
    assert torch.equal(L.decode_mxfp4_keys(b), F4.qdq_mxfp4(x))
    packed, exps = F4.quantize_mxfp4(x)
    assert torch.equal(b[..., :64], packed) and torch.equal(b[..., 64:], exps)
    pages = torch.zeros(4, L.mxfp4_page_bytes(8), dtype=torch.uint8)
    vals, scs = L.mxfp4_page_views(pages, 8)
    assert vals.shape == (4, 8, 64) and scs.shape == (4, 8, 4)
    vals.copy_(b[..., :64])
    scs.copy_(b[..., 64:])
    for j in (0, 3, 7):
        assert torch.equal(pages[:, j * 64:(j + 1) * 64], b[:, j, :64])
        assert torch.equal(pages[:, 8 * 64 + j * 4: 8 * 64 + (j + 1) * 4], b[:, j, 64:])


def test_fp8_key_bytes_hand_built():
    x = torch.zeros(128)
    x[:3] = torch.tensor([448.0, 1.0, -1.0])
    b = L.encode_fp8_keys(x)
    assert b.shape == (132,)
    assert b[:3].tolist() == [0x7E, 0x38, 0xB8] and b[3:128].tolist() == [0] * 125
    assert b[128:].tolist() == list(struct.pack("<f", 1.0))
    assert torch.equal(L.decode_fp8_keys(b), x)


def test_fp8_keys_round_trip():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 128, generator=g) * 7
    b = L.encode_fp8_keys(x)
    assert torch.equal(L.decode_fp8_keys(b), F8.qdq_fp8_key(x))
    _, scale = F8.quantize_fp8_key(x)
    assert [struct.unpack("<f", bytes(r[128:].tolist()))[0] for r in b] == scale.tolist()


ENCODERS = [(L.encode_kv_entries, 512), (L.encode_mxfp4_keys, 128), (L.encode_fp8_keys, 128)]


@pytest.mark.parametrize("enc,n", ENCODERS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_encoders_reject_nonfinite(enc, n, bad):
    x = torch.randn(2, n)
    x[1, n - 1] = bad  # in the rope part for the KV entry
    with pytest.raises(ValueError, match="NaN or Inf"):
        enc(x)


@pytest.mark.parametrize("enc,n", ENCODERS)
def test_encoders_reject_bad_shape_and_dtype(enc, n):
    with pytest.raises(ValueError, match=f"must be {n}"):
        enc(torch.randn(2, n + 64))
    with pytest.raises(ValueError, match="floating"):
        enc(torch.ones(2, n, dtype=torch.int32))


def test_decoders_reject_bad_inputs():
    d, s = L.encode_kv_entries(torch.randn(2, 512))
    with pytest.raises(ValueError, match="uint8"):
        L.decode_kv_entries(d.to(torch.int16), s)
    with pytest.raises(ValueError, match="576"):
        L.decode_kv_entries(d[:, :575], s)
    with pytest.raises(ValueError, match="8"):
        L.decode_kv_entries(d, s[:, :7])
    with pytest.raises(ValueError, match="68"):
        L.decode_mxfp4_keys(torch.zeros(2, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        L.decode_fp8_keys(torch.zeros(2, 132))
    with pytest.raises(ValueError, match="block_size"):
        L.kv_page_bytes(0)
