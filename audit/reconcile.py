"""The reconcile job (Beam): a run's consumption against the corpus manifest.

Inputs are a frozen list of consumption files: the run's published spool segment files, or an
export of the ledger. Both the consumption and the manifest are cut into record-key buckets and
joined with CoGroupByKey; every element is a bucket's numpy columns, never one Python object per
row, and there are no side inputs at all. Each bucket yields partial aggregates (sums, and
elementwise maxima for the first bad step) that one reduce merges; per-record rows are written
as part files that the driver joins. Only Create, ParDo, GroupByKey and Flatten are used, the
primitives every runner translates, Dask's included.

Restart lineage (`audit.ledger.rolled_back_from`) splits rows into effective and rolled back;
rolled-back rows are compared step by step with the surviving replay.
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from audit import spool as sp
from audit.errors import TallyError
from audit.ingest import BadFile, read_checked
from audit.ledger import Ledger, rolled_back_from
from pipeline.corpus import read_rows
from pipeline.runners import RunnerSpec, pipeline

COLUMNS = ("attempt", "host", "step", "row", "record_key", "offset", "n_tokens", "content_hash",
           "epoch")
# What crosses the shuffle, narrowed: ~30 bytes a row instead of ~52.
BUCKET_COLUMNS = {"record_key": np.int64, "step": np.int32, "host": np.int16,
                  "offset": np.int32, "n_tokens": np.int32, "content_hash": np.uint64,
                  "epoch": np.int32}
EXAMPLES = 20
# Peak memory per shuffled row on FnApiRunner (measured: 8.9 GiB for 49.6M rows in one pass).
BYTES_PER_ROW = 180  # examples kept per finding (hash mismatches, unknown keys)


@dataclass(frozen=True)
class InputFile:
    path: str
    spool_file: sp.SpoolFile | None = None  # None: a ledger export with an `attempt` column


@dataclass
class Plan:
    """Everything the workers need to know, decided before the pipeline starts."""

    run_id: str
    files: list[InputFile]
    attempts: dict[int, dict[str, Any]]  # attempt -> resumed_from_step, host_count, last_step
    manifest: str
    records: int  # manifest rows
    train_records: int
    fingerprint: str
    run_fingerprint: str | None
    at_step: int | None
    hosts: int
    bucket_size: int
    buckets: int
    rows: int = 0  # consumption rows, for sizing the passes
    cutoffs: dict[int, int | None] = field(default_factory=dict)
    replay_ranges: list[tuple[int, int]] = field(default_factory=list)


# ---- inputs -------------------------------------------------------------------------------

def spool_inputs(spool: Path, run_id: str) -> tuple[list[InputFile], dict, str | None]:
    files, attempts, fingerprint = [], {}, None
    for f in sp.scan(spool):
        if not isinstance(f, sp.SpoolFile) or f.kind != "seg" or f.run_id != run_id:
            continue
        try:
            md = {k.decode(): v.decode() for k, v in
                  (pq.read_metadata(f.path).metadata or {}).items()}
            resumed = md.get("tally.resumed_from_step", "")
            info = attempts.setdefault(f.attempt, {
                "resumed_from_step": int(resumed) if resumed else None,
                "host_count": int(md["tally.host_count"]), "last_step": -1})
            info["last_step"] = max(info["last_step"], int(md["tally.last_step"]))
            info["rows"] = info.get("rows", 0) + int(md["tally.rows"])
            fingerprint = fingerprint or md.get("tally.manifest_fingerprint") or None
        except Exception:
            pass  # the worker re-checks the file and reports why it was skipped
        files.append(InputFile(str(f.path), f))
    if not files:
        raise TallyError(f"no segment files for run {run_id!r} in spool {spool}")
    return files, attempts, fingerprint


def ledger_inputs(ledger_path: Path, run_id: str, workdir: Path) -> tuple[list, dict, str | None]:
    with Ledger(ledger_path, read_only=True) as ledger:
        run = ledger.query("SELECT run, manifest_fingerprint FROM runs WHERE run_id = ?",
                           [run_id])
        if not run:
            raise TallyError(f"run {run_id!r} is not in ledger {ledger_path}")
        rows = ledger.query("""
            SELECT a.attempt, a.resumed_from_step, a.host_count, max(h.step) AS last_step,
                   coalesce(sum(h.n_segments), 0) AS rows
            FROM attempts a LEFT JOIN host_steps h USING (run, attempt)
            WHERE a.run = ? GROUP BY ALL""", [run[0]["run"]])
        attempts = {r["attempt"]: {"resumed_from_step": r["resumed_from_step"],
                                   "host_count": r["host_count"],
                                   "last_step": r["last_step"] if r["last_step"] is not None
                                   else -1, "rows": int(r["rows"])} for r in rows}
        out = workdir / "export"
        target = str(out).replace("'", "''")  # a path is no SQL parameter in COPY ... TO
        ledger.con.execute(f"""
            COPY (SELECT attempt, host, step, "row", record_key, "offset", n_tokens,
                         content_hash, epoch FROM consumption WHERE run = {int(run[0]['run'])})
            TO '{target}' (FORMAT parquet, PER_THREAD_OUTPUT true, FILE_SIZE_BYTES '64MB')""")
    files = [InputFile(str(p)) for p in sorted(out.glob("*.parquet"))]
    return files, attempts, run[0]["manifest_fingerprint"]


def make_plan(*, run_id: str, manifest: str | Path, files: list[InputFile], attempts: dict,
              run_fingerprint: str | None, at_step: int | None,
              bucket_records: int = 250_000) -> Plan:
    from pipeline.manifest import manifest_info

    info = manifest_info(manifest)
    records, train = int(info["records"]), int(info["train_records"])
    buckets = max(1, -(-records // bucket_records))
    plan = Plan(run_id=run_id, files=files, attempts=attempts, manifest=str(manifest),
                records=records, train_records=train, fingerprint=info["manifest_fingerprint"],
                run_fingerprint=run_fingerprint, at_step=at_step,
                hosts=max([a["host_count"] for a in attempts.values()] + [1]),
                bucket_size=-(-records // buckets), buckets=buckets,
                rows=sum(a.get("rows", 0) for a in attempts.values()))
    plan.cutoffs = rolled_back_from({a: v["resumed_from_step"] for a, v in attempts.items()})
    for a, cut in plan.cutoffs.items():
        last = attempts[a]["last_step"]
        if at_step is not None:
            last = min(last, at_step)
        if cut is not None and last >= cut:
            plan.replay_ranges.append((cut, last))
    return plan


# ---- merging partial aggregates -----------------------------------------------------------

def merge(a: Any, b: Any) -> Any:
    """Sum nested dicts of numpy arrays and ints (arrays padded to the longer shape); keys
    starting with `min_` / `max_` keep the smaller / larger value; lists concatenate (capped)."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, dict):
        out = dict(a)
        for k, v in b.items():
            if str(k).startswith(("min_", "max_")):
                out[k] = _pick(str(k), out.get(k), v)
            else:
                out[k] = merge(out.get(k), v)
        return out
    if isinstance(a, list):
        return (a + b)[:EXAMPLES]
    if isinstance(a, np.ndarray):
        shape = tuple(max(x, y) for x, y in zip(a.shape, b.shape, strict=True))
        out = np.zeros(shape, dtype=np.result_type(a.dtype, b.dtype))
        out[tuple(slice(0, n) for n in a.shape)] += a
        out[tuple(slice(0, n) for n in b.shape)] += b
        return out
    return a + b


