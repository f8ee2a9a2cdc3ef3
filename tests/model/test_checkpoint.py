"""AttentionWeights.from_checkpoint: transformers-saved checkpoints and hand-built official FP8 checkpoints."""

from __future__ import annotations

import json
import os

import pytest
import torch

import dsv4
from dsv4.formats.block_fp8 import BlockFp8Weight
from dsv4.checkpoint import CheckpointError, dequantize_fp8_blocks, quantize_fp8_blocks

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

from support.hf import random_hf_attention, tiny_causal_lm  # noqa: E402

TINY = dsv4.ModelConfig.preset("tiny")
FP8_FIELDS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "indexer.wq_b")  # FP8 in the official checkpoint (SPEC §1.3)


def same_weights(a: dsv4.AttentionWeights, b: dsv4.AttentionWeights) -> bool:
    """The same parameters and values (a block-scaled FP8 projection compared by its dequantized values)."""
    def values(w):
        return {k: v.dequantize() if isinstance(v, BlockFp8Weight) else v for k, v in w.named_parameters()}

    ta, tb = values(a), values(b)
    return ta.keys() == tb.keys() and all(
        ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape and torch.equal(ta[k], tb[k]) for k in ta
    )


@pytest.fixture(scope="module")
def hf_model():
    return tiny_causal_lm()


@pytest.mark.parametrize("original_format", [True, False], ids=["official-names", "transformers-names"])
def test_transformers_saved_checkpoint_loads_like_from_hf_module(hf_model, tmp_path, original_format: bool) -> None:
    hf_model.save_pretrained(tmp_path, save_original_format=original_format)
    from safetensors import safe_open

    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any((".attn.wq_a." if original_format else ".self_attn.q_a_proj.") in k for k in keys)
    cfg = dsv4.checkpoint.config_from_checkpoint(tmp_path)
    assert cfg.compress_ratios == TINY.compress_ratios
    x = torch.randn(24, TINY.hidden_size, generator=torch.Generator().manual_seed(1))
    for li in range(TINY.num_layers):
        got = dsv4.AttentionWeights.from_checkpoint(tmp_path, li)
        want = dsv4.AttentionWeights.from_hf_module(hf_model.model.layers[li].self_attn)
        assert same_weights(got, want), li
        assert torch.equal(dsv4.reference.attention(got, TINY, li, x, "exact"),
                           dsv4.reference.attention(want, TINY, li, x, "exact"))
    with pytest.raises(CheckpointError, match="MTP"):
        dsv4.AttentionWeights.from_checkpoint(tmp_path, TINY.num_layers, TINY)


