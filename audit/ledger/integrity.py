"""Integrity at ingest: each segment file's rows checked against the manifest as they go into the
ledger, in the file's own transaction, so that a hash mismatch, a key the manifest does not
hold, or a held-out record trained on is an alert within one ingest round of the file that
carries it (reconcile, the full audit, says the same numbers later, with the cause).

What is checked, per row (the rules reconcile's join uses, tally.audit.core.exposure):
- unknown: a record key outside the manifest (below 0, or at or past its records);
- held out: an exposure (a record start) of a key past the train split;
- hash: a record start holding its whole record (`hash_checks`) whose content hash differs
  from the manifest's; only where the run's content basis is the manifest's (tally.pipeline.text),
  and only for a run that trained against this manifest (its fingerprint), else the file is
  recorded as skipped, with why: a run of another corpus is not flooded with mismatches.

Counts are per file (`integrity_files`, keyed by file and manifest fingerprint) over every row
the file holds, rolled-back steps included: a mismatch in a step the run rolled back was still
read. Distinct keys (unknown, held out) are kept per file up to KEYS_PER_FILE, so the run's
distinct counts are exact below that and "at least" beyond; a few mismatching rows a file are
kept as examples. Files ingested before the service had this manifest (or by `tally ingest`
without one) are checked afterwards from the ledger's rows (`catch_up`).

Cost (bench/integrity_rate.py): the manifest's hash and length by key are a memory-mapped
cache of 12 bytes a record (tally.pipeline.manifest_file.ManifestKeyIndex), built once per
manifest; a check is a few gathers and compares per row. The index is handed in by the caller
(the ledger imports nothing of the pipeline)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import duckdb
import numpy as np
import pyarrow as pa

from tally.audit.core.exposure import hash_checks, starts

log = logging.getLogger("tally.ingest")

KEYS_PER_FILE = 10_000  # distinct unknown or held-out keys kept a file (a count beyond: at least)
EXAMPLES_PER_FILE = 8  # mismatching rows kept a file, as examples
CATCH_UP_ROWS = 4_000_000  # ledger rows checked per catch-up transaction

DDL = """
CREATE TABLE IF NOT EXISTS integrity_files (   -- a segment file checked against a manifest
    file_id INTEGER NOT NULL,
    manifest_fingerprint VARCHAR NOT NULL,
    run INTEGER NOT NULL,
    segments BIGINT NOT NULL,                  -- rows checked for their key
    hash_checked BIGINT NOT NULL,              -- whole-record starts compared by hash
    hash_mismatches BIGINT NOT NULL,
    unknown_segments BIGINT NOT NULL,
    heldout_exposures BIGINT NOT NULL,
    keys_capped BOOLEAN NOT NULL,              -- more distinct keys than integrity_keys holds
    skipped VARCHAR,                           -- why the file was not checked at all
    hashes_skipped VARCHAR,                    -- why its hashes were not compared
    PRIMARY KEY (file_id, manifest_fingerprint)
);
CREATE TABLE IF NOT EXISTS integrity_keys (    -- unknown and held-out keys, mismatch examples
    file_id INTEGER NOT NULL,
    manifest_fingerprint VARCHAR NOT NULL,
    run INTEGER NOT NULL,
    kind VARCHAR NOT NULL,                     -- 'unknown', 'heldout' or 'mismatch'
    record_key BIGINT NOT NULL,
    step BIGINT NOT NULL,
    host INTEGER NOT NULL
);
"""


class KeyIndex(Protocol):
    """The manifest as the check reads it (tally.pipeline.manifest_file.ManifestKeyIndex)."""

    fingerprint: str
    records: int
    train_records: int
    hash: np.ndarray
    n_tokens: np.ndarray

    def basis_differences(self, run_basis: str | None) -> list[str]: ...


@dataclass
class FileCheck:
    """One file's integrity counts, and the keys it keeps."""

    segments: int = 0
    hash_checked: int = 0
    hash_mismatches: int = 0
    unknown_segments: int = 0
    heldout_exposures: int = 0
    keys_capped: bool = False
    skipped: str | None = None
    hashes_skipped: str | None = None
    keys: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)


