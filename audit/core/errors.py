"""User-facing errors: the CLI prints these as one clear line instead of a traceback, and the
API answers them with their HTTP status."""


class TallyError(Exception):
    """A problem with the user's input or environment that Tally can explain."""


class NotFound(TallyError):
    """Something the user named does not exist: a run, host, record or checkpoint (HTTP 404)."""


class Unavailable(TallyError):
    """The answer needs something the service was not given, such as a manifest (HTTP 409)."""


class CorpusError(TallyError):
    """Bad corpus input; the message names the file and, where it applies, the record.

    Defined here so that corpus readers that import only `tally.audit.core` (`tally.pipeline.olmo`)
    raise
    it; `tally.pipeline.corpus.CorpusError` is this class."""