def _expected_dequant(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Independent dequantization: each element times its block's scale, by explicit block indices."""
    rows = torch.arange(q.shape[0])[:, None] // block
    cols = torch.arange(q.shape[1])[None, :] // block
    return q.float() * scale.float()[rows, cols]


def official_tensors(layer_weights: dict[int, dsv4.AttentionWeights], ue8m0: bool, prefix: str = "",
                     scale_name: str = "scale", mtp_from: int | None = None):
    """Official-layout tensors: FP8 E4M3 weights + per-128x128-block scales for the FP8 fields, BF16 for the
    compressor / indexer projections and norms, FP32 sinks and position biases. Returns (tensors, dequantized
    weights per layer as the checkpoint defines them)."""
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[int, dsv4.AttentionWeights] = {}
    for li, w in layer_weights.items():
        group = f"mtp.{li - mtp_from}" if mtp_from is not None and li >= mtp_from else f"layers.{li}"
        named = {}
        for name, t in w.named_tensors():
            is_matrix = t.dim() == 2 and not name.endswith("ape")
            key = f"{prefix}{group}.attn.{name}" + (".weight" if is_matrix or name.endswith("norm") else "")
            if name in FP8_FIELDS:
                q, s = quantize_fp8_blocks(t, (128, 128), ue8m0=ue8m0)
                if ue8m0:
                    s = s.to(torch.float8_e8m0fnu)
                tensors[key] = q
                tensors[key[: -len(".weight")] + f".{scale_name}"] = s
                named[name] = _expected_dequant(q, s)
            elif name in ("attn_sink",) or name.endswith("ape"):
                tensors[key] = t.float().contiguous()
                named[name] = t.float()
            else:  # BF16 in the checkpoint (compressor projections, indexer weights_proj, norms)
                tensors[key] = t.to(torch.bfloat16).contiguous()
                named[name] = t.to(torch.bfloat16).float()
        expected[li] = dsv4.AttentionWeights.from_named(named, TINY.layer_kind(li))
    return tensors, expected


def write_checkpoint(path, tensors: dict[str, torch.Tensor], shards: int = 1, config: dict | None = None) -> None:
    os.makedirs(path, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            part = names[s::shards]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: tensors[n] for n in part}, os.path.join(path, fname))
            weight_map.update({n: fname for n in part})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    cfg = dict(TINY.to_hf_dict())
    cfg["compress_ratios"] = list(TINY.compress_ratios)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "scale_fmt": "ue8m0"}
    cfg.update(config or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize(
    "ue8m0,scale_name,prefix,shards",
    [(True, "scale", "", 1), (False, "weight_scale_inv", "model.", 2)],
    ids=["ue8m0-scale-official", "fp32-weight_scale_inv-sharded"],
)
def test_official_fp8_checkpoint_dequantizes_exactly(tmp_path, ue8m0, scale_name, prefix, shards) -> None:
    layers = list(range(TINY.num_attention_layers))  # MTP block included (mtp.0.attn)
    src = {li: dsv4.AttentionWeights.from_hf_module(random_hf_attention(TINY, min(li, TINY.num_layers - 1), seed=li))
           for li in layers[: TINY.num_layers]}
    src[TINY.num_layers] = dsv4.AttentionWeights.random(TINY, TINY.num_layers, seed=5, fp8=False)
    tensors, expected = official_tensors(src, ue8m0, prefix, scale_name, mtp_from=TINY.num_layers)
    assert tensors[f"{prefix}layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    write_checkpoint(tmp_path, tensors, shards)
    x = torch.randn(24, TINY.hidden_size, generator=torch.Generator().manual_seed(3))
    for li in layers:
        got = dsv4.AttentionWeights.from_checkpoint(tmp_path, li, TINY)
        assert same_weights(got, expected[li]), li
        if li < TINY.num_layers:
            # A transformers module holding the dequantized weights gives the same weights and outputs.
            module = random_hf_attention(TINY, li, seed=99)
            hf_names = dsv4.checkpoint.HF_NAMES
            params = dict(module.named_parameters())
            with torch.no_grad():
                for name, t in expected[li].named_tensors():
                    params[hf_names[name][0]].copy_(t)
            via_hf = dsv4.AttentionWeights.from_hf_module(module)
            assert same_weights(got, via_hf)
            # official numerics quantize a plain weight to UE8M0 blocks: the same FP8 weight as a UE8M0 checkpoint's
            numerics = "official" if ue8m0 else "exact"
            assert torch.equal(dsv4.reference.attention(got, TINY, li, x, numerics),
                               dsv4.reference.attention(via_hf, TINY, li, x, numerics))
    if ue8m0:  # the FP8 projections are kept as stored: the checkpoint's E4M3 bytes and block scales, not dequantized
        w = dsv4.AttentionWeights.from_checkpoint(tmp_path, 1, TINY)
        q = tensors[f"{prefix}layers.1.attn.wq_b.weight"]
        s = tensors[f"{prefix}layers.1.attn.wq_b.scale"].float()
        assert isinstance(w.wq_b, BlockFp8Weight) and torch.equal(w.wq_b.scale, s)
        assert torch.equal(w.wq_b.data.view(torch.uint8), q.view(torch.uint8))


def test_dequantize_scale_encodings_agree() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g)
    q, s = quantize_fp8_blocks(w, (128, 128), ue8m0=True)
    assert s.shape == (3, 2)
    a = dequantize_fp8_blocks(q, s)
    b = dequantize_fp8_blocks(q, s.to(torch.float8_e8m0fnu))
    c = dequantize_fp8_blocks(q, s.to(torch.float8_e8m0fnu).view(torch.uint8))  # raw UE8M0 bytes
    assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(a, _expected_dequant(q, s))
    assert (a - w).abs().max() <= s.max() * 32  # E4M3 rounding: half an ulp at 448 is 16 · scale
    with pytest.raises(CheckpointError, match="block scales"):
        dequantize_fp8_blocks(q, s[:, :1])


def test_checkpoint_errors(tmp_path) -> None:
    src = {li: dsv4.AttentionWeights.random(TINY, li, seed=li, fp8=False) for li in range(TINY.num_layers)}
    tensors, _ = official_tensors(src, ue8m0=True)
    # FP8 weight without its scale
    broken = dict(tensors)
    del broken["layers.1.attn.wq_b.scale"]
    write_checkpoint(tmp_path / "noscale", broken)
    with pytest.raises(CheckpointError, match="no .scale"):
        dsv4.AttentionWeights.from_checkpoint(tmp_path / "noscale", 1, TINY)
    # missing tensor of a CSA layer
    broken = {k: v for k, v in tensors.items() if "layers.1.attn.indexer.weights_proj" not in k}
    write_checkpoint(tmp_path / "missing", broken)
    with pytest.raises(CheckpointError, match="indexer.weights_proj"):
        dsv4.AttentionWeights.from_checkpoint(tmp_path / "missing", 1, TINY)
    assert dsv4.AttentionWeights.from_checkpoint(tmp_path / "missing", 2, TINY).compressor is not None
    # a layer the checkpoint lacks, a path that does not exist
    with pytest.raises(CheckpointError, match="no tensors"):
        dsv4.AttentionWeights.from_checkpoint(tmp_path / "missing", TINY.num_layers, TINY)
    with pytest.raises(CheckpointError, match="does not exist"):
        dsv4.AttentionWeights.from_checkpoint(tmp_path / "nope", 0, TINY)
    # shapes are checked against the config
    wrong = TINY.replace(name="wide", q_lora_rank=32)
    with pytest.raises(ValueError, match="wq_a"):
        dsv4.AttentionWeights.from_checkpoint(tmp_path / "missing", 0, wrong)
