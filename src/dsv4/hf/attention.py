"""The attention swap: a transformers ``DeepseekV4Attention`` module's forward served by ``dsv4.Attention``.

transformers' attention interface (``AttentionInterface``) hands an implementation the finished queries and keys;
dsv4 needs the layer's input instead (it runs the projections, the compressors and the indexer over its own
cache), so the whole module forward is replaced: ``LayerAdapter.forward`` takes the module's arguments, gathers
the step's real tokens from ``hidden_states`` ``[B, S, d]`` into ``x`` ``[T, d]`` (plan order, see
``DSV4Cache.begin_step``), runs ``dsv4.Attention`` over the ``DSV4Cache``'s ``HybridCache`` and scatters ``y``
``[T, d]`` back to ``[B, S, d]`` in ``hidden_states``' dtype — zeros at pad columns, whose outputs nothing reads.

The module keeps its parameters (``state_dict``, ``.to()``, saving are unchanged). The dsv4 layer reads them
without a copy (``AttentionWeights.from_hf_module(copy=False)``; dsv4 casts once per device / dtype what its
numerics need; FP8 projections of a quantized checkpoint are dequantized once, to the model's dtype) and is
rebuilt when a parameter's storage, dtype, device or version counter changes (``model.to``,
``load_state_dict``, in-place edits). Inference only: no gradients flow through the dsv4 layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from ..layer import Attention
from ..weights import AttentionWeights
from .cache import DSV4Cache

__all__ = ["LayerAdapter"]


def _parameter_fingerprint(module: nn.Module) -> tuple:
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in module.parameters())


class LayerAdapter:
    """Serves one ``DeepseekV4Attention`` module with ``dsv4.Attention``.

    Args:
        module: the transformers attention module (``DeepseekV4Attention``).
        cfg: the model's ``ModelConfig``.
        layer_idx: the module's layer.
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` (``dsv4.Attention``'s).
        check_inputs: validate the layer input (finite values: a host sync per layer and step).
        fp8_dtype: what FP8 projections (transformers' ``FP8Linear``) are dequantized to — the only weights the
            adapter copies.
    """

    def __init__(
        self, module: nn.Module, cfg: ModelConfig, layer_idx: int, backend: str, check_inputs: bool,
        fp8_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.module = module
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.backend = backend
        self.check_inputs = check_inputs
        self.fp8_dtype = fp8_dtype
        self._layer: Attention | None = None
        self._fingerprint: tuple | None = None
        self.layer()  # shapes and finiteness of the weights checked now

    def layer(self) -> Attention:
        """The dsv4 layer over the module's current parameters."""
        fp = _parameter_fingerprint(self.module)
        if self._layer is None or fp != self._fingerprint:
            w = AttentionWeights.from_hf_module(self.module, copy=False, fp8_dtype=self.fp8_dtype)
            self._layer = Attention(w, self.cfg, self.layer_idx, backend=self.backend, check_inputs=self.check_inputs)
            self._fingerprint = fp
        return self._layer

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        """``DeepseekV4Attention.forward``'s signature; returns ``(output [B, S, d], None)`` (no attention weights).

        Reads only ``hidden_states`` ``[B, S, d]`` and the ``DSV4Cache`` (keyword ``cache`` or
        ``past_key_values``); positions and masks were checked once for the step by ``DSV4Cache.begin_step``.
        """
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(cache, DSV4Cache):
            raise RuntimeError(
                f"layer {self.layer_idx} is served by dsv4 and needs the DSV4Cache its model's hook provides, got "
                f"{type(cache).__name__}; call the model (not a layer) with use_cache / past_key_values as usual"
            )
        B, S, d = hidden_states.shape
        step = cache.layer_step(self.layer_idx, B, S)
        flat = hidden_states.reshape(B * S, d)
        out = torch.zeros_like(flat)
        if step.batch is not None:
            y = self.layer()(flat.index_select(0, step.token_index), step.batch, cache.hybrid)
            out.index_copy_(0, step.token_index, y.to(out.dtype))
        return out.view(B, S, d), None