def _pick(key: str, a: Any, b: Any) -> Any:
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, np.ndarray):  # elementwise max of per-step series, padded
        out = np.zeros(max(len(a), len(b)), dtype=np.int64)
        out[: len(a)] = a
        out[: len(b)] = np.maximum(out[: len(b)], b)
        return out
    return min(a, b) if key.startswith("min_") else max(a, b)


def _reduce(xs: Iterable[Any]) -> Any:
    out = None
    for x in xs:
        out = merge(out, x)
    return out


def _bincount(idx: np.ndarray, weights: np.ndarray | None = None,
              n: int = 0) -> np.ndarray:
    if idx.size == 0:
        return np.zeros(n, dtype=np.int64)
    out = np.bincount(idx, weights=weights, minlength=n)
    return out.astype(np.int64) if weights is None or weights.dtype.kind in "iu" else out


# ---- stage 1: read consumption ------------------------------------------------------------

def _read_file(f: InputFile) -> dict[str, np.ndarray]:
    if f.spool_file is None:
        table = pq.read_table(f.path)
    else:
        table, _ = read_checked(f.spool_file)  # the same checks as ingest; BadFile if not
        table = table.append_column(
            "attempt", pa.array(np.full(table.num_rows, f.spool_file.attempt, np.int32)))
    return {c: table[c].to_numpy() for c in COLUMNS}


