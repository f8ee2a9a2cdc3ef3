"""``ModelConfig.from_hf`` follows every RoPE field of a transformers config: its tables equal transformers' own.

The oracle is transformers' ``DeepseekV4RotaryEmbedding`` built from the same config: its ``main`` / ``compress``
inverse frequencies, its cos/sin at far-apart positions and its magnitude scale (dsv4 has none: 1.0). Configs go
in as a ``DeepseekV4Config``, its ``to_dict()`` and a ``config.json`` path.
"""

import pytest
import torch

import dsv4
from dsv4.config import LayerKind
from dsv4.reference import rope_inv_freq

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding  # noqa: E402

TINY = dsv4.ModelConfig.preset("tiny")
POSITIONS = torch.tensor([[0, 1, 7, 100, 4095, 65535, 300_000]])


def _base_dict(**changes) -> dict:
    d = TINY.to_hf_dict()
    d.pop("rope_parameters")
    d.update(changes)
    return d


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _assert_tables_match(cfg: dsv4.ModelConfig, hc) -> None:
    rotary = DeepseekV4RotaryEmbedding(hc)
    x = torch.zeros(1, POSITIONS.shape[1], 8)
    for label, kind in (("main", LayerKind.SWA), ("compress", LayerKind.CSA), ("compress", LayerKind.HCA)):
        ours = rope_inv_freq(cfg, kind)
        theirs = getattr(rotary, f"{label}_inv_freq")
        assert ours.shape == theirs.shape, (label, ours.shape, theirs.shape)
        assert _rel(ours, theirs) <= 1e-6, (label, kind)
        assert getattr(rotary, f"{label}_attention_scaling") == 1.0
        cos, sin = rotary(x, POSITIONS, layer_type=label)
        angle = POSITIONS[0, :, None].float() * ours  # as dsv4's apply_rope forms its angles (FP32)
        assert _rel(torch.cos(angle), cos[0]) <= 1e-6 and _rel(torch.sin(angle), sin[0]) <= 1e-6


def _check_all_inputs(hc, tmp_path) -> dsv4.ModelConfig:
    """from_hf of the config object, its dict and its config.json agree and match transformers' tables."""
    cfg = dsv4.ModelConfig.from_hf(hc, name="t")
    assert dsv4.ModelConfig.from_hf(hc.to_dict(), name="t") == cfg
    hc.save_pretrained(tmp_path)
    assert dsv4.ModelConfig.from_hf(tmp_path / "config.json", name="t") == cfg
    assert dsv4.ModelConfig.from_hf(tmp_path, name="t") == cfg
    _assert_tables_match(cfg, hc)
    return cfg


YARN_FULL = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}

CASES = {
    # no rope_parameters: transformers gives the compressed layers plain RoPE (the issue-34 bug: YaRN was applied)
    "default": {},
    "default-explicit": {"rope_parameters": {"rope_type": "default"}},
    "yarn-official": {"rope_parameters": YARN_FULL},
    "yarn-factor-only": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
    "yarn-factor-original": {
        "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048}
    },
    "yarn-betas": {"rope_parameters": {**YARN_FULL, "beta_fast": 16, "beta_slow": 2}},
    "yarn-legacy-rope-scaling": {"rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536}},
    "thetas": {"rope_theta": 5000.0, "compress_rope_theta": 40000.0, "rope_parameters": YARN_FULL},
    "default-thetas": {"rope_theta": 20000.0, "compress_rope_theta": 80000.0},
    "partial-rotary": {"partial_rotary_factor": 0.25, "rope_parameters": YARN_FULL},
    "nested": {"rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 7000.0, "partial_rotary_factor": 0.125},
        "compress": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "rope_theta": 90000.0,
                     "partial_rotary_factor": 0.125, "attention_factor": 1.0},
    }},
    "nested-default": {"rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0},
        "compress": {"rope_type": "default", "rope_theta": 123456.0},
    }},
}


@pytest.mark.parametrize("case", list(CASES))
def test_from_hf_rope_matches_transformers(case: str, tmp_path) -> None:
    hc = DeepseekV4Config(**_base_dict(**CASES[case]))
    cfg = _check_all_inputs(hc, tmp_path)
    want_yarn = hc.rope_parameters["compress"]["rope_type"] == "yarn"
    assert cfg.compress_rope_type == ("yarn" if want_yarn else "default")


def test_default_config_gets_no_yarn() -> None:
    """The issue's case: a DeepseekV4Config built without rope_parameters; the compressed table is θ^(-2i/R)."""
    cfg = dsv4.ModelConfig.from_hf(DeepseekV4Config(**_base_dict()))
    want = 1.0 / 160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert cfg.compress_rope_type == "default"
    assert _rel(rope_inv_freq(cfg, LayerKind.CSA), want) <= 1e-6


