"""``model.generate()`` on a transformers DeepseekV4ForCausalLM whose attention dsv4 serves (``dsv4.hf``).

Oracle: transformers' own ``generate()`` on the same model, detached (its eager FP32 attention), against dsv4 with
``numerics="exact"`` (FP32, no quantization): the same tokens and logits within 1e-4 relative, on tiny random
models with SWA, CSA and HCA layers, YaRN and plain RoPE on the compressed layers.

Padded batches: transformers does not mask padding inside its compressors (transformers issue #45938, SPEC §8)
and forms compressor windows and their RoPE positions by column rather than by position, so its own output for
a left-padded row differs from the same prompt unpadded (here by ~100% of the logits). dsv4 keeps each row's real
tokens only, from position 0 — the unpadded computation. So every padded row is compared with transformers'
unpadded single-row ``generate()`` of the same prompt; batches without padding are compared batch to batch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import dsv4

transformers = pytest.importorskip("transformers")
import dsv4.hf  # noqa: E402
from dsv4.hf import DSV4Cache, InconsistentInputError  # noqa: E402

TINY = dsv4.ModelConfig.preset("tiny")  # layers SWA, CSA (m=4), HCA (m'=16), CSA; window 16, top-k 8
CONFIGS = {
    "yarn": TINY,
    # plain RoPE on the compressed layers, another layer order, a CSA top-k that selects
    "default-rope": TINY.replace(name="tiny-default-rope", compress_rope_type="default",
                                 compress_ratios=(16, 0, 4, 4, 0), index_topk=4),
}
NEW = 14  # tokens generated per row
REL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models run several times faster on one thread (and the CI machine has two cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    return dsv4.hf.random_causal_lm(CONFIGS[request.param], seed=len(request.param))


@pytest.fixture(scope="module")
def yarn_model():
    return dsv4.hf.random_causal_lm(TINY, seed=11)


@contextlib.contextmanager
def attached(model, numerics: str = "exact", backend: str = "torch", **kwargs):
    att = dsv4.hf.attach(model, backend=backend, numerics=numerics, **kwargs)
    try:
        yield att
    finally:
        dsv4.hf.detach(model)


def prompts(lengths: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g) for n in lengths]


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` / ``attention_mask`` ``[B, max_len]``, pads (id 0) on the left."""
    L = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, L - len(r):] = r
        mask[b, L - len(r):] = 1
    return ids, mask


def generate(model, ids, mask=None, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW)
    kwargs.setdefault("do_sample", False)
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True, **kwargs)


