"""One record-key bucket of a diff: run A's and run B's exposures of the bucket's records,
compared per record, per step, per window of steps and per epoch, as a typed partial
(`DiffPartial`) and a per-record table. Numpy over the bucket's columns; no per-row objects.

The unit everywhere is the exposure (tally.audit.core.exposure: an effective record start). A step's
records are the multiset of records whose starts it consumed; per record, an exposure count in
each run. Per-record numbers cover the manifest's records (train and held out); keys outside
the manifest are counted apart (`unknown_*`) but take part in the step, window and epoch
comparisons, since they were consumed there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa

from tally.audit.buckets.partials import EXAMPLES, Mergeable, Partial, merged_by, summed
from tally.audit.core.arrays import bincount, distinct
from tally.audit.posthoc.multiset import compare_groups, dense_codes

RUNS = ("a", "b")
_STRING = pa.dictionary(pa.int32(), pa.string())
# Per record: one row per manifest record (the diff's records/ table).
RECORDS_SCHEMA = pa.schema([
    ("record_key", pa.int64()), ("split", _STRING), ("domain", _STRING),
    ("exposures_a", pa.int64()), ("exposures_b", pa.int64()), ("difference", pa.int64()),
    ("first_step_a", pa.int64()), ("first_step_b", pa.int64()),
])


def each_merged(a: dict[str, Mergeable], b: dict[str, Mergeable]) -> dict[str, Mergeable]:
    """Two dicts of partials, merged key by key."""
    return {k: a[k].merge(b[k]) if k in a and k in b else a.get(k, b.get(k))
            for k in a.keys() | b.keys()}


def lowest(a: list, b: list) -> list:
    """The EXAMPLES smallest values of both (the same whatever order the merge runs in)."""
    return sorted(set(a) | set(b))[:EXAMPLES]


@dataclass
class DiffPartial(Mergeable):
    """Aggregates of part of two runs' consumption; each field merges by its declared rule."""

    # ---- per run, from the read stage: reconcile's per-file partials (rows, steps, hosts) ----
    read: dict[str, Partial] = merged_by(each_merged, factory=dict)

    # ---- per bucket: rows and slices joined (checked against the read stage) ----
    rows_joined: dict[str, int] = summed(dict)
    slices_joined: dict[str, int] = summed(dict)

    # ---- per manifest record ----
    records: int = summed()
    only_a: int = summed()  # seen by A, never by B
    only_b: int = summed()
    same: int = summed()  # seen by both, equally often
    more_a: int = summed()  # seen by both, more often by A
    more_b: int = summed()
    difference_histogram: dict[int, int] = summed(dict)  # exposures A - B -> records
    only_a_examples: list[int] = merged_by(lowest, factory=list)
    only_b_examples: list[int] = merged_by(lowest, factory=list)
    exposures: dict[str, int] = summed(dict)  # every exposure, unknown keys included
    heldout_exposures: dict[str, int] = summed(dict)
    heldout_records: dict[str, int] = summed(dict)
    unknown_keys: dict[str, int] = summed(dict)  # distinct keys beyond the manifest exposed
    unknown_exposures: dict[str, int] = summed(dict)

    # ---- groups compared (tally.audit.posthoc.multiset.GroupComparison's fields, as arrays) ----
    steps: dict[str, np.ndarray] = summed(dict)
    windows: dict[str, np.ndarray] = summed(dict)
    epochs: dict[str, np.ndarray] = summed(dict)  # starts of a known epoch (>= 0) only
    unknown_epoch: dict[str, int] = summed(dict)  # exposures whose epoch is unknown

    # ---- coverage and mix of the train split ----
    exposure_counts: dict[str, np.ndarray] = summed(dict)  # train records seen e times, by e
    train_exposures_by_step: dict[str, np.ndarray] = summed(dict)
    new_unique_by_step: dict[str, np.ndarray] = summed(dict)
    # domain -> (train records, exposures A, exposures B, seen by A, seen by B)
    domain: dict[str, np.ndarray] = summed(dict)
    window_domain: dict[tuple[str, str], np.ndarray] = summed(dict)  # (run, domain) -> windows


def _bincount(idx: np.ndarray, n: int = 0, weights: np.ndarray | None = None) -> np.ndarray:
    return bincount(idx, weights, n).astype(np.int64, copy=False)


def _starts(man: dict | None, c: dict[str, np.ndarray], base: int) -> dict[str, np.ndarray]:
    """A run's starts in this bucket: manifest row (or -1), whole key, step, epoch."""
    s = c["start"]
    if man is None:  # the overflow bucket: whole keys, none in the manifest
        whole = c["key"][s].astype(np.int64)
        row = np.full(len(whole), -1, np.int64)
    else:
        row = c["key"][s].astype(np.int64)
        whole = row + base
        row[row >= len(man["record_key"])] = -1  # past the manifest's end, in its last bucket
    return {"row": row, "whole": whole, "step": c["step"][s].astype(np.int64),
            "epoch": c["epoch"][s].astype(np.int64)}


