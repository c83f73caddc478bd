"""What a load is asked to do: its options, and a rank's whole spec.

Light on purpose (no torch.distributed.tensor, no model code): the launcher builds these, and
a CLI process that only starts ranks should not pay the ranks' imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..plan import ResolvedPlan
from ..strategies import STRATEGIES

# memory sampling rates: below the minimum a sample would come long after the load ended,
# above the maximum the sampler would take a core from the load it measures
MIN_MEMORY_HZ, MAX_MEMORY_HZ = 0.1, 1000.0


def check_strategy(name: str) -> None:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r} (choose from {', '.join(STRATEGIES)})")


def check_device(device: str, gpus: int, lacking: str) -> None:
    """A device ranks load on: the CPU, or GPUs, one per rank, of which `gpus` must be
    visible (`lacking` says who would lack one)."""
    if device == "cuda":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus > visible:
            raise ValueError(
                f"device='cuda' runs one rank per GPU: {lacking} ({visible} visible); load on 'cpu'"
            )
    elif device != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")


@dataclass
class LoadOptions:
    strategy: str = "sliced"
    init: str = "checkpoint"  # or "random"
    seed: int = 0
    memory_hz: float = 20.0
    profile_dir: str | None = None
    profile_forward: bool = False  # also profile one forward of the fixed prompt
    # rank -> seed offset: lets a test make one rank diverge; deliberately not a launch() argument
    seed_skew: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.profile_dir = str(self.profile_dir) if self.profile_dir else None
        self.seed_skew = dict(self.seed_skew or {})

    def reads_checkpoint(self, rank: int) -> bool:
        """Whether `rank` reads the checkpoint: in rank0_broadcast only rank 0 does (the
        others may not even see the files)."""
        return self.init == "checkpoint" and (self.strategy != "rank0_broadcast" or rank == 0)

    def validate(self, plan: ResolvedPlan) -> None:
        check_strategy(self.strategy)
        if self.init not in ("checkpoint", "random"):
            raise ValueError(f"init must be 'checkpoint' or 'random', not {self.init!r}")
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64:
            # torch.manual_seed's range: a seed outside it would fail on every rank
            raise ValueError(f"seed must be an integer from -2**63 to 2**64 - 1, not {seed!r}")
        hz = self.memory_hz
        if (
            isinstance(hz, bool)
            or not isinstance(hz, (int, float))
            or not (hz == 0 or MIN_MEMORY_HZ <= hz <= MAX_MEMORY_HZ)
        ):
            raise ValueError(
                f"memory_hz must be 0 (no sampling between units) or from {MIN_MEMORY_HZ} to "
                f"{MAX_MEMORY_HZ} samples a second, not {hz!r}"
            )
        if self.profile_forward and not self.profile_dir:
            raise ValueError(
                "profile_forward profiles into profile_dir: give that too (CLI: --profile DIR)"
            )
        if self.init == "checkpoint" and not plan.has_weights:
            # say what was there and why it is not read, not only that nothing was
            found = [w.message for w in plan.warnings if w.code == "unused_weights"]
            what = "; ".join(found) if found else "config.json only"
            raise ValueError(
                f"{plan.source} holds no weights tpviz can load ({what}); pass init='random' "
                "(CLI: --init random --seed N) to initialise instead"
            )


@dataclass
class WorkerSpec:
    plan: ResolvedPlan
    options: LoadOptions
    device: str
    rendezvous: str  # file rendezvous path in the launcher's private temp dir
    threads: int
    timeout: float  # process-group timeout, seconds
    events_dir: str | None = None
