"""Generate with a transformers DeepSeek-V4 model whose attention runs in dsv4.

    python examples/hf_generate.py                 # a tiny random model on the CPU (seconds)
    python examples/hf_generate.py --checkpoint DIR --device cuda --backend triton --numerics official

Without ``--checkpoint`` it builds a tiny random ``DeepseekV4ForCausalLM`` (SWA, CSA and HCA layers), generates
for a left-padded batch with transformers' own attention (each prompt alone: transformers does not mask padding
inside its compressors) and with dsv4 attached, compares the tokens, then continues the conversation on the
returned cache. With ``--checkpoint`` it loads the model and tokenizer and generates for two text prompts.
"""

from __future__ import annotations

import argparse
import time

import torch

import dsv4
import dsv4.hf


def random_demo(args: argparse.Namespace) -> None:
    cfg = dsv4.ModelConfig.preset("tiny")
    model = dsv4.hf.random_causal_lm(cfg, seed=0, device=args.device)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g) for n in (40, 23, 9)]
    L = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):  # left padding (pad id 0)
        ids[b, L - len(p):], mask[b, L - len(p):] = p, 1
    ids, mask = ids.to(args.device), mask.to(args.device)
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    t = time.perf_counter()
    want = [model.generate(p[None].to(args.device), **kw)[0, len(p):] for p in prompts]
    print(f"transformers (each prompt alone): {time.perf_counter() - t:.2f} s")

    dsv4.hf.attach(model, backend=args.backend, numerics=args.numerics)
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kw)
    print(f"dsv4 ({args.numerics}, {args.backend}), one padded batch: {time.perf_counter() - t:.2f} s")
    for b, w in enumerate(want):
        got = out.sequences[b, L:]
        verdict = "same as transformers" if torch.equal(got, w) else "differs"
        print(f"  row {b} ({len(prompts[b])} tokens): {got.tolist()}  {verdict}")
    if args.numerics == "official":
        print("  (official numerics quantize the cache to FP8 / MXFP4: a random model's logits have no margin, so its "
              "greedy tokens soon part ways with transformers' FP32 ones; --numerics exact agrees)")

    cache = out["cache"] if "cache" in out else out["past_key_values"]  # a dsv4.hf.DSV4Cache
    follow = torch.cat([out.sequences, torch.randint(3, 128, (len(prompts), 4), generator=g).to(args.device)], 1)
    mask2 = torch.cat([mask, torch.ones(len(prompts), follow.shape[1] - L, dtype=torch.long, device=args.device)], 1)
    cache_kw = {"cache" if "cache" in out else "past_key_values": cache}
    again = model.generate(follow, attention_mask=mask2, **cache_kw, **kw)
    print(f"follow-up turn on the same cache ({cache.get_seq_length()} columns, {cache.memory_in_use() / 2**10:.0f} KiB "
          f"in use): {again[:, follow.shape[1]:].tolist()}")


def checkpoint_demo(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.checkpoint, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16, device_map=args.device)
    dsv4.hf.attach(model, backend=args.backend, numerics=args.numerics)
    batch = tok(["The capital of France is", "Write a haiku about the sea:"], return_tensors="pt", padding=True)
    out = model.generate(**batch.to(args.device), max_new_tokens=args.max_new_tokens, do_sample=False)
    for text in tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True):
        print(repr(text))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="a DeepSeek-V4 checkpoint directory (default: a tiny random model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--numerics", default="exact", choices=["exact", "official"],
                   help="exact: FP32, agrees with transformers; official: FP8 / MXFP4 cache, BF16 compute")
    p.add_argument("--max-new-tokens", type=int, default=12)
    args = p.parse_args()
    if args.device == "cpu" and not args.checkpoint:
        torch.set_num_threads(1)  # a tiny model: threads cost more than they bring
    (checkpoint_demo if args.checkpoint else random_demo)(args)


if __name__ == "__main__":
    main()
