"""The keyed Grain loader: one builder for training, pre-flight and tests.

    MapDataset.source(train split)
      .map_with_index(keyed)     # carries idx = epoch * N + record_key, per token
      .shuffle(seed)             # Grain reshuffles every epoch (seed + epoch)
      .repeat(epochs)
      [host::host_count]         # per-host slice
      .to_iter_dataset()
      -> packing (none | first_fit | concat_split) -> batch -> optional mp_prefetch

Because `map_with_index` sits directly after the source, the index it sees is the one the
shuffle and repeat above it asked for, `epoch * N + record_key`, and that survives slicing,
packing and batching. Every batch row therefore says which record segments it holds: the
`tokens`, `tokens_segment_ids`, `key` and `pos` arrays that `tally.audit.segments_from_batch` reads.

`elastic=True` uses Grain's ElasticIterator (batching and sharding inside, unpacked rows
only), whose state is the global position: it restores on any host count.

Fault switches reproduce real loader bugs (docs/DESIGN.md, "Known ways loaders go wrong") with real
Grain code, so demos and tests get real damaged ledgers. They are off by default:
- `per_host_seed`: each host shuffles with its own seed, then slices ("~Poisson" coverage).
- `double_slice`: the per-host slice applied twice (`[h::H][h::H]`).
- `no_sharding`: no per-host slice: every host reads the whole corpus.
- `naive_reshard`: a per-host iterator state is restored on a different host count without
  the elastic iterator, as if positions meant the same thing there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np
from grain import experimental as gx

from tally.audit.core.errors import TallyError
from tally.pipeline.loader_config import LoaderConfig

BATCH_FIELDS = ("tokens", "tokens_segment_ids", "key", "pos")


class LoaderStateError(TallyError):
    """A saved loader state that cannot be restored safely into this loader."""


class _Keyed:
    """The record -> per-token arrays map (a class, so it pickles into worker processes)."""

    def __init__(self, seq_len: int, packing: str) -> None:
        self.seq_len, self.packing = seq_len, packing

    def __call__(self, index: int, tokens: np.ndarray) -> dict[str, np.ndarray]:
        tokens = np.asarray(tokens, dtype=np.int32)
        if self.packing != "concat_split":
            tokens = tokens[: self.seq_len]  # a row holds at most seq_len tokens of a record
        n = len(tokens)
        if self.packing != "none":
            return {"tokens": tokens, "key": np.full(n, index, np.int64),
                    "pos": np.arange(n, dtype=np.int32)}
        # Padded to seq_len by slice assignment: np.pad costs ~10 us a call, which dominated
        # the loader's per-record cost (and the pre-flight shadow run's).
        out = {"tokens": np.zeros(self.seq_len, np.int32), "key": np.zeros(self.seq_len, np.int64),
               "pos": np.zeros(self.seq_len, np.int32),
               "tokens_segment_ids": np.zeros(self.seq_len, np.int32)}
        out["tokens"][:n] = tokens
        out["key"][:n] = index
        out["pos"][:n] = np.arange(n, dtype=np.int32)
        out["tokens_segment_ids"][:n] = 1
        return out


def _select(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: batch[k] for k in BATCH_FIELDS}


def global_records(source, cfg: LoaderConfig, host: int = 0) -> grain.MapDataset:
    """The keyed, shuffled, repeated record stream before any per-host slicing."""
    ds = grain.MapDataset.source(source).map_with_index(_Keyed(cfg.seq_len, cfg.packing))
    if cfg.shuffle:
        seed = cfg.seed + (host if cfg.fault == "per_host_seed" else 0)
        ds = ds.shuffle(seed=seed)
    return ds.repeat(cfg.epochs)


def _host_slice(ds: grain.MapDataset, cfg: LoaderConfig, host: int, hosts: int):
    if cfg.fault == "no_sharding":
        return ds
    ds = ds[host::hosts]
    if cfg.fault == "double_slice":
        ds = ds[host::hosts]
    return ds


class KeyedLoader:
    """Batches for one host, with a state that can be saved and restored."""

    def __init__(self, source, cfg: LoaderConfig, host: int = 0, host_count: int = 1) -> None:
        cfg.check(host_count)
        if not 0 <= host < host_count:
            raise ValueError(f"host {host} is outside 0..{host_count - 1}")
        self.cfg, self.host, self.host_count = cfg, host, host_count
        self.records_per_epoch = len(source)
        self.rows_per_host = cfg.global_batch // host_count
        mp = None
        if cfg.workers:
            _absl_flags_parsed()
            mp = grain.MultiprocessingOptions(num_workers=cfg.workers)
        records = global_records(source, cfg, host)
        read = grain.ReadOptions(num_threads=cfg.read_threads,
                                 prefetch_buffer_size=cfg.read_buffer)
        if cfg.elastic:
            self._it = iter(gx.ElasticIterator(
                records, cfg.global_batch, grain.sharding.ShardOptions(host, host_count),
                read_options=read, multiprocessing_options=mp))
            return
        ds = _host_slice(records, cfg, host, host_count).to_iter_dataset(read_options=read)
        length = {"tokens": cfg.seq_len, "key": cfg.seq_len, "pos": cfg.seq_len}
        if cfg.packing == "first_fit":
            ds = gx.FirstFitPackIterDataset(ds, length_struct=length,
                                            num_packing_bins=self.rows_per_host)
        elif cfg.packing == "concat_split":
            ds = gx.ConcatThenSplitIterDataset(ds, length_struct=length)
        ds = ds.batch(self.rows_per_host, drop_remainder=cfg.drop_remainder)
        if cfg.packing != "none":
            ds = ds.map(_select)
        if mp is not None:
            ds = ds.mp_prefetch(mp)
        self._it = iter(ds)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._it)

    def close(self) -> None:
        """Stops Grain's worker processes, if any."""
        close = getattr(self._it, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> KeyedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_state(self) -> dict[str, Any]:
        """JSON-able: the loader's config, topology and Grain iterator state."""
        return {"config": self.cfg.to_dict(), "host": self.host, "host_count": self.host_count,
                "records_per_epoch": self.records_per_epoch,
                "iterator": json.loads(json.dumps(self._it.get_state(), default=_bytes))}

    def set_state(self, state: dict[str, Any], *, force: bool = False) -> None:
        """Continue from `state`. `force` restores a state that `compatibility` objects to, as
        a naive transfer would; pre-flight uses it to measure what that would do."""
        problems = compatibility(state, self)
        if problems and not force and not (self.cfg.fault == "naive_reshard"
                                           and problems == ["host_count"]):
            raise LoaderStateError("; ".join(explain(p, state, self) for p in problems))
        self._it.set_state(state["iterator"])


def _absl_flags_parsed() -> None:
    """Grain's worker processes read absl flags; a program that never parsed them (most
    training scripts that are not absl apps) would fail there. Defaults are what we want."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _bytes(obj: object) -> object:
    if isinstance(obj, bytes):
        return obj.decode("latin-1")
    raise TypeError(f"loader state holds an unexpected {type(obj).__name__}")


def compatibility(state: dict[str, Any], loader: KeyedLoader) -> list[str]:
    """What stands between a saved state and `loader` (empty: safe to restore)."""
    saved = state.get("config", {})
    mine = loader.cfg.to_dict()
    problems = []
    if state.get("records_per_epoch") != loader.records_per_epoch:
        problems.append("records_per_epoch")
    for key in ("seq_len", "global_batch", "packing", "seed", "shuffle", "epochs",
                "drop_remainder", "elastic"):
        if saved.get(key) != mine[key]:
            problems.append(key)
    if state.get("host_count") != loader.host_count and not loader.cfg.elastic:
        problems.append("host_count")
    return problems


def state_for_host(loaders: dict[str, Any], host: int) -> dict[str, Any]:
    """The saved loader state new host `host` restores when the host count changes: old host
    `host % old_hosts`'s (what a trainer's transfer does; the pre-flight check shadow-runs the
    same placement)."""
    return loaders[str(host % len(loaders))]


def explain(problem: str, state: dict[str, Any], loader: KeyedLoader) -> str:
    """One line on a problem `compatibility` found."""
    if problem == "host_count":
        return (f"state saved on {state.get('host_count')} hosts cannot be restored on "
                f"{loader.host_count} without the elastic iterator (positions in a per-host "
                "slice mean different records on another host count)")
    if problem == "records_per_epoch":
        return (f"state is for a corpus of {state.get('records_per_epoch')} records, this one "
                f"has {loader.records_per_epoch}")
    return (f"{problem} was {state.get('config', {}).get(problem)!r} when saved, "
            f"is {loader.cfg.to_dict()[problem]!r} now")
