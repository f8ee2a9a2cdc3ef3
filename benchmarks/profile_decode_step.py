"""Where a whole decode step's time goes: the kernels of the engine's graph-replayed decode steps, per kernel name.

The engine runs ``--requests`` prompts of ``--prompt-len`` tokens with ``--gen-len`` tokens each, as ``dsv4 run``
does, twice: once unprofiled (each decode-only step's wall and GPU time), then with the torch profiler (device side)
over ``--steps`` decode-only steps from the first one after every prompt is prefilled (the full batch). Per kernel
name: launches and µs per step; the kernels' sum, the time the GPU ran at least one of them (union), and the
span. ``span − union`` is the GPU's idle time inside the profiled steps; the kernel table says which kernels — the
layers', the residual glue's, the hidden states', the step's inputs — cost what. ``benchmarks/profile_layer.py``
times one layer of each kind alone; this script shows the same kernels in the run, where the rows are the run's
batch and the caches the run's.

    python benchmarks/profile_decode_step.py [--preset v4-flash] [--requests 64] [--prompt-len 8192]
        [--gen-len 96] [--steps 16] [--side-stream on|off] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

from torch.profiler import ProfilerActivity

from dsv4.bench.roofline import environment
from dsv4.engine import make_requests
from profile_step import cuda_engine, kernel_table, profiled_run

REQUIRES_CUDA = True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="v4-flash", help="model preset")
    ap.add_argument("--requests", type=int, default=64, help="prompts, the decode batch")
    ap.add_argument("--prompt-len", type=int, default=8192, help="tokens per prompt")
    ap.add_argument("--gen-len", type=int, default=96, help="tokens generated per request")
    ap.add_argument("--max-batched-tokens", type=int, default=8192, help="the step's token budget")
    ap.add_argument("--steps", type=int, default=16, help="decode-only steps profiled")
    ap.add_argument("--top", type=int, default=30, help="kernel names to list")
    ap.add_argument("--side-stream", default="on", choices=("on", "off"),
                    help="each layer's writes and ring commit on a second CUDA stream (the default) or not")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    cfg, engine = cuda_engine("profile_decode_step.py", args.preset, args.requests, args.max_batched_tokens,
                              side_stream=args.side_stream == "on")

    def requests() -> list:
        return make_requests(args.requests, args.prompt_len, args.gen_len, seed=0)

    steps = engine.run(requests()).steps  # every run schedules alike
    last_prefill = max(i for i, s in enumerate(steps) if s.prefill_tokens)
    first, last = last_prefill + 1, min(len(steps) - 1, last_prefill + 1 + args.steps)
    if last <= first:
        raise SystemExit("no decode-only steps after the prompts: raise --gen-len")
    window = steps[first + 1 : last + 1]
    table = kernel_table(profiled_run(engine, requests, (first, last), [ProfilerActivity.CUDA]), last - first)

    env = environment()
    print(f"{env['device']}  {args.preset}, {cfg.num_layers} layers: {args.requests} x {args.prompt_len} tokens, "
          f"gen {args.gen_len}; decode-only steps {first + 1}-{last} profiled")
    print(f"unprofiled, those steps: batch {statistics.mean(s.decode_tokens for s in window):.1f}, wall p50 "
          f"{statistics.median(s.seconds for s in window) * 1e3:.2f} ms, GPU events p50 "
          f"{statistics.median(s.gpu_seconds for s in window) * 1e3:.2f} ms, graph {sum(s.graph for s in window)}"
          f"/{len(window)}")
    print(f"profiled, per step: kernels {table['kernel_sum_ms']:.3f} ms summed, {table['kernel_union_ms']:.3f} ms "
          f"busy (union), span {table['span_ms']:.3f} ms, {table['launches']:.0f} launches")
    print(f"{'kernel':<72}{'calls/step':>11}{'us/step':>9}{'us/call':>9}{'%':>6}")
    for k in table["kernels"][: args.top]:
        print(f"{k['name']:<72}{k['calls']:>11.1f}{k['ms'] * 1e3:>9.1f}{k['ms'] * 1e3 / k['calls']:>9.2f}"
              f"{100 * k['ms'] / table['kernel_sum_ms']:>6.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "preset": args.preset, "requests": args.requests, "prompt_len": args.prompt_len,
                       "gen_len": args.gen_len, "window": [first, last], **table}, f, indent=1)


if __name__ == "__main__":
    main()
