"""``DSV4Cache``: a ``transformers`` ``Cache`` whose storage is a dsv4 ``HybridCache``.

Batch row ``b`` of the model's input is dsv4 request ``"<prefix>/row<b>"``; the request holds the row's real tokens
only (see ``dsv4.hf.step``). The cache is the per-step context the attention layers share:

* ``begin_step`` (called once per model forward, before the first layer, by the hook ``dsv4.hf.attach`` installs
  on the base model) checks the step's ``attention_mask`` / ``position_ids`` / ``cache_position``, adds the rows'
  requests on the first step, runs ``HybridCache.prepare_forward`` **once** for all layers and opens the step;
* each attached layer takes the open step with ``layer_step(layer_idx, ...)`` — exactly once per step, so a
  forward that stops half-way (an exception in a layer) leaves layers that never ran, which the next
  ``begin_step`` detects: the cache is then marked broken and refuses every later step (its pages no longer match
  the tokens) until ``reset()``.

Sizing: without a ``HybridCache`` of the caller's, the first step allocates one with a state slot per row and pool
blocks for ``max_length`` real tokens per row (default: twice the longest row's first step, at least 256 more
tokens); when a step needs more blocks, the cache grows (to at least twice its blocks) by moving every request
into a larger ``HybridCache`` (``save_request`` / ``restore_request``: bit-identical). A caller's ``HybridCache``
is never grown (``CacheFullError``); its requests are released with ``reset()`` or when this object is collected.

transformers API: ``get_seq_length()`` is the number of **columns** consumed (pads included), which is what
``generate()`` slices a follow-up turn's ``input_ids`` by; beam search (``reorder_cache``), cropping and batch
reshuffles are refused with a clear error; ``update()`` (transformers' own attention writing to this cache) too.
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from ..cache import CacheFullError, HybridCache, StepBatch
from ..cache.schema import blocks_for_tokens
from ..config import ModelConfig
from ..numerics import Numerics
from .step import RowTokens, row_tokens

__all__ = ["ATTACHMENT_ATTR", "CacheSettings", "DSV4Cache", "default_block_size"]

ATTACHMENT_ATTR = "_dsv4_attachment"  # where dsv4.hf.attach keeps its Attachment on the model

_cache_ids = itertools.count()


def default_block_size(cfg: ModelConfig, layers: tuple[int, ...]) -> int:
    """The smallest multiple of every cached compression ratio that is ≥ 256 (``HybridCache``'s default)."""
    lcm = 1
    for i in layers:
        if cfg.ratio(i):
            lcm = math.lcm(lcm, cfg.ratio(i))
    return lcm * -(-256 // lcm)


@dataclass(frozen=True)
class CacheSettings:
    """How ``DSV4Cache``s of one attached model are built.

    Attributes:
        cfg: the model's attention configuration (``ModelConfig.from_hf`` of its config).
        numerics: storage formats and compute dtypes (``"official"`` / ``"exact"``).
        device: where the cache lives (the attention weights' device).
        layers: the cached layers (every decoder layer).
        block_size: token positions per pool block.
        max_length: real tokens per row to allocate for on the first step (``None``: from the first step, growing
            on demand).
    """

    cfg: ModelConfig
    numerics: Numerics
    device: torch.device
    layers: tuple[int, ...]
    block_size: int
    max_length: int | None = None


@dataclass
class OpenStep:
    """The step in progress.

    Attributes:
        index: 0, 1, … per cache.
        plan: the rows' real tokens (``RowTokens``).
        batch: from ``HybridCache.prepare_forward`` (``None`` when no row has a real token this step).
        token_index: int64 ``[T]`` on the cache's device: flat ``b·S + s`` of each real token, plan order.
        pending: layers that have not run this step yet.
    """

    index: int
    plan: RowTokens
    batch: StepBatch | None
    token_index: Tensor
    pending: set[int] = field(default_factory=set)


def _release_all(hybrid: HybridCache, request_ids: list[str]) -> None:
    for rid in request_ids:
        if rid in hybrid:
            hybrid.release(rid)
    request_ids.clear()


def _settings_of(model_or_settings: Any) -> CacheSettings:
    if isinstance(model_or_settings, CacheSettings):
        return model_or_settings
    attachment = getattr(model_or_settings, ATTACHMENT_ATTR, None)
    if attachment is None:
        raise ValueError(
            f"DSV4Cache needs a model attached with dsv4.hf.attach(model, ...) (or CacheSettings); got "
            f"{type(model_or_settings).__name__} without an attachment"
        )
    return attachment.settings


class DSV4Cache(Cache):
    """A ``transformers`` cache for a model attached with ``dsv4.hf.attach``, backed by a ``HybridCache``.

    Pass it to ``generate(..., past_key_values=cache)`` (transformers ≥ 5.24 also accepts ``cache=``) to keep it
    for a follow-up turn, or let ``generate()`` make one (the attach hook swaps transformers' fresh
    ``DynamicCache`` for a ``DSV4Cache``; ``return_dict_in_generate=True`` returns it).

    Args:
        model: the attached model (or its ``CacheSettings``).
        max_length: real tokens per row to allocate for on the first step (default: see the module docstring).
        hybrid: a ``HybridCache`` of your own to hold the requests (same config, numerics and device; it must
            cache every decoder layer); never grown.
    """

    def __init__(self, model: Any, *, max_length: int | None = None, hybrid: HybridCache | None = None) -> None:
        settings = _settings_of(model)
        if max_length is not None:
            if not isinstance(max_length, int) or max_length < 1:
                raise ValueError(f"max_length must be a positive int, got {max_length!r}")
            settings = replace(settings, max_length=max_length)
        if hybrid is not None:
            problems = []
            if hybrid.cfg != settings.cfg:
                problems.append(f"config {hybrid.cfg.name!r} is not the model's")
            if hybrid.numerics != settings.numerics:
                problems.append(f"numerics {hybrid.numerics.name!r} != {settings.numerics.name!r}")
            if hybrid.device != settings.device:
                problems.append(f"device {hybrid.device} != the model's {settings.device}")
            missing = sorted(set(settings.layers) - set(hybrid.layer_indices))
            if missing:
                problems.append(f"layers {missing} are not cached")
            if problems:
                raise ValueError("the HybridCache does not fit the model: " + "; ".join(problems))
        try:
            super().__init__(layers=[])
        except TypeError:  # transformers versions whose Cache takes no layers
            super().__init__()
        self.settings = settings
        self.prefix = f"hf{next(_cache_ids)}"
        self._hybrid = hybrid
        self._owns_hybrid = hybrid is None
        self._rows: list[str] = []
        self._columns = 0
        self._steps = 0
        self._open: OpenStep | None = None
        self._broken: str | None = None
        self.growths = 0
        self.ephemeral = False  # made by the attach hook for a use_cache=False call
        if hybrid is not None:
            weakref.finalize(self, _release_all, hybrid, self._rows)

    # ================================================================ dsv4 side
    @property
    def hybrid(self) -> HybridCache | None:
        """The ``HybridCache`` holding the rows (``None`` before the first step)."""
        return self._hybrid

    @property
    def request_ids(self) -> list[str]:
        """The dsv4 request id of each batch row."""
        return list(self._rows)

    @property
    def num_steps(self) -> int:
        """Model steps begun so far."""
        return self._steps

    def row_tokens(self) -> list[int]:
        """Real tokens each row's request holds."""
        return [self._hybrid.num_tokens(r) for r in self._rows] if self._hybrid is not None else []

    def begin_step(
        self,
        batch_size: int,
        num_columns: int,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache_position: Tensor | None = None,
    ) -> OpenStep:
        """Check and schedule one model step of ``batch_size`` rows × ``num_columns`` new columns (see
        ``dsv4.hf.step.row_tokens`` for the arguments): add the rows' requests on the first step, prepare the step
        once for all layers, and open it.

        Raises (the cache unchanged): ``InconsistentInputError`` (bad or inconsistent inputs), ``CacheFullError``
        (a caller's ``HybridCache`` is full), ``RuntimeError`` (the cache is broken: a previous forward stopped
        half-way).
        """
        self._check_usable()
        if self._open is not None and self._open.pending:
            self._broken = (
                f"DSV4Cache {self.prefix}: step {self._open.index} did not finish (layers {sorted(self._open.pending)} "
                "never ran), so the cache no longer matches the tokens; use a new cache or reset() this one"
            )
            raise RuntimeError(self._broken)
        fresh = not self._rows
        past = [0] * batch_size if fresh else self.row_tokens()
        plan = row_tokens(batch_size, num_columns, self._columns, past, attention_mask, position_ids, cache_position)
        if fresh:
            self._add_rows(plan)
        try:
            batch = self._prepare(plan) if plan.num_tokens else None
        except BaseException:
            if fresh:
                _release_all(self._hybrid, self._rows)
            raise
        self._open = OpenStep(self._steps, plan, batch, plan.token_index(self.settings.device), set(self.settings.layers))
        self._columns += plan.num_columns
        self._steps += 1
        return self._open

    def layer_step(self, layer_idx: int, batch_size: int, num_columns: int) -> OpenStep:
        """The open step, for layer ``layer_idx`` to run once (its input must be ``[batch_size, num_columns, d]``)."""
        self._check_usable()
        step = self._open
        if step is None:
            raise RuntimeError(
                f"DSV4Cache {self.prefix}: no step was prepared; run the attached model's forward (its hook prepares "
                "each step) instead of calling a layer directly"
            )
        if layer_idx not in step.pending:
            raise RuntimeError(f"layer {layer_idx} already ran in step {step.index} (or is not a cached layer)")
        if (batch_size, num_columns) != (step.plan.batch_size, step.plan.num_columns):
            raise ValueError(
                f"layer {layer_idx} got hidden states of {batch_size} x {num_columns} but step {step.index} is "
                f"{step.plan.batch_size} x {step.plan.num_columns}"
            )
        step.pending.discard(layer_idx)
        return step

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(self._broken)

    def _min_ratio(self) -> int:
        ratios = [self.settings.cfg.ratio(i) for i in self.settings.layers if self.settings.cfg.ratio(i)]
        return min(ratios) if ratios else 0

    def _blocks_for(self, tokens_per_row: list[int]) -> int:
        m, bs = self._min_ratio(), self.settings.block_size
        return sum(blocks_for_tokens(n, m, bs) for n in tokens_per_row)

    def _new_hybrid(self, max_requests: int, num_blocks: int) -> HybridCache:
        s = self.settings
        return HybridCache(
            s.cfg, layers=s.layers, max_requests=max_requests, num_blocks=num_blocks, block_size=s.block_size,
            device=s.device, numerics=s.numerics,
        )

    def _add_rows(self, plan: RowTokens) -> None:
        B = plan.batch_size
        if self._hybrid is None or (self._owns_hybrid and self._hybrid.max_requests < B):
            longest = max(plan.new_tokens)
            per_row = self.settings.max_length or max(2 * longest, longest + 256)
            per_row = min(max(per_row, longest), self.settings.cfg.max_position)
            self._hybrid = self._new_hybrid(B, self._blocks_for([per_row] * B))
        ids = [f"{self.prefix}/row{b}" for b in range(B)]
        if self._hybrid.num_free_slots < B:
            raise CacheFullError(
                f"the HybridCache has {self._hybrid.num_free_slots} free state slots but the batch has {B} rows"
            )
        for rid in ids:
            self._hybrid.add_request(rid)
            self._rows.append(rid)

    def _prepare(self, plan: RowTokens) -> StepBatch:
        request_plan = {self._rows[b]: plan.new_tokens[b] for b in plan.rows()}
        try:
            return self._hybrid.prepare_forward(request_plan)
        except CacheFullError:
            if not self._owns_hybrid:
                raise
        needed = self._blocks_for([p + n for p, n in zip(plan.past_tokens, plan.new_tokens)])
        self._grow(max(2 * self._hybrid.num_blocks, needed))
        return self._hybrid.prepare_forward(request_plan)

    def _grow(self, num_blocks: int) -> None:
        """Move every row into a new ``HybridCache`` of ``num_blocks`` blocks (same slots count, bit-identical)."""
        old = self._hybrid
        new = self._new_hybrid(old.max_requests, num_blocks)
        for rid in self._rows:
            new.restore_request(rid, old.save_request(rid))
        self._hybrid = new
        self.growths += 1

    def memory_bytes(self) -> int:
        """Bytes the ``HybridCache`` allocated (0 before the first step)."""
        return self._hybrid.memory_bytes() if self._hybrid is not None else 0

    def memory_in_use(self) -> int:
        """Bytes of the blocks and state slots the rows hold."""
        return self._hybrid.memory_in_use() if self._hybrid is not None else 0

    # ================================================================ transformers Cache API
    def __len__(self) -> int:
        return len(self.settings.layers)

    def __repr__(self) -> str:
        return (
            f"DSV4Cache({self.prefix}, {len(self._rows)} rows, {self._columns} columns, {self._steps} steps, "
            f"{self.settings.numerics.name}, hybrid={self._hybrid!r})"
        )

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Columns consumed so far (pads included): what ``generate()`` slices a continuation's inputs by."""
        return self._columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of a full mask over every column (only used if a mask is built at all)."""
        return self._columns + int(query_length), 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    get_max_cache_shape = get_max_length  # the older transformers name

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return bool(self._rows)

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self)

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self)

    @property
    def batch_size(self) -> int:
        return len(self._rows) if self._rows else -1

    def update(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "transformers' own attention called DSV4Cache.update: this cache serves only layers attached with "
            "dsv4.hf.attach (was the model detached?)"
        )

    def reset(self) -> None:
        """Release every row's request (the ``HybridCache`` stays allocated) and start empty."""
        if self._hybrid is not None:
            _release_all(self._hybrid, self._rows)
        self._rows.clear()
        self._columns = 0
        self._open = None
        self._broken = None

    def reorder_cache(self, beam_idx: Tensor) -> None:
        raise NotImplementedError("DSV4Cache does not support beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("DSV4Cache cannot crop: the compressor state is not rewindable")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1 and self._rows:
            raise NotImplementedError("DSV4Cache cannot repeat its rows; expand the inputs before the first step")

    def batch_select_indices(self, indices: Tensor) -> None:
        raise NotImplementedError("DSV4Cache cannot select rows")
