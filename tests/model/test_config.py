"""ModelConfig presets and import from transformers configs."""

import json

import pytest

import dsv4
from dsv4.config import LayerKind


def test_flash_preset_pattern() -> None:
    cfg = dsv4.ModelConfig.preset("v4-flash")
    assert len(cfg.compress_ratios) == 44
    assert cfg.compress_ratios[:4] == (0, 0, 4, 128) and cfg.compress_ratios[-2:] == (4, 0)
    kinds = cfg.layer_kinds
    assert kinds[:2] == (LayerKind.SWA, LayerKind.SWA) and kinds[43] is LayerKind.SWA
    assert cfg.layers_of_kind(LayerKind.CSA) == list(range(2, 43, 2))  # 21 layers
    assert cfg.layers_of_kind(LayerKind.HCA) == list(range(3, 42, 2))  # 20 layers
    assert (cfg.num_heads, cfg.q_lora_rank, cfg.o_groups, cfg.index_topk) == (64, 1024, 8, 512)


def test_pro_preset_pattern() -> None:
    cfg = dsv4.ModelConfig.preset("v4-pro")
    assert len(cfg.compress_ratios) == 62 and cfg.compress_ratios[:4] == (128, 128, 4, 128)
    assert len(cfg.layers_of_kind(LayerKind.CSA)) == 30 and len(cfg.layers_of_kind(LayerKind.HCA)) == 31
    assert cfg.layer_kind(61) is LayerKind.SWA
    assert (cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.o_groups, cfg.index_topk) == (7168, 128, 1536, 16, 1024)


def test_tiny_has_every_kind() -> None:
    cfg = dsv4.ModelConfig.preset("tiny")
    assert set(cfg.layer_kinds) == set(LayerKind)


def test_unknown_preset_and_bad_config() -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        dsv4.ModelConfig.preset("v5")
    with pytest.raises(ValueError, match="compress_ratios"):
        dsv4.ModelConfig.preset("tiny").replace(compress_ratios=(0, 4, 7, 4, 0))


def _official_style_dict(cfg: dsv4.ModelConfig) -> dict:
    d = cfg.to_hf_dict()
    d.pop("layer_types")
    d["compress_ratios"] = list(cfg.compress_ratios)
    return d


@pytest.mark.parametrize("preset", ["v4-flash", "v4-pro", "tiny"])
def test_from_hf_roundtrip(preset: str, tmp_path) -> None:
    cfg = dsv4.ModelConfig.preset(preset)
    d = _official_style_dict(cfg)
    assert dsv4.ModelConfig.from_hf(d, name=preset) == cfg
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    assert dsv4.ModelConfig.from_hf(path, name=preset) == cfg
    assert dsv4.ModelConfig.from_hf(tmp_path, name=preset) == cfg


@pytest.mark.parametrize("preset", ["v4-flash", "v4-pro", "tiny"])
def test_from_transformers_config(preset: str) -> None:
    pytest.importorskip("transformers")
    from transformers import DeepseekV4Config

    cfg = dsv4.ModelConfig.preset(preset)
    # Real checkpoints ship compress_ratios, which transformers folds into layer_types; it knows only the
    # ratios 0/4/128, so the tiny config goes in through layer_types + compress_rates.
    d = cfg.to_hf_dict() if preset == "tiny" else _official_style_dict(cfg)
    hc = DeepseekV4Config(**d)
    got = dsv4.ModelConfig.from_hf(hc, name=preset)
    assert got == cfg
