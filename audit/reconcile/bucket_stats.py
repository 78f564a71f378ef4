"""Per-record exposure for one record-key bucket: partial aggregates and the per-record rows.

Everything is vectorised over the bucket's rows: one sort of a packed int64 key
(`(record << 32) | steps since the bucket's first`; a second, `(record << 32) | epoch`, only
when epochs are too many to count in place), bincounts, and for the host overlap a histogram
of each record's set of hosts (beyond 16 hosts, each record's host pairs and a matrix product
over the records on many hosts). No per-row Python objects.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from tally.audit.buckets.partials import (
    EVIDENCE,
    EXAMPLES,
    RANK_CAP,
    SEEN,
    MaxSpans,
    Partial,
    Spans,
)
from tally.audit.core.arrays import bincount, distinct, host_overlap, ranks, sort_in_place
from tally.audit.core.exposure import hash_checks

_STRING = pa.dictionary(pa.int32(), pa.string())
# Cells of a bucket's records by (domain, epoch, times seen in the epoch) kept at most: 2 MB a
# bucket (20 domains over 4,000 epochs seen up to 3 times each). A spool whose epochs run into
# the hundreds of thousands (an epoch counter that counts steps) has them untold instead.
DOMAIN_EPOCH_CELLS = 1 << 18
# Per-record exposure: one row per manifest record (report's records/ table).
RECORDS_SCHEMA = pa.schema([
    ("record_key", pa.int64()), ("split", _STRING), ("domain", _STRING),
    ("n_tokens", pa.int32()), ("exposures", pa.int64()), ("tokens_consumed", pa.int64()),
    ("hosts", pa.int32()), ("first_step", pa.int64()), ("hash_mismatches", pa.int64()),
])


def _examples(keys, steps, hosts, keep: int = EXAMPLES) -> list[dict[str, int]]:
    """The `keep` lowest rows by (record key, step, host): the same whatever order the rows
    came in (the runner's, or the live reconcile's rounds: tally.audit.reconcile.follow)."""
    pick = np.lexsort((hosts, steps, keys))[:keep]
    return [{"record_key": int(keys[i]), "step": int(steps[i]), "host": int(hosts[i])}
            for i in pick.tolist()]


def _groups(sorted_keys: np.ndarray) -> np.ndarray:
    """Start index of each run of equal values."""
    if not sorted_keys.size:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])


def compute(man: dict | None, c: dict[str, np.ndarray], host_ids: np.ndarray,
            loss_window: int = 1, run_first_step: int = 0, keep: int = EXAMPLES,
            evidence: int = EVIDENCE) -> tuple[Partial, pa.Table | None]:
    """`man`: the bucket's manifest columns (None beyond the manifest); `c`: its effective
    consumption rows (tally.audit.buckets.exchange); `host_ids`: the run's hosts with rows
    (tally.audit.buckets.plan.Plan.host_ids: per-host counts are by position there);
    `run_first_step`: the run's first step, where the loss windows start; `keep` example rows
    and `evidence` most repeated records at most (the live reconcile keeps more). Returns the
    bucket's partial and its per-record table."""
    if man is None:  # the overflow bucket: whole keys, none in the manifest
        keys, known = c["key"], np.zeros(len(c["key"]), dtype=bool)
    else:  # keys as offsets from the bucket's first key: the manifest row within the bucket
        n = len(man["record_key"])
        j = c["key"].astype(np.int64)
        known = j < n  # all but keys past the manifest's end, in its last bucket
        keys = j[~known] + man["record_key"][0]
    unknown = ~known
    out = Partial(unknown_segments=int(unknown.sum()), unknown_keys=int(distinct(keys).size),
                  unknown_examples=_examples(keys, c["step"][unknown], c["host"][unknown],
                                             keep))
    if man is None:
        return out, None
    if not known.all():
        c = {k: v[known] for k, v in c.items()}
        j = j[known]
    step = c["step"].astype(np.int64, copy=False)
    # record starts (tally.audit.core.exposure.starts, flagged in the bucket file)
    starts = c["start"]
    j_starts = j[starts]
    full, mismatch = hash_checks(starts, c["n_tokens"], c["content_hash"], man["n_tokens"][j],
                                 man["content_hash"][j])
    exposures = bincount(j_starts, n=n)
    tokens = bincount(j, c["n_tokens"], n=n)
    train_codes = [i for i, name in enumerate(man["split_names"]) if name == "train"]
    train = np.isin(man["split"], train_codes)
    every = bool(train.all())  # the usual bucket: no held-out records, nothing to mask

    def of_train(a: np.ndarray) -> np.ndarray:
        return a if every else a[train]

    hosts = len(host_ids)
    at = ranks(host_ids, c["host"].astype(np.int64))  # each row's host by its position
    unique, others, overlap, n_hosts = _host_sets(j_starts, at[starts], n, hosts, train)

    # Train start events ordered by (record, step): the first of each record gives its
    # first-seen step; the position within the record is the exposure's rank, kept as the
    # highest rank per step (the driver finds the first step whose highest rank exceeds what a
    # perfect loader allows by then: the first bad step).
    ev = starts if every else starts & train[j]
    # Steps are int64: the series of this bucket start at its first step (`lo`), and the sort
    # key packs the record with the step relative to it (a run spans fewer than 2^31 steps:
    # tally.audit.buckets.plan.MAX_RUN_STEPS).
    lo = int(step.min()) if step.size else 0
    losses = c["loss"][ev] if "loss" in c else np.zeros(0, np.float32)
    with_loss = bool(np.isfinite(losses).any())
    # Within one epoch a record is due at most once: count the exposures beyond that.
    ep = ev & (c["epoch"] >= 0)
    (per_epoch, repeats_at, repeats_on, (out.records_by_epoch, levels),
     out.epoch_duplicated_by_host, repeats_of, (jj, sj)) = _within_epoch(
        j[ep], c["epoch"][ep], step[ep] - lo, at[ep], hosts, n, man["domain"])
    if levels is None:
        out.domain_epochs_untold = True
    for code, name in enumerate(man["domain_names"][:len(levels) if levels is not None else 0]):
        if levels[code].any():  # per domain: a mixture's domains pass epochs apart, or
            out.domain_epoch_levels[name] = levels[code]  # pass one several times in one
    out.epoch_repeats_by_step = Spans([(lo, repeats_at)])
    out.epoch_repeats_by_host = repeats_on
    if not with_loss and int(ep.sum()) == int(ev.sum()) and \
            bool(((sj[1:] >= sj[:-1]) | (jj[1:] != jj[:-1])).all()):
        # The within-epoch sort, (record, epoch, step, host), is already in (record, step)
        # order when every start's epoch is known and each record's epochs follow its steps
        # (every sane run): the same sequence the sort below gives, one sort of the bucket's
        # starts fewer (a quarter of a bucket's time at 1.6M rows). Not with losses: ties at
        # one (record, step) would take their losses in another order.
        js, ss = jj, sj
    else:
        packed = (j[ev] << 32) | (step[ev] - lo)
        if with_loss:  # the exposures' losses follow them into (record, step) order
            # Ties at one (record, step) by host, then loss: ranks and their losses do not
            # depend on the order the rows came in.
            order = np.lexsort((losses, c["host"][ev], packed))
            key, losses = packed[order], losses[order]
        else:
            key = sort_in_place(packed)  # (a live reconcile's rows come in sorted runs)
        js, ss = key >> 32, key & 0xFFFFFFFF
    head = _groups(js)
    first_step = np.full(n, -1, dtype=np.int64)
    first_step[js[head]] = ss[head] + lo
    group_start = np.zeros(len(js), dtype=np.int64)
    group_start[head] = head
    rank = np.arange(1, len(js) + 1) - np.maximum.accumulate(group_start)
    max_rank = np.zeros(int(ss.max()) + 1 if ss.size else 0, dtype=np.int64)
    np.maximum.at(max_rank, ss, rank)
    if with_loss:
        out.loss_by_rank = loss_by_rank(ss + (lo - run_first_step), rank, losses, loss_window)


    e_train = of_train(exposures)
    out.train_exposures = int(e_train.sum())
    out.epoch_duplicates = int((per_epoch - 1).sum())
    out.epoch_duplicate_records = int((per_epoch > 1).sum())
    out.exposure_counts = bincount(e_train)  # records seen e times, by e
    out.hash_checked = int(full.sum())
    out.hash_unverifiable = int(len(full) - full.sum())
    out.hash_overlong = int((starts & (c["n_tokens"] > man["n_tokens"][j])).sum())
    out.hash_mismatches = int(mismatch.sum())
    out.heldout_consumed_records = int(((exposures > 0) & ~train).sum())
    out.heldout_exposures = int(exposures[~train].sum())
    out.overlap = overlap
    out.host_unique, out.host_overlap_with_others = unique, others
    out.new_unique_by_step = Spans([(lo, bincount(ss[head]))])
    out.train_exposures_by_step = Spans([(lo, bincount(ss))])
    out.max_rank_by_step = MaxSpans([(lo, max_rank)])
    out.hash_mismatch_examples = _examples(man["record_key"][j[mismatch]], c["step"][mismatch],
                                           c["host"][mismatch], keep)
    if not every:
        held = starts & ~train[j]
        out.heldout_examples = _examples(man["record_key"][j[held]], c["step"][held],
                                         c["host"][held], keep)
    out.never_seen_examples = man["record_key"][
        np.flatnonzero(train & (exposures == 0))[:EVIDENCE]].tolist()
    out.most_repeated = _most_repeated(man["record_key"], j, c, exposures, repeats_of,
                                       n_hosts, train, evidence)

    weights = {"tokens": of_train(man["n_tokens"]), "exposures": e_train,
               "consumed": of_train(tokens), "never_seen": e_train == 0,
               # content drift, by corpus source: records consumed with other bytes
               "mismatched": of_train(bincount(j[mismatch], n=n)) > 0}
    for col, fields in (("domain", ("records", "tokens", "exposures", "consumed",
                                    "never_seen")),
                        ("source", ("records", "never_seen", "mismatched"))):
        codes, k = of_train(man[col]), len(man[f"{col}_names"])
        sums = {f: np.bincount(codes, None if f == "records" else weights[f], k)
                for f in fields}
        per_name = getattr(out, col)
        for code, name in enumerate(man[f"{col}_names"]):
            if sums["records"][code]:
                per_name[name] = np.array([sums[f][code] for f in fields]).astype(np.int64)
    # Each domain's records by how often they were seen (its own ideal: a mixture that
    # weights its domains, tally.audit.core.exposure.domain_distance): one bincount.
    levels = len(out.exposure_counts)  # 0: the bucket holds no train record
    if levels:
        by_level = np.bincount(of_train(man["domain"]).astype(np.int64) * levels + e_train,
                               minlength=len(man["domain_names"]) * levels
                               ).reshape(-1, levels)
        for code, name in enumerate(man["domain_names"]):
            if by_level[code].any():
                out.domain_levels[name] = by_level[code]
    records = pa.table({
        "record_key": man["record_key"],
        "split": _strings(man, "split"),
        "domain": _strings(man, "domain"),
        "n_tokens": man["n_tokens"],
        "exposures": exposures,
        "tokens_consumed": tokens,
        "hosts": n_hosts.astype(np.int32),
        "first_step": first_step,
        "hash_mismatches": bincount(j[mismatch], n=n),
    }, schema=RECORDS_SCHEMA)
    return out, records


