"""Tally's core: the concepts every role shares, importing nothing else of the project.

- `errors`: the user-facing errors (one clear line, never a traceback).
- `hashing`: the one content hash.
- `schema`: the segment and metric columns, from which every file and table layout derives.
- `exposure`: which rows count, what an exposure is, the ideal and the distance from it, the
  coverage answer and the finding record.
- `arrays`: array helpers of the numpy-vectorised jobs.
- `paths`: output paths checked before work starts, and the one way a file is published.
- `logs`: Tally's log lines on stderr, in their two formats.
- `allocator`: the C allocator's settings for Tally's own processes.
- `cpu`: numpy's CPU dispatch for Tally's own processes (no AVX-512 sort on AMD Zen 4).
- `words`: how Tally's lines say a count (the noun and the verb agreeing with it).

The public face (`__all__`): every module; the siblings import from them.
"""

__all__ = ["allocator", "arrays", "cpu", "errors", "exposure", "hashing", "logs", "paths", "schema",
           "words"]