def logits(out, row: int) -> torch.Tensor:
    """``[steps, vocab]`` FP32 logits of one row."""
    return torch.stack(out.logits)[:, row]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst relative error over the steps (rows of ``[steps, vocab]``)."""
    return ((got.double() - want.double()).norm(dim=-1) / want.double().norm(dim=-1)).max().item()


def with_cache(cache) -> dict:
    """``generate()`` / forward keyword for a cache: ``cache`` (transformers >= 5.24) or ``past_key_values``."""
    import inspect

    from transformers import DeepseekV4ForCausalLM

    name = "cache" if "cache" in inspect.signature(DeepseekV4ForCausalLM.forward).parameters else "past_key_values"
    return {name: cache}


def returned_cache(out) -> DSV4Cache:
    cache = out.get("cache", out.get("past_key_values"))
    assert isinstance(cache, DSV4Cache)
    return cache


def test_greedy_batch_matches_transformers(model) -> None:
    """Batch without padding (prompt 37 tokens: past the window 16 and HCA ratio 16): batch to batch."""
    ids = torch.stack(prompts([37, 37, 37], seed=1))
    want = generate(model, ids)
    with attached(model):
        got = generate(model, ids)
    assert torch.equal(got.sequences, want.sequences)
    for b in range(3):
        assert rel_err(logits(got, b), logits(want, b)) <= REL
    assert len(set(want.sequences[:, 37:].flatten().tolist())) > 5  # the model's tokens depend on the context


def test_greedy_left_padded_batch_matches_unpadded_rows(model) -> None:
    """Rows of 41, 23, 9 and 1 tokens left-padded into one batch; each row against transformers' unpadded
    single-row generate (see the module docstring for why not transformers' padded batch)."""
    rows = prompts([41, 23, 9, 1], seed=2)
    ids, mask = left_pad(rows)
    want = [generate(model, r[None]) for r in rows]
    with attached(model):
        got = generate(model, ids, mask)
        cache = returned_cache(got)
    for b, (r, w) in enumerate(zip(rows, want)):
        assert torch.equal(got.sequences[b, ids.shape[1]:], w.sequences[0, len(r):]), b
        assert rel_err(logits(got, b), logits(w, 0)) <= REL, b
    # each row's request holds its real tokens only: prompt + fed generated tokens (the last one is never fed)
    assert cache.row_tokens() == [len(r) + NEW - 1 for r in rows]
    assert cache.get_seq_length() == ids.shape[1] + NEW - 1


def test_chunked_prefill_with_all_pad_chunks(yarn_model) -> None:
    """``prefill_chunk_size``: a short row has no real token in the first chunks (it joins later)."""
    rows = prompts([40, 6], seed=3)
    ids, mask = left_pad(rows)
    with attached(yarn_model):
        whole = generate(yarn_model, ids, mask)
        chunked = generate(yarn_model, ids, mask, prefill_chunk_size=16)
    assert torch.equal(whole.sequences, chunked.sequences)
    for b in range(2):
        assert rel_err(logits(chunked, b), logits(whole, b)) <= REL


def test_use_cache_false(yarn_model) -> None:
    """``use_cache=False``: every step runs the whole sequence through a fresh cache; the same tokens and logits."""
    rows = prompts([15, 7], seed=16)
    ids, mask = left_pad(rows)
    with attached(yarn_model):
        cached = generate(yarn_model, ids, mask, max_new_tokens=5)
        uncached = generate(yarn_model, ids, mask, max_new_tokens=5, use_cache=False)
    assert torch.equal(cached.sequences, uncached.sequences)
    for b in range(2):
        assert rel_err(logits(uncached, b), logits(cached, b)) <= REL


def test_sampling_same_seed_as_transformers(yarn_model) -> None:
    ids = torch.stack(prompts([30, 30], seed=4))
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    torch.manual_seed(123)
    want = generate(yarn_model, ids, **kw)
    with attached(yarn_model):
        torch.manual_seed(123)
        got = generate(yarn_model, ids, **kw)
        torch.manual_seed(124)
        other = generate(yarn_model, ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert not torch.equal(other.sequences, got.sequences)  # the seed matters: these tokens are sampled
    for b in range(2):
        assert rel_err(logits(got, b), logits(want, b)) <= REL


def test_num_return_sequences(yarn_model) -> None:
    """Rows expanded by generate(): each copy is its own request; sampled with transformers' seed."""
    ids = torch.stack(prompts([25, 25], seed=5))
    kw = dict(do_sample=True, top_k=0, num_return_sequences=3)
    torch.manual_seed(7)
    want = generate(yarn_model, ids, **kw)
    with attached(yarn_model):
        torch.manual_seed(7)
        got = generate(yarn_model, ids, **kw)
        assert len(returned_cache(got).request_ids) == 6
    assert got.sequences.shape == (6, 25 + NEW)
    assert torch.equal(got.sequences, want.sequences)
    assert len({tuple(s) for s in got.sequences[:3, 25:].tolist()}) > 1  # the copies of a prompt diverge


def test_eos_stops_rows_independently(yarn_model) -> None:
    """EOS = a token row 0 generates early; finished rows are fed pad tokens (mask 1) by generate() and stay
    consistent; each row equals transformers' unpadded run with the same EOS."""
    rows = prompts([33, 20, 12], seed=6)
    ids, mask = left_pad(rows)
    probe = generate(yarn_model, rows[0][None])
    eos = int(probe.sequences[0, len(rows[0]) + 2])  # row 0's third token
    want = [generate(yarn_model, r[None], eos_token_id=eos, pad_token_id=0) for r in rows]
    with attached(yarn_model):
        got = generate(yarn_model, ids, mask, eos_token_id=eos, pad_token_id=0)
    L = ids.shape[1]
    finished = 0
    for b, (r, w) in enumerate(zip(rows, want)):
        n = w.sequences.shape[1] - len(r)
        assert torch.equal(got.sequences[b, L:L + n], w.sequences[0, len(r):]), b
        assert (got.sequences[b, L + n:] == 0).all()  # padded after this row's EOS
        assert rel_err(logits(got, b)[:n], logits(w, 0)) <= REL
        finished += int(eos in w.sequences[0, len(r):].tolist())
    assert finished >= 1 and eos in got.sequences[0, L:L + 3].tolist()


def test_follow_up_turn_reuses_the_cache(yarn_model) -> None:
    """Turn 2 passes turn 1's cache and the whole conversation: only the new columns are computed, and the result
    equals a fresh generate over the whole conversation."""
    rows = prompts([26, 11], seed=7)
    ids, mask = left_pad(rows)
    user = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(8))
    with attached(yarn_model) as att:
        first = generate(yarn_model, ids, mask, max_new_tokens=6)
        cache = returned_cache(first)
        seen = cache.get_seq_length()
        ids2 = torch.cat([first.sequences, user], dim=1)
        mask2 = torch.cat([mask, torch.ones(2, ids2.shape[1] - mask.shape[1], dtype=torch.long)], dim=1)
        steps = []
        begin = cache.begin_step
        cache.begin_step = lambda *a, **k: steps.append(a[:2]) or begin(*a, **k)
        second = generate(yarn_model, ids2, mask2, **with_cache(cache))
        fresh = generate(yarn_model, ids2, mask2)
        assert att.settings.numerics.name == "exact"
    assert seen == ids2.shape[1] - 1 - 5  # turn 1's last token and the user's 5 are new
    assert steps[0] == (2, 6) and all(s == (2, 1) for s in steps[1:])
    assert torch.equal(second.sequences, fresh.sequences)
    for b in range(2):
        assert rel_err(logits(second, b), logits(fresh, b)) <= REL


def test_cache_grows_and_caller_hybrid(yarn_model) -> None:
    """A cache sized for 8 tokens per row grows (bit-identically); a caller's HybridCache is used, never grown."""
    ids = torch.stack(prompts([30, 30], seed=9))
    with attached(yarn_model, block_size=16) as att:
        want = generate(yarn_model, ids)
        small = DSV4Cache(yarn_model, max_length=8)
        got = generate(yarn_model, ids, **with_cache(small))
        assert small.growths >= 1 and torch.equal(got.sequences, want.sequences)
        s = att.settings
        hybrid = dsv4.HybridCache(s.cfg, layers=s.layers, max_requests=4, num_blocks=64, block_size=s.block_size,
                                  numerics=s.numerics)
        mine = DSV4Cache(yarn_model, hybrid=hybrid)
        got2 = generate(yarn_model, ids, **with_cache(mine))
        assert torch.equal(got2.sequences, want.sequences) and len(hybrid.active_requests) == 2
        mine.reset()
        assert hybrid.active_requests == [] and hybrid.num_free_blocks == 64
        small.reset()  # a reset cache serves a new, larger batch (its own HybridCache is re-made for 3 rows)
        ids3 = torch.cat([ids, ids[:1]])
        got3 = generate(yarn_model, ids3, **with_cache(small))
        assert torch.equal(got3.sequences[:2], want.sequences) and torch.equal(got3.sequences[2], want.sequences[0])
        tiny = dsv4.HybridCache(s.cfg, layers=s.layers, max_requests=4, num_blocks=1, block_size=s.block_size,
                                numerics=s.numerics)
        with pytest.raises(dsv4.CacheFullError):
            generate(yarn_model, ids, **with_cache(DSV4Cache(yarn_model, hybrid=tiny)))


def test_official_numerics_on_cpu(yarn_model) -> None:
    """numerics="official" (FP8 / MXFP4 cache, BF16 compute) through generate(): a padded batch equals its rows run
    alone through dsv4 (same numerics), and its first logits are near transformers' FP32 ones."""
    rows = prompts([34, 17], seed=10)
    ids, mask = left_pad(rows)
    exact = [generate(yarn_model, r[None], max_new_tokens=1) for r in rows]
    with attached(yarn_model, numerics="official"):
        got = generate(yarn_model, ids, mask)
        alone = [generate(yarn_model, r[None]) for r in rows]
    for b, (r, a) in enumerate(zip(rows, alone)):
        assert torch.equal(got.sequences[b, ids.shape[1]:], a.sequences[0, len(r):]), b
        assert rel_err(logits(got, b), logits(a, 0)) <= 2e-2
        assert rel_err(logits(got, b)[:1], logits(exact[b], 0)) <= 0.15


def test_attach_keeps_the_module_and_detach_restores(yarn_model) -> None:
    ids = torch.stack(prompts([20], seed=12))
    before = generate(yarn_model, ids)
    impl, keys = yarn_model.config._attn_implementation, set(yarn_model.state_dict())
    with attached(yarn_model):
        assert yarn_model.config._attn_implementation == dsv4.hf.ATTN_IMPLEMENTATION
        assert set(yarn_model.state_dict()) == keys
        # weights are read from the module: an in-place change shows through
        attn = yarn_model.model.layers[1].self_attn
        saved = attn.q_b_proj.weight.detach().clone()
        with torch.no_grad():
            attn.q_b_proj.weight.mul_(1.5)
        changed = generate(yarn_model, ids)
        with torch.no_grad():
            attn.q_b_proj.weight.copy_(saved)
        again = generate(yarn_model, ids)
    assert not torch.equal(torch.stack(changed.logits), torch.stack(again.logits))
    assert torch.equal(again.sequences, before.sequences)
    assert yarn_model.config._attn_implementation == impl
    after = generate(yarn_model, ids)
    assert torch.equal(torch.stack(after.logits), torch.stack(before.logits))


def test_fp8_quantized_projections(yarn_model) -> None:
    """Attention projections as transformers ``FP8Linear`` modules (E4M3 weights, UE8M0 scales per 128 x 128 block,
    as DeepSeek checkpoints ship them) give exactly what the same model with those weights dequantized gives."""
    import copy

    from transformers.integrations.finegrained_fp8 import FP8Linear

    from dsv4.checkpoint import dequantize_fp8_blocks, quantize_fp8_blocks

    fp8, dense = copy.deepcopy(yarn_model), copy.deepcopy(yarn_model)
    names = [n for n, m in yarn_model.named_modules()
             if n.endswith(("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj")) and ".self_attn." in n]
    assert len(names) > 8
    for name in names:
        parent, child = name.rsplit(".", 1)
        w = yarn_model.get_submodule(name).weight.detach()
        q, scale = quantize_fp8_blocks(w)
        layer = FP8Linear(w.shape[1], w.shape[0], block_size=(128, 128))
        layer.weight = torch.nn.Parameter(q, requires_grad=False)
        layer.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
        setattr(fp8.get_submodule(parent), child, layer)
        with torch.no_grad():
            dense.get_submodule(name).weight.copy_(dequantize_fp8_blocks(q, scale))
    ids = torch.stack(prompts([30, 30], seed=18))
    outs = []
    for model in (fp8, dense):
        with attached(model):
            outs.append(generate(model, ids))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert torch.equal(torch.stack(outs[0].logits), torch.stack(outs[1].logits))


# ------------------------------------------------------------------ bad input


def _used_cache(model, rows):
    """A cache after a prefill of ``rows`` (left-padded) through the model's forward."""
    ids, mask = left_pad(rows)
    cache = DSV4Cache(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **with_cache(cache))
    return cache, ids, mask


@pytest.mark.parametrize(
    "case, match",
    [
        ("right-padding", "right padding or a hole"),
        ("hole", "right padding or a hole"),
        ("non-binary", "values other than 0 and 1"),
        ("short-mask", r"has shape \[2, 1\] but the step needs \[2, 21\]"),
        ("past-mismatch", "marks 20 of the 20 past columns as real tokens but the cache holds 9"),
        ("4d-mask", "2D padding mask"),
        ("positions", "position_ids row 0"),
        ("cache-position", "cache_position must be the new columns 20"),
        ("batch-size", "the cache holds 2 rows but this step has 3"),
        ("no-mask", "no attention_mask, but row 1"),
    ],
)
def test_bad_step_input_is_refused_and_changes_nothing(yarn_model, case: str, match: str) -> None:
    with attached(yarn_model):
        cache, ids, mask = _used_cache(yarn_model, prompts([20, 9], seed=13))
        snap, columns, steps = cache.hybrid.snapshot(), cache.get_seq_length(), cache.num_steps
        new = torch.tensor([[5], [6]])
        kw = dict(input_ids=new, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
                  position_ids=torch.tensor([[20], [9]]))
        if case == "right-padding":
            kw["attention_mask"] = torch.cat([mask.flip(1), torch.ones(2, 1, dtype=torch.long)], 1)
        elif case == "hole":
            kw["attention_mask"][0, 5] = 0
        elif case == "non-binary":
            kw["attention_mask"] = kw["attention_mask"] * 2
        elif case == "short-mask":
            kw["attention_mask"] = torch.ones(2, 1, dtype=torch.long)
        elif case == "past-mismatch":
            kw["attention_mask"] = torch.ones(2, 21, dtype=torch.long)
        elif case == "4d-mask":
            kw["attention_mask"] = torch.zeros(2, 1, 1, 21)
        elif case == "positions":
            kw["position_ids"] = torch.tensor([[21], [9]])
        elif case == "cache-position":
            kw["cache_position"] = torch.tensor([19])
        elif case == "batch-size":
            kw = dict(input_ids=torch.tensor([[5], [6], [7]]), attention_mask=torch.ones(3, 21, dtype=torch.long))
        elif case == "no-mask":
            kw.pop("attention_mask")
        with pytest.raises(InconsistentInputError, match=match), torch.no_grad():
            yarn_model(use_cache=True, **with_cache(cache), **kw)
        cache.hybrid.assert_same(snap)
        assert (cache.get_seq_length(), cache.num_steps) == (columns, steps)
        # the cache still serves the right input
        good = dict(input_ids=new, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1))
        with torch.no_grad():
            yarn_model(use_cache=True, **with_cache(cache), **good)
        assert cache.row_tokens() == [21, 10]