def _name(path: str) -> str:
    return xxhash.xxh3_64_hexdigest(path.encode())


def _take(cols: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[mask] for k, v in cols.items()}


def _only(item: tuple[str, Any], kind: str) -> list[Any]:
    return [item[1]] if item[0] == kind else []


class ReadConsumption(beam.DoFn):
    """One input file -> (kind, value): effective rows by bucket, per-step and per-host
    partials, replay rows, or the reason the file was skipped."""

    def __init__(self, plan: Plan, buckets: tuple[int, int], first_pass: bool) -> None:
        self.plan, self.buckets, self.first_pass = plan, buckets, first_pass

    def process(self, f: InputFile):
        plan = self.plan
        try:
            cols = _read_file(f)
        except BadFile as exc:
            if self.first_pass:
                yield "skipped", {"_id": f"skipped-{_name(f.path)}", "skipped_files": [
                    f"{f.path}: {exc}"]}
            return
        if plan.at_step is not None:
            cols = _take(cols, cols["step"] <= plan.at_step)
        # Each row's rollback cutoff, looked up by its attempt (no cutoff: never rolled back).
        lut = np.full(max(plan.cutoffs, default=0) + 1, np.iinfo(np.int64).max, np.int64)
        for a, cut in plan.cutoffs.items():
            if cut is not None:
                lut[a] = cut
        known = cols["attempt"] < len(lut)
        effective = ~known | (cols["step"] < lut[np.where(known, cols["attempt"], 0)])
        rolled = _take(cols, ~effective)
        cols = _take(cols, effective)
        if self.first_pass:
            yield from self._per_file(f, cols, rolled)
        bucket = cols["record_key"] // plan.bucket_size
        keep = (bucket >= self.buckets[0]) & (bucket < self.buckets[1])
        if plan.buckets < self.buckets[1]:  # the last pass takes the overflow bucket too
            keep |= bucket >= plan.buckets
        cols = {k: cols[k][keep].astype(t, copy=False) for k, t in BUCKET_COLUMNS.items()}
        bucket = np.minimum(bucket[keep], plan.buckets)
        order = np.argsort(bucket, kind="stable")
        bucket = bucket[order]
        cols = {k: v[order] for k, v in cols.items()}
        bounds = np.flatnonzero(np.diff(bucket)) + 1
        for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(bucket)], strict=True):
            if hi > lo:
                yield "by_bucket", (int(bucket[lo]), {k: v[lo:hi] for k, v in cols.items()})

    def _per_file(self, f: InputFile, cols: dict, rolled: dict):
        """Once per file (first pass): replay rows and the per-step, per-host partials."""
        plan = self.plan
        # Replay comparison: rolled-back rows, and effective rows at rolled-back steps.
        if plan.replay_ranges:
            in_range = np.zeros(len(cols["step"]), dtype=bool)
            for lo, hi in plan.replay_ranges:
                in_range |= (cols["step"] >= lo) & (cols["step"] <= hi)
            for tag, part in (("eff", _take(cols, in_range)), ("rb", rolled)):
                for step in np.unique(part["step"]):
                    sel = _take(part, part["step"] == step)
                    yield "replay", (int(step), (tag, sel))
        if not len(cols["step"]):
            return
        steps = cols["step"]
        starts = cols["offset"] == 0
        hosts = self.plan.hosts
        # Rows per step: distinct (host, row) pairs; a host's step sits in one file.
        rows_n, hosts_n = int(cols["row"].max()) + 1, int(cols["host"].max()) + 1
        _, first = np.unique((steps * hosts_n + cols["host"]) * rows_n + cols["row"],
                             return_index=True)
        yield "partials", {
            "_id": f"file-{_name(f.path)}",
            "steps": {
                "segments": _bincount(steps),
                "tokens": _bincount(steps, cols["n_tokens"].astype(np.int64)),
                "rows": _bincount(steps[first]),
            },
            "hosts": {
                "segments": _bincount(cols["host"], n=hosts),
                "exposures": _bincount(cols["host"][starts], n=hosts),
                "tokens": _bincount(cols["host"], cols["n_tokens"].astype(np.int64), n=hosts),
            },
            "segments": len(steps),
            "min_step": int(steps.min()),
            "max_step": int(steps.max()),  # merged with max()
        }


