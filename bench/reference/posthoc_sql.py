"""The post-hoc audits' numbers, computed by DuckDB SQL straight from ledgers and the manifest.

The test oracle for `tally diff` and `tally exposure`, written independently of
`tally.audit.posthoc`
from the definitions in docs/DESIGN.md ("Post-hoc audits"): an exposure is an effective record
start; a step's records are the multiset of its exposures; a step is identical when both runs
have the same multiset there and the same number of segments and tokens; per record over the
manifest's records; a document matches every manifest record with its content hash.
"""

from __future__ import annotations

import duckdb


def reference(a: tuple[str, str], b: tuple[str, str], manifest: str,
              at_step: int | None = None, window: int = 1) -> dict:
    """`a`, `b`: (ledger path, run id); the two may share a ledger."""
    con = duckdb.connect()
    alias = {}
    for path, _ in (a, b):
        if path not in alias:
            alias[path] = f"l{len(alias)}"
            con.execute(f"ATTACH '{path}' AS {alias[path]} (READ_ONLY)")
    at = "" if at_step is None else f"AND c.step <= {int(at_step)}"
    for r, (path, run_id) in (("a", a), ("b", b)):
        db = alias[path]
        con.execute(f"""
            CREATE TEMP VIEW eff_{r} AS SELECT c.* FROM {db}.consumption c
                JOIN {db}.attempts x USING (run, attempt) JOIN {db}.runs USING (run)
                WHERE run_id = '{run_id}' AND (x.rolled_back_from_step IS NULL
                      OR c.step < x.rolled_back_from_step) {at};
            CREATE TEMP VIEW starts_{r} AS SELECT * FROM eff_{r} WHERE "offset" = 0;""")
    con.execute(f"CREATE TEMP VIEW m AS SELECT * FROM read_parquet('{manifest}')")

    def all_(sql):
        return con.execute(sql).fetchall()

    def one(sql):
        return all_(sql)[0]

    def compare(group: str, where: str = "TRUE") -> dict[int, tuple]:
        """Per group: (size a, size b, distinct a, distinct b, common, L1)."""
        return {r[0]: tuple(int(x) for x in r[1:]) for r in all_(f"""
            WITH ca AS (SELECT {group} AS g, record_key, count(*) AS n FROM starts_a
                        WHERE {where} GROUP BY ALL),
                 cb AS (SELECT {group} AS g, record_key, count(*) AS n FROM starts_b
                        WHERE {where} GROUP BY ALL)
            SELECT g, coalesce(sum(ca.n), 0), coalesce(sum(cb.n), 0), count(ca.n), count(cb.n),
                   count(*) FILTER (WHERE ca.n IS NOT NULL AND cb.n IS NOT NULL),
                   sum(abs(coalesce(ca.n, 0) - coalesce(cb.n, 0)))
            FROM ca FULL OUTER JOIN cb USING (g, record_key) GROUP BY g ORDER BY g""")}

    out: dict = {}
    shape = {row[0]: row[1:] for row in all_("""
        WITH sa AS (SELECT step, count(*) AS seg, sum(n_tokens) AS tok FROM eff_a GROUP BY ALL),
             sb AS (SELECT step, count(*) AS seg, sum(n_tokens) AS tok FROM eff_b GROUP BY ALL)
        SELECT step, coalesce(sa.seg, 0), coalesce(sb.seg, 0), coalesce(sa.tok, 0),
               coalesce(sb.tok, 0)
        FROM sa FULL OUTER JOIN sb USING (step) ORDER BY step""")}
    steps = compare("step")
    identical = {s: sh[0] == sh[1] and sh[2] == sh[3] and steps.get(s, (0,) * 6)[5] == 0
                 for s, sh in shape.items()}
    out["steps_compared"] = len(shape)
    out["identical_steps"] = sum(identical.values())
    out["first_divergent_step"] = min((s for s, ok in identical.items() if not ok),
                                      default=None)
    out["steps"] = {s: (int(sh[0]), int(sh[1]), int(sh[2]), int(sh[3]),
                        *steps.get(s, (0,) * 6), identical[s]) for s, sh in shape.items()}
    # Windows of `window` steps from the first step either run consumed.
    first = one("SELECT least((SELECT min(step) FROM eff_a), (SELECT min(step) FROM eff_b))")[0]
    out["windows"] = compare(f"(step - {int(first or 0)}) // {int(window)}")
    out["epochs"] = compare("epoch", "epoch >= 0")

    con.execute("""CREATE TEMP TABLE per_record AS
        SELECT m.record_key, m.split, m.domain, coalesce(xa.n, 0) AS ea, coalesce(xb.n, 0) AS eb
        FROM m LEFT JOIN (SELECT record_key, count(*) AS n FROM starts_a GROUP BY ALL) xa
               USING (record_key)
             LEFT JOIN (SELECT record_key, count(*) AS n FROM starts_b GROUP BY ALL) xb
               USING (record_key)""")
    out["records"] = dict(zip(("compared", "only_a", "only_b", "same", "more_often_a",
                               "more_often_b", "neither"), map(int, one("""
        SELECT count(*), count(*) FILTER (WHERE ea > 0 AND eb = 0),
               count(*) FILTER (WHERE eb > 0 AND ea = 0),
               count(*) FILTER (WHERE ea > 0 AND ea = eb),
               count(*) FILTER (WHERE eb > 0 AND ea > eb),
               count(*) FILTER (WHERE ea > 0 AND eb > ea),
               count(*) FILTER (WHERE ea = 0 AND eb = 0) FROM per_record""")), strict=True))
    out["histogram"] = {str(d): int(n) for d, n in all_(
        "SELECT ea - eb AS d, count(*) FROM per_record GROUP BY d ORDER BY d")}
    out["domains"] = {row[0]: tuple(int(x) for x in row[1:]) for row in all_("""
        SELECT domain, count(*), sum(ea), sum(eb), count(*) FILTER (WHERE ea > 0),
               count(*) FILTER (WHERE eb > 0)
        FROM per_record WHERE split = 'train' GROUP BY domain ORDER BY domain""")}
    for r in ("a", "b"):
        seen, total = one(f"""SELECT count(*) FILTER (WHERE e{r} > 0), coalesce(sum(e{r}), 0)
                              FROM per_record WHERE split = 'train'""")
        unknown = one(f"""SELECT count(DISTINCT record_key) FROM starts_{r}
                          WHERE record_key NOT IN (SELECT record_key FROM m)""")[0]
        out[r] = {"seen": int(seen), "train_exposures": int(total),
                  "exposures": int(one(f"SELECT count(*) FROM starts_{r}")[0]),
                  "unknown_keys": int(unknown)}
    con.close()
    return out