def compute(man: dict | None, rows: dict[str, dict[str, np.ndarray]], base: int,
            window: int, first_step: int = 0) -> tuple[DiffPartial, pa.Table | None]:
    """`man`: the bucket's manifest columns (None beyond the manifest); `rows[r]`: run r's
    effective rows in this bucket (tally.audit.buckets.exchange), steps counted from `first_step`
    (the first step of either run); `base`: the bucket's first key; `window`: steps per
    window. Returns the bucket's partial and its per-record table."""
    st = {r: _starts(man, rows[r], base) for r in RUNS}
    n = 0 if man is None else len(man["record_key"])
    out = DiffPartial(rows_joined={r: len(rows[r]["step"]) for r in RUNS},
                      exposures={r: len(st[r]["step"]) for r in RUNS},
                      unknown_keys={r: len(distinct(st[r]["whole"][st[r]["row"] < 0]))
                                    for r in RUNS},
                      unknown_exposures={r: int((st[r]["row"] < 0).sum()) for r in RUNS})

    # Group comparisons over every start: a key is its manifest row, or beyond the rows a
    # rank among the bucket's unknown keys (whole keys may not fit 32 bits).
    unknown = np.concatenate([st[r]["whole"][st[r]["row"] < 0] for r in RUNS])
    _, unknown_sorted = dense_codes(unknown)
    code = {}
    for r in RUNS:
        c = st[r]["row"].copy()
        out_of = c < 0
        c[out_of] = n + np.searchsorted(unknown_sorted, st[r]["whole"][out_of])
        code[r] = c
    a, b = st["a"], st["b"]
    out.steps = asdict(compare_groups(a["step"], code["a"], b["step"], code["b"]))
    out.windows = asdict(compare_groups(a["step"] // window, code["a"], b["step"] // window,
                                        code["b"]))
    ka, kb = a["epoch"] >= 0, b["epoch"] >= 0
    out.epochs = asdict(compare_groups(a["epoch"][ka], code["a"][ka], b["epoch"][kb],
                                       code["b"][kb]))
    out.unknown_epoch = {"a": int((~ka).sum()), "b": int((~kb).sum())}
    if man is None:
        return out, None

    # Per manifest record.
    e, first = {}, {}
    train_codes = [i for i, name in enumerate(man["split_names"]) if name == "train"]
    train = np.isin(man["split"], train_codes)
    for r in RUNS:
        known = st[r]["row"] >= 0
        row, step = st[r]["row"][known], st[r]["step"][known]
        e[r] = _bincount(row, n)
        f = np.full(n, np.iinfo(np.int64).max, np.int64)
        np.minimum.at(f, row, step)
        first[r] = np.where(e[r] > 0, f, -1)  # since first_step (made absolute below)
        out.heldout_exposures[r] = int(e[r][~train].sum())
        out.heldout_records[r] = int((e[r][~train] > 0).sum())
        # Coverage of the train split: exposures per step, records first seen per step.
        on_train = train[row]
        out.train_exposures_by_step[r] = _bincount(step[on_train])
        out.exposure_counts[r] = _bincount(e[r][train])
        out.new_unique_by_step[r] = _bincount(first[r][train & (e[r] > 0)])
    ea, eb = e["a"], e["b"]
    seen_a, seen_b = ea > 0, eb > 0
    keys = man["record_key"]
    out.records = n
    out.only_a = int((seen_a & ~seen_b).sum())
    out.only_b = int((seen_b & ~seen_a).sum())
    out.same = int((seen_a & (ea == eb)).sum())
    out.more_a = int((seen_b & (ea > eb)).sum())
    out.more_b = int((seen_a & (eb > ea)).sum())
    values, counts = np.unique(ea - eb, return_counts=True)
    out.difference_histogram = dict(zip(values.tolist(), counts.tolist(), strict=True))
    out.only_a_examples = keys[seen_a & ~seen_b][:EXAMPLES].tolist()
    out.only_b_examples = keys[seen_b & ~seen_a][:EXAMPLES].tolist()

    # The mix of the train split: per domain, and per domain over windows of steps.
    dom = man["domain"]
    k = len(man["domain_names"])
    sums = [_bincount(dom[train], k)]
    for r in RUNS:
        sums.append(_bincount(dom[train], k, e[r][train]))
    for r in RUNS:
        sums.append(_bincount(dom[train], k, (e[r][train] > 0).astype(np.int64)))
    for code_, name in enumerate(man["domain_names"]):
        if sums[0][code_]:
            out.domain[name] = np.array([s[code_] for s in sums], np.int64)
    for r in RUNS:
        known = st[r]["row"] >= 0
        row, step = st[r]["row"][known], st[r]["step"][known]
        on_train = train[row]
        w = step[on_train] // window
        per = _bincount(w * k + dom[row[on_train]], (int(w.max()) + 1 if w.size else 0) * k)
        per = per.reshape(-1, k)
        for code_, name in enumerate(man["domain_names"]):
            if per[:, code_].any():
                out.window_domain[(r, name)] = per[:, code_].copy()

    records = pa.table({
        "record_key": keys,
        "split": _strings(man, "split"),
        "domain": _strings(man, "domain"),
        "exposures_a": ea, "exposures_b": eb, "difference": ea - eb,
        **{f"first_step_{r}": np.where(first[r] >= 0, first[r] + first_step, -1) for r in RUNS},
    }, schema=RECORDS_SCHEMA)
    return out, records


def _strings(man: dict, col: str) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(man[col], pa.int32()),
                                          pa.array(man[f"{col}_names"], pa.string()))