# ---- stage 2: manifest buckets ------------------------------------------------------------

class ReadManifest(beam.DoFn):
    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def process(self, bucket: int):
        lo = bucket * self.plan.bucket_size
        hi = min(lo + self.plan.bucket_size, self.plan.records)
        if lo >= hi:  # the overflow bucket: keys beyond the manifest
            return
        t = read_rows(pq.ParquetFile(self.plan.manifest), lo, hi,
                      ["record_key", "content_hash", "n_tokens", "domain", "split", "source"])
        out = {c: t[c].to_numpy() for c in ("record_key", "content_hash", "n_tokens")}
        for c in ("domain", "split", "source"):
            # Strings travel as codes plus a short list of names: pickling a column of
            # Python strings costs more than everything else in the job.
            enc = t[c].combine_chunks().dictionary_encode()
            out[c] = enc.indices.to_numpy(zero_copy_only=False).astype(np.int32)
            out[f"{c}_names"] = enc.dictionary.to_pylist()
        yield bucket, out


# ---- stage 3: the join ----------------------------------------------------------------------

def _joined(grouped: dict):
    """(manifest columns, effective columns, manifest row index of each consumed row)."""
    cons = grouped["c"]
    man = grouped["m"][0] if grouped["m"] else None
    c = ({k: np.concatenate([x[k] for x in cons]).astype(np.int64 if k != "content_hash"
                                                           else np.uint64)
          for k in BUCKET_COLUMNS} if cons
         else {k: np.zeros(0, t) for k, t in BUCKET_COLUMNS.items()})
    if man is None:  # keys beyond the manifest
        return None, c, np.full(len(c["step"]), -1)
    j = c["record_key"] - man["record_key"][0] if len(man["record_key"]) else c["record_key"]
    j = np.where((j >= 0) & (j < len(man["record_key"])), j, -1)
    return man, c, j


def _strings(man: dict, col: str) -> pa.Array:
    return pa.DictionaryArray.from_arrays(man[col], pa.array(man[f"{col}_names"],
                                                             pa.string())).cast(pa.string())