def _most_repeated(record_key: np.ndarray, j: np.ndarray, c: dict[str, np.ndarray],
                   exposures: np.ndarray, epoch_repeats: np.ndarray, n_hosts: np.ndarray,
                   train: np.ndarray, evidence: int = EVIDENCE) -> list[dict]:
    """The bucket's `evidence` train records repeated most within their epochs, then exposed
    most (ties: the lower key), each with its first SEEN exposures (step, host, epoch). One
    partition over the bucket's records, then work for those few only."""
    score = epoch_repeats * (int(exposures.max(initial=0)) + 1) + exposures
    cand = np.flatnonzero(train & ((epoch_repeats > 0) | (exposures > 1)))
    if not cand.size:
        return []
    sc = score[cand]
    if cand.size > evidence:  # the best: those above the cut, then the cut's lowest keys
        cut = np.partition(sc, cand.size - evidence)[cand.size - evidence]
        cand = np.r_[cand[sc > cut], cand[sc == cut][:evidence]]
        sc = score[cand]
    top = cand[np.lexsort((cand, -sc))][:evidence]
    wanted = np.zeros(len(exposures), bool)  # a lookup by record: np.isin sorted the rows
    wanted[top] = True
    rows = np.flatnonzero(c["start"] & wanted[j])
    rows = rows[np.lexsort((c["epoch"][rows], c["host"][rows], c["step"][rows], j[rows]))]
    out = []
    for r in top.tolist():
        mine = rows[j[rows] == r][:SEEN]
        out.append({"record_key": int(record_key[r]), "exposures": int(exposures[r]),
                    "epoch_repeats": int(epoch_repeats[r]), "hosts": int(n_hosts[r]),
                    "seen": [{"step": int(s), "host": int(h), "epoch": int(e)} for s, h, e in
                             zip(c["step"][mine], c["host"][mine], c["epoch"][mine],
                                 strict=True)]})
    return out


