"""Fingerprints of every kernel specialisation the project launches, compiled for Hopper (sm_90) on any machine.

Each entry of ``SPECIALISATIONS`` names a kernel of ``sm90_resources.KERNELS`` and the constexprs of one
specialisation a run uses (decode / prefill, each layer kind, each format). The fingerprint is a hash of the
kernel's SASS with addresses, encodings and the kernel's own name removed: two trees whose fingerprints agree
run the same machine code, so a change that only moves or renames code (or drops a dead constexpr branch) can be
checked without a GPU::

    python tools/kernel_fingerprints.py --save fingerprints.json     # before a change
    python tools/kernel_fingerprints.py --compare fingerprints.json  # after it: lists every specialisation that differs

A kernel whose signature changes (arguments added, removed or reordered) legitimately changes its fingerprint;
``--opcodes`` compares only the sequence of SASS opcodes (operands ignored), which shows whether the code around
the arguments stayed the same.

``ptxas`` is not deterministic for every kernel: where its register allocator spills (the Triton attention kernel)
two compiles of the same PTX give different SASS. ``--ptx`` hashes the PTX instead (without line information,
debug sections and the kernel's name): the same PTX is the same program handed to ``ptxas``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys

from sm90_resources import KERNELS, compile_sm90, sass

#: (name, kernel of ``KERNELS``, constexpr / option overrides)
SPECIALISATIONS: list[tuple[str, str, dict]] = [
    # the layer's norms and queries
    ("rms_norm_512", "rms_norm_512", {}),
    ("rms_norm_1024", "rms_norm", {"BLOCK": 1024, "num_warps": 4}),
    ("queries", "queries", {}),
    # write path
    ("window_entries", "window_entries", {}),
    ("append_swa", "append_swa", {}),
    ("write_hca_decode", "write", dict(C=512, M=128, OVERLAP=False, HAS_INDEX=False, NW=4, NW_INDEX=4, PARTS=8,
                                       ENTRY_PROGRAMS=False)),
    ("write_hca_prefill", "write", dict(C=512, M=128, OVERLAP=False, HAS_INDEX=False, NW=4, NW_INDEX=4, PARTS=8,
                                        ENTRY_PROGRAMS=True)),
    # (CSA: a / z_raw rows 2560 apart, the stacked compressor GEMM's output; HCA: 1024, sm90_resources' default)
    ("write_csa_prefill", "write", dict(C=512, M=4, OVERLAP=True, HAS_INDEX=True, NW=1, NW_INDEX=1, PARTS=1,
                                        ENTRY_PROGRAMS=True, MAZ_STRIDE=2560, XAZ_STRIDE=2560, num_warps=2)),
    ("write_csa_decode", "write", dict(C=512, M=4, OVERLAP=True, HAS_INDEX=True, NW=1, NW_INDEX=1, PARTS=1,
                                       ENTRY_PROGRAMS=False, MAZ_STRIDE=2560, XAZ_STRIDE=2560)),
    ("write_csa_state_only", "write", dict(C=512, M=4, OVERLAP=True, HAS_INDEX=True, NW=1, NW_INDEX=1, PARTS=1,
                                           STATE_ONLY=True, ENTRY_PROGRAMS=False, MAZ_STRIDE=2560,
                                           XAZ_STRIDE=2560)),
    ("csa_entries", "csa_entries", {}),
    # indexer
    ("mxfp4_queries", "mxfp4_queries", {}),
    ("scores_mxfp4_decode", "scores", dict(FORMAT=0, QT=1)),
    ("scores_fp8", "scores", dict(FORMAT=1, QT=1, USE_ASM=False)),
    ("scores_fp32", "scores", dict(FORMAT=2, QT=1, USE_ASM=False, _types={"q_ptr": "*fp32"})),
    ("scores_sm90_decode", "scores_sm90", dict(QT=1, maxnreg=128)),
    ("scores_sm90_prefill", "scores_sm90", dict(QT=4, maxnreg=255)),
    ("topk_hist", "topk_hist", {}),
    ("topk_select", "topk_select", {}),
    ("topk_filter", "topk_filter", {}),
    ("topk_bisect", "topk_bisect", {}),
    ("topk_bisect_sm90", "topk_bisect_sm90", {}),
    # attention
    ("attention_triton_csa_split", "attention", dict(MODE=1, SPLIT=True)),
    ("attention_triton_hca", "attention", dict(RATIO=128, PAGE_ENTRIES=2, MODE=2, SPLIT=False)),
    ("attention_triton_swa", "attention", dict(MODE=0, SPLIT=False)),
    ("attention_sm90_csa_split", "attention_sm90", dict(MODE=1, SPLIT=True)),
    ("attention_sm90_csa_cluster", "attention_sm90", dict(MODE=1, SPLIT=True, CLUSTER=4)),
    ("attention_sm90_hca_bf16keys", "attention_sm90", dict(RATIO=128, PAGE_ENTRIES=2, MODE=2, SPLIT=False,
                                                           KEYS_BF16=True)),
    ("attention_sm90_swa", "attention_sm90", dict(MODE=0, SPLIT=False)),
    ("attention_ws_hca", "attention_ws", {}),
    ("attention_ws_csa", "attention_ws", dict(RATIO=4, PAGE_ENTRIES=64, MODE=1)),
    ("attention_pipelined_bf16", "attention_pipelined", {}),
    ("attention_pipelined_fp8", "attention_pipelined", dict(KEYS_BF16=False, VALUE_REGS_C=160, PRODUCER_REGS_C=168)),
    ("combine", "combine", {}),
    ("bf16_keys", "bf16_keys", {}),
]

_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
_ENCODING = re.compile(r"/\*\s*0x[0-9a-f]+\s*\*/")


def normalised_sass(text: str) -> list[str]:
    """SASS instruction lines without addresses, encodings, headers or symbol names."""
    lines = []
    for line in text.splitlines():
        line = _ENCODING.sub("", _ADDRESS.sub("", line)).strip()
        if not line or line.startswith(("code for", "Function", ".", "-", "=")) or "Fatbin" in line:
            continue
        lines.append(re.sub(r"\s+", " ", line))
    return lines


def normalised_ptx(text: str, name: str) -> list[str]:
    """PTX instruction and directive lines without comments, ``.loc`` / ``.file`` lines, debug sections or the
    kernel's name."""
    text = text.split("\t.section\t.debug", 1)[0].replace(name, "KERNEL")
    lines = (re.sub(r"\s+", " ", ln.split("//", 1)[0]).strip() for ln in text.splitlines())
    return [ln for ln in lines if ln and not ln.startswith((".loc", ".file"))]


