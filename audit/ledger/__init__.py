"""The ledger: the DuckDB file one process owns, exactly-once ingest of the spool, the aggregates
kept at ingest with the per-record state behind them, the live snapshot and cache engine, and
the answers the API, the CLI and the pre-flight check read from it.

The public face (`__all__`): `database` (`Ledger`), `ingest`, `ingest_loop` (the service's
ingester), `integrity` (checks against the manifest at ingest), `live` (snapshots and cached
answers) and `queries` (the answers). The aggregates, the per-record state, its snapshots and
the lookup index (aggregates, state, setmap, snapshot, lookup) are the ledger's own: siblings
reach them through `Ledger`."""

__all__ = ["database", "ingest", "ingest_loop", "integrity", "live", "queries"]