def _set_bits(hosts: int) -> tuple[np.ndarray, np.ndarray]:
    """Every set of `hosts` hosts as an integer (a bit per host), and its bits as a
    [2**hosts, hosts] matrix: a histogram of sets times it counts per host."""
    sets = np.arange(2**hosts)
    return sets, (sets[:, None] >> np.arange(hosts)) & 1


def _host_sets(j: np.ndarray, host: np.ndarray, n: int, hosts: int,
               train: np.ndarray) -> tuple[np.ndarray, ...]:
    """From (record, host) exposure pairs: per host, train records seen and those also seen by
    another host; the train overlap matrix; hosts per record."""
    if hosts <= 16:
        # Each record's set of hosts as one small integer (a bit per host, packed from a byte
        # per host): a histogram of the sets gives every host statistic with work proportional
        # to the records, not records x hosts^2.
        width = 8 if hosts <= 8 else 16
        seen = np.zeros(n * width, dtype=bool)
        seen[j * width + host] = True
        packed = np.packbits(seen, bitorder="little")
        code = (packed if width == 8 else packed.view("<u2")).astype(np.int64)
        sets, bits = _set_bits(hosts)
        hist = np.bincount(code[train], minlength=2**hosts)
        multi = np.bitwise_count(sets) > 1
        return (hist @ bits, (hist * multi) @ bits, bits.T @ (hist[:, None] * bits),
                np.bitwise_count(code))
    return _host_pairs(j, host, n, hosts, train)


