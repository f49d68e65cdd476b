"""Everything a stage needs, built once per process: layouts, dock, engines, data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spmd_rl.config.layout import Layouts
from spmd_rl.config.schema import Config
from spmd_rl.data.prompts import PromptSet
from spmd_rl.data.sampler import PromptSampler
from spmd_rl.distributed.accelerator import Accelerator
from spmd_rl.dock.client import Peer, TransferDock
from spmd_rl.engines.rollout import RolloutEngine
from spmd_rl.engines.base import Engine
from spmd_rl.reshard.allgather_swap import Resharder
from spmd_rl.reshard.swap import HostSwap


@dataclass
class Run:
    cfg: Config
    lay: Layouts
    peer: Peer
    acc: Accelerator
    dock: TransferDock
    actor: Engine
    ref: Engine | None
    ref_swap: HostSwap | None
    rollout: RolloutEngine
    resharder: Resharder
    tokenizer: Any
    prompts: PromptSet
    sampler: PromptSampler
    reward_fn: Any
    evaluator: Callable[[], float] | None = None
    """Held-out greedy accuracy of the current policy (``trainer.eval_interval``)."""