def fingerprint(kernel: str, overrides: dict, opcodes: bool = False, ptx: bool = False) -> str:
    compiled = compile_sm90(kernel, overrides)
    if ptx:
        lines = normalised_ptx(compiled.asm["ptx"], compiled.metadata.name)
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
    lines = normalised_sass(sass(compiled.asm["cubin"]))
    if opcodes:
        lines = [re.split(r"[ ;]", ln.lstrip("@!PT0123456789 "), maxsplit=1)[0] for ln in lines]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", help="write the fingerprints to this JSON file")
    ap.add_argument("--compare", help="compare with the fingerprints in this JSON file")
    ap.add_argument("--only", nargs="*", help="specialisation names (default: all)")
    ap.add_argument("--opcodes", action="store_true", help="hash only the opcode sequence")
    ap.add_argument("--ptx", action="store_true", help="hash the PTX (ptxas is not deterministic where it spills)")
    a = ap.parse_args()
    results: dict[str, str] = {}
    for name, kernel, overrides in SPECIALISATIONS:
        if a.only and name not in a.only:
            continue
        try:
            results[name] = fingerprint(kernel, overrides, a.opcodes, a.ptx)
        except Exception as err:  # report and go on: one broken kernel should not hide the others
            results[name] = f"error: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
        print(f"{name:32s} {results[name]}", flush=True)
    if a.save:
        with open(a.save, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    if a.compare:
        with open(a.compare) as f:
            before = json.load(f)
        differ = [n for n in results if before.get(n) != results[n]]
        missing = [n for n in before if n not in results and not a.only]
        print(f"\n{len(results) - len(differ)} of {len(results)} specialisations unchanged")
        for n in differ:
            print(f"  DIFFERS  {n}: {before.get(n)} -> {results[n]}")
        for n in missing:
            print(f"  MISSING  {n}")
        sys.exit(1 if differ or missing else 0)


if __name__ == "__main__":
    main()