def _host_pairs(j: np.ndarray, host: np.ndarray, n: int, hosts: int,
                train: np.ndarray) -> tuple[np.ndarray, ...]:
    """`_host_sets` for any number of hosts, in memory proportional to the distinct (record,
    host) pairs, not records x hosts (tally.audit.core.arrays.host_overlap)."""
    pair = distinct(j * hosts + host)  # distinct (record, host), by record then host
    rec, hst = pair // hosts, pair % hosts
    n_hosts = bincount(rec, n=n)
    on_train = train[rec]
    rec, hst = rec[on_train], hst[on_train]
    unique, others, overlap = host_overlap(rec, hst, n_hosts[rec], hosts)
    return unique, others, overlap, n_hosts


def loss_by_rank(step: np.ndarray, rank: np.ndarray, loss: np.ndarray,
                 window: int) -> np.ndarray:
    """Training loss of exposures by (window of `window` steps from the run's first step,
    exposure rank): count, sum and sum of squares, [windows, RANK_CAP, 3]; ranks from RANK_CAP
    on share the last cell. `step`: steps since the run's first step."""
    ok = np.isfinite(loss)
    cell = (step[ok].astype(np.int64) // window) * RANK_CAP + np.minimum(rank[ok], RANK_CAP) - 1
    if not len(cell):
        return np.zeros((0, RANK_CAP, 3))
    size = (int(cell.max()) // RANK_CAP + 1) * RANK_CAP
    value = loss[ok].astype(np.float64)
    out = np.stack([np.bincount(cell, minlength=size).astype(np.float64),
                    np.bincount(cell, value, minlength=size),
                    np.bincount(cell, value * value, minlength=size)], axis=-1)
    return out.reshape(-1, RANK_CAP, 3)


def _within_epoch(j: np.ndarray, epoch: np.ndarray, step: np.ndarray, host: np.ndarray,
                  hosts: int, n: int, domain: np.ndarray) -> tuple[np.ndarray, ...]:
    """From train start events with known epochs: how often each (record, epoch) occurs (those
    that occur), the within-epoch repeats (every occurrence after the first, in step order) by
    step and by host, the distinct records seen per epoch and those seen e times (e >= 1) by
    domain and epoch ([domain code, epoch, e]; `domain`: each record's code; None beyond
    DOMAIN_EPOCH_CELLS cells), per host the records repeated within an epoch
    that it took part in (once per record and epoch), and per record (of n) its within-epoch
    repeats; and the events' (record, step) in that order."""
    if not j.size:
        empty = np.zeros(0, np.int64)
        return (empty, empty, np.zeros(hosts, np.int64), (empty, np.zeros((0, 0, 0), np.int64)),
                np.zeros(hosts, np.int64), np.zeros(n, np.int64), (empty, empty))
    # In (record, epoch, step) order, ties at one step by host: one plain sort of the four
    # packed into an int64 where they fit (a stable argsort and the gathers after it were a
    # quarter of a bucket's time), else a lexsort.
    cols = [np.asarray(c, np.int64) for c in (j, epoch, step, host)]
    widths = [int(c.max()).bit_length() for c in cols]
    if sum(widths) <= 63 and min(int(c.min()) for c in cols) >= 0:
        code = np.zeros(len(j), np.int64)
        for c, w in zip(cols, widths, strict=True):
            code <<= w
            code |= c
        sort_in_place(code)
        out = []
        for w in reversed(widths):
            out.append(code & ((1 << w) - 1))
            code >>= w  # in place: a new array a field cost as much as the sort
        hh, ss, ee, jj = out
    else:
        order = np.lexsort(cols[::-1])
        jj, ee, ss, hh = (c[order] for c in cols)
    head = np.r_[True, (jj[1:] != jj[:-1]) | (ee[1:] != ee[:-1])]
    starts = np.flatnonzero(head)
    counts = np.diff(np.r_[starts, len(jj)])
    again = ~head
    shape = (int(domain.max(initial=0)) + 1, int(ee[head].max()) + 1, int(counts.max()) + 1)
    levels = None  # beyond DOMAIN_EPOCH_CELLS (epochs by the thousand): not kept
    if math.prod(shape) <= DOMAIN_EPOCH_CELLS:
        # (domain, epoch, times seen in it) of each (record, epoch), as one index: a bincount
        first = jj[head]
        cell = (domain[first].astype(np.int64) * shape[1] + ee[head]) * shape[2] + counts
        levels = np.bincount(cell, minlength=math.prod(shape)).reshape(shape)
    return (counts, bincount(ss[again]),
            bincount(hh[again], n=hosts), (bincount(ee[head].astype(np.int64)), levels),
            _hosts_of_repeated(starts, counts, hh, hosts),
            bincount(jj[again].astype(np.int64, copy=False), n=n), (jj, ss))


def _hosts_of_repeated(starts: np.ndarray, counts: np.ndarray, host: np.ndarray,
                       hosts: int) -> np.ndarray:
    """Per host, the (record, epoch) groups seen more than once that it took part in; the
    groups are the runs of `host` (positions) beginning at `starts`, `counts` long."""
    many = counts > 1
    if not many.any():
        return np.zeros(hosts, np.int64)
    rows = np.repeat(many, counts)  # rows of records repeated within their epoch
    if hosts <= 16:
        # Each repeated group's set of hosts as one small integer, OR-ed over its rows, and a
        # histogram of the sets: no sort (the distinct (group, host) pairs took a fifth of a
        # bucket's time at 1.6M rows).
        first = np.r_[0, np.cumsum(counts[many])[:-1]]
        sets = np.bitwise_or.reduceat(np.left_shift(1, host[rows]), first)
        return np.bincount(sets, minlength=2**hosts) @ _set_bits(hosts)[1]
    group = np.repeat(np.arange(len(counts)), counts)
    pairs = distinct(group[rows] * hosts + host[rows])
    return bincount(pairs % hosts, n=hosts)


def _strings(man: dict, col: str) -> pa.Array:
    # Kept dictionary-encoded: the records file is written from these without expanding them.
    return pa.DictionaryArray.from_arrays(pa.array(man[col], pa.int32()),
                                          pa.array(man[f"{col}_names"], pa.string()))