class BucketStats(beam.DoFn):
    """Per-record exposure for one bucket: partial aggregates, and a part file of records."""

    def __init__(self, plan: Plan, parts: str) -> None:
        self.plan, self.parts = plan, parts

    def process(self, item):
        bucket, grouped = item
        plan = self.plan
        man, c, j = _joined(grouped)
        known = j >= 0
        out: dict[str, Any] = {
            "_id": f"bucket-{bucket}",
            "unknown_segments": int((~known).sum()),
            "unknown_keys": int(np.unique(c["record_key"][~known]).size),
            "examples": {"unknown": [{"record_key": int(k), "step": int(s), "host": int(h)}
                                     for k, s, h in zip(c["record_key"][~known][:EXAMPLES],
                                                        c["step"][~known][:EXAMPLES],
                                                        c["host"][~known][:EXAMPLES],
                                                        strict=True)]},
        }
        if man is None:
            yield out
            return
        c, j = _take(c, known), j[known]
        n = len(man["record_key"])
        starts = c["offset"] == 0
        full = starts & (c["n_tokens"] == man["n_tokens"][j])
        mismatch = full & (c["content_hash"] != man["content_hash"][j])
        exposures = _bincount(j[starts], n=n)
        tokens = _bincount(j, c["n_tokens"].astype(np.int64), n=n)
        train = np.isin(man["split"], [i for i, name in enumerate(man["split_names"])
                                       if name == "train"])
        # Hosts that saw each record (starts), as a records x hosts matrix.
        seen = np.zeros((n, plan.hosts), dtype=bool)
        seen[j[starts], c["host"][starts]] = True
        seen_train = seen[train].astype(np.int64)
        multi = seen_train.sum(axis=1) > 1
        # Train start events in (record, step) order: first-seen step of each record (new
        # unique per step), and the rank of each exposure of a record, kept as the highest
        # rank per step: the driver finds the first step whose highest rank exceeds what a
        # perfect loader allows by then (the first bad step).
        first_step = np.full(n, -1, dtype=np.int64)
        ev = starts & train[j]
        # Within one epoch a record is due at most once: count the exposures beyond that.
        ep = ev & (c["epoch"] >= 0)
        _, per_epoch = np.unique(j[ep] * (int(c["epoch"][ep].max(initial=0)) + 1)
                                 + c["epoch"][ep], return_counts=True)
        js, ss = j[ev], c["step"][ev]
        order = np.lexsort((ss, js))
        js, ss = js[order], ss[order]
        head = np.flatnonzero(np.r_[True, js[1:] != js[:-1]]) if js.size else js
        first_step[js[head]] = ss[head]
        rank = np.arange(len(js)) - np.repeat(head, np.diff(np.r_[head, len(js)])) + 1
        max_rank = np.zeros(int(ss.max()) + 1 if ss.size else 0, dtype=np.int64)
        if ss.size:  # highest rank per step: sort by (step, rank), keep each step's last
            by_step = np.lexsort((rank, ss))
            last = np.r_[ss[by_step][1:] != ss[by_step][:-1], True]
            max_rank[ss[by_step][last]] = rank[by_step][last]
        e_train = exposures[train]
        out.update({
            "train_exposures": int(e_train.sum()),
            "epoch_duplicates": int((per_epoch - 1).sum()),
            "epoch_duplicate_records": int((per_epoch > 1).sum()),
            "exposure_counts": _bincount(e_train),  # records seen e times, by e
            "hash_checked": int(full.sum()),
            "hash_unverifiable": int((~full).sum()),
            "hash_mismatches": int(mismatch.sum()),
            "heldout_consumed_records": int(((exposures > 0) & ~train).sum()),
            "heldout_exposures": int(exposures[~train].sum()),
            "overlap": seen_train.T @ seen_train,
            "hosts": {"unique": seen_train.sum(axis=0),
                      "overlap_with_others": seen_train[multi].sum(axis=0)},
            "steps": {"new_unique": _bincount(first_step[train & (first_step >= 0)])},
            "train_exposures_by_step": _bincount(ss),
            "max_rank_by_step": max_rank,
            "domain": {}, "source": {},
        })
        out["examples"]["hash_mismatch"] = [
            {"record_key": int(man["record_key"][jj]), "step": int(s), "host": int(h)}
            for jj, s, h in zip(j[mismatch][:EXAMPLES], c["step"][mismatch][:EXAMPLES],
                                c["host"][mismatch][:EXAMPLES], strict=True)]
        for col, fields in (("domain", ("records", "tokens", "exposures", "consumed",
                                        "never_seen")), ("source", ("records", "never_seen"))):
            codes, k = man[col][train], len(man[f"{col}_names"])
            sums = {
                "records": np.bincount(codes, minlength=k),
                "tokens": np.bincount(codes, man["n_tokens"][train].astype(np.float64), k),
                "exposures": np.bincount(codes, exposures[train].astype(np.float64), k),
                "consumed": np.bincount(codes, tokens[train].astype(np.float64), k),
                "never_seen": np.bincount(codes, (exposures[train] == 0), k),
            }
            for code, name in enumerate(man[f"{col}_names"]):
                if sums["records"][code]:
                    out[col][name] = np.array([sums[f][code] for f in fields]).astype(np.int64)
        pq.write_table(pa.table({
            "record_key": man["record_key"],
            "split": _strings(man, "split"),
            "domain": _strings(man, "domain"),
            "n_tokens": man["n_tokens"],
            "exposures": exposures,
            "tokens_consumed": tokens,
            "hosts": seen.sum(axis=1).astype(np.int32),
            "first_step": first_step,
            "hash_mismatches": _bincount(j[mismatch], n=n),
        }), Path(self.parts, f"records-{bucket:06d}.parquet"))
        yield out


