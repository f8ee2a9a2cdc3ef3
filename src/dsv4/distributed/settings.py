"""``Parallel``: the process groups one rank's layers split their work over, and how to make them.

Two splits (``dsv4.distributed``):

* **tensor parallelism** (``tp_group``): the query heads — each rank holds ``H/tp`` heads in whole output groups
  and its share of ``wo_b``; one all-reduce of the output per layer;
* **context parallelism** (``cp_group``): the compressed pool — each rank holds the entries ``i ≡ cp_rank (mod
  cp)`` of every request; the indexer's top-k and the attention over those entries merge across the group.

Ranks form a ``dp × cp × tp`` grid, tensor-parallel ranks innermost (on one host the NVLink neighbours): global
rank ``((d · cp) + c) · tp + t``. ``Parallel.build`` makes the groups from an initialized default process group;
``init_from_env`` initializes it from ``torchrun``'s environment first.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..validate import require_choice, require_int
from .collectives import all_reduce_max
from .merge import MERGES
from .sharding import check_tp_size, local_config

__all__ = ["CP_WINDOW_MODES", "Parallel", "init_from_env"]

#: Where the sliding window of a CSA / HCA layer is attended under context parallelism: ``"split"`` — each rank
#: attends ``W / cp`` of its columns (balanced); ``"first"`` — rank 0 attends all of it.
CP_WINDOW_MODES = ("split", "first")


@dataclass(frozen=True)
class Parallel:
    """The groups of one rank (``None``: no split of that kind).

    Attributes:
        tp_group: tensor-parallel group (heads).
        cp_group: context-parallel group (the compressed pool).
        cp_window: ``CP_WINDOW_MODES``: which CP rank attends which window keys of a CSA / HCA layer.
        cp_merge: ``merge.MERGES``: how the CP ranks' parts of a softmax combine (``"sums"``: a shared maximum,
            one process's roundings; ``"lse"``: partial outputs merged by their log-sum-exp, the kernels' form).
        tp_rank, tp_size, cp_rank, cp_size: this rank's place in each group (filled from the groups).
    """

    tp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    cp_window: str = "split"
    cp_merge: str = "sums"
    tp_rank: int = field(init=False, default=0)
    tp_size: int = field(init=False, default=1)
    cp_rank: int = field(init=False, default=0)
    cp_size: int = field(init=False, default=1)

    def __post_init__(self) -> None:
        require_choice("cp_window", self.cp_window, CP_WINDOW_MODES)
        require_choice("cp_merge", self.cp_merge, MERGES)
        for name in ("tp", "cp"):
            group = getattr(self, f"{name}_group")
            if group is None:
                continue
            if not isinstance(group, dist.ProcessGroup):
                raise TypeError(f"{name}_group must be a torch.distributed ProcessGroup or None, got "
                                f"{type(group).__name__}")
            object.__setattr__(self, f"{name}_rank", dist.get_rank(group))
            object.__setattr__(self, f"{name}_size", dist.get_world_size(group))

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, tp: int = 1, cp: int = 1, cp_window: str = "split", cp_merge: str = "sums") -> "Parallel":
        """This rank's groups for a ``tp × cp`` split of an initialized default group whose size is a multiple of
        ``tp · cp`` (the rest: independent replicas). Every rank of the default group must call it (the groups are
        created collectively, in the same order on every rank)."""
        tp, cp = require_int("tp", tp, 1), require_int("cp", cp, 1)
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call dsv4.distributed.init_from_env (under "
                               "torchrun) or torch.distributed.init_process_group first")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % (tp * cp):
            raise ValueError(f"{world} processes cannot form tp={tp} x cp={cp} groups: the number of processes must "
                             f"be a multiple of {tp * cp}")
        replicas = range(world // (tp * cp))
        grid = {  # every group of each kind, in the same order on every rank (new_group is collective)
            "tp": [[(d * cp + c) * tp + t for t in range(tp)] for d in replicas for c in range(cp)],
            "cp": [[(d * cp + c) * tp + t for c in range(cp)] for d in replicas for t in range(tp)],
        }
        mine: dict[str, dist.ProcessGroup | None] = {"tp": None, "cp": None}
        for kind, size in (("tp", tp), ("cp", cp)):
            if size > 1:
                for ranks in grid[kind]:
                    group = dist.new_group(ranks)
                    if rank in ranks:
                        mine[kind] = group
        return cls(mine["tp"], mine["cp"], cp_window, cp_merge)

    # ------------------------------------------------------------------ what the layers ask
    @property
    def is_split(self) -> bool:
        """Whether any work is split (tp or cp > 1)."""
        return self.tp_size > 1 or self.cp_size > 1

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` as this rank's layer computes it (``H/tp`` heads, ``G/tp`` output groups)."""
        return local_config(cfg, self.tp_size)

    def check(self, cfg: ModelConfig) -> None:
        """``ValueError`` unless ``cfg``'s heads split over ``tp_size`` ranks in whole output groups."""
        check_tp_size(cfg, self.tp_size)

    def agree_max(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s elementwise maximum over every rank this rank shares a layer with (its tp group, then its cp
        group: the whole ``tp × cp`` grid), in place — so that all of them take the same decision (a NaN check).
        Returns ``t``."""
        for group in (self.tp_group, self.cp_group):
            if group is not None:
                all_reduce_max(t, group)
        return t

    def describe(self) -> str:
        parts = [f"tp {self.tp_rank}/{self.tp_size}", f"cp {self.cp_rank}/{self.cp_size}"]
        if self.cp_size > 1:
            parts.append(f"window {self.cp_window}, merge {self.cp_merge}")
        return ", ".join(parts)


def init_from_env(tp: int = 1, cp: int = 1, device: str | torch.device | None = None, cp_window: str = "split",
                  cp_merge: str = "sums", timeout_s: float = 600.0) -> tuple[Parallel, torch.device]:
    """Initialize ``torch.distributed`` from ``torchrun``'s environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``) — NCCL with one GPU per process (``cuda:LOCAL_RANK``) when ``device`` is CUDA
    (``None``/``"auto"``: CUDA when available), else gloo on the CPU — and build the ``tp × cp`` groups.

    Returns ``(parallel, device)``. Raises ``RuntimeError`` outside ``torchrun`` (no ``WORLD_SIZE``) and
    ``ValueError`` when ``WORLD_SIZE`` is not a multiple of ``tp · cp``."""
    tp, cp = require_int("tp", tp, 1), require_int("cp", cp, 1)
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise RuntimeError(f"tp={tp} x cp={cp} needs {tp * cp} processes started by torchrun, e.g. "
                           f"`torchrun --nproc-per-node {tp * cp} -m dsv4.cli run --tp {tp} --cp {cp} ...`")
    world = int(os.environ["WORLD_SIZE"])
    if world % (tp * cp):
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of tp x cp = {tp * cp}")
    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    if device is None or str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": dev} if dev.type == "cuda" else {}))
    return Parallel.build(tp, cp, cp_window, cp_merge), dev