def test_generate_refuses_right_padding(yarn_model) -> None:
    """A right-padded batch through generate(): a clear error on the first step, and no cache is kept."""
    rows = prompts([12, 5], seed=17)
    ids, mask = left_pad(rows)
    with attached(yarn_model):
        with pytest.raises(InconsistentInputError, match="attention_mask row 1 has a 0 after a 1"):
            generate(yarn_model, ids.flip(1), mask.flip(1))
        cache = DSV4Cache(yarn_model)
        with pytest.raises(InconsistentInputError, match="right padding"):
            generate(yarn_model, ids.flip(1), mask.flip(1), **with_cache(cache))
        assert cache.hybrid is None and cache.get_seq_length() == 0  # nothing was allocated or counted


def test_forward_that_stops_half_way_breaks_the_cache(yarn_model) -> None:
    """A NaN input makes layer 0 refuse (nothing written); the step is incomplete, so the cache refuses from then on
    (its token counts no longer match its pages) until reset()."""
    with attached(yarn_model):
        cache, ids, mask = _used_cache(yarn_model, prompts([12, 12], seed=14))
        embeds = torch.full((2, 1, TINY.hidden_size), float("nan"))
        with pytest.raises(ValueError, match="NaN"), torch.no_grad():
            yarn_model(inputs_embeds=embeds, attention_mask=torch.ones(2, 13), use_cache=True, **with_cache(cache))
        with pytest.raises(RuntimeError, match="did not finish"), torch.no_grad():
            yarn_model(input_ids=torch.tensor([[5], [6]]), attention_mask=torch.ones(2, 14), **with_cache(cache))
        with pytest.raises(RuntimeError, match="did not finish"):
            generate(yarn_model, ids, mask, **with_cache(cache))
        cache.reset()
        got = generate(yarn_model, ids, mask, **with_cache(cache))
        assert got.sequences.shape == (2, 12 + NEW)


