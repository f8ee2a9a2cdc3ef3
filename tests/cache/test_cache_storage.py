"""Entry storage codecs over uint8 pages (dsv4.cache.storage)."""

import zlib

import pytest
import torch

from dsv4 import formats
from dsv4.cache import EntryStorage, index_storage, kv_storage
from dsv4.numerics import INDEX_FORMATS, KV_FORMATS

ALL = [("kv", n) for n in KV_FORMATS] + [("index", n) for n in INDEX_FORMATS]
ENTRY_BYTES = {
    ("kv", "fp8_ds_mla"): 584,
    ("kv", "fp8_per_token"): 580,
    ("kv", "fp32"): 2048,
    ("index", "mxfp4"): 68,
    ("index", "nvfp4"): 72,
    ("index", "fp8"): 132,
    ("index", "fp32"): 512,
}


def make(kind: str, name: str) -> EntryStorage:
    return kv_storage(name) if kind == "kv" else index_storage(name)


def reference_roundtrip(kind: str, name: str, x: torch.Tensor) -> torch.Tensor:
    """The format's own decode(encode(x)), straight from dsv4.formats."""
    if name == "fp8_ds_mla":
        return formats.decode_kv_entries(*formats.encode_kv_entries(x))
    if name == "fp8_per_token":
        nope = formats.dequantize_fp8_per_token(*formats.quantize_fp8_per_token(x[:, :448]))
        return torch.cat([nope, x[:, 448:].to(torch.bfloat16).float()], dim=-1)
    if name == "mxfp4":
        return formats.decode_mxfp4_keys(formats.encode_mxfp4_keys(x))
    if name == "nvfp4":
        return formats.dequantize_nvfp4(*formats.quantize_nvfp4(x, 16), 16)
    if name == "fp8":
        return formats.decode_fp8_keys(formats.encode_fp8_keys(x))
    assert name == "fp32"
    return x.float()


@pytest.mark.parametrize("kind,name", ALL)
def test_entry_bytes(kind, name):
    assert make(kind, name).entry_bytes == ENTRY_BYTES[(kind, name)]


def test_constants_match_formats():
    assert kv_storage("fp8_ds_mla").entry_bytes == formats.KV_ENTRY_BYTES
    assert index_storage("mxfp4").entry_bytes == formats.MXFP4_KEY_BYTES
    assert index_storage("fp8").entry_bytes == formats.FP8_KEY_BYTES
    for bs in (1, 2, 16, 63, 64, 128, 256):
        assert kv_storage("fp8_ds_mla").page_bytes(bs) == formats.kv_page_bytes(bs)
        assert index_storage("mxfp4").page_bytes(bs) == formats.mxfp4_page_bytes(bs)


@pytest.mark.parametrize("kind,name", ALL)
@pytest.mark.parametrize("entries_per_page", [1, 2, 16, 64])
def test_write_read_scatter(kind, name, entries_per_page):
    st = make(kind, name)
    g = torch.Generator().manual_seed(zlib.crc32(f"{kind}/{name}/{entries_per_page}".encode()))
    num_pages = 5
    pb = st.page_bytes(entries_per_page)
    assert st.entries_per_page(pb) == entries_per_page
    pages = torch.randint(0, 256, (num_pages, pb), dtype=torch.uint8, generator=g)
    before = pages.clone()
    # distinct random (page, slot) targets
    E = min(7, num_pages * entries_per_page)
    flat = torch.randperm(num_pages * entries_per_page, generator=g)[:E]
    block_ids, slots = flat // entries_per_page, flat % entries_per_page
    x = torch.randn(E, st.dim, generator=g) * torch.logspace(-3, 3, E).unsqueeze(1)
    st.write(pages, block_ids, slots, x)

    got = st.read(pages, block_ids, slots)
    assert got.dtype == torch.float32 and got.shape == (E, st.dim)
    want = reference_roundtrip(kind, name, x)
    assert torch.equal(got, want)
    assert torch.equal(st.read_bytes(pages, block_ids, slots), st.encode(x))

    # exactly the targeted bytes changed: compute every targeted byte's page offset from the segment layout
    touched = torch.zeros_like(pages, dtype=torch.bool)
    offset = 0
    for w in st.segments:
        for b, s in zip(block_ids.tolist(), slots.tolist()):
            touched[b, offset + s * w : offset + (s + 1) * w] = True
        offset += entries_per_page * w
    assert torch.equal(pages[~touched], before[~touched])
    assert int(touched.sum()) == E * st.entry_bytes


