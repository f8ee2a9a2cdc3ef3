"""Requests, their length distributions and their prompts' token ids.

A request feeds ``prompt_len`` tokens through the stack in prefill chunks, then ``gen_len`` decode tokens, a few
per step (``decode_tokens``, 1 normally, up to 4 for speculative/MTP decoding). With no embeddings or LM head in
scope, every token's hidden state comes from the engine's hidden-state source (``dsv4.engine.hidden``), a function
of the token id: prompts are seeded random token ids, and requests of one *prefix group* begin with the same
``shared_prefix`` ids (a system prompt), so prefix caching can reuse what the first of them computed.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field

import torch

from ..validate import require_int

__all__ = ["DEFAULT_VOCAB", "LengthSpec", "Request", "make_requests", "prompt_token_ids"]

#: Token ids are drawn from ``[0, DEFAULT_VOCAB)`` (DeepSeek-V3 / V4's tokenizer size).
DEFAULT_VOCAB = 129_280


@dataclass
class Request:
    """One generation request and its progress.

    Attributes:
        request_id: unique id (the cache's request id).
        prompt_len: prompt tokens (≥ 1), fed in prefill chunks.
        gen_len: generated tokens (≥ 0), fed in decode steps after the prompt.
        arrival_step: the first engine step at which the request may be admitted (0: from the start).
        number: stable integer id (submission order), the key of its generated tokens' ids.
        token_ids: the prompt's ``prompt_len`` token ids (``None``: the engine draws unique ones from its seed).
        num_computed: tokens fed so far (prefill + decode), including those restored from the prefix cache.
        cached_tokens: prompt tokens restored from the prefix cache on admission (0: computed them all).
        admitted_step / prefill_done_step / finished_step: engine step numbers (``None`` until reached).
        admitted_s / first_token_s / finished_s: wall-clock seconds since the run started.
    """

    request_id: str
    prompt_len: int
    gen_len: int
    arrival_step: int = 0
    number: int = -1
    token_ids: list[int] | None = field(default=None, repr=False)
    num_computed: int = 0
    cached_tokens: int = 0
    admitted_step: int | None = None
    prefill_done_step: int | None = None
    finished_step: int | None = None
    admitted_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    last_scheduled: int = field(default=-1, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        require_int(f"request {self.request_id!r}: prompt_len", self.prompt_len, 1)
        require_int(f"request {self.request_id!r}: gen_len", self.gen_len, 0)
        require_int(f"request {self.request_id!r}: arrival_step", self.arrival_step, 0)
        if self.token_ids is not None and len(self.token_ids) != self.prompt_len:
            raise ValueError(
                f"request {self.request_id!r}: {len(self.token_ids)} token ids for a prompt of {self.prompt_len}"
            )

    @property
    def total_len(self) -> int:
        """Tokens the request feeds in all (``prompt_len + gen_len``)."""
        return self.prompt_len + self.gen_len

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def done(self) -> bool:
        return self.num_computed >= self.total_len

    @property
    def remaining_prompt(self) -> int:
        return max(self.prompt_len - self.num_computed, 0)

    @property
    def remaining(self) -> int:
        return self.total_len - self.num_computed


_SPEC_RE = re.compile(r"^\s*(?:(fixed|uniform|normal|lognormal|choice)\s*:)?\s*(.+?)\s*$")


@dataclass(frozen=True)
class LengthSpec:
    """A token-length distribution, parsed from a string:

    * ``"512"`` or ``"fixed:512"`` — always 512;
    * ``"uniform:128:1024"`` — integers uniform in [128, 1024];
    * ``"normal:512:128"`` — mean 512, standard deviation 128 (rounded, clipped to ≥ ``minimum``);
    * ``"lognormal:512:0.5"`` — median 512, log-space σ 0.5 (rounded, ≥ ``minimum``);
    * ``"choice:128,512,2048"`` — one of the listed values, uniformly.
    """

    kind: str
    params: tuple[float, ...]
    minimum: int = 1

    @classmethod
    def parse(cls, text: str | int | LengthSpec, minimum: int = 1) -> LengthSpec:
        if isinstance(text, LengthSpec):
            return text
        if isinstance(text, int):
            return cls("fixed", (float(text),), minimum)
        m = _SPEC_RE.match(str(text))
        if not m:
            raise ValueError(f"bad length spec {text!r}")
        kind = m.group(1) or "fixed"
        body = m.group(2)
        try:
            if kind == "choice":
                params = tuple(float(v) for v in body.split(","))
            else:
                params = tuple(float(v) for v in body.split(":"))
        except ValueError:
            raise ValueError(
                f"bad length spec {text!r}; use N, fixed:N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEDIAN:SIGMA "
                "or choice:A,B,C"
            ) from None
        want = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2}.get(kind)
        if want is not None and len(params) != want:
            raise ValueError(f"length spec {text!r}: {kind} takes {want} number(s)")
        if kind == "choice" and not params:
            raise ValueError(f"length spec {text!r}: choice needs at least one value")
        if kind == "uniform" and params[0] > params[1]:
            raise ValueError(f"length spec {text!r}: uniform needs LO <= HI")
        spec = cls(kind, params, minimum)
        if spec.max_value < minimum:
            raise ValueError(f"length spec {text!r}: every value would be below the minimum {minimum}")
        return spec

    @property
    def max_value(self) -> int:
        """An upper bound of the samples (∞ distributions are reported as a 4-σ bound)."""
        p = self.params
        if self.kind == "fixed":
            return int(p[0])
        if self.kind == "uniform":
            return int(p[1])
        if self.kind == "choice":
            return int(max(p))
        if self.kind == "normal":
            return int(round(p[0] + 4 * p[1]))
        return int(round(p[0] * math.exp(4 * p[1])))

    def sample(self, rng: random.Random) -> int:
        p = self.params
        if self.kind == "fixed":
            v = p[0]
        elif self.kind == "uniform":
            v = rng.randint(int(p[0]), int(p[1]))
        elif self.kind == "choice":
            v = rng.choice(p)
        elif self.kind == "normal":
            v = rng.gauss(p[0], p[1])
        else:
            v = p[0] * math.exp(rng.gauss(0.0, p[1]))
        return max(int(round(v)), self.minimum)

    def __str__(self) -> str:
        def f(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        if self.kind == "fixed":
            return f(self.params[0])
        sep = "," if self.kind == "choice" else ":"
        return f"{self.kind}:" + sep.join(f(x) for x in self.params)


def prompt_token_ids(seed: int, stream: int, n: int, vocab: int = DEFAULT_VOCAB) -> list[int]:
    """``n`` seeded random token ids in ``[0, vocab)`` of one stream (a request's own tokens or a group's shared
    prefix), deterministic in ``(seed, stream)``."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + stream) & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def make_requests(
    num: int,
    prompt_len: str | int | LengthSpec,
    gen_len: str | int | LengthSpec,
    seed: int = 0,
    prefix: str = "req",
    max_total: int | None = None,
    shared_prefix: int = 0,
    prefix_groups: int = 1,
    vocab: int = DEFAULT_VOCAB,
) -> list[Request]:
    """``num`` requests with lengths drawn from the specs and seeded random prompt token ids (deterministic in
    ``seed``).

    ``shared_prefix`` > 0: request i belongs to prefix group ``i % prefix_groups`` and its prompt is the group's
    ``shared_prefix`` token ids followed by ``prompt_len`` ids of its own. ``max_total`` caps the whole prompt plus
    ``gen_len`` (e.g. ``cfg.max_position``): longer draws are clipped, prompt first kept ≥ 1.
    """
    require_int("number of requests", num, 1)
    require_int("seed", seed)
    if max_total is not None:
        require_int("max_total", max_total, 1)
    require_int("shared_prefix", shared_prefix, 0)
    require_int("prefix_groups", prefix_groups, 1)
    p_spec, g_spec = LengthSpec.parse(prompt_len, 1), LengthSpec.parse(gen_len, 0)
    rng = random.Random(seed)
    groups = [prompt_token_ids(seed, -1 - k, shared_prefix, vocab) for k in range(prefix_groups)] if shared_prefix else []
    out = []
    for i in range(num):
        p, g = p_spec.sample(rng) + shared_prefix, g_spec.sample(rng)
        if max_total is not None and p + g > max_total:
            p = max(1, min(p, max_total - 1))
            g = max(0, max_total - p)
        head = groups[i % prefix_groups][:p] if groups else []
        ids = head + prompt_token_ids(seed, i, p - len(head), vocab)
        out.append(Request(f"{prefix}{i}", p, g, number=i, token_ids=ids))
    return out
