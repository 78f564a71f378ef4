"""Audit a user's `grain.DataLoader` as it is, with one line, from the loader's index contract.

    loader = grain.DataLoader(data_source=src, sampler=sampler, operations=[..., Batch(B)],
                              shard_options=ShardOptions(h, H), worker_count=W)
    loader = tally_grain.audited(loader, "spool", run_id="exp1")   # the one line
    for batch in loader: ...                                         # the same batches as before

Which records a batch holds is read from the loader's own contract, never from the batch's
fields (MaxText's OLMo pipeline drops the instance id before the trainer sees a batch):

- the loader's local position p on host h reads `sampler[p * H + h]` (`ShardOptions(h, H)`),
  whose `record_key` names the record `data_source[record_key]`;
- with W worker processes, worker w reads local positions w, w + W, w + 2W, ... and the
  loader takes one batch from each worker in turn; without workers one stream reads them all;
- `Batch(B)` groups B consecutive positions of one stream; every other operation must map one
  element to one element (`Map`, `RandomMap`, `TfRandomMap`), else positions stop naming
  records and the loader is refused (`AttachError`), never silently mis-recorded.

Where the next batch starts is read from the iterator's own checkpoint state before each batch
(`last_seen_indices`, `last_worker_index`: the JSON Grain saves as `process_<i>-of-<n>.json`),
so a loader restored by `set_state`, by Grain's checkpoint handler or by Orbax continues its keys
exactly, and the step of a batch is `start_step` plus the loader's own batch ordinal. Replay
(`tally.pipeline.replay`) reads the same contract from the same states without running the loader.

Content hashes: by default of what the data source returns for the record, read again on the
writer's thread (`tokens_field` names the field of a dict record; an array record is the tokens);
or from the manifest (`hashes=ManifestHashes(path)`: nothing is read again, and the hash
integrity check then proves nothing about the corpus). Epochs are exact for Grain's
`IndexSampler` and `SequentialSampler`; for another sampler, -1 (unknown) unless it has a
`tally_epochs(indices)` method or the caller gives `epoch_of`.
"""

from __future__ import annotations

import bisect
import json
import os
import pickle
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grain
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tally.audit.core.errors import TallyError
from tally.audit.core.hashing import as_token_array, hash_runs
from tally.audit.hook.segments import Segments
from tally.pipeline.loaders import leading_rows
from tally.pipeline.manifest_file import ManifestHashes, manifest_info  # noqa: F401  (re-exported)

# The operations that map one element to one element (checked by exact class or subclass).
ONE_TO_ONE = (grain.transforms.Map, grain.transforms.RandomMap, grain.transforms.TfRandomMap)


class AttachError(TallyError):
    """A loader Tally cannot audit from its index contract (the message says what to do)."""


# ---- the index contract ------------------------------------------------------------------

