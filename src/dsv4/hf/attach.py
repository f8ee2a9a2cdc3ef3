"""``attach`` / ``detach``: serve a transformers DeepSeek-V4 model's attention with dsv4.

``attach(model, ...)`` installs three things and returns an ``Attachment`` (also kept on the model):

1. every decoder layer's ``self_attn`` forward is served by a ``LayerAdapter`` (``dsv4.hf.attention``);
2. a forward pre-hook on the base ``DeepseekV4Model``: once per model forward it makes sure the ``cache`` (or
   ``past_key_values``) argument is a ``DSV4Cache`` — a fresh, empty ``DynamicCache`` (what ``generate()`` makes)
   or none is replaced by a new one, which the model then returns, so ``generate()`` carries it on (with
   ``use_cache=False`` every call gets a new one, as transformers' attention keeps nothing) — and calls
   ``DSV4Cache.begin_step`` with the step's shape, ``attention_mask``, ``position_ids`` and ``cache_position``:
   the one ``prepare_forward`` of the step, for all layers;
3. the attention implementation ``"dsv4"``, registered in transformers' ``AttentionInterface`` (a function that
   only raises: nothing but the adapters may run attention) and ``AttentionMaskInterface`` (no mask: dsv4 masks
   by positions itself; the 2D padding mask still reaches the hook) and set on the model, so transformers
   builds no ``[B, 1, S, P+S]`` mask.

``detach(model)`` removes all three. Existing ``DSV4Cache``s of the model cannot serve it afterwards.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..numerics import NumericsLike, resolve_numerics
from .attention import LayerAdapter
from .cache import ATTACHMENT_ATTR, CacheSettings, DSV4Cache, default_block_size

__all__ = ["ATTN_IMPLEMENTATION", "Attachment", "attach", "detach"]

ATTN_IMPLEMENTATION = "dsv4"
_CACHE_ARGS = ("cache", "past_key_values")  # transformers >= 5.24 / older


def _dsv4_attention_function(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        f"{type(module).__name__} reached transformers' attention interface with attn_implementation "
        f"{ATTN_IMPLEMENTATION!r}, but dsv4 serves whole attention modules: was it attached with dsv4.hf.attach?"
    )


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The ``"dsv4"`` mask function: no 4D mask (dsv4 masks by positions; the 2D padding mask reaches the hook)."""
    return None


def _register_attention_implementation() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _dsv4_attention_function)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