def _first_of_each(keys: np.ndarray, step: np.ndarray, host: np.ndarray, cap: int
                   ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], bool]:
    """Each distinct key once (at its first row), at most `cap` of them; whether more were."""
    uniq, first = np.unique(keys, return_index=True)
    first = np.sort(first)[:cap]
    return (keys[first], step[first], host[first]), len(uniq) > cap


class IngestIntegrity:
    """The checks ingest runs against one manifest. `open_index` opens it on first need, in
    the ingesting thread, before a transaction (a cache built then reads the whole manifest:
    2.8 s for 100M records from the page cache, bench/integrity_rate.py); when it fails,
    `error` says why (the service's /healthz shows it) and ingest goes on unchecked.
    `generation` moves with each catch-up commit, which adds checks without a new file (the
    ledger version the live answers are cached under does not move then)."""

    def __init__(self, open_index: Callable[[], KeyIndex]) -> None:
        self._open = open_index
        self._index: KeyIndex | None = None
        self._lock = threading.Lock()
        self.error: str | None = None
        self._basis: dict[str | None, str | None] = {}
        # Set once a catch-up finds every file checked: the files ingested after it are
        # checked in their own transaction, so the ledger is not asked again each round.
        self.caught_up = False
        self.checked_late = 0  # files checked by catch_up, so far
        self.generation = 0

    def ready(self) -> KeyIndex | None:
        """The manifest's index, opened once; None (with `error` set) when it cannot be."""
        with self._lock:
            if self._index is None and self.error is None:
                try:
                    self._index = self._open()
                except Exception as exc:  # noqa: BLE001 (a bad manifest: said, ingest goes on)
                    self.error = f"integrity at ingest is off: {type(exc).__name__}: {exc}"
                    log.error("%s", self.error)
            return self._index

    @property
    def fingerprint(self) -> str | None:
        return None if self._index is None else self._index.fingerprint

    def _hashes_skipped(self, index: KeyIndex, run_basis: str | None) -> str | None:
        if run_basis not in self._basis:
            differ = index.basis_differences(run_basis)
            self._basis[run_basis] = None if not differ else (
                "the run's content hashes are taken otherwise than the manifest's: "
                + "; ".join(differ))
        return self._basis[run_basis]

    def check(self, index: KeyIndex, rows: dict[str, np.ndarray], run_fingerprint: str | None,
              run_basis: str | None) -> FileCheck:
        """One file's rows (record_key, offset, n_tokens, content_hash, step, host) checked."""
        out = FileCheck(segments=len(rows["record_key"]))
        if run_fingerprint and run_fingerprint != index.fingerprint:
            out.skipped = (f"the run trained against manifest {run_fingerprint}, not "
                           f"{index.fingerprint}")
            return out
        key = rows["record_key"]
        step, host = rows["step"], rows["host"]
        unknown = (key < 0) | (key >= index.records)
        out.unknown_segments = int(unknown.sum())
        is_start = starts(rows["offset"])
        if out.unknown_segments:
            kept, capped = _first_of_each(key[unknown], step[unknown], host[unknown],
                                          KEYS_PER_FILE)
            out.keys.append(("unknown", *kept))
            out.keys_capped |= capped
            known = ~unknown
            key, step, host, is_start = key[known], step[known], host[known], is_start[known]
            n_tokens, content_hash = rows["n_tokens"][known], rows["content_hash"][known]
        else:
            n_tokens, content_hash = rows["n_tokens"], rows["content_hash"]
        held = is_start & (key >= index.train_records)
        out.heldout_exposures = int(held.sum())
        if out.heldout_exposures:
            kept, capped = _first_of_each(key[held], step[held], host[held], KEYS_PER_FILE)
            out.keys.append(("heldout", *kept))
            out.keys_capped |= capped
        out.hashes_skipped = self._hashes_skipped(index, run_basis)
        if out.hashes_skipped is None and len(key):
            checked, mismatch = hash_checks(is_start, n_tokens, content_hash,
                                            index.n_tokens[key], index.hash[key])
            out.hash_checked = int(checked.sum())
            out.hash_mismatches = int(mismatch.sum())
            if out.hash_mismatches:
                at = np.flatnonzero(mismatch)[:EXAMPLES_PER_FILE]
                out.keys.append(("mismatch", key[at], step[at], host[at]))
        return out

    def check_files(self, index: KeyIndex,
                    files: list[tuple[int, int, dict[str, np.ndarray], str | None, str | None]]
                    ) -> list[tuple[int, int, FileCheck]]:
        """(file id, run, check) of each (file id, run, columns, run fingerprint, run content
        basis). A check that fails turns the checks off for this process (`error`, shown by
        /healthz) and returns none: it never stops the files' ingest."""
        try:
            return [(fid, run, self.check(index, columns, fp, basis))
                    for fid, run, columns, fp, basis in files]
        except Exception as exc:  # noqa: BLE001 (a bug here must not stall the ingest)
            with self._lock:
                self.error = f"integrity at ingest is off: {type(exc).__name__}: {exc}"
                self._index = None
            log.exception("integrity check failed; ingest goes on without it")
            return []

    def record(self, cur: duckdb.DuckDBPyConnection, index: KeyIndex,
               checked: list[tuple[int, int, FileCheck]]) -> None:
        """The checks of (file id, run, check) into the ledger, inside the caller's
        transaction (the one that ingests the files)."""
        if not checked:
            return
        fp = index.fingerprint
        files = pa.table({
            "file_id": pa.array([f for f, _, _ in checked], pa.int32()),
            "manifest_fingerprint": [fp] * len(checked),
            "run": pa.array([r for _, r, _ in checked], pa.int32()),
            **{name: pa.array([getattr(c, name) for _, _, c in checked], pa.int64())
               for name in ("segments", "hash_checked", "hash_mismatches", "unknown_segments",
                            "heldout_exposures")},
            "keys_capped": [c.keys_capped for _, _, c in checked],
            "skipped": pa.array([c.skipped for _, _, c in checked], pa.string()),
            "hashes_skipped": pa.array([c.hashes_skipped for _, _, c in checked], pa.string())})
        cur.register("incoming_integrity", files)
        try:
            cur.execute("INSERT OR REPLACE INTO integrity_files BY NAME "
                        "SELECT * FROM incoming_integrity")
        finally:
            cur.unregister("incoming_integrity")
        parts = [(fid, run, kind, k, s, h) for fid, run, c in checked for kind, k, s, h in c.keys]
        if not parts:
            return
        cur.execute("DELETE FROM integrity_keys WHERE manifest_fingerprint = ? AND file_id IN "
                    "(SELECT unnest(?))", [fp, [f for f, _, _ in checked]])
        keys = pa.table({
            "file_id": pa.array(np.concatenate([np.full(len(k), f, np.int32)
                                                for f, _, _, k, _, _ in parts])),
            "manifest_fingerprint": [fp] * sum(len(k) for _, _, _, k, _, _ in parts),
            "run": pa.array(np.concatenate([np.full(len(k), r, np.int32)
                                            for _, r, _, k, _, _ in parts])),
            "kind": [kind for _, _, kind, k, _, _ in parts for _ in range(len(k))],
            "record_key": pa.array(np.concatenate([k for *_, k, _, _ in parts]), pa.int64()),
            "step": pa.array(np.concatenate([s for *_, s, _ in parts]), pa.int64()),
            "host": pa.array(np.concatenate([h for *_, h in parts]), pa.int32())})
        cur.register("incoming_integrity_keys", keys)
        try:
            cur.execute("INSERT INTO integrity_keys BY NAME SELECT * FROM incoming_integrity_keys")
        finally:
            cur.unregister("incoming_integrity_keys")

    def catch_up(self, cur: duckdb.DuckDBPyConnection, *, max_rows: int | None = None,
                 stop: threading.Event | None = None, seconds: float | None = None) -> int:
        """Check the ledger's segment files this manifest has not checked yet (ingested before
        the service had it), from their rows in the ledger, a transaction of up to `max_rows`
        rows (CATCH_UP_ROWS) at a time; with `seconds`, no new transaction once that long has
        passed (the caller comes back for the rest: the live service's ingest goes on between
        slices). Returns the files checked."""
        index = self.ready()
        if index is None or self.caught_up:
            return 0
        max_rows = max_rows or CATCH_UP_ROWS
        done, t0 = 0, time.monotonic()
        while (stop is None or not stop.is_set()) and \
                (seconds is None or done == 0 or time.monotonic() - t0 < seconds):
            todo = cur.execute("""
                SELECT g.file_id, g.run, g.n_rows, r.manifest_fingerprint, r.content_basis
                FROM segments g JOIN runs r USING (run)
                WHERE g.kind = 'seg' AND g.file_id NOT IN (
                    SELECT file_id FROM integrity_files WHERE manifest_fingerprint = ?)
                ORDER BY g.file_id LIMIT 4096""", [index.fingerprint]).fetchall()
            if not todo:
                self.caught_up = True
                if self.checked_late:
                    log.info("integrity at ingest: the %d files ingested before the manifest "
                             "came are checked", self.checked_late,
                             extra={"files": self.checked_late})
                return done
            take, rows = [], 0
            for t in todo:
                if take and rows + t[2] > max_rows:
                    break
                take.append(t)
                rows += t[2]
            got = cur.execute("""SELECT file_id, record_key, "offset", n_tokens, content_hash,
                step, host FROM consumption WHERE file_id IN (SELECT unnest(?))
                ORDER BY file_id""", [[t[0] for t in take]]).fetchnumpy()
            fid = got["file_id"]
            bounds = np.searchsorted(fid, [t[0] for t in take] + [np.iinfo(np.int32).max])
            checked = self.check_files(index, [
                (file_id, run, {k: v[bounds[n]:bounds[n + 1]] for k, v in got.items()}, fp, basis)
                for n, (file_id, run, _, fp, basis) in enumerate(take)])
            if self.error is not None:
                return done
            cur.execute("BEGIN TRANSACTION")
            try:
                self.record(cur, index, checked)
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            self.generation += 1
            done += len(take)
            self.checked_late += len(take)
        return done