def test_fp8_ds_mla_page_layout():
    st = kv_storage("fp8_ds_mla")
    bs = 8
    pages = torch.zeros(2, st.page_bytes(bs), dtype=torch.uint8)
    assert pages.shape[1] % 576 == 0 and pages.shape[1] == -(-bs * 584 // 576) * 576
    x = torch.randn(3, 512)
    blocks, slots = torch.tensor([1, 0, 1]), torch.tensor([5, 0, 2])
    st.write(pages, blocks, slots, x)
    data, scales = formats.encode_kv_entries(x)
    for e, (b, j) in enumerate(zip(blocks.tolist(), slots.tolist())):
        assert torch.equal(pages[b, j * 576 : (j + 1) * 576], data[e])
        assert torch.equal(pages[b, bs * 576 + j * 8 : bs * 576 + (j + 1) * 8], scales[e])
    # agrees with the formats module's page views
    dv, sv = formats.kv_page_views(pages, bs)
    assert torch.equal(dv[blocks, slots], data) and torch.equal(sv[blocks, slots], scales)


def test_mxfp4_page_layout_matches_formats_views():
    st = index_storage("mxfp4")
    bs = 64
    pages = torch.zeros(3, st.page_bytes(bs), dtype=torch.uint8)
    x = torch.randn(4, 128)
    blocks, slots = torch.tensor([2, 0, 2, 1]), torch.tensor([63, 0, 1, 17])
    st.write(pages, blocks, slots, x)
    enc = formats.encode_mxfp4_keys(x)
    vals, scs = formats.mxfp4_page_views(pages, bs)
    assert torch.equal(vals[blocks, slots], enc[:, :64]) and torch.equal(scs[blocks, slots], enc[:, 64:])


def test_write_bytes_read_bytes_roundtrip():
    st = kv_storage("fp8_ds_mla")
    pages = torch.zeros(4, st.page_bytes(2), dtype=torch.uint8)
    raw = torch.randint(0, 256, (3, 584), dtype=torch.uint8)
    b, s = torch.tensor([3, 0, 3]), torch.tensor([1, 0, 0])
    st.write_bytes(pages, b, s, raw)
    assert torch.equal(st.read_bytes(pages, b, s), raw)


def test_ring_as_one_page():
    """The SWA ring of each state slot is one page of `window` entries."""
    st = kv_storage("fp8_ds_mla")
    window, max_requests = 16, 3
    ring = torch.zeros(max_requests, st.page_bytes(window), dtype=torch.uint8)
    pos = torch.arange(40)
    x = torch.randn(40, 512)
    keep = pos >= 40 - window  # the last `window` tokens survive
    st.write(ring, torch.full((int(keep.sum()),), 1), pos[keep] % window, x[keep])
    got = st.read(ring, torch.full((window,), 1), pos[keep] % window)
    assert torch.equal(got, formats.decode_kv_entries(*formats.encode_kv_entries(x[keep])))
    assert not ring[0].any() and not ring[2].any()


def test_empty_write_and_read():
    st = index_storage("mxfp4")
    pages = torch.zeros(2, st.page_bytes(4), dtype=torch.uint8)
    e = torch.zeros(0, dtype=torch.int64)
    st.write(pages, e, e, torch.zeros(0, 128))
    assert st.read(pages, e, e).shape == (0, 128)
    assert not pages.any()


def test_errors():
    with pytest.raises(ValueError, match="unknown KV storage format 'bf16'"):
        kv_storage("bf16")
    with pytest.raises(ValueError, match="unknown indexer key storage format 'int4'"):
        index_storage("int4")
    with pytest.raises(ValueError, match="fp8_ds_mla stores"):
        kv_storage("fp8_ds_mla", dim=256)
    st = kv_storage("fp8_ds_mla")
    with pytest.raises(ValueError, match="not a page size"):
        st.entries_per_page(1000)
    pages = torch.zeros(2, st.page_bytes(2), dtype=torch.uint8)
    i = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"values must be \[E, 512\]"):
        st.write(pages, i, i, torch.zeros(1, 128))
    with pytest.raises(ValueError, match="uint8"):
        st.write(pages.float(), i, i, torch.zeros(1, 512))
    with pytest.raises(ValueError, match="1-D of equal length"):
        st.read(pages, i, torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("kind,name", ALL)
def test_write_does_no_host_check(kind, name):
    """Codecs call the quantizers with check=False: a NaN is stored, not raised on (no device→host sync per step)."""
    st = make(kind, name)
    pages = torch.zeros(1, st.page_bytes(2), dtype=torch.uint8)
    i = torch.zeros(1, dtype=torch.int64)
    st.write(pages, i, i, torch.full((1, st.dim), float("nan")))