class CompareReplay(beam.DoFn):
    """For one step: was each rolled-back attempt's batch replayed, and identically?"""

    def process(self, item):
        step, parts = item
        eff = [p for tag, p in parts if tag == "eff"]
        rb: dict[int, list] = {}
        for tag, p in parts:
            if tag == "rb":
                for a in np.unique(p["attempt"]):
                    rb.setdefault(int(a), []).append(_take(p, p["attempt"] == a))
        want = _multiset(eff)
        for a, ps in rb.items():
            got = _multiset(ps)
            same = bool(eff) and got == want
            yield {"_id": f"replay-{step}-{a}",
                   "replay": {str(a): np.array([1, int(bool(eff)), int(same)], np.int64)},
                   f"min_differs_{a}": None if (not eff or same) else step}


def _multiset(parts: list[dict]) -> list[tuple]:
    rows = []
    for p in parts:
        rows += list(zip(p["record_key"].tolist(), p["offset"].tolist(),
                         p["n_tokens"].tolist(), p["content_hash"].tolist(), strict=True))
    return sorted(rows)


# ---- the job --------------------------------------------------------------------------------

def run_reconcile(plan: Plan, work: Path, runner: RunnerSpec | None = None,
                  passes: int = 1) -> dict:
    """Run the pipeline; return the merged aggregates. Workers write per-record parts and
    results under `work`, which must be reachable from every worker."""
    (work / "records").mkdir(parents=True)

    # Key-range passes: each pipeline shuffles only its share of the buckets, which bounds
    # the memory a runner that keeps a GroupByKey in memory (FnApiRunner) needs.
    edges = np.linspace(0, plan.buckets + 1, min(passes, plan.buckets + 1) + 1).astype(int)
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        _one_pass(plan, work, runner, (int(lo), int(hi)), first=i == 0)
    files = sorted((work / "partials").glob("*.pkl"))
    if not (work / "saved").exists():
        raise TallyError("the reconcile job did not finish writing its results")
    merged = _reduce(pickle.loads(f.read_bytes()) for f in files) or {}
    merged.setdefault("skipped_files", [])
    read = int(merged.get("segments", 0))
    joined = sum(int(merged.get(k, 0)) for k in ("unknown_segments", "hash_checked",
                                                 "hash_unverifiable"))
    if read != joined:
        raise TallyError(f"the reconcile job lost rows: {read:,} effective rows read, "
                         f"{joined:,} joined with the manifest (runner {runner}); no report "
                         "written")
    return merged


