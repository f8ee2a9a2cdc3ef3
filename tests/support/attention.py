"""A sparse-attention step over a real ``HybridCache`` layer filled with random valid 584-B entries, the key
dequantization probe of each kernel, and the Triton backend's ``attend`` against the torch backend's. Shared by the
attention kernel tests on the GPU and under the Triton interpreter, and by the BF16-keys tests."""

from __future__ import annotations

import torch

import dsv4
from dsv4.cache import HybridCache
from dsv4.config import LayerKind
from dsv4.ops import torch_ops
from dsv4.reference.rope import rope_inv_freq

FLASH = dsv4.ModelConfig.preset("v4-flash")
PRO = dsv4.ModelConfig.preset("v4-pro")


def make_case(
    cfg: dsv4.ModelConfig,
    kind: LayerKind,
    prefix: list[int],
    step: list[int],
    device: str,
    seed: int = 0,
    topk: int | None = None,
    invalid_frac: float = 0.1,
    block_size: int = 256,
):
    """A layer step ready for ``attend``: returns ``(layer, batch, args)`` with args for ``attend`` minus the
    entry list, and the entry lists for torch (``[T, K]``) and triton (CSA: same; HCA: counts)."""
    g = torch.Generator().manual_seed(seed)
    li = cfg.layers_of_kind(kind)[0]
    m = cfg.ratio(li)
    need = sum(-(-(p + s) // block_size) for p, s in zip(prefix, step)) + 2
    cache = HybridCache(cfg, layers=[li], max_requests=len(prefix) + 1, num_blocks=need, block_size=block_size,
                        device=device, numerics="official")
    names = [f"r{i}" for i in range(len(prefix))]
    for n in names:
        cache.add_request(n)
    for n, p in zip(names, prefix):
        if p:
            cache.prepare_forward({n: p})
    batch = cache.prepare_forward(dict(zip(names, step)))
    layer = cache.layer(li)
    storage = layer.schema.kv_storage
    W = cfg.window

    def rand_entries(n: int) -> torch.Tensor:
        v = torch.randn(n, 512, generator=g) * torch.exp(torch.randn(n, 8, generator=g)).repeat_interleave(64, 1)
        return storage.encode(v)

    if layer.kv_pages is not None and layer.kv_pages.shape[0]:
        nb, epp = layer.kv_pages.shape[0], layer.schema.entries_per_block
        blocks = torch.arange(nb).repeat_interleave(epp)
        slots = torch.arange(epp).repeat(nb)
        storage.write_bytes(layer.kv_pages, blocks.to(device), slots.to(device), rand_entries(nb * epp).to(device))
    R = layer.ring.shape[0]
    storage.write_bytes(layer.ring, torch.arange(R).repeat_interleave(W).to(device), torch.arange(W).repeat(R).to(device),
                        rand_entries(R * W).to(device))
    ring_pos = torch.full((R, W), -1, dtype=torch.int32)
    for b, start in enumerate(batch.start_positions):
        slot = int(batch.slots[b])
        for p in range(max(0, start - W), start):
            r = torch.rand((), generator=g).item()
            ring_pos[slot, p % W] = -1 if r < invalid_frac / 2 else (p - W if r < invalid_frac else p)
    layer.ring_positions.copy_(ring_pos.to(device))

    T, H = batch.num_tokens, cfg.num_heads
    q = torch.randn(T, H, 512, generator=g).to(torch.bfloat16)
    nm = dsv4.Numerics.official()
    kv_new = nm.qdq_kv(torch.randn(T, 512, generator=g), cfg.nope_dim)
    sink = torch.randn(H, generator=g)
    inv_freq = rope_inv_freq(cfg, kind)

    torch_idx = triton_idx = None
    if kind is LayerKind.CSA:
        k = topk or cfg.index_topk
        vis = batch.visible_entries[m].cpu()
        n_max = int(vis.max()) if T else 0
        width = min(k, n_max)
        order = torch.rand(T, max(n_max, 1), generator=g).argsort(dim=1)[:, :width]
        ok = (order < vis[:, None]) & (torch.rand(T, width, generator=g) >= invalid_frac)
        torch_idx = torch.where(ok, order, -1).to(device)
        triton_idx = torch_idx
    elif kind is LayerKind.HCA:
        torch_idx = triton_idx = batch.visible_entries[m]  # HCA: each token's count of visible entries
    args = dict(q=q.to(device), kv_new=kv_new.to(device), m=m, sink=sink.to(device), scale=cfg.softmax_scale,
                inv_freq=inv_freq.to(device), numerics=nm)
    return layer, batch, args, torch_idx, triton_idx


def dequant_probe(device: str, options: dict, wide: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The key dequantization that the kernel of ``options`` (requests to the attention plan, e.g.
    ``{"impl": "triton"}``) runs (Triton: ``_key_block`` × 8; the Gluon kernels on Hopper:
    ``sm90_serial._e4m3_to_bf16`` or ``sm90_ws``'s word variant) of 64 entries holding every finite E4M3 code,
    against ``code × 2^(e−127)`` rounded to BF16 once. Exponents 100–134, or 10–246 when ``wide`` (the Gluon
    conversion's second multiply, e > 134). Returns ``(kernel, expected)`` as float32 ``[64, 512]``.
    """
    from dsv4.formats.fp8 import e4m3_decode
    from dsv4.kernels.attention import sm90_serial, sm90_ws, triton_kernel
    from dsv4.kernels.device import is_sm90

    g = torch.Generator().manual_seed(seed)
    codes = (torch.randperm(64 * 448, generator=g) % 256).to(torch.uint8).view(64, 448)
    codes[(codes & 0x7F) == 0x7F] = 0  # NaN codes → zero (kept: ±0 and every subnormal)
    lo, hi = (10, 246) if wide else (100, 134)
    exps = torch.randint(lo, hi + 1, (64, 8), generator=g, dtype=torch.uint8)
    exps[:, 7] = 0
    exps[0, :7] = hi  # the extremes are present
    exps[1, :7] = lo
    rope = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    pages = torch.cat((torch.cat((codes, rope.view(torch.uint8)), 1).reshape(-1), exps.reshape(-1)))
    scale = torch.ldexp(torch.ones(64, 7), exps[:, :7].to(torch.int32) - 127).repeat_interleave(64, 1)
    expected = torch.cat(((e4m3_decode(codes) * scale).to(torch.bfloat16), rope), 1).float()
    out = torch.empty(64, 512, dtype=torch.bfloat16, device=device)
    impl = options.get("impl", "auto")
    if impl != "triton" and is_sm90(torch.device(device)):
        # the pipelined kernel dequantizes FP8 pages through the warp-specialized kernel's helpers
        gluon = sm90_ws if impl in ("gluon_ws", "gluon_pipelined") else sm90_serial
        gluon.dequant_probe(pages.to(device), out)
    else:
        triton_kernel.dequant_probe(pages.to(device), out)
    return out.float().cpu(), expected


def compare(layer, batch, args, torch_idx, triton_idx, requests: dict | None = None, plan=None):
    """Relative errors ``(o, lse)`` of the triton ``attend`` against torch's, plus the triton outputs; the triton
    side runs ``plan``, or the plan of ``requests`` (to the attention plan), or the rules' plan."""
    from dsv4.ops import triton_attention

    o_ref, lse_ref = torch_ops.attend_layer(layer, batch, entry_idx=torch_idx, **args)
    if plan is None and requests:
        plan = triton_attention.attention_plan(batch, args["q"], args["kv_new"], args["m"], triton_idx, **requests)
    o, lse = triton_attention.attend_layer(layer, batch, entry_idx=triton_idx, plan=plan, **args)
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype and lse.shape == lse_ref.shape
    assert torch.isfinite(o.float()).all() and torch.isfinite(lse).all()
    err_o = ((o.double() - o_ref.double()).norm() / o_ref.double().norm()).item()
    err_l = ((lse.double() - lse_ref.double()).norm() / lse_ref.double().norm()).item()
    return err_o, err_l, o, o_ref


def step_plan(layer, batch, args, q=None, **options):
    """The plan ``step_fwd`` makes for the same ``options`` (entry keywords and requests)."""
    from dsv4.kernels.attention.launch import plan_for

    q = args["q"] if q is None else q
    options.setdefault("ratio", 4)
    return plan_for(q, args["kv_new"], batch.block_tables, window=batch.window, block_size=batch.block_size,
                    **options)


def step_fwd(layer, batch, args, q=None, **options):
    """``sparse_attention_fwd`` over a ``make_case`` step (its queries, or ``q``); ``options`` are the op's keywords
    (``ratio`` 4 unless given; a ``plan``, or requests). ``out`` / ``lse`` default to new NaN-filled tensors, so any
    element the kernels do not write fails the checks. Returns ``(out, lse)``."""
    from dsv4.kernels.attention.launch import sparse_attention_fwd

    q = args["q"] if q is None else q
    options.setdefault("ratio", 4)
    out = options.pop("out", None)
    out = torch.full_like(q, float("nan")) if out is None else out
    lse = options.pop("lse", None)
    lse = torch.full(out.shape[:2], float("nan"), device=q.device) if lse is None else lse
    sparse_attention_fwd(
        q, args["kv_new"], layer.ring, layer.ring_positions, layer.kv_pages if options["ratio"] else None,
        batch.block_tables, batch.token_request, batch.positions, batch.cu_seqlens, batch.start_pos,
        batch.token_slots, args["sink"], args["inv_freq"], args["scale"], window=batch.window,
        block_size=batch.block_size, out=out, lse=lse, workspace=layer.workspace, **options)
    return out, lse