def _set_attn_implementation(model: nn.Module, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    if model.config._attn_implementation != name:  # versions without the setter, or one that did not apply it
        model.config._attn_implementation = name


@dataclass
class Attachment:
    """What ``attach`` installed on a model.

    Attributes:
        settings: how this model's ``DSV4Cache``s are built (config, numerics, device, block size, max_length).
        backend: the dsv4 backend of every layer.
        adapters: one ``LayerAdapter`` per decoder layer.
        base: the ``DeepseekV4Model`` the hook sits on.
        previous_attn_implementation: restored by ``detach``.
    """

    settings: CacheSettings
    backend: str
    adapters: list[LayerAdapter]
    base: nn.Module
    previous_attn_implementation: str | None
    _hook: Any = None
    _cache_arg: str = "cache"
    _signature: inspect.Signature | None = None

    @property
    def cfg(self) -> ModelConfig:
        return self.settings.cfg

    def new_cache(self, max_length: int | None = None, **kwargs: Any) -> DSV4Cache:
        """A fresh ``DSV4Cache`` for this model (``DSV4Cache``'s keyword arguments)."""
        return DSV4Cache(self.settings, max_length=max_length, **kwargs)

    # ---------------------------------------------------------------- the per-step hook
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The base model's forward pre-hook: a ``DSV4Cache`` in the cache argument, the step begun on it."""
        params = self._signature.parameters
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        extra = next((v for k, v in bound.items() if params[k].kind is inspect.Parameter.VAR_KEYWORD), {})

        def arg(name: str) -> Any:
            return bound[name] if name in bound else extra.get(name)

        input_ids, inputs_embeds = arg("input_ids"), arg("inputs_embeds")
        shaped = input_ids if input_ids is not None else inputs_embeds
        if shaped is None:
            raise ValueError("the model needs input_ids or inputs_embeds")
        used = [n for n in _CACHE_ARGS if arg(n) is not None]
        cache = arg(used[0]) if used else None
        use_cache = arg("use_cache")
        use_cache = getattr(module.config, "use_cache", True) if use_cache is None else bool(use_cache)
        if not use_cache and getattr(cache, "ephemeral", False):
            cache = None  # a use_cache=False call got back the cache of the previous one (generate() does that)
        made = not isinstance(cache, DSV4Cache)
        cache = self._as_dsv4_cache(cache)
        if made and not use_cache:
            cache.ephemeral = True
        cache.begin_step(
            shaped.shape[0], shaped.shape[1], arg("attention_mask"), arg("position_ids"), arg("cache_position")
        )
        name = used[0] if used else self._cache_arg
        positional = list(params).index(name) if name in params else None
        if positional is not None and positional < len(args):
            args = args[:positional] + (cache,) + args[positional + 1 :]
        else:
            kwargs = {**kwargs, name: cache}
        return args, kwargs

    def _as_dsv4_cache(self, cache: Any) -> DSV4Cache:
        if isinstance(cache, DSV4Cache):
            if cache.settings.cfg != self.settings.cfg or cache.settings.device != self.settings.device:
                raise ValueError("this DSV4Cache was made for another model (config or device differ)")
            return cache
        if cache is None or _unused_transformers_cache(cache):
            return self.new_cache()  # none, or generate()'s default DynamicCache before its first step
        held = f" already holding {cache.get_seq_length()} tokens" if hasattr(cache, "get_seq_length") else ""
        raise ValueError(
            f"a model attached to dsv4 needs a DSV4Cache (or none); got a {type(cache).__name__}{held} "
            "(transformers' attention filled it: dsv4 cannot continue it)"
        )


def _unused_transformers_cache(cache: Any) -> bool:
    from transformers.cache_utils import Cache

    if not isinstance(cache, Cache):
        return False
    try:
        return cache.get_seq_length() == 0
    except Exception:  # noqa: BLE001 - a cache that cannot even say its length holds nothing we can use
        return False


def _base_model(model: nn.Module) -> nn.Module:
    base = model
    if not hasattr(base, "layers") and hasattr(base, "model"):
        base = base.model
    layers = getattr(base, "layers", None)
    if layers is None or getattr(getattr(model, "config", None), "model_type", None) != "deepseek_v4":
        raise TypeError(
            f"dsv4.hf.attach expects a transformers DeepseekV4ForCausalLM / DeepseekV4Model, got {type(model).__name__}"
        )
    return base


def attach(
    model: nn.Module,
    backend: str = "auto",
    numerics: NumericsLike = "official",
    *,
    max_length: int | None = None,
    block_size: int | None = None,
    check_inputs: bool = True,
) -> Attachment:
    """Serve ``model``'s attention with dsv4; ``model.generate(...)`` then runs unchanged.

    Args:
        model: a transformers ``DeepseekV4ForCausalLM`` or ``DeepseekV4Model`` (attention weights on one device).
            Attaching an attached model replaces its attachment.
        backend: ``"torch"`` (any device), ``"triton"`` (Hopper GPUs) or ``"auto"`` (Triton for CUDA when
            available).
        numerics: ``"official"`` (FP8 / MXFP4 cache, BF16 compute: DeepSeek's inference numerics) or ``"exact"``
            (FP32, no quantization: agrees with transformers' own attention to rounding).
        max_length: real tokens per row the caches allocate for on their first step (default: grow on demand).
        block_size: token positions per pool block (default: the smallest multiple of the ratios ≥ 256).
        check_inputs: check every layer input is finite (a host sync per layer and step).
    Returns:
        The ``Attachment`` (also ``model._dsv4_attachment``); ``attachment.new_cache()`` makes a ``DSV4Cache``.
    """
    base = _base_model(model)
    if getattr(model, ATTACHMENT_ATTR, None) is not None:
        detach(model)
    cfg = ModelConfig.from_hf(model.config, name=getattr(model.config, "name_or_path", None) or "hf")
    modules = [layer.self_attn for layer in base.layers]
    if len(modules) != cfg.num_layers:
        raise ValueError(f"the model has {len(modules)} decoder layers but its config says {cfg.num_layers}")
    devices = {p.device for m in modules for p in m.parameters()}
    if len(devices) != 1:
        raise ValueError(f"the attention weights are spread over {sorted(map(str, devices))}; dsv4 needs one device")
    device = devices.pop()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    layers = tuple(range(cfg.num_layers))
    settings = CacheSettings(
        cfg=cfg, numerics=resolve_numerics(numerics), device=device, layers=layers,
        block_size=block_size if block_size is not None else default_block_size(cfg, layers), max_length=max_length,
    )
    dtype = base.embed_tokens.weight.dtype if hasattr(base, "embed_tokens") else torch.bfloat16
    fp8_dtype = dtype if dtype.is_floating_point and dtype.itemsize >= 2 else torch.bfloat16
    adapters = [LayerAdapter(m, cfg, i, backend, check_inputs, fp8_dtype) for i, m in enumerate(modules)]
    signature = inspect.signature(base.forward)
    cache_arg = next((n for n in _CACHE_ARGS if n in signature.parameters), "cache")
    _register_attention_implementation()
    attachment = Attachment(
        settings=settings, backend=backend, adapters=adapters, base=base,
        previous_attn_implementation=model.config._attn_implementation, _cache_arg=cache_arg, _signature=signature,
    )
    _set_attn_implementation(model, ATTN_IMPLEMENTATION)
    for adapter in adapters:
        adapter.module.forward = adapter.forward
    attachment._hook = base.register_forward_pre_hook(attachment.pre_forward, with_kwargs=True)
    setattr(model, ATTACHMENT_ATTR, attachment)
    if base is not model:
        setattr(base, ATTACHMENT_ATTR, attachment)
    return attachment


def detach(model: nn.Module) -> None:
    """Undo ``attach``: transformers' own attention serves the model again (no-op if it is not attached)."""
    attachment: Attachment | None = getattr(model, ATTACHMENT_ATTR, None)
    if attachment is None:
        return
    attachment._hook.remove()
    for adapter in attachment.adapters:
        if adapter.module.__dict__.get("forward") == adapter.forward:
            del adapter.module.forward
    if attachment.previous_attn_implementation is not None:
        _set_attn_implementation(model, attachment.previous_attn_implementation)
    for obj in (model, attachment.base):
        if obj.__dict__.get(ATTACHMENT_ATTR) is attachment:
            delattr(obj, ATTACHMENT_ATTR)