def test_presets_keep_official_yarn() -> None:
    for name in dsv4.ModelConfig.presets():
        cfg = dsv4.ModelConfig.preset(name)
        assert cfg.compress_rope_type == "yarn" and cfg.yarn_factor == 16.0 and cfg.yarn_original_seq_len == 65536
        freqs = rope_inv_freq(cfg, LayerKind.CSA)
        base = rope_inv_freq(cfg.replace(compress_rope_type="default"), LayerKind.CSA)
        # SPEC §2.2: pairs 0-15 keep their frequency, pairs >= 25 are divided by 16
        assert torch.equal(freqs[:16], base[:16]) and torch.allclose(freqs[25:], base[25:] / 16)


@pytest.mark.parametrize("preset", ["tiny", "v4-flash"])
def test_to_hf_dict_roundtrip_of_both_rope_types(preset: str) -> None:
    for rope_type in ("yarn", "default"):
        cfg = dsv4.ModelConfig.preset(preset).replace(compress_rope_type=rope_type)
        hc = DeepseekV4Config(**cfg.to_hf_dict())
        got = dsv4.ModelConfig.from_hf(hc, name=cfg.name)
        assert got.compress_rope_type == rope_type
        _assert_tables_match(got, hc)


def test_official_inference_names() -> None:
    """Official config names: YaRN iff original_seq_len > 0, as the official precompute_freqs_cis."""
    d = _base_dict()
    d.update(rope_factor=4.0, original_seq_len=8192, beta_fast=16, beta_slow=2)
    cfg = dsv4.ModelConfig.from_hf(d)
    assert (cfg.compress_rope_type, cfg.yarn_factor, cfg.yarn_original_seq_len) == ("yarn", 4.0, 8192)
    assert (cfg.yarn_beta_fast, cfg.yarn_beta_slow) == (16.0, 2.0)
    d["original_seq_len"] = 0
    assert dsv4.ModelConfig.from_hf(d).compress_rope_type == "default"


@pytest.mark.parametrize(
    "rope, match",
    [
        ({"main": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
          "compress": {"rope_type": "default"}}, "main.*rope_type 'yarn'"),
        ({"rope_type": "linear", "factor": 2.0}, "rope_type 'linear' is not supported"),
        # nested YaRN without attention_factor: transformers scales cos/sin by 0.1 ln(16) + 1
        ({"main": {"rope_type": "default"}, "compress": {**YARN_FULL}}, "attention_factor 1.27726"),
        ({**YARN_FULL, "attention_factor": 1.5}, "attention_factor 1.5"),
        ({**YARN_FULL, "truncate": False}, "truncate=False"),
        ({"rope_type": "yarn"}, "needs 'factor'"),
        ({"compress": {"rope_type": "default"}}, "half-nested"),
        ({"main": {"rope_type": "default", "partial_rotary_factor": 0.25},
          "compress": {"rope_type": "default", "partial_rotary_factor": 0.125}}, "different widths"),
    ],
)
def test_unrepresentable_rope_is_refused(rope: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dsv4.ModelConfig.from_hf(_base_dict(rope_parameters=rope))


def test_qk_rope_head_dim_must_agree_with_partial_rotary_factor() -> None:
    with pytest.raises(ValueError, match="qk_rope_head_dim 32 disagrees"):
        dsv4.ModelConfig.from_hf(_base_dict(qk_rope_head_dim=32))


def test_bad_compress_rope_type() -> None:
    with pytest.raises(ValueError, match="compress_rope_type"):
        TINY.replace(compress_rope_type="linear")


@pytest.mark.parametrize("layer_idx", [1, 2], ids=["csa", "hca"])
def test_reference_matches_transformers_with_default_rope(layer_idx: int) -> None:
    """End to end: a transformers layer built without rope_parameters (plain RoPE on CSA/HCA) and dsv4's reference
    with ``from_hf`` of that config agree to FP32 rounding (the YaRN table the bug used: ~5e-4 apart at 45 tokens)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    from support.hf import run_hf_attention

    hc = DeepseekV4Config(**_base_dict())
    hc._attn_implementation = "eager"
    cfg = dsv4.ModelConfig.from_hf(hc, name="tiny-default-rope")
    torch.manual_seed(layer_idx)
    module = DeepseekV4Attention(hc, layer_idx).float().eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = p.shape[1] ** -0.5 if p.dim() == 2 else 0.1
            p.copy_(torch.randn_like(p) * scale + (1.0 if p.dim() == 1 and "position_bias" not in name else 0.0))
    w = dsv4.AttentionWeights.from_hf_module(module)
    x = torch.randn(45, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    want = run_hf_attention(module, cfg, x)

    def err(c: dsv4.ModelConfig) -> float:
        got = dsv4.reference.attention(w, c, layer_idx, x, numerics="exact")
        return ((got.double() - want.double()).norm() / want.double().norm()).item()

    assert err(cfg) <= 1e-5
    assert err(cfg.replace(compress_rope_type="yarn")) > 1e-4  # the table the bug used is clearly off