def from_diff(d: dict, tables: dict) -> dict:
    """The same numbers, picked out of a diff's diff.json and tables."""
    st = tables["steps"].to_pylist()
    win = tables["windows"].to_pylist()
    fields = ("exposures_a", "exposures_b", "records_a", "records_b", "common_records",
              "multiset_difference")
    return {
        "steps_compared": d["steps_compared"], "identical_steps": d["identical_steps"],
        "first_divergent_step": d["first_divergent_step"],
        "steps": {x["step"]: (x["segments_a"], x["segments_b"], x["tokens_a"], x["tokens_b"],
                              *(x[f] for f in fields), x["identical"]) for x in st},
        "windows": {x["window"]: tuple(x[f] for f in fields) for x in win
                    if x["exposures_a"] or x["exposures_b"]},
        "epochs": {x["epoch"]: tuple(x[f] for f in fields) for x in d["epochs"]},
        "records": d["records"],
        "histogram": d["exposure_difference_histogram"],
        "domains": {x["domain"]: (x["records"], x["exposures_a"], x["exposures_b"], x["seen_a"],
                                  x["seen_b"]) for x in d["domains"]},
        **{r: {"seen": d[r]["coverage"]["seen"],
               "train_exposures": d[r]["coverage"]["exposures"],
               "exposures": d[r]["exposures"], "unknown_keys": d[r]["unknown_keys"]}
           for r in ("a", "b")},
    }


def exposure_reference(ledger: str, manifest: str, run_ids: list[str],
                       doc_hashes: list[int]) -> dict:
    """Per (document, record key, run): exposures, first and last step, hosts, epochs; and per
    run the documents matched, consumed, consumed twice or more."""
    con = duckdb.connect()
    con.execute(f"ATTACH '{ledger}' AS l (READ_ONLY)")
    con.execute(f"CREATE TEMP VIEW m AS SELECT * FROM read_parquet('{manifest}')")
    con.execute("CREATE TEMP TABLE docs (document BIGINT, content_hash UBIGINT)")
    con.executemany("INSERT INTO docs VALUES (?, ?)", list(enumerate(doc_hashes)))
    rows, per_run = {}, {}
    for run_id in run_ids:
        con.execute(f"""
            CREATE OR REPLACE TEMP VIEW s AS SELECT c.* FROM l.consumption c
                JOIN l.attempts x USING (run, attempt) JOIN l.runs USING (run)
                WHERE run_id = '{run_id}' AND c."offset" = 0
                  AND (x.rolled_back_from_step IS NULL OR c.step < x.rolled_back_from_step)""")
        for r in con.execute("""
                SELECT d.document, m.record_key, count(s.step), min(s.step), max(s.step),
                       list(DISTINCT s.host ORDER BY s.host) FILTER (WHERE s.host IS NOT NULL),
                       list(DISTINCT s.epoch ORDER BY s.epoch) FILTER (WHERE s.epoch IS NOT NULL)
                FROM docs d LEFT JOIN m USING (content_hash)
                LEFT JOIN s USING (record_key) GROUP BY ALL""").fetchall():
            hosts = r[5] if r[2] else None
            epochs = r[6] if r[2] else None
            rows[(r[0], r[1], run_id)] = (r[2], r[3], r[4], hosts, epochs)
        per_run[run_id] = dict(zip(("documents", "matched", "consumed", "consumed_2plus"),
                                   con.execute("""
            WITH per_doc AS (SELECT d.document, count(m.record_key) AS records,
                                    count(s.step) AS exposures
                             FROM docs d LEFT JOIN m USING (content_hash)
                             LEFT JOIN s USING (record_key) GROUP BY d.document)
            SELECT count(*), count(*) FILTER (WHERE records > 0),
                   count(*) FILTER (WHERE exposures >= 1), count(*) FILTER (WHERE exposures >= 2)
            FROM per_doc""").fetchall()[0], strict=True))
    con.close()
    return {"rows": rows, "runs": per_run}
