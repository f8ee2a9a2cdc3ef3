"""Diagnostic (GPU): where the Triton backend's logits part from the torch backend's in ``dsv4.hf`` (issue 34).

The model and prompts of ``tests/hf/test_hf_generate_gpu.py`` (tiny preset, ``random_causal_lm`` seed 21, four
left-padded rows of 300 / 129 / 64 / 17 tokens from generator seed 22), one prefill forward per run, for the
official numerics with FP8 and with BF16 projections. Runs:

* ``torch`` — the torch backend on CUDA (the reference of every comparison);
* ``triton`` — the Triton backend on CUDA, fed the model's own hidden states (errors accumulate over layers);
* ``triton-replay`` — the Triton backend on a fresh cache, every attention module fed the ``torch`` run's input
  (forward pre-hooks), so each layer's error is its own;
* ``torch-cpu`` / ``torch-cpu-replay`` — the torch backend on a CPU copy of the model: the same formulas summed in
  other orders (the noise floor of two correct implementations);
* ``torch+noise`` — the torch backend on CUDA with every attention input multiplied by ``1 + 1e-4·N(0,1)`` (far
  below one BF16 step): how much the model amplifies a perturbation that small.

Sections (each guarded: one failing prints its error and the others still run): step-0 logits per row; each
layer's attention output per row (accumulated and replayed); CSA top-k sets of the replay against the torch run's
(how many query rows differ, and whether only by near-ties of the torch run's index scores); the cache after the
replayed prefill against the torch run's (window ring bytes, main KV entries, indexer keys, compressor state);
optionally (``--generate``) the GPU test's own criterion for triton / torch-cpu / torch+noise against torch.

Usage (repo root): PYTHONPATH=src python3 tools/diag_hf_backends.py [--generate] [--noise 1e-4]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
import traceback
from typing import Any, Callable

import torch

import dsv4
from dsv4.config import LayerKind
from dsv4.layer import Attention
from dsv4.ops import torch_ops
from dsv4.reference.indexer import index_scores, topk_within

LENGTHS = (300, 129, 64, 17)
NEAR_TIE = 2.0**-7  # the GPU test's near-tie rule (gap of the top two logits / max |logit|)
TOPK_NEAR_TIE = 1e-2  # a top-k set difference whose score gap is within this share of the row's largest score


# ------------------------------------------------------------------------------------------------ recording
class Recorder:
    """While ``active``: each dsv4 layer's ``StepOutputs`` and the torch backend's index scores, by layer."""

    def __init__(self) -> None:
        self.active = False
        self.aux: dict[int, Any] = {}
        self.scores: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def reset(self) -> None:
        self.aux, self.scores = {}, {}


REC = Recorder()
_orig_call = Attention.__call__
_orig_topk = torch_ops.indexer_topk


def _recording_call(self: Attention, x, batch, cache, plan=None):
    out = self.forward_with_aux(x, batch, cache, plan)
    if REC.active:
        REC.aux[self.layer_idx] = out
    return out.y


def _recording_topk(step, q_idx, head_weights):
    """The torch backend's top-k, unchanged; also keeps its index scores ``[T, N]`` (−inf where no entry)."""
    out = _orig_topk(step, q_idx, head_weights)
    if REC.active:
        batch, m = step.batch, step.ratio
        n = max(((s + c) // m for s, c in zip(batch.start_positions, batch.num_new)), default=0)
        full = torch.full((batch.num_tokens, max(n, 1)), float("-inf"), device=q_idx.device)
        for rows, keys in torch_ops.request_index_keys(step.cache, batch, m):
            s = index_scores(q_idx[rows], head_weights[rows], keys, step.numerics.score_dtype).float()
            full[rows, : s.shape[1]] = s
        REC.scores[step.layer_idx] = (full, batch.visible_entries[m].clone())
    return out


def install_recording() -> None:
    Attention.__call__ = _recording_call
    torch_ops.indexer_topk = _recording_topk


# ------------------------------------------------------------------------------------------------ runs
@dataclasses.dataclass
class Run:
    logits: torch.Tensor  # [B, V] float32, last column (step 0 of generate)
    ins: dict[int, torch.Tensor]  # attention input [B, S, d] per layer
    outs: dict[int, torch.Tensor]  # attention output [B, S, d] per layer
    aux: dict[int, Any]
    scores: dict[int, tuple[torch.Tensor, torch.Tensor]]
    cache: Any  # DSV4Cache


def prompts(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    import dsv4.hf

    return dsv4.hf.left_padded_prompts(LENGTHS, 128, torch.Generator().manual_seed(22), device)


def prefill(model, backend: str, numerics, replay: dict[int, torch.Tensor] | None = None, noise: float = 0.0) -> Run:
    import dsv4.hf

    device = next(model.parameters()).device
    ids, mask = prompts(str(device))
    dsv4.hf.attach(model, backend=backend, numerics=numerics)
    ins, outs, hooks = {}, {}, []
    gen = torch.Generator(device="cpu").manual_seed(5)
    for i, layer in enumerate(model.model.layers):
        def pre(mod, args, i=i):
            x = args[0]
            if replay is not None:
                x = replay[i].to(x.device, x.dtype).clone()
            if noise:
                x = x * (1 + noise * torch.randn(x.shape, generator=gen).to(x.device, x.dtype))
            return (x,) + tuple(args[1:])

        def post(mod, args, out, i=i):
            ins[i], outs[i] = args[0].detach().float().cpu(), out[0].detach().float().cpu()

        hooks += [layer.self_attn.register_forward_pre_hook(pre), layer.self_attn.register_forward_hook(post)]
    REC.reset()
    REC.active = True
    try:
        with torch.no_grad():
            o = model(ids, attention_mask=mask, use_cache=True)
    finally:
        REC.active = False
        for h in hooks:
            h.remove()
        dsv4.hf.detach(model)
    cache = getattr(o, "past_key_values", None) or getattr(o, "cache", None)
    return Run(o.logits[:, -1].float().cpu(), ins, outs, dict(REC.aux), dict(REC.scores), cache)


# ------------------------------------------------------------------------------------------------ helpers
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def row_cols(b: int) -> slice:
    L = max(LENGTHS)
    return slice(L - LENGTHS[b], L)


def token_rows(b: int) -> slice:
    """Row ``b``'s tokens in the step's plan order (rows in order, each row's real tokens)."""
    start = sum(LENGTHS[:b])
    return slice(start, start + LENGTHS[b])


def section(title: str, fn: Callable[[], None]) -> None:
    print(f"\n## {title}", flush=True)
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
        print(f"   !! section failed: {type(e).__name__}: {e}")
        print("   " + "".join(traceback.format_exc().splitlines(keepends=True)[-6:]).replace("\n", "\n   "))
    print(flush=True)


def fmt(v: float | None) -> str:
    return "   -    " if v is None else f"{v:8.2e}"


# ------------------------------------------------------------------------------------------------ sections
def logits_table(runs: dict[str, Run]) -> None:
    ref = runs["torch"].logits
    names = [n for n in ("triton", "torch-cpu", "torch+noise") if n in runs]
    print("   step-0 logits, relative L2 vs the torch backend on CUDA (and the torch run's top-2 gap / max|logit|)")
    print("   row  len  " + "  ".join(f"{n:>11}" for n in names) + "   top2-gap")
    for b, n in enumerate(LENGTHS):
        top2 = ref[b].topk(2).values
        gap = float((top2[0] - top2[1]) / ref[b].abs().max())
        vals = "  ".join(f"{rel(runs[k].logits[b], ref[b]):11.2e}" for k in names)
        print(f"   {b:3d} {n:4d}  {vals}   {gap:8.2e}")


def layer_table(runs: dict[str, Run], cfg) -> None:
    ref = runs["torch"]
    names = [n for n in ("triton", "triton-replay", "torch-cpu", "torch-cpu-replay", "torch+noise") if n in runs]
    print("   attention output of each layer, relative L2 vs torch (CUDA), per row; *-replay: fed torch's input")
    print("   layer kind row  " + "  ".join(f"{n:>16}" for n in names) + "   input(triton)")
    for i in range(cfg.num_layers):
        kind = cfg.layer_kind(i).name
        for b in range(len(LENGTHS)):
            c = row_cols(b)
            vals = "  ".join(f"{rel(runs[k].outs[i][b, c], ref.outs[i][b, c]):16.2e}" for k in names)
            inp = rel(runs["triton"].ins[i][b, c], ref.ins[i][b, c]) if "triton" in runs else None
            print(f"   {i:5d} {kind:4s} {b:3d}  {vals}   {fmt(inp)}")


def topk_table(runs: dict[str, Run], cfg) -> None:
    ref = runs["torch"]
    k = cfg.index_topk
    names = [n for n in ("triton-replay", "torch-cpu-replay", "triton") if n in runs]
    print(f"   CSA top-k (k={k}) vs the torch run's sets: query rows with > k visible entries / rows whose set differs"
          f" / of those, within {TOPK_NEAR_TIE:g}·max|score| of the torch scores (near-ties) / worst gap;"
          " ties: rows whose k-th and (k+1)-th torch scores are equal")
    for i in range(cfg.num_layers):
        if cfg.layer_kind(i) is not LayerKind.CSA or i not in ref.scores:
            continue
        scores, visible = ref.scores[i]
        scores, visible = scores.cpu(), visible.cpu()
        want = ref.aux[i].entry_idx.cpu()
        for name in names:
            if i not in runs[name].aux:
                print(f"   layer {i} {name}: no record")
                continue
            got = runs[name].aux[i].entry_idx.cpu()
            for b in range(len(LENGTHS)):
                r = token_rows(b)
                s, v, w, g = scores[r], visible[r], want[r], got[r]
                many = v > k
                if not bool(many.any()):
                    continue
                differ = torch.tensor([sorted(x[x >= 0].tolist()) != sorted(y[y >= 0].tolist())
                                       for x, y in zip(w, g)], dtype=torch.bool)
                s_fin = torch.where(torch.isinf(s), torch.zeros_like(s), s)
                ok, gap = topk_within(s_fin, v, g, k, TOPK_NEAR_TIE)
                ties = 0
                if s.shape[1] > k:
                    top = s.topk(k + 1, dim=-1).values
                    ties = int(((top[:, k - 1] == top[:, k]) & many).sum())
                worst = float(gap[differ].max()) if differ.any() else None
                print(f"   layer {i} {name:16s} row {b}: {int(many.sum()):3d} rows > k, {int(differ.sum()):3d} differ, "
                      f"{int((differ & ok).sum()):3d} near-tie, worst gap {fmt(worst)}, ties {ties}")


def _entries(hybrid, layer_idx: int, rid: str, m: int, which: str, block_size: int) -> torch.Tensor | None:
    layer = hybrid.layer(layer_idx)
    pages = layer.kv_pages if which == "kv" else layer.index_pages
    storage = layer.schema.kv_storage if which == "kv" else layer.schema.index_storage
    n = hybrid.num_tokens(rid) // m
    if pages is None or n == 0:
        return None
    table = torch.tensor(hybrid.block_table(rid), dtype=torch.long)
    first = torch.arange(n) * m
    block = table[first // block_size].to(pages.device)
    slot = ((first % block_size) // m).to(pages.device)
    return storage.read(pages, block, slot).float().cpu()


def cache_table(runs: dict[str, Run], cfg, names: tuple[str, ...]) -> None:
    ref = runs["torch"].cache
    print("   cache after the prefill vs the torch run's (replays: same layer inputs), all rows: ring = differing bytes "
          "of the window rings (positions equal?); kv / index = entries differing / entries (worst relative L2 of an "
          "entry); state = differing bytes of the compressor state rows")
    for name in names:
        if name not in runs:
            continue
        got = runs[name].cache
        hr, hg = ref.hybrid, got.hybrid
        bs = ref.settings.block_size
        for i in range(cfg.num_layers):
            m = cfg.ratio(i)
            lr, lg = hr.layer(i), hg.layer(i)
            ring, pos_ok, state = 0, True, 0
            entries = {"kv": [0, 0, 0.0], "index": [0, 0, 0.0]}
            for rr, rg in zip(ref.request_ids, got.request_ids):
                sr, sg = hr.slot(rr), hg.slot(rg)
                ring += int((lr.ring[sr] != lg.ring[sg]).sum())
                pos_ok &= bool(torch.equal(lr.ring_positions[sr], lg.ring_positions[sg]))
                if not m:
                    continue
                for which, acc in entries.items():
                    a, c = _entries(hr, i, rr, m, which, bs), _entries(hg, i, rg, m, which, bs)
                    if a is None or c is None:
                        continue
                    acc[0] += int((a != c).any(-1).sum())
                    acc[1] += a.shape[0]
                    acc[2] = max(acc[2], max(((x - y).norm() / y.norm().clamp_min(1e-30)).item() for x, y in zip(c, a)))
                for key, t in lr.state.items():
                    if not key.startswith("ring"):
                        u = lg.state[key]
                        state += int((t[sr].contiguous().view(torch.uint8) != u[sg].contiguous().view(torch.uint8)).sum())
            parts = [f"ring {ring:6d} B (positions {'equal' if pos_ok else 'DIFFER'})"]
            parts += [f"{w} {d:3d}/{n:3d} (worst {x:.1e})" for w, (d, n, x) in entries.items() if n]
            if m:
                parts.append(f"state {state} B")
            print(f"   {name:16s} layer {i} {cfg.layer_kind(i).name:4s}: " + ", ".join(parts))


def generate_table(model, cpu_model, numerics, noise: float, backend: str = "triton") -> None:
    import dsv4.hf

    ids, mask = prompts(str(next(model.parameters()).device))
    L = ids.shape[1]

    def gen(m, backend, noise_=0.0):
        dsv4.hf.attach(m, backend=backend, numerics=numerics)
        hooks = []
        g = torch.Generator(device="cpu").manual_seed(5)
        if noise_:
            for layer in m.model.layers:
                def pre(mod, args):
                    x = args[0]
                    return (x * (1 + noise_ * torch.randn(x.shape, generator=g).to(x.device, x.dtype)),) + tuple(args[1:])
                hooks.append(layer.self_attn.register_forward_pre_hook(pre))
        dev = next(m.parameters()).device
        try:
            with torch.no_grad():
                return m.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=16, do_sample=False,
                                  return_dict_in_generate=True, output_logits=True)
        finally:
            for h in hooks:
                h.remove()
            dsv4.hf.detach(m)

    ref = gen(model, "torch")
    others = {"triton": lambda: gen(model, backend), "torch+noise": lambda: gen(model, "torch", noise)}
    if cpu_model is not None:
        others["torch-cpu"] = lambda: gen(cpu_model, "torch")
    rl = torch.stack(ref.logits).float().cpu()
    print("   the GPU test's criterion vs torch (CUDA): first step whose greedy token differs, the torch run's top-2 "
          f"gap there (near-tie if <= 2^-7 = {NEAR_TIE:.2e}), worst logit error before it")
    for name, fn in others.items():
        try:
            got = fn()
        except Exception as e:  # noqa: BLE001
            print(f"   {name}: failed: {type(e).__name__}: {e}")
            continue
        gl = torch.stack(got.logits).float().cpu()
        for b in range(len(LENGTHS)):
            worst, verdict = 0.0, "same 16 tokens"
            for t in range(rl.shape[0]):
                if ref.sequences[b, L + t] != got.sequences[b, L + t]:
                    top2 = rl[t, b].topk(2).values
                    gap = float((top2[0] - top2[1]) / rl[t, b].abs().max())
                    verdict = f"differs at step {t:2d}, gap {gap:.2e} ({'near-tie' if gap <= NEAR_TIE else 'NOT a near-tie'})"
                    break
                worst = max(worst, rel(gl[t, b], rl[t, b]))
            print(f"   {name:12s} row {b}: {verdict}; worst logit error before: {worst:.2e}")


# ------------------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--noise", type=float, default=1e-4, help="relative noise of the torch+noise run")
    ap.add_argument("--generate", action="store_true", help="also the GPU test's 16-token criterion (slower)")
    ap.add_argument("--no-cpu", action="store_true", help="skip the torch backend on the CPU")
    ap.add_argument("--device", default="cuda", help="where the model runs (cpu with --backend torch: a smoke test)")
    ap.add_argument("--backend", default="triton", help="the backend compared with torch")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    import dsv4.hf
    import transformers

    t0 = time.time()
    where = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {where}; compared backend {a.backend}")
    install_recording()
    cfg = dsv4.ModelConfig.preset("tiny")
    model = dsv4.hf.random_causal_lm(cfg, seed=21, device=a.device)
    cpu_model = None if a.no_cpu else copy.deepcopy(model).to("cpu")
    official = dsv4.Numerics.official()
    variants = {"official (FP8 projections)": official,
                "official, BF16 projections": dataclasses.replace(official, fp8_projections=False)}
    for title, nm in variants.items():
        print(f"\n################ {title}", flush=True)
        runs: dict[str, Run] = {}

        def do(name: str, fn: Callable[[], Run]) -> None:
            try:
                runs[name] = fn()
            except Exception as e:  # noqa: BLE001
                print(f"   run {name} failed: {type(e).__name__}: {e}")
                print("   " + "".join(traceback.format_exc().splitlines(keepends=True)[-6:]).replace("\n", "\n   "))

        do("torch", lambda: prefill(model, "torch", nm))
        if "torch" not in runs:
            continue
        do("triton", lambda: prefill(model, a.backend, nm))
        do("triton-replay", lambda: prefill(model, a.backend, nm, replay=runs["torch"].ins))
        if cpu_model is not None:
            do("torch-cpu", lambda: prefill(cpu_model, "torch", nm))
            do("torch-cpu-replay", lambda: prefill(cpu_model, "torch", nm, replay=runs["torch"].ins))
        do("torch+noise", lambda: prefill(model, "torch", nm, noise=a.noise))
        print(f"   ({time.time() - t0:.0f} s so far)")
        section("step-0 logits", lambda: logits_table(runs))
        section("per-layer attention outputs", lambda: layer_table(runs, cfg))
        section("CSA top-k sets", lambda: topk_table(runs, cfg))
        section("cache contents", lambda: cache_table(runs, cfg, ("triton-replay", "torch-cpu-replay")))
        if a.generate:
            section("generate criterion", lambda: generate_table(model, cpu_model, nm, a.noise, a.backend))
        print(f"   ({time.time() - t0:.0f} s so far)")


if __name__ == "__main__":
    main()