def test_foreign_caches_and_unsupported_modes(yarn_model) -> None:
    from transformers import DynamicCache

    ids = torch.stack(prompts([10], seed=15))
    used = DynamicCache(config=yarn_model.config)
    with torch.no_grad():
        yarn_model(input_ids=ids, use_cache=True, **with_cache(used))  # transformers' attention fills it
    with attached(yarn_model):
        with pytest.raises(ValueError, match="needs a DSV4Cache .*already holding 10 tokens"):
            generate(yarn_model, ids, **with_cache(used))
        with pytest.raises(NotImplementedError, match="beam search"):
            generate(yarn_model, ids, num_beams=2)
    with pytest.raises(ValueError, match="attached with dsv4.hf.attach"):
        DSV4Cache(yarn_model)
    with pytest.raises(TypeError, match="DeepseekV4ForCausalLM"):
        dsv4.hf.attach(torch.nn.Linear(2, 2))


def test_plan_step_unit() -> None:
    """``row_tokens`` directly: counts and token order of a left-padded first step and of a decode step."""
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]])
    plan = dsv4.hf.row_tokens(3, 4, 0, [0, 0, 0], mask, position_ids=torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3], [0] * 4]))
    assert plan.new_tokens == (2, 4, 0) and plan.rows() == [0, 1] and plan.num_tokens == 6
    assert plan.token_index("cpu").tolist() == [2, 3, 4, 5, 6, 7]
    step = dsv4.hf.row_tokens(3, 1, 4, [2, 4, 0], torch.cat([mask, torch.tensor([[1], [1], [1]])], 1))
    assert step.new_tokens == (1, 1, 1) and step.token_index("cpu").tolist() == [0, 1, 2]
