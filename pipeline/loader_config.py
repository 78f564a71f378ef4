"""The keyed loader's configuration: its packings, its fault switches and `LoaderConfig`.

Apart from pipeline/loader.py, which imports Grain (and with it JAX: 1.4 s a process here), so
that what only checks or carries a config (`tally train`'s launcher, trainer/config.py) starts
without them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

PACKINGS = ("none", "first_fit", "concat_split")
FAULTS = ("per_host_seed", "double_slice", "no_sharding", "naive_reshard")


@dataclass(frozen=True)
class LoaderConfig:
    seq_len: int = 256
    global_batch: int = 16  # rows per step over all hosts
    packing: str = "none"
    seed: int = 0
    shuffle: bool = True
    epochs: int | None = None  # None: repeat forever (training); k: exactly k epochs
    drop_remainder: bool = True
    workers: int = 0  # Grain mp_prefetch worker processes (0: in the calling process)
    read_threads: int = 16  # Grain ReadOptions: threads reading ahead (0: read on demand)
    read_buffer: int = 500  # Grain ReadOptions: records read ahead
    elastic: bool = False
    fault: str | None = None

    def check(self, host_count: int) -> None:
        if self.packing not in PACKINGS:
            raise ValueError(f"packing {self.packing!r} is not one of {PACKINGS}")
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"fault {self.fault!r} is not one of {FAULTS}")
        if self.global_batch % host_count:
            raise ValueError(f"global batch {self.global_batch} is not divisible by "
                             f"{host_count} hosts")
        if self.elastic and self.packing != "none":
            raise ValueError("the elastic iterator batches records itself: packing must be 'none'")
        if self.seq_len < 1 or self.global_batch < 1:
            raise ValueError("seq_len and global_batch must be positive")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