def segment_columns(table: pa.Table) -> dict[str, np.ndarray]:
    """A segment file's columns the check reads, as numpy."""
    return {name: table[name].to_numpy() for name in
            ("record_key", "offset", "n_tokens", "content_hash", "step", "host")}


def totals(cur: duckdb.DuckDBPyConnection, run: int, fingerprint: str) -> dict[str, Any]:
    """A run's integrity checked at ingest against the manifest `fingerprint`: counts, distinct
    keys, examples, and how many of its segment files are checked (5 ms at 72,000 files: the
    service caches it, tally.api.service)."""
    seg_files = cur.execute("SELECT count(*) FROM segments WHERE run = ? AND kind = 'seg'",
                            [run]).fetchall()[0][0]
    (files, segments, checked, mismatches, unknown, heldout, capped, skipped,
     hashes_skipped) = cur.execute("""
        SELECT count(*), coalesce(sum(segments), 0), coalesce(sum(hash_checked), 0),
               coalesce(sum(hash_mismatches), 0), coalesce(sum(unknown_segments), 0),
               coalesce(sum(heldout_exposures), 0), coalesce(bool_or(keys_capped), false),
               max(skipped), max(hashes_skipped)
        FROM integrity_files WHERE run = ? AND manifest_fingerprint = ?""",
        [run, fingerprint]).fetchall()[0]
    distinct = dict(cur.execute("""
        SELECT kind, count(DISTINCT record_key) FROM integrity_keys
        WHERE run = ? AND manifest_fingerprint = ? AND kind IN ('unknown', 'heldout')
        GROUP BY kind""", [run, fingerprint]).fetchall())
    examples: dict[str, list[dict[str, int]]] = {"mismatch": [], "unknown": [], "heldout": []}
    for kind, key, step, host in cur.execute("""
            SELECT kind, record_key, step, host FROM integrity_keys
            WHERE run = ? AND manifest_fingerprint = ?
            QUALIFY row_number() OVER (PARTITION BY kind ORDER BY step, host, record_key) <= 3
            ORDER BY kind, step, host, record_key""", [run, fingerprint]).fetchall():
        examples[kind].append({"record_key": key, "step": step, "host": host})
    return {"manifest_fingerprint": fingerprint, "files": seg_files, "files_checked": files,
            "segments": int(segments), "hash_checked": int(checked),
            "hash_mismatches": int(mismatches), "unknown_segments": int(unknown),
            "unknown_keys": int(distinct.get("unknown", 0)),
            "heldout_consumed_records": int(distinct.get("heldout", 0)),
            "heldout_exposures": int(heldout), "keys_at_least": bool(capped),
            "skipped": skipped, "hashes_skipped": hashes_skipped, "examples": examples}
