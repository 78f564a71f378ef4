"""Tally's core: the concepts every role shares, importing nothing else of the project.

- `errors`: the user-facing errors (one clear line, never a traceback).
- `hashing`: the one content hash.
- `schema`: the segment and metric columns, from which every file and table layout derives.
- `exposure`: which rows count, what an exposure is, the ideal and the distance from it, the
  coverage answer and the finding record.
"""