def _one_pass(plan: Plan, work: Path, runner: RunnerSpec | None, buckets: tuple[int, int],
              first: bool) -> None:
    with pipeline(runner or RunnerSpec(), partitions=max(2, len(plan.files))) as p:
        read = (p | "files" >> beam.Create(plan.files) | "spread files" >> beam.Reshuffle()
                  | "read" >> beam.ParDo(ReadConsumption(plan, buckets, first)))
        # Outputs are (kind, value) pairs split by FlatMaps, not tagged outputs: the Dask
        # runner sends every tagged output to the main one.
        out = {kind: read | kind >> beam.FlatMap(_only, kind)
               for kind in ("by_bucket", "partials", "replay", "skipped")}
        man = (p | "buckets" >> beam.Create(list(range(*buckets)))
                 | "spread buckets" >> beam.Reshuffle()
                 | "manifest" >> beam.ParDo(ReadManifest(plan)))
        joined = {"c": out["by_bucket"], "m": man} | "join" >> beam.CoGroupByKey()
        stats = joined | "stats" >> beam.ParDo(BucketStats(plan, str(work / "records")))
        replay = (out["replay"] | "by step" >> beam.GroupByKey()
                  | "compare" >> beam.ParDo(CompareReplay()))
        # Every partial result goes to its own file; the driver merges them and checks that
        # nothing went missing. One leaf: the Dask runner computes only the last transform.
        saved = ((stats, replay, out["partials"], out["skipped"])
                 | "all partials" >> beam.Flatten()
                 | "save" >> beam.ParDo(_Save(str(work / "partials"))))
        (saved | "count" >> beam.Map(lambda n: (0, n)) | "total" >> beam.GroupByKey()
         | "done" >> beam.MapTuple(lambda _, ns: (work / "saved").write_text(str(sum(ns)))))


class _Save(beam.DoFn):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def process(self, partial: dict):
        # Named by what it summarises, written by rename: a retried bundle replaces its
        # earlier result instead of adding a second one, and never leaves half a file.
        Path(self.folder).mkdir(parents=True, exist_ok=True)
        final = Path(self.folder, f"{partial.pop('_id')}.pkl")
        tmp = final.with_name(f".{final.name}.{os.getpid()}")
        tmp.write_bytes(pickle.dumps(partial))
        os.replace(tmp, final)
        yield 1


def records_table(work: Path) -> pa.Table:
    parts = sorted((work / "records").glob("records-*.parquet"))
    return pa.concat_tables([pq.read_table(p) for p in parts]) if parts else pa.table({})


def reconcile(*, run_id: str, manifest: str | Path, out: str | Path,
              spool: str | Path | None = None, ledger: str | Path | None = None,
              at_step: int | None = None, runner: RunnerSpec | None = None,
              bucket_records: int = 250_000, memory_gb: float = 3.0,
              passes: int | None = None) -> dict:
    """Inputs -> plan -> Beam job -> report files in `out`; returns the report.

    `passes` (default: from `memory_gb` and the row count) splits the key space so that each
    pipeline shuffles only a share of the rows."""
    from audit import report as rp

    if (spool is None) == (ledger is None):
        raise TallyError("give exactly one of --spool or --ledger")
    if not Path(manifest).exists():
        raise TallyError(f"no manifest at {manifest}")
    out = Path(out)
    # Under the output folder, so that workers on other machines can reach it when the output
    # is on a shared file system; removed when the job is done.
    work = out / ".work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        if spool is not None:
            if not Path(spool).is_dir():
                raise TallyError(f"spool {spool} is not a directory")
            files, attempts, fp = spool_inputs(Path(spool), run_id)
        else:
            files, attempts, fp = ledger_inputs(Path(ledger), run_id, work)
        plan = make_plan(run_id=run_id, manifest=manifest, files=files, attempts=attempts,
                         run_fingerprint=fp, at_step=at_step, bucket_records=bucket_records)
        if passes is None:
            passes = max(1, -(-plan.rows * BYTES_PER_ROW // int(memory_gb * 2**30)))
        merged = run_reconcile(plan, work, runner, passes)
        report, tables = rp.build(plan, merged)
        rp.write(report, tables, records_table(work), out)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)
