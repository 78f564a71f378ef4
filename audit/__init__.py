"""Tally's audit core: hashing, the spool writer, ingest and the DuckDB ledger.

The writing side (hashing, segments, spool, writer) depends only on numpy, pyarrow and
xxhash so that any training loop can carry it; the ledger side adds DuckDB.
"""

from audit.errors import TallyError
from audit.hashing import content_hash
from audit.segments import Segments, segments_from_batch
from audit.writer import LedgerWriter, WriterError

__all__ = [
    "LedgerWriter",
    "Segments",
    "TallyError",
    "WriterError",
    "content_hash",
    "segments_from_batch",
]
