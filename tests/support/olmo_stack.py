"""A user's training data stack as MaxText's OLMo pipeline builds it, written for the tests
(nothing of Tally in it): a Grain `RandomAccessDataSource` of fixed-length token instances over
an OLMo numpy mix (index JSON + flat token files), a sampler that takes this host's contiguous
block of each epoch's global permutation, 1:1 operations that drop the instance id and reshape
rows into inputs/targets, then `Batch`.

`make_loader(host, host_count)` is what `tally replay --loader
tests.support.olmo_stack:make_loader` imports. The environment picks the mix and the mistake, as a
job's flags would: TALLY_TEST_MIX (index JSON), TALLY_TEST_SHARDING (`twice`: the sampler takes the
host's block *and* the loader is given ShardOptions for the host, the reference incident; `once`: a
global permutation, sharded by the loader only), TALLY_TEST_BATCH (rows per host),
TALLY_TEST_WORKERS, TALLY_TEST_START (the sampler's start offset, MaxText's `initial_step`: the
first absolute index the sampler gives; global for `once`, per host for `twice`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import grain
import numpy as np


class MixSource(grain.sources.RandomAccessDataSource):
    """Instance i of the mix: `sequence_length` tokens of the file holding it."""

    def __init__(self, index_path: str | os.PathLike) -> None:
        self.index_path = str(index_path)
        idx = json.loads(Path(index_path).read_text())
        self.seq = int(idx["sequence_length"])
        self.dtype = np.dtype(idx["dtype"])
        base = Path(index_path).parent
        self.paths = [str(base / f["path"]) for f in idx["files"]]
        self.offsets = np.array([f["instance_offset"] for f in idx["files"]], np.int64)
        self.total = int(idx["total_instances"])
        self.fingerprint = idx.get("fingerprint", "")
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int) -> dict:
        f = int(np.searchsorted(self.offsets, i, side="right") - 1)
        if f not in self._maps:
            self._maps[f] = np.memmap(self.paths[f], dtype=self.dtype, mode="r")
        start = (int(i) - int(self.offsets[f])) * self.seq
        return {"tokens": np.array(self._maps[f][start:start + self.seq]), "instance_id": int(i)}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}}

    def __repr__(self) -> str:
        return f"MixSource({self.fingerprint!r}, seq={self.seq})"


class BlockSampler:
    """Per-host index i -> this host's contiguous block of epoch e's global permutation
    (e = i // block); endless. With shard_count 1 it is the global permutation itself."""

    def __init__(self, total: int, seed: int, shard_index: int = 0, shard_count: int = 1,
                 start: int = 0) -> None:
        self.total, self.seed, self.start = total, seed, start
        self.shard_index, self.shard_count = shard_index, shard_count
        self.block = total // shard_count
        self._cache: tuple[int, np.ndarray] | None = None

    def _perm(self, epoch: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.total)
            lo = self.shard_index * self.block
            self._cache = (epoch, perm[lo:lo + self.block])
        return self._cache[1]

    def __getitem__(self, index: int) -> grain.RecordMetadata:
        if index < 0:
            raise IndexError(index)
        epoch, within = divmod(int(index) + self.start, self.block)
        return grain.RecordMetadata(index=index, record_key=int(self._perm(epoch)[within]))

    def __repr__(self) -> str:
        return (f"BlockSampler(total={self.total}, seed={self.seed}, "
                f"shard={self.shard_index}/{self.shard_count})")


class DropId(grain.transforms.Map):
    def map(self, element: dict) -> dict:
        return {"tokens": element["tokens"]}


class InputsTargets(grain.transforms.Map):
    def map(self, element: dict) -> dict:
        t = element["tokens"].astype(np.int32)
        return {"inputs": t, "targets": np.append(t[1:], 0).astype(np.int32),
                "inputs_segmentation": np.ones_like(t)}


def build(index_path: str | os.PathLike, host: int, host_count: int, *, batch: int,
          sharding: str = "twice", seed: int = 7, workers: int = 0,
          operations: list | None = None, start: int = 0) -> grain.DataLoader:
    source = MixSource(index_path)
    if sharding == "twice":
        sampler = BlockSampler(len(source), seed, host, host_count, start)
    else:
        sampler = BlockSampler(len(source), seed, start=start)
    ops = operations if operations is not None else [DropId(), InputsTargets()]
    return grain.DataLoader(
        data_source=source, sampler=sampler,
        operations=[*ops, grain.transforms.Batch(batch_size=batch, drop_remainder=True)],
        shard_options=grain.sharding.ShardOptions(host, host_count, drop_remainder=True),
        worker_count=workers)


def make_loader(host: int, host_count: int) -> grain.DataLoader:
    """The factory `tally replay --loader` and `tally preflight --loader` call
    (TALLY_TEST_FAIL_HOST: that host's loader cannot be made, as a job's broken flag would)."""
    if os.environ.get("TALLY_TEST_FAIL_HOST") == str(host):
        raise FileNotFoundError(f"no data for host {host}")
    return build(os.environ["TALLY_TEST_MIX"], host, host_count,
                 batch=int(os.environ.get("TALLY_TEST_BATCH", "4")),
                 sharding=os.environ.get("TALLY_TEST_SHARDING", "twice"),
                 workers=int(os.environ.get("TALLY_TEST_WORKERS", "0")),
                 start=int(os.environ.get("TALLY_TEST_START", "0")))


class DropRepetitive(grain.transforms.Filter):
    """Not 1:1: drops instances (what MaxText's n-gram filter avoids doing)."""

    def filter(self, element: dict) -> bool:
        return len(np.unique(element["tokens"])) > 1


def make_filtered_loader(host: int, host_count: int) -> grain.DataLoader:
    """A loader Tally must refuse: a Filter among its operations."""
    return build(os.environ["TALLY_TEST_MIX"], host, host_count, batch=4,
                 operations=[DropRepetitive(), DropId()])
