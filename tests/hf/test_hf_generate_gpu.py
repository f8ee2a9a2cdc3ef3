"""``generate()`` through ``dsv4.hf`` on a GPU: the Triton backend gives the torch backend's tokens, and its logits
are within the torch backend's own noise floor (marked gpu).

Official numerics (FP8 / MXFP4 cache, BF16 compute), a tiny random DeepseekV4ForCausalLM (SWA, CSA, HCA layers)
on CUDA, a left-padded batch of prompts from 17 to 300 tokens (past the window, several HCA windows, more CSA
entries than the top-k). Greedy tokens must be equal; the two backends round BF16 GEMMs and index scores
differently, so a step where the torch backend's best two logits are within 2^-7 of the largest |logit| (a
near-tie) may go either way — from such a step on the rows are not compared. Needs transformers >= 5.24.0.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from packaging.version import Version

import dsv4

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")
if Version(transformers.__version__) < Version("5.24.0") or not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip(f"needs transformers >= 5.24.0 (the version dsv4.hf is tested with), found {transformers.__version__}",
                allow_module_level=True)
import dsv4.hf  # noqa: E402

NEAR_TIE = 2.0**-7
LOGIT_TOL = float(os.environ.get("DSV4_HF_LOGIT_TOL", "2e-2"))  # a measurement run sets it to 1 to see the errors

NUMERICS = {
    "official": dsv4.Numerics.official(),
    "official-bf16-projections": dataclasses.replace(dsv4.Numerics.official(), fp8_projections=False),
}


def _generate(model, ids, mask, backend: str, numerics: dsv4.Numerics, noise: float = 0.0, seed: int = 0,
              new: int = 16):
    """Greedy ``generate()`` through dsv4; ``noise``: every attention input multiplied by ``1 + noise·N(0, 1)``."""
    dsv4.hf.attach(model, backend=backend, numerics=numerics)
    hooks = []
    if noise:
        g = torch.Generator().manual_seed(seed)

        def perturb(module, args):
            x = args[0]
            return (x * (1 + noise * torch.randn(x.shape, generator=g).to(x.device, x.dtype)),) + tuple(args[1:])

        hooks = [layer.self_attn.register_forward_pre_hook(perturb) for layer in model.model.layers]
    try:
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                              return_dict_in_generate=True, output_logits=True)
    finally:
        for h in hooks:
            h.remove()
        dsv4.hf.detach(model)


def _batch():
    """The tiny random model on CUDA and a left-padded batch of prompts of 300 / 129 / 64 / 17 tokens."""
    model = dsv4.hf.random_causal_lm(dsv4.ModelConfig.preset("tiny"), seed=21, device="cuda")
    ids, mask = dsv4.hf.left_padded_prompts([300, 129, 64, 17], 128, torch.Generator().manual_seed(22), "cuda")
    return model, ids, mask


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.xfail(reason="known (issue 34): on this tiny random model the official numerics amplify rounding ~500x, "
                          "so the torch backend itself fails this criterion when its attention inputs are perturbed "
                          "by 1e-4; H200 2026-11-28: Triton logits 4.9e-2 / 1.15e-1 apart at step 0, noise floor "
                          "2.1e-1 / 1.4e-1 (see the noise-floor test below)", strict=False)
@pytest.mark.parametrize("numerics", list(NUMERICS))
def test_triton_backend_generates_the_torch_backends_tokens(numerics: str) -> None:
    pytest.importorskip("triton")
    model, ids, mask = _batch()
    lengths, L = [int(n) for n in mask.sum(1)], ids.shape[1]
    ref = _generate(model, ids, mask, "torch", NUMERICS[numerics])
    got = _generate(model, ids, mask, "triton", NUMERICS[numerics])
    ref_logits, got_logits = torch.stack(ref.logits).float(), torch.stack(got.logits).float()  # [steps, B, V]
    assert torch.isfinite(got_logits).all()
    compared, worst = 0, 0.0
    for b in range(len(lengths)):
        for t in range(ref_logits.shape[0]):
            want, have = ref.sequences[b, L + t], got.sequences[b, L + t]
            if want != have:
                top2 = ref_logits[t, b].topk(2).values
                gap = (top2[0] - top2[1]).item() / ref_logits[t, b].abs().max().item()
                assert gap <= NEAR_TIE, f"row {b} step {t}: token {have} vs {want}, not a near-tie (gap {gap:.2e})"
                break
            err = ((got_logits[t, b] - ref_logits[t, b]).norm() / ref_logits[t, b].norm()).item()
            worst = max(worst, err)
            assert err <= LOGIT_TOL, (b, t, err)
            compared += 1
    print(f"\n{numerics}: {compared} (row, step) logits compared, worst relative error {worst:.3e}")
    assert compared >= 0.75 * ref_logits.shape[0] * len(lengths), compared


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("numerics", list(NUMERICS))
def test_triton_backend_within_the_torch_backends_noise_floor(numerics: str) -> None:
    """The first generated token's logits of the Triton backend differ from the torch backend's by no more than the
    torch backend's own differ when its attention inputs are perturbed by 1e-4 relative (far below one BF16 step,
    3.9e-3): the official numerics amplify rounding differences about 500× on this tiny random model (top-8 of ≤ 75
    entries, ReLU-zero score ties, FP8 activation codes), so this is the resolution at which two correct
    implementations can be told apart on it. Per row: Triton's error ≤ 2 × the largest of three perturbed runs'."""
    pytest.importorskip("triton")
    model, ids, mask = _batch()
    nm = NUMERICS[numerics]
    ref = _generate(model, ids, mask, "torch", nm, new=1).logits[0].float()
    got = _generate(model, ids, mask, "triton", nm, new=1).logits[0].float()
    floor = torch.stack([
        (_generate(model, ids, mask, "torch", nm, noise=1e-4, seed=s, new=1).logits[0].float() - ref).norm(dim=-1)
        for s in range(3)]).amax(0) / ref.norm(dim=-1)
    err = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    print(f"\n{numerics}: Triton vs torch per row {[f'{e:.2e}' for e in err.tolist()]}; "
          f"noise floor {[f'{f:.2e}' for f in floor.tolist()]}")
    assert torch.isfinite(got).all()
    assert (err <= 2 * floor).all(), (err.tolist(), floor.tolist())
