"""Registers, spills and shared memory of a kernel compiled for Hopper (sm_90) — on any machine, no GPU needed.

Compiles one of the project's Triton kernels ahead of time for ``GPUTarget("cuda", 90, 32)`` with the same
specialisation a launch gets (pointers and the usual strides divisible by 16), then reads the cubin's resource
usage with the ``cuobjdump`` shipped in the triton wheel. Use it to check a change's register pressure before
spending GPU time::

    python tools/sm90_resources.py attention                       # Flash CSA decode, split partials
    python tools/sm90_resources.py attention '{"BLOCK_N": 32}'     # constexpr / num_warps / num_stages overrides
    python tools/sm90_resources.py attention_ws '{"PRODUCER_REGS": 136}'  # warp-specialized, HCA
    python tools/sm90_resources.py write                           # HCA write path (entries in 8 parts)
    python tools/sm90_resources.py write '{"M": 4, "OVERLAP": true, "HAS_INDEX": true, "NW": 0, "PARTS": 1,
                                           "MAZ_STRIDE": 2560, "XAZ_STRIDE": 2560}'   # CSA
    python tools/sm90_resources.py csa_entries                     # CSA entries of a prefill chunk
    python tools/sm90_resources.py scores_sm90 '{"QT": 4, "maxnreg": 255}'  # Gluon index scores, prefill

``--ptx PATH`` writes the PTX and prints ``ptxas``'s own report of it (e.g. why it serialises ``wgmma``).
``--sass PATH`` also writes the disassembly (count ``STL``/``LDL`` for spills in loops, ``LDG.E.128`` for
vectorised loads).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

#: the sparse-attention kernels' pointer dtypes and the strides a launch specialises as divisible by 16
_ATTENTION_ARGS = {
    "q_ptr": "*bf16", "kv_new_ptr": "*bf16", "ring_ptr": "*u8", "ring_pos_ptr": "*i32", "pool_ptr": "*u8",
    "block_tables_ptr": "*i32", "idx_ptr": "*i32", "visible_ptr": "*i64", "token_request_ptr": "*i32",
    "positions_ptr": "*i64", "cu_seqlens_ptr": "*i32", "start_pos_ptr": "*i64", "token_slots_ptr": "*i64",
    "sink_ptr": "*fp32", "inv_freq_ptr": "*fp32", "o_ptr": "*bf16", "lse_ptr": "*fp32", "po_ptr": "*fp32",
    "plse_ptr": "*fp32", "qk_scale": "fp32", "keys_ptr": "*bf16"}
_ATTENTION_DIV16 = {"stride_qt", "stride_qh", "stride_kvt", "stride_ring", "stride_rpos", "stride_page", "stride_idx",
                    "stride_ot", "stride_oh", "stride_lt", "stride_kb"}

#: kernel → (import path, pointer dtypes by argument, default constexprs + num_warps / num_stages,
#: int args ≡ 0 mod 16)
KERNELS = {
    "attention": ("dsv4.kernels.attention.triton_kernel:_sparse_attention_kernel", _ATTENTION_ARGS,
        dict(WINDOW=128, RATIO=4, BLOCK_SIZE=256, PAGE_ENTRIES=64, MODE=1, SPLIT=True, BLOCK_H=64, BLOCK_N=64,
             INTERPRET=False, num_warps=8, num_stages=1),
        _ATTENTION_DIV16),
    "attention_sm90": ("dsv4.kernels.attention.sm90_serial:_sparse_attention_sm90_kernel", _ATTENTION_ARGS,
        dict(WINDOW=128, RATIO=4, BLOCK_SIZE=256, PAGE_ENTRIES=64, MODE=1, SPLIT=True, CLUSTER=1, KEYS_BF16=False,
             num_warps=8),
        _ATTENTION_DIV16),
    "attention_ws": ("dsv4.kernels.attention.sm90_ws:_sparse_attention_ws_kernel", _ATTENTION_ARGS,
        dict(WINDOW=128, RATIO=128, BLOCK_SIZE=256, PAGE_ENTRIES=2, MODE=2, SPLIT=True, PRODUCER_REGS=152,
             num_warps=8),
        _ATTENTION_DIV16),
    "attention_pipelined": ("dsv4.kernels.attention.sm90_pipelined:_pipelined_kernel", _ATTENTION_ARGS,
        dict(WINDOW=128, RATIO=4, BLOCK_SIZE=256, PAGE_ENTRIES=64, MODE=1, SPLIT=False, KEYS_BF16=True,
             VALUE_REGS_C=168, PRODUCER_REGS_C=88, num_warps=4),
        _ATTENTION_DIV16),
    "dequant_sm90": ("dsv4.kernels.attention.sm90_serial:_dequant_probe_kernel",
        {"pages_ptr": "*u8", "out_ptr": "*bf16"}, dict(num_warps=8), set()),
    "dequant_ws": ("dsv4.kernels.attention.sm90_ws:_dequant_probe_kernel",
        {"pages_ptr": "*u8", "out_ptr": "*bf16"}, dict(num_warps=4), set()),
    "write": ("dsv4.kernels.write.compressor:write_before_attention_kernel", {
        "kv_ptr": "*bf16", "pos_ptr": "*i64", "kv_out_ptr": "*bf16", "start_ptr": "*i64", "end_ptr": "*i64",
        "cu_ptr": "*i32", "slots_ptr": "*i64", "block_tables_ptr": "*i32", "emit_req_ptr": "*i32",
        "emit_entry_ptr": "*i64", "num_emit_ptr": "*i32", "count_ptr": "*i32", "mpages_ptr": "*u8", "xpages_ptr": "*u8",
        "eps": "fp32"},
        dict(C=512, M=128, OVERLAP=False, HAS_INDEX=False, BT=4, NW=4, NW_INDEX=0, MAXT=512, PARTS=8,
             MAZ_STRIDE=1024, XAZ_STRIDE=1024, num_warps=4),
        {"mpage_bytes", "xpage_bytes"}),
    "window_entries": ("dsv4.kernels.write.window:_window_entries_kernel", {
        "kv_ptr": "*bf16", "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "out_ptr": "*bf16"},
        dict(BT=4, num_warps=4, enable_fp_fusion=False), set()),
    "append_swa": ("dsv4.kernels.write.window:_append_swa_kernel", {
        "kvn_ptr": "*bf16", "ring_ptr": "*u8", "ring_pos_ptr": "*i32", "token_slots_ptr": "*i64",
        "ring_slots_ptr": "*i64", "rows_ptr": "*i64", "pos_ptr": "*i64"},
        dict(WINDOW=128, BT=4, num_warps=4, enable_fp_fusion=False), {"ring_page_bytes"}),
    "csa_entries": ("dsv4.kernels.write.csa_entries:csa_entries_kernel", {
        "mpages_ptr": "*u8", "xpages_ptr": "*u8", "block_tables_ptr": "*i32", "start_ptr": "*i64", "cu_ptr": "*i32",
        "emit_req_ptr": "*i32", "emit_entry_ptr": "*i64", "num_emit_ptr": "*i32", "eps": "fp32", "kv_ptr": "*bf16",
        "pos_ptr": "*i64", "kv_out_ptr": "*bf16"},
        dict(BT=4, MAZ_STRIDE=2560, XAZ_STRIDE=2560, num_warps=1, enable_fp_fusion=False),
        {"mpage_bytes", "xpage_bytes"}),
    "scores": ("dsv4.kernels.indexer.scores:_scores_kernel", {
        "pages_ptr": "*u8", "bt_ptr": "*i32", "cu_ptr": "*i32", "vis_ptr": "*i64", "q_ptr": "*u8", "w_ptr": "*fp32",
        "out_ptr": "*bf16"},
        dict(M_RATIO=4, BLOCK_SIZE=256, ENTRIES=64, HP=64, QT=1, BLOCK_N=64, FORMAT=0, USE_ASM=True, NUM_STAGES=3,
             PAGE_VECTOR=True, MAX_TPS=32, HOST_BOUND=False, TPS_HINT=0, num_warps=4),
        {"bt_stride", "out_stride", "PAGE_BYTES"}),
    "scores_sm90": ("dsv4.kernels.indexer.scores_sm90:_scores_sm90_kernel", {
        "pages_ptr": "*u8", "bt_ptr": "*i32", "cu_ptr": "*i32", "vis_ptr": "*i64", "q_ptr": "*u8", "w_ptr": "*fp32",
        "out_ptr": "*bf16"},
        dict(ENTRIES=64, HP=64, QT=1, num_warps=4, maxnreg=128), {"bt_stride", "out_stride", "PAGE_BYTES"}),
    "topk_hist": ("dsv4.kernels.indexer.topk_split:_split_hist_kernel",
        {"s_ptr": "*i16", "n_ptr": "*i64", "ws_ptr": "*i32"},
        dict(K=512, KEY_BITS=16, RADIX=8, PASS=1, BLOCK=1024, HOST_BOUND=False, CHUNK_HINT=0, num_warps=4),
        {"s_stride", "ws_stride", "chunk"}),
    "topk_select": ("dsv4.kernels.indexer.topk_split:_split_select_kernel",
        {"s_ptr": "*i16", "n_ptr": "*i64", "ws_ptr": "*i32", "out_ptr": "*i64"},
        dict(K=512, KEY_BITS=16, RADIX=8, BLOCK=1024, FILL=512, HOST_BOUND=False, CHUNK_HINT=0, num_warps=4),
        {"s_stride", "ws_stride", "out_stride", "chunk"}),
    "topk_filter": ("dsv4.kernels.indexer.topk_filter:_filter_topk_kernel",
        {"s_ptr": "*i16", "n_ptr": "*i64", "hdr_ptr": "*i32", "cand_ptr": "*i32", "out_ptr": "*i64"},
        dict(K=512, KEY_BITS=16, RADIX=4, BLOCK=16384, C=64, CBLOCK=8192, CC=64, FILL=512, SPLIT=True, PTX=True,
             HOST_BOUND=False, CHUNK_HINT=0, num_warps=16),
        {"s_stride", "hdr_stride", "cand_stride", "out_stride", "chunk"}),
    "topk_bisect": ("dsv4.kernels.indexer.topk_bisect:_bisect_topk_kernel",
        {"s_ptr": "*i16", "n_ptr": "*i64", "out_ptr": "*i64"},
        dict(K=512, KEY_BITS=16, BLOCK=32768, C=64, FILL=512, PTX=True, num_warps=16), {"s_stride", "out_stride"}),
    "topk_bisect_sm90": ("dsv4.kernels.indexer.topk_bisect_sm90:_bisect_topk_sm90_kernel",
        {"s_ptr": "*i16", "n_ptr": "*i64", "out_ptr": "*i64"},
        dict(K=512, BLOCK=32768, C=64, FILL=512, NW=16, num_warps=16), {"s_stride", "out_stride"}),
    "rms_norm_512": ("dsv4.kernels.project.rms_norm:_rms_norm_512_kernel", {"x_ptr": "*bf16", "w_ptr": "*fp32",
                                                                    "out_ptr": "*bf16", "eps": "fp32"},
        dict(num_warps=1, enable_fp_fusion=False), {"stride_x"}),
    "rms_norm": ("dsv4.kernels.project.rms_norm:_rms_norm_kernel", {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*bf16",
                                                            "inv_c": "fp32", "eps": "fp32"},
        dict(BLOCK=1024, QUANTIZE=False, num_warps=4, enable_fp_fusion=False), {"stride_x"}),
    "queries": ("dsv4.kernels.project.queries:_queries_kernel", {"q_ptr": "*bf16", "pos_ptr": "*i64", "inv_freq_ptr": "*fp32",
                                                         "out_ptr": "*bf16", "eps": "fp32"},
        dict(HEADS=8, num_warps=8, enable_fp_fusion=False), {"stride_t"}),
    "combine": ("dsv4.kernels.attention.combine:_combine_kernel", {
        "po_ptr": "*fp32", "plse_ptr": "*fp32", "positions_ptr": "*i64", "sink_ptr": "*fp32", "inv_freq_ptr": "*fp32",
        "o_ptr": "*bf16", "lse_ptr": "*fp32"},
        dict(BLOCK_H=2, BLOCK_S=8, INTERPRET=False, num_warps=4), {"stride_ot", "stride_oh", "stride_lt"}),
    "bf16_keys": ("dsv4.kernels.attention.bf16_keys:_bf16_keys_kernel", {
        "ring_ptr": "*u8", "pool_ptr": "*u8", "block_tables_ptr": "*i32", "cu_seqlens_ptr": "*i32",
        "start_pos_ptr": "*i64", "token_slots_ptr": "*i64", "out_ptr": "*bf16"},
        dict(WINDOW=128, RATIO=4, BLOCK_SIZE=256, PAGE_ENTRIES=64, ROWS=16, num_warps=4),
        {"stride_ring", "stride_page", "stride_bt", "stride_ob"}),
    "mxfp4_queries": ("dsv4.kernels.indexer.queries:_mxfp4_queries_kernel", {
        "q_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q8_ptr": "*u8", "qs_ptr": "*fp32"},
        dict(HB=16, ROUND_BF16=True, num_warps=4, enable_fp_fusion=False), {"q_stride"}),
}


def compile_sm90(kernel: str, overrides: dict | None = None):
    """Compile ``kernel`` (a key of ``KERNELS``) for sm_90 with ``overrides`` on its default constexprs; returns
    triton's compiled kernel (``.asm["cubin" | "ptx"]``, ``.metadata``)."""
    target, types, defaults, div16 = KERNELS[kernel]
    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)
    overrides = dict(overrides or {})
    types = {**types, **overrides.pop("_types", {})}  # pointer dtypes of this specialisation, where they differ
    const = {**defaults, **overrides}
    for param in fn.params:  # constexprs with a default value the caller did not set
        if param.is_constexpr and param.name not in const and param.default is not inspect.Parameter.empty:
            const[param.name] = param.default
    opts = {k: const.pop(k) for k in ("num_warps", "num_stages", "maxnreg", "enable_fp_fusion") if k in const}
    sig = {a: "constexpr" if a in const else types.get(a, "*fp32" if a.endswith("_ptr") else "i32")
           for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a].startswith("*") or a in div16}
    source_type = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource
    src = source_type(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def sass(cubin: bytes) -> str:
    """The disassembly of a cubin (``cuobjdump -sass``)."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def resources(kernel: str, overrides: dict | None = None, sass_path: str | None = None,
              ptx_path: str | None = None) -> dict:
    """Compile ``kernel`` (a key of ``KERNELS``) for sm_90 and return ``{regs, stack, shared}`` (bytes)."""
    compiled = compile_sm90(kernel, overrides)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in usage.splitlines() if "REG:" in ln)
    fields = dict(item.split(":") for item in line.split() if ":" in item)
    if sass_path:
        with open(sass_path, "w") as out:
            out.write(subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout)
    os.unlink(f.name)
    if ptx_path:
        with open(ptx_path, "w") as out:
            out.write(compiled.asm["ptx"])
        ptxas = os.path.join(os.path.dirname(cuobjdump), "ptxas")
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-o", os.devnull, ptx_path], capture_output=True,
                                text=True)
        print(report.stdout + report.stderr)
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"]), "shared": compiled.metadata.shared}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=list(KERNELS))
    ap.add_argument("overrides", nargs="?", default="{}", help="JSON: constexprs, num_warps, num_stages, maxnreg")
    ap.add_argument("--sass", help="also write the SASS here")
    ap.add_argument("--ptx", help="also write the PTX here and print ptxas's report of it")
    a = ap.parse_args()
    r = resources(a.kernel, json.loads(a.overrides), a.sass, a.ptx)
    print(f"{a.kernel} {a.overrides}: {r['regs']} registers/thread, {r['stack']} B stack (spills), "
          f"{r['shared']} B shared memory")


if __name__ == "__main__":
    main()