@dataclass(frozen=True)
class Contract:
    """How one host's loader turns positions into sampler indices and batches."""

    shard_index: int
    shard_count: int
    workers: int  # Grain's worker_count (0: the loader reads in the calling process)
    batch_size: int
    drop_remainder: bool
    positions: int  # local positions the loader reads: len(sampler) // shard_count

    @property
    def streams(self) -> int:
        return max(self.workers, 1)

    def stream_length(self, w: int) -> int:
        """Elements stream (worker) w reads: local positions w, w + W, ... below `positions`."""
        return max(0, -(-(self.positions - w) // self.streams))

    def cursor(self, state: Mapping[str, Any] | None) -> Cursor:
        """Where the next batch starts, from the iterator's checkpoint state (None: a fresh
        iterator). The inverse of how Grain writes `last_seen_indices`."""
        if state is None:
            return Cursor([0] * self.streams, 0)
        try:
            seen = state["last_seen_indices"]
            if int(state.get("worker_count", 0)) != self.workers or len(seen) != self.streams:
                raise AttachError(f"loader state for {state.get('worker_count')} worker(s), "
                                  f"this loader has {self.workers}")
            g = self.streams * self.shard_count
            nxt = [(int(seen[str(w)]) + g - self.shard_index - w * self.shard_count) // g
                   for w in range(self.streams)]
            return Cursor(nxt, (int(state["last_worker_index"]) + 1) % self.streams)
        except (KeyError, TypeError, ValueError) as exc:
            raise AttachError(f"not a Grain DataLoader state ({type(exc).__name__}: {exc}): "
                              "expected last_seen_indices for each worker and "
                              "last_worker_index") from None

    def next_batch(self, cur: Cursor) -> tuple[np.ndarray, int, Cursor] | None:
        """(sampler indices of the next batch, its ordinal, the cursor after it), or None when
        the loader is exhausted. Streams with no batch left are passed over in turn, as
        Grain's round robin does."""
        for k in range(self.streams):
            w = (cur.next_stream + k) % self.streams
            start, left = cur.next[w], self.stream_length(w) - cur.next[w]
            if left <= 0 or (self.drop_remainder and left < self.batch_size):
                continue
            j = np.arange(start, start + min(self.batch_size, left), dtype=np.int64)
            indices = (w + j * self.streams) * self.shard_count + self.shard_index
            after = list(cur.next)
            after[w] = start + len(j)
            ordinal = (start // self.batch_size) * self.streams + w
            return indices, ordinal, Cursor(after, (w + 1) % self.streams)
        return None


@dataclass(frozen=True)
class Cursor:
    next: list[int]  # per stream: elements read so far
    next_stream: int  # the stream the next batch comes from


def contract_of(loader: grain.DataLoader) -> Contract:
    """The loader's index contract, or AttachError when its operations are not 1:1."""
    if not isinstance(loader, grain.DataLoader):
        raise AttachError(f"expected a grain.DataLoader, got {type(loader).__name__}")
    batch: grain.transforms.Batch | None = None
    for i, op in enumerate(loader._operations):
        if isinstance(op, grain.transforms.Batch):
            if batch is not None:
                raise AttachError(f"operation {i} is a second Batch: one Batch is supported "
                                  "(batch once, then reshape in a Map)")
            batch = op
        elif not isinstance(op, ONE_TO_ONE):
            raise AttachError(
                f"operation {i} ({type(op).__name__}) is not 1:1: after it a loader position "
                "no longer names one record, so Tally cannot read the keys from the loader. "
                "Filter in the data source or the sampler instead, or carry the record key "
                "through the pipeline and write batches with LedgerWriter.write_batch "
                "(docs/guides/attach.md: 'Attaching Tally to your own loop')")
    if batch is None:
        raise AttachError("the loader has no Batch operation: Tally records batches (add "
                          "grain.transforms.Batch(batch_size=...) as the last operation)")
    shard = loader._shard_options
    mp = loader.multiprocessing_options
    return Contract(int(shard.shard_index), int(shard.shard_count), int(mp.num_workers),
                    int(batch.batch_size), bool(batch.drop_remainder), _positions(loader))


def _positions(loader: grain.DataLoader) -> int:
    """The local positions the loader reads, as the loader itself computed them when it was
    made (len(sampler) // shard_count; a sampler without a length is searched for its first
    refused index, an endless one reads as sys.maxsize // shard_count). Taken from the
    loader's own sampler dataset: searching again would cost an endless sampler ~63 lookups,
    each maybe a permutation of the whole corpus."""
    stack = [loader._dataset]
    while stack:
        ds = stack.pop()
        if type(ds).__name__ == "_SamplerMapDataset":
            return int(len(ds))
        stack.extend(getattr(ds, "parents", ()))
        stack.extend(getattr(ds, "_datasets", ()))  # worker streams (Grain's interleave)
    raise AttachError("this grain.DataLoader has no sampler dataset where Grain "
                      f"{grain.__version__ if hasattr(grain, '__version__') else ''} puts one: "
                      "a Grain version Tally does not know")


# ---- record keys and epochs of sampler indices -----------------------------------------

class SamplerKeys:
    """record keys (and epochs) of sampler indices: vectorised for Grain's samplers where
    the sampler allows it and for a sampler with `tally_record_keys(indices)`, one
    `sampler[i]` a record otherwise."""

    def __init__(self, sampler: Any, epoch_of: Callable[[np.ndarray], np.ndarray] | None = None
                 ) -> None:
        self.sampler, self.epoch_of = sampler, epoch_of

    def keys(self, indices: np.ndarray) -> np.ndarray:
        s = self.sampler
        if hasattr(s, "tally_record_keys"):
            return np.asarray(s.tally_record_keys(indices), np.int64)
        if isinstance(s, grain.samplers.SequentialSampler):
            return indices.astype(np.int64)
        if isinstance(s, grain.samplers.IndexSampler):
            ds, per = s._record_keys, _shards_of(s)
            at = indices // per
            if not s._shuffle:
                return _unshuffled_keys(ds, at, s._num_records)
            return _shuffled_keys(ds, at, s._num_records)
        return np.fromiter((s[i].record_key for i in indices.tolist()), np.int64, len(indices))

    def epochs(self, indices: np.ndarray) -> np.ndarray:
        s = self.sampler
        if self.epoch_of is not None:
            return np.asarray(self.epoch_of(indices), np.int64)
        if hasattr(s, "tally_epochs"):
            return np.asarray(s.tally_epochs(indices), np.int64)
        if isinstance(s, grain.samplers.IndexSampler):
            return (indices // _shards_of(s)) // len(s._record_keys)
        if isinstance(s, grain.samplers.SequentialSampler):
            return np.zeros(len(indices), np.int64)
        return np.full(len(indices), -1, np.int64)


def _shards_of(sampler: grain.samplers.IndexSampler) -> int:
    opts = sampler._shard_options
    return 1 if isinstance(opts, grain.sharding.NoSharding) else int(opts.shard_count)


_SHUFFLE: list[Callable[[int, int, int, int], int]] = []


def _index_shuffle() -> Callable[[int, int, int, int], int]:
    """Grain's index shuffle, called the cheapest way that gives its answers: the C++ function
    of its shared library through ctypes (2.4 us a call) when the library exports it and it
    agrees with Grain's Python binding (3.5 us a call) on a sample, else that binding."""
    if _SHUFFLE:
        return _SHUFFLE[0]
    import ctypes

    from grain._src.python.experimental.index_shuffle.python import index_shuffle_module as m

    best = m.index_shuffle
    lib = Path(m.__file__).parent.parent / "libindex_shuffle.so"
    try:
        fn = ctypes.CDLL(str(lib))._ZN5grain6random13index_shuffleEmmjj
        fn.restype = ctypes.c_uint64
        fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint32]
        sample = [(i * 7919 % 1001, 1000, 3 + i, 4) for i in range(64)]
        if all(fn(*a) == best(*a) for a in sample):
            best = fn
    except (OSError, AttributeError):
        pass
    _SHUFFLE.append(best)
    return best


def _shuffled_keys(ds: Any, at: np.ndarray, n: int) -> np.ndarray:
    """IndexSampler with shuffle: Grain's per-epoch index shuffle (its own C++ function, one
    call a record: ~2.4 us against ~10 us through `sampler[i]`, which also builds a Philox
    generator per record), then the unshuffled parent in numpy."""
    index_shuffle = _index_shuffle()
    if type(ds).__name__ != "ShuffleMapDataset":  # a Grain version that builds it otherwise
        get = ds.__getitem__
        return np.fromiter((get(i) for i in at.tolist()), np.int64, len(at))
    length, seed = len(ds), ds._seed
    epoch, within = np.divmod(at, length)
    seeds = ((seed + epoch) % 2**32).tolist()
    top = length - 1
    shuffled = np.fromiter((index_shuffle(i, top, e, 4) for i, e in zip(within.tolist(), seeds,
                                                                       strict=True)),
                           np.int64, len(at))
    return _unshuffled_keys(ds._parent, shuffled + epoch * length, n)


def _unshuffled_keys(ds: Any, at: np.ndarray, n: int) -> np.ndarray:
    """IndexSampler without shuffle: range(n), or one host's contiguous block of it."""
    length = len(ds)
    epoch, within = np.divmod(at, length)
    start = getattr(ds, "_start", 0)
    if start or length != n:  # a sharded sampler: its block, repeated epoch after epoch
        return start + within
    return within


# ---- content hashes ----------------------------------------------------------------------

class SourceHashes:
    """Segments of records read back from the data source and hashed (the default)."""

    def __init__(self, source: Any, tokens_field: str = "tokens") -> None:
        self.source, self.field = source, tokens_field

    def tokens(self, key: int) -> np.ndarray:
        rec = self.source[key]
        if isinstance(rec, Mapping):
            if self.field not in rec:
                raise AttachError(f"record {key} of the data source has no field "
                                  f"{self.field!r} (fields: {sorted(rec)}): name the token "
                                  "field with tokens_field=")
            rec = rec[self.field]
        if isinstance(rec, (bytes, str)):
            raise AttachError(f"record {key} of the data source is {type(rec).__name__}, not "
                              "token ids (a serialized record: MaxText's tf.Example in "
                              "ArrayRecord files): give hashes= the corpus manifest")
        return as_token_array(np.asarray(rec).reshape(-1))

    def check(self) -> SourceHashes:
        """Itself, once its first record reads as tokens: a source Tally cannot hash is
        refused when the loader is attached, not by the writer after the first batch."""
        if len(self.source):
            self.tokens(0)
        return self

    def segments(self, keys: np.ndarray, epochs: np.ndarray) -> Segments:
        toks = [self.tokens(k) for k in keys.tolist()]
        lengths = np.array([len(t) for t in toks], np.int64)
        flat = np.concatenate(toks) if toks else np.zeros(0, np.int32)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(toks) else lengths
        return Segments.build(row=np.arange(len(keys)), record_key=keys, n_tokens=lengths,
                              content_hash=hash_runs(flat, starts, lengths), epoch=epochs)


class FileKeyedHashes:
    """ManifestHashes for sources that read files (Grain's and array_record's
    `ArrayRecordDataSource`): a source's record i is record j of file f by the source's own read
    instructions, and its record key is the manifest's row whose `source` names file f and
    whose `source_index` is j. MaxText lists its files with `glob.glob` (directory order, not
    sorted) and mixes its patterns in the order the user wrote them, where `tally manifest`
    keys files sorted by path: by position alone a key would name another file's record (and,
    in a mixture, another domain's)."""

    def __init__(self, hashes: ManifestHashes, source: Leaves) -> None:
        self.inner, self.fingerprint = hashes, hashes.fingerprint
        self.content_basis = hashes.content_basis
        files = _manifest_files(hashes.path)
        starts, bases = [], []
        for offset, src in zip(source.offsets, source.sources, strict=True):
            at = offset
            for name, lo, hi in _read_instructions(src):
                r = _manifest_file(files, name, hashes.path)
                first, last = r["first"], r["last"]
                if r["rows"] != last - first + 1 or lo < first or hi - 1 > last:
                    raise AttachError(f"file {name} (records {lo}..{hi - 1}) is not among "
                                      f"records {first}..{last} of its entry in the manifest "
                                      f"{hashes.path}: is it this corpus' manifest?")
                starts.append(at)
                bases.append(r["key"] + lo - first)
                at += hi - lo
        self.starts, self.bases = np.array(starts, np.int64), np.array(bases, np.int64)

    def __len__(self) -> int:
        return len(self.inner)

    def keys(self, keys: np.ndarray) -> np.ndarray:
        f = np.searchsorted(self.starts, keys, side="right") - 1
        return self.bases[f] + (keys - self.starts[f])

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.lookup(self.keys(keys))

    def resolve(self, keys: np.ndarray, epochs: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(manifest record keys, lengths, content hashes) of the sources' keys."""
        keys = self.keys(keys)
        h, n = self.inner.lookup(keys)
        return keys, n, h

    def segments(self, keys: np.ndarray, epochs: np.ndarray) -> Segments:
        return self.inner.segments(self.keys(keys), epochs)


def _manifest_files(manifest: str) -> dict[str, dict[str, int]]:
    """Per file of the manifest's train split (its `source`): the least and greatest
    `source_index`, the least record key and the rows, read a batch at a time with the file
    names dictionary-encoded (a manifest of billions of records is never held whole)."""
    files: dict[str, dict[str, int]] = {}
    pf = pq.ParquetFile(manifest, read_dictionary=["source"])
    for batch in pf.iter_batches(columns=["record_key", "split", "source", "source_index"],
                                 batch_size=1 << 20):
        train = pc.equal(batch["split"], "train").to_numpy(zero_copy_only=False)
        if not train.any():
            continue
        src = batch["source"].filter(pa.array(train))
        codes = src.indices.to_numpy(zero_copy_only=False)
        names = src.dictionary.to_pylist()
        key = batch["record_key"].to_numpy()[train]
        index = batch["source_index"].to_numpy()[train]
        for c in np.unique(codes).tolist():
            at = codes == c
            k, i = key[at], index[at]
            r = files.setdefault(names[c], {"key": int(k.min()), "first": int(i.min()),
                                            "last": int(i.max()), "rows": 0})
            r["key"], r["rows"] = min(r["key"], int(k.min())), r["rows"] + int(at.sum())
            r["first"], r["last"] = min(r["first"], int(i.min())), max(r["last"], int(i.max()))
    return files


def _read_instructions(source: Any) -> list[tuple[str, int, int]]:
    return [(os.fspath(r.filename), int(r.start), int(r.end))
            for r in source._read_instructions]


def _manifest_file(files: Mapping[str, Any], name: str, manifest: str) -> Any:
    """The manifest's entry for file `name`: its `source` is the file's path under the corpus
    directory, so the longest one that `name` ends with."""
    found = [s for s in files if name == s or name.endswith("/" + s)]
    if not found:
        raise AttachError(f"file {name} is not among the sources of the manifest {manifest}: "
                          "make the manifest of the files the loader reads")
    return files[max(found, key=len)]


def keyed_by_file(hashes: ManifestHashes | None, source: Leaves
                  ) -> ManifestHashes | FileKeyedHashes | None:
    """`hashes` keyed by file where every source the loader reads is a file reader (see
    FileKeyedHashes); as they are otherwise (a source of records in the manifest's order)."""
    if hashes is None or not all(hasattr(s, "_read_instructions") for s in source.sources):
        return hashes
    return FileKeyedHashes(hashes, source)


# ---- the live attach -------------------------------------------------------------------

def _private_copy(obj: Any) -> Any:
    """A copy for the writer's thread (samplers cache an epoch's permutation and sources keep
    open files: sharing them with the loader's thread would race); the object itself when it
    does not pickle."""
    try:
        return pickle.loads(pickle.dumps(obj))
    except Exception:
        return obj


def _inner_state(it: Any) -> dict[str, Any]:
    """The iterator's checkpoint state as a dict (without Grain's JSON round trip when the
    iterator keeps it as one)."""
    inner = getattr(it, "_iterator", None)
    if inner is not None and hasattr(inner, "get_state"):
        return inner.get_state()
    return json.loads(it.get_state())


class AuditedIterator(Iterator[Any]):
    """The loader's iterator, recording each batch it hands out (same objects, same order).
    `get_state`, `set_state`, `save`, `load` and `start_prefetch` are the iterator's own."""

    def __init__(self, it: Any, writer: Any, contract: Contract,
                 keys: SamplerKeys, hashes: SourceHashes | ManifestHashes, start_step: int
                 ) -> None:
        self._it, self._writer = it, writer
        self.contract, self._keys, self._hashes = contract, keys, hashes
        self.start_step = start_step

    def __iter__(self) -> AuditedIterator:
        return self

    def __next__(self) -> Any:
        nxt = self.contract.next_batch(self.contract.cursor(_inner_state(self._it)))
        batch = next(self._it)
        if nxt is None:
            raise AttachError("the loader gave a batch after the positions its sampler holds "
                              "ran out: its length is not what Tally computed")
        indices, ordinal, _ = nxt
        rows = leading_rows(batch)
        if rows is not None and rows != len(indices):
            raise AttachError(f"batch {ordinal} has {rows} rows, the loader's contract says "
                              f"{len(indices)}: an operation changed the element count")
        keys, hashes = self._keys, self._hashes

        def segments() -> Segments:  # on the writer's thread
            return hashes.segments(keys.keys(indices), keys.epochs(indices))

        self._writer.write_segments(self.start_step + ordinal, segments)
        return batch

    # The iterator's own state API, unchanged (a checkpoint holds what it held before).
    def get_state(self) -> Any:
        return self._it.get_state()

    def set_state(self, state: Any) -> None:
        self._it.set_state(state)

    async def save(self, directory: Any) -> Any:
        return await self._it.save(directory)

    async def load(self, directory: Any) -> Any:
        return await self._it.load(directory)

    def start_prefetch(self) -> None:
        self._it.start_prefetch()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


class AuditedLoader:
    """A `grain.DataLoader` whose iterators record what they hand out; anything else is the
    loader's own (`__getattr__`)."""

    def __init__(self, loader: grain.DataLoader, writer: Any, *, start_step: int = 0,
                 tokens_field: str = "tokens", hashes: ManifestHashes | None = None,
                 epoch_of: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        self.loader, self.writer, self.start_step = loader, writer, start_step
        self.contract = contract_of(loader)
        self._keys = SamplerKeys(_private_copy(loader._sampler), epoch_of)
        self._hashes = keyed_by_file(hashes, Leaves((loader._data_source,), (0,))) or \
            SourceHashes(_private_copy(loader._data_source), tokens_field).check()

    def __iter__(self) -> AuditedIterator:
        return AuditedIterator(iter(self.loader), self.writer, self.contract,
                               self._keys, self._hashes, self.start_step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def audited(loader: Any, spool: Any, run_id: str | None = None, *,
            start_step: int = 0, tokens_field: str = "tokens",
            hashes: ManifestHashes | str | os.PathLike | None = None,
            epoch_of: Callable[[np.ndarray], np.ndarray] | None = None,
            **writer_options: Any) -> AuditedLoader | AuditedDataset:
    """`loader`, recording every batch its iterators hand out.

    `loader` is a `grain.DataLoader`, or a MapDataset pipeline ending in `.batch(B)` (or its
    `to_iter_dataset()...batch(B)`, then 1:1 maps and `mp_prefetch` as MaxText's): for those,
    give `host=` and `host_count=` with a spool directory (a MapDataset does not know its
    host). Its sources may be mixed (`MapDataset.mix`, `concatenate`).

    `spool`: a spool directory (a `LedgerWriter` is made for this host: host and host count
    from the loader's `ShardOptions`, records_per_epoch from the data source, `run_id` and
    `writer_options` as `LedgerWriter` takes them: `content_basis=` says how a loop that
    tokenizes text hashes, TextHasher(...).basis; with `hashes`, the manifest's) or a
    `LedgerWriter` already made.
    `start_step`: the training step of a fresh loader's first batch (a sampler resumed by its
    own start offset, MaxText's `initial_step`: the step the run resumed at). A loader
    restored from its own state already continues from its batch ordinal: leave it 0 there,
    or the offset counts twice. `hashes`: a manifest path to take hashes from instead of reading
    records back. Raises AttachError for a loader whose operations are not 1:1."""
    from tally.audit.hook.writer import LedgerWriter

    dataset = isinstance(loader, (grain.MapDataset, grain.IterDataset))
    if dataset:
        elements = dataset_contract(loader).elements
        records = len(leaves(elements))
        if not isinstance(spool, LedgerWriter) and not {"host", "host_count"} <= set(
                writer_options):
            raise AttachError("a dataset pipeline does not know its host: give host= and "
                              "host_count= (or a LedgerWriter)")
    else:
        contract = contract_of(loader)
        records = _length(loader._data_source)
        writer_options.setdefault("host", contract.shard_index)
        writer_options.setdefault("host_count", contract.shard_count)
    if isinstance(hashes, (str, os.PathLike)):
        hashes = ManifestHashes(hashes)
    writer = spool
    if not isinstance(spool, LedgerWriter):
        if run_id is None:
            raise AttachError("audited(loader, spool, run_id): a spool directory needs a run id")
        writer_options.setdefault("records_per_epoch", records)
        if hashes is not None:
            writer_options.setdefault("manifest_fingerprint", hashes.fingerprint)
            writer_options.setdefault("content_basis", hashes.content_basis or None)
        writer = LedgerWriter(Path(spool), run_id, **writer_options)
    if dataset:
        return AuditedDataset(loader, writer, start_step=start_step, tokens_field=tokens_field,
                              hashes=hashes)
    return AuditedLoader(loader, writer, start_step=start_step, tokens_field=tokens_field,
                         hashes=hashes, epoch_of=epoch_of)


def _length(source: Any) -> int | None:
    try:
        n = len(source)
    except TypeError:
        return None
    return n if n > 0 else None


# ---- MapDataset pipelines ----------------------------------------------------------------
# A MapDataset pipeline decides record order by index arithmetic too: a batch position k holds
# elements k*B .. k*B + B - 1 of the dataset under the Batch, and each element index walks down
# the chain to the source: a slice maps i to start + (i % len) * step + (i // len) * parent's
# length, a shuffle through Grain's per-epoch index shuffle, a repeat passes it on (or takes it
# modulo with reseed_each_epoch=False), 1:1 maps pass it on, and the source reads index % N:
# the record key is g % N and the epoch g // N. A mixture (`MapDataset.mix`, `concatenate`)
# hands index i to parent j at index i_j, both from its own selection map (Grain's, asked
# element by element, so any selection map is followed exactly); each parent's chain goes on
# from there. The sources under a mixture are keyed in its order, each after the records of
# the ones before (`Leaves`), and an epoch is a pass over the record's own source: Grain's mix
# of a 10-record and a 40-record source at even weights reads the small one in every mix epoch
# and the next 10 of the large one (a probe: ids 100-109, then 110-119, ...), so the large
# source's passes are a quarter as many, which the reconcile measures by each domain's own
# ideal where the manifest gives each source its domain. Filter, flat map, window shuffle and
# zip change the correspondence and are refused.
_PASS_THROUGH = ("MapMapDataset", "RandomMapMapDataset", "MapWithIndexMapDataset",
                 "_WithSeedMapDataset")
_MIXTURES = ("MixedMapDataset", "ConcatenateMapDataset")
_ITER_PASS_THROUGH = ("MapIterDataset", "RandomMapIterDataset", "_WithSeedIterDataset",
                      "_WithOptionsIterDataset", "WithOptionsIterDataset")


def _parent(ds: Any) -> Any:
    parents = getattr(ds, "_parents", ())
    return parents[0] if parents else None


@dataclass(frozen=True)
class Leaves:
    """The data sources under a MapDataset pipeline in its mixtures' order: source j's record
    i has record key `offsets[j] + i`. Reads a record by its key (what SourceHashes hashes)."""

    sources: tuple[Any, ...]
    offsets: tuple[int, ...]

    def __len__(self) -> int:
        return self.offsets[-1] + len(self.sources[-1])

    def __getitem__(self, key: int) -> Any:
        j = bisect.bisect_right(self.offsets, key) - 1
        return self.sources[j][key - self.offsets[j]]

    def __repr__(self) -> str:
        return f"Leaves({', '.join(repr(s) for s in self.sources)})"


def leaves(ds: grain.MapDataset) -> Leaves:
    """The sources `ds` reads, in key order; AttachError for a chain the attach cannot follow."""
    found: list[Any] = []
    stack = [ds]
    while stack:
        d = stack.pop()
        name = type(d).__name__
        if name == "SourceMapDataset":
            found.append(d._source)
        elif name in _MIXTURES:
            stack.extend(reversed(d._parents))
        elif name in _PASS_THROUGH + ("SliceMapDataset", "ShuffleMapDataset",
                                      "RepeatMapDataset"):
            if name == "SliceMapDataset" and d._length == 0:
                raise AttachError("an empty slice in the pipeline: nothing to read")
            if _parent(d) is None:
                raise AttachError("the pipeline does not start at MapDataset.source(...)")
            stack.append(_parent(d))
        else:
            raise AttachError(
                f"{name} in the MapDataset pipeline changes which record an index names "
                "(filter, flat map, window shuffle, zip): carry the record key instead "
                "(map_with_index right after the source) and hand batches to "
                "LedgerWriter.write_batch (docs/guides/attach.md: 'Attaching Tally to your own "
                "loop')")
    lengths = [len(s) for s in found]
    return Leaves(tuple(found), tuple(int(x) for x in np.cumsum([0, *lengths[:-1]])))


def source_indices(ds: grain.MapDataset, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(record keys, epochs) of elements `idx` of `ds`: keys as `leaves(ds)` numbers them, the
    epoch the pass over the record's own source."""
    idx = np.asarray(idx, np.int64)
    while True:
        name = type(ds).__name__
        if name in _PASS_THROUGH:
            pass
        elif name == "SliceMapDataset":
            if ds._length == 0:
                raise AttachError("an empty slice in the pipeline: nothing to read")
            epoch, off = np.divmod(idx, ds._length)
            idx = ds._start + off * ds._step + epoch * ds._parent_length
        elif name == "ShuffleMapDataset":
            length = len(ds)
            epoch, within = np.divmod(idx, length)
            fn, seeds = _index_shuffle(), ((ds._seed + epoch) % 2**32).tolist()
            shuffled = np.fromiter((fn(i, length - 1, e, 4) for i, e in
                                    zip(within.tolist(), seeds, strict=True)), np.int64, len(idx))
            idx = shuffled + epoch * length
        elif name == "RepeatMapDataset":
            if not ds._reseed_each_epoch:
                idx = idx % ds._parent_length
        elif name in _MIXTURES:
            return _mixed_indices(ds, idx)
        elif name == "SourceMapDataset":
            n = len(ds._source)
            return idx % n, idx // n
        else:
            leaves(ds)  # raises the refusal, in one line
            raise AttachError(f"{name} in the MapDataset pipeline cannot be followed")
        ds = _parent(ds)
        if ds is None:
            raise AttachError("the pipeline does not start at MapDataset.source(...)")


def _mixed_indices(ds: Any, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    selection = ds._selection_map
    picked = [selection[i] for i in idx.tolist()]
    which = np.fromiter((j for j, _ in picked), np.int64, len(picked))
    within = np.fromiter((i for _, i in picked), np.int64, len(picked))
    keys, epochs = np.empty_like(idx), np.empty_like(idx)
    base = 0
    for j, parent in enumerate(ds._parents):
        at = which == j
        if at.any():
            k, e = source_indices(parent, within[at])
            keys[at], epochs[at] = k + base, e
        base += len(leaves(parent))
    return keys, epochs


@dataclass(frozen=True)
class DatasetContract:
    """A batched MapDataset pipeline: batch position k holds elements k*B .. of `elements`."""

    elements: Any  # the MapDataset under the Batch
    batch_size: int
    drop_remainder: bool
    batches: int  # batches in one pass over `elements`
    wraps: bool  # a MapDataset's batch k >= `batches` reads a later pass (Grain's rule)
    workers: int = 0  # `mp_prefetch` worker processes: worker w batches elements w, w + W, ...

    def batch_indices(self, k: int) -> np.ndarray:
        n = len(self.elements)
        epoch, k = divmod(k, self.batches) if self.wraps and self.batches else (0, k)
        lo = k * self.batch_size
        return np.arange(lo, min(lo + self.batch_size, n), dtype=np.int64) + epoch * n

    def positions(self, state: Mapping[str, Any] | None) -> tuple[list[int], int]:
        """(elements each stream had read, the stream whose batch is next) at an iterator
        state (None: the start): a MapDataset's batches read, an IterDataset's elements, or
        mp_prefetch's workers' elements and its next worker in the interleave's cycle."""
        if state is None:
            return [0] * max(1, self.workers), 0
        try:
            if not self.workers:
                return [int(state["next_index"])], 0
            cycle = int(state["next_index_in_cycle"])
            return (_worker_positions(state, self.workers),
                    int(state["iterators_in_use_indices"][cycle]))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise AttachError(f"not this pipeline's iterator state ({type(exc).__name__}: "
                              f"{exc})") from None

    def schedule(self, state: Mapping[str, Any] | None = None
                 ) -> Iterator[tuple[int, np.ndarray]]:
        """(batch number, elements) of the batches the pipeline hands out from `state` on: a
        MapDataset indexed by step (`ds[k]`, later passes beyond its length, endless); an
        IterDataset in one pass, its `mp_prefetch` workers in turn from the next one, each
        worker's batches of its own elements w + W*p, passing over a worker with none left
        (what the live attach records, batch by batch)."""
        pos, w = self.positions(state)
        if self.wraps:
            k = pos[0]
            while True:
                yield k, self.batch_indices(k)
                k += 1
        n, b, w_n = len(self.elements), self.batch_size, max(1, self.workers)
        per = [len(range(v, n, w_n)) for v in range(w_n)]
        left = [p - q for p, q in zip(per, pos, strict=True)]
        k = sum(-(-q // b) for q in pos)
        while True:
            ready = [left[v] >= b or (left[v] > 0 and not self.drop_remainder)
                     for v in range(w_n)]
            if not any(ready):
                return
            while not ready[w]:
                w = (w + 1) % w_n
            hi = min(pos[w] + b, per[w])
            yield k, w + w_n * np.arange(pos[w], hi, dtype=np.int64)
            left[w] -= hi - pos[w]
            pos[w], k, w = hi, k + 1, (w + 1) % w_n


def dataset_contract(ds: Any) -> DatasetContract:
    """The contract of `ds`: a MapDataset whose last step is `.batch(B)` (1:1 maps above it
    allowed), or its `to_iter_dataset()` followed by 1:1 maps and `.batch(B)`."""
    d = ds
    names = _ITER_PASS_THROUGH if isinstance(ds, grain.IterDataset) else _PASS_THROUGH
    while d is not None and type(d).__name__ in names:
        d = _parent(d)
    workers, d = _prefetch_workers(d)
    while workers and d is not None and type(d).__name__ in names:
        d = _parent(d)
    if type(d).__name__ not in ("BatchMapDataset", "BatchIterDataset"):
        raise AttachError(f"expected a pipeline ending in .batch(B) (1:1 maps after it), found "
                          f"{type(d).__name__}: packing and other IterDataset transformations "
                          "need the record key carried (docs/guides/attach.md: 'Attaching "
                          "Tally to your own loop')")
    wraps = type(d).__name__ == "BatchMapDataset"
    b, drop, batches = int(d._batch_size), bool(d._drop_remainder), len(d) if wraps else 0
    d = _parent(d)
    if isinstance(ds, grain.IterDataset):
        while d is not None and type(d).__name__ in _ITER_PASS_THROUGH:
            d = _parent(d)
        if type(d).__name__ != "PrefetchIterDataset":  # what to_iter_dataset() makes
            raise AttachError(f"{type(d).__name__} between to_iter_dataset() and .batch(): "
                              "only 1:1 maps keep positions naming records")
        d = _parent(d)
    leaves(d)  # refuses an unsupported chain now, not mid-run
    return DatasetContract(d, b, drop, batches, wraps, workers)


# `mp_prefetch(MultiprocessingOptions(num_workers=W))` (MaxText's last step) makes, in Grain
# 0.2.x, WithOptions(Interleave([ProcessPrefetch(MpContext(WorkerSlice(ds, w::W))) for w])):
# each worker process runs the whole pipeline with the MapDataset under to_iter_dataset()
# sliced to elements w, w + W, ..., and the interleave takes a batch from each in turn. Its
# checkpoint state lists each worker's own iterator state (`next_index`: elements it read).
_PREFETCH_CHAIN = ("ProcessPrefetchIterDataset", "_MpContextIterDataset")


def _prefetch_workers(d: Any) -> tuple[int, Any]:
    """(W, the pipeline each worker runs) for an mp_prefetch's interleave; (0, d) otherwise."""
    shards = getattr(d, "_datasets", None)
    if type(d).__name__ != "InterleaveIterDataset" or not shards or not all(
            type(p).__name__ == _PREFETCH_CHAIN[0] for p in shards):
        return 0, d
    inner = shards[0]
    for name in _PREFETCH_CHAIN:
        if type(inner).__name__ != name:
            raise AttachError(f"an mp_prefetch whose workers run {type(inner).__name__}, not "
                              "Grain's worker chain: this Grain version is not supported")
        inner = _parent(inner)
    w = len(shards)
    if type(inner).__name__ == "_LazyWorkerSliceIterDataset":
        if inner._slice != slice(0, None, w) or inner._sequential_slice:
            raise AttachError(f"mp_prefetch's workers read {inner._slice} of the pipeline, "
                              f"not every {w}th element: not supported")
        inner = _parent(inner)
    elif w != 1:
        raise AttachError(f"mp_prefetch with {w} workers that do not slice the pipeline")
    return w, inner


class AuditedDataset:
    """A batched MapDataset (or its IterDataset) pipeline recording what it hands out.

    `ds[k]` (a MapDataset) records batch k at step `start_step + k`; iterating records each
    batch at its position, read from the iterator's state (`next_index`), so `set_state`
    continues the keys."""

    def __init__(self, ds: Any, writer: Any, *, start_step: int = 0,
                 tokens_field: str = "tokens", hashes: ManifestHashes | None = None) -> None:
        self.ds, self.writer, self.start_step = ds, writer, start_step
        self.contract = dataset_contract(ds)
        source = leaves(self.contract.elements)
        self.records = len(source)
        self._hashes = keyed_by_file(hashes, source) or SourceHashes(_private_copy(source),
                                                                     tokens_field).check()

    def _record(self, k: int, idx: np.ndarray | None = None) -> None:
        idx = self.contract.batch_indices(k) if idx is None else idx
        contract, hashes = self.contract, self._hashes

        def segments() -> Segments:  # on the writer's thread
            return hashes.segments(*source_indices(contract.elements, idx))

        self.writer.write_segments(self.start_step + k, segments)

    def __getitem__(self, k: int) -> Any:
        if not isinstance(self.ds, grain.MapDataset):
            raise TypeError("an IterDataset is iterated, not indexed")
        batch = self.ds[k]
        self._record(int(k))
        return batch

    def __len__(self) -> int:
        return len(self.ds)

    def __iter__(self) -> Iterator[Any]:
        ds = self.ds.to_iter_dataset() if isinstance(self.ds, grain.MapDataset) else self.ds
        return _AuditedDatasetIterator(iter(ds), self)


def _worker_positions(state: Any, workers: int) -> list[int]:
    """Elements each mp_prefetch worker had read, from the interleave's checkpoint state."""
    try:
        at = dict(zip(state["iterators_in_use_indices"], state["iterators_in_use_states"],
                      strict=True))
        return [int(at[w]["next_index"]) for w in range(workers)]
    except (KeyError, TypeError, ValueError) as exc:
        raise AttachError(f"not the state of Grain's mp_prefetch ({type(exc).__name__}: "
                          f"{exc}): this Grain version is not supported") from None


class _AuditedDatasetIterator(Iterator[Any]):
    def __init__(self, it: Any, owner: AuditedDataset) -> None:
        self._it, self._owner = it, owner

    def __next__(self) -> Any:
        contract = self._owner.contract
        if contract.workers:
            return self._next_of_workers(contract)
        k = int(self._it.get_state()["next_index"])  # batches read (elements, for an
        if isinstance(self._owner.ds, grain.IterDataset):  # IterDataset batched on top)
            k //= contract.batch_size
        batch = next(self._it)
        self._owner._record(k)
        return batch

    def _next_of_workers(self, contract: DatasetContract) -> Any:
        """The batch an mp_prefetch hands out: the worker whose position moved made it, of
        its elements [before, after), and it is the loader's batch number sum over workers
        of the batches each had made (ceil: a worker's last batch may be short)."""
        w_count, b = contract.workers, contract.batch_size
        before = _worker_positions(self._it.get_state(), w_count)
        batch = next(self._it)
        after = _worker_positions(self._it.get_state(), w_count)
        moved = [w for w in range(w_count) if after[w] != before[w]]
        if len(moved) != 1:
            raise AttachError(f"mp_prefetch's state moved {len(moved)} workers for one batch: "
                              "this Grain version is not supported")
        w = moved[0]
        idx = w + w_count * np.arange(before[w], after[w], dtype=np.int64)
        self._owner._record(sum(-(-p // b) for p in before), idx)
        return batch

    def get_state(self) -> Any:
        return self._it.get_state()

    def set_state(self, state: Any) -> None:
        self._it.set_state(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)
