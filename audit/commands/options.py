"""The parts of `tally`'s parsers several commands share: argparse types that refuse a bad value
in one line, the examples epilog, -q/--json, --log-format, and the Beam runner's options."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tally.pipeline.runners import RunnerSpec


def runner_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Beam runner")
    g.add_argument("--runner", default="direct",
                   help="direct (FnApiRunner, default), dask, or a Beam runner name such as "
                        "DataflowRunner, FlinkRunner, SparkRunner")
    g.add_argument("--mode", default="in_memory", choices=["in_memory", "multi_processing"],
                   help="FnApiRunner mode (direct runner only)")
    g.add_argument("--workers", type=positive_int, default=2,
                   help="worker processes with multi_processing or of a local Dask "
                        "cluster; in memory, the threads of reconcile's and diff's stages")
    g.add_argument("--dask-address", help="scheduler of a running dask.distributed cluster "
                                          "(default: start a local one)")
    # Beam's own options come after `--`; `parse` splits them off before argparse, which
    # cannot tell them from a positional argument's values.
    p.epilog = "Beam pipeline options go after '--', e.g. -- --flink_master=host:8081"
    p.set_defaults(beam_args=[])


def runner(args: argparse.Namespace) -> RunnerSpec:
    from tally.pipeline.runners import RunnerSpec

    return RunnerSpec(name=args.runner, workers=args.workers, mode=args.mode,
                      dask_address=args.dask_address, beam_args=args.beam_args)


def number(convert: type, ok: Any, what: str) -> Any:
    """An argparse type: `convert(text)`, refused unless `ok(value)`. A float must be finite
    too (argparse's own float takes "nan" and "inf"). `--interval 0` made the service's
    ingester scan the spool in a loop at 100% of a core; `--memory-gb 0` or `--at-step -5`
    went on into the job."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if (convert is float and not math.isfinite(value)) or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value
    parse.__name__ = what  # what argparse says of a value its type refused
    return parse


positive_float = number(float, lambda v: v > 0, "a number > 0")
non_negative_float = number(float, lambda v: v >= 0, "a number >= 0")
non_negative_int = number(int, lambda v: v >= 0, "an integer >= 0")
positive_int = number(int, lambda v: v > 0, "an integer > 0")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def output_dir(text: str) -> str:
    """An argparse type: a path that can be a directory (-o of reconcile, diff, exposure),
    neither a file nor under one. `-o afile` failed in the job with a traceback."""
    from tally.audit.core.paths import unwritable_dir

    problem = unwritable_dir(text, probe=False)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def http_url(text: str) -> str:
    """An argparse type: an http(s) URL with a host (--api-url, which report.html's links
    open: anything else makes links that go nowhere)."""
    from urllib.parse import urlsplit

    u = urlsplit(text)
    if u.scheme not in ("http", "https") or not u.netloc or u.query or u.fragment:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an http(s) URL of a service, such as http://tally.internal:8000")
    return text


def examples(p: argparse.ArgumentParser, *lines: str) -> None:
    """An example or two at the top of the command's epilog (kept as written)."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "examples:\n" + "\n".join(f"  {x}" for x in lines) + (
        f"\n\n{p.epilog}" if p.epilog else "")


def log_format(p: argparse.ArgumentParser) -> None:
    from tally.audit.core.logs import FORMATS

    p.add_argument("--log-format", default="text", choices=FORMATS,
                   help="log lines on stderr: text ('tally: [level] ...', default) or json "
                        "(one object a line: time, level, logger, message and fields)")


def quiet_json(p: argparse.ArgumentParser, quiet: str | None = "no progress, no worker logs",
                json_: str | None = "machine-readable output") -> None:
    if quiet:
        p.add_argument("-q", "--quiet", action="store_true", help=quiet)
    if json_:
        p.add_argument("--json", action="store_true", help=json_)

