"""One training host: `python -m trainer.host` (started by trainer/launch.py, one per host)."""

from __future__ import annotations

import argparse
import json
import sys

from audit.errors import TallyError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainer.host")
    p.add_argument("--config-json", required=True)
    p.add_argument("--host", type=int, required=True)
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--coordinator")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    from trainer.config import TrainConfig
    from trainer.distributed import initialize
    from trainer.loop import train

    try:
        initialize(args.host, args.hosts, args.coordinator)
        cfg = TrainConfig(**json.loads(args.config_json))
        train(cfg, host=args.host, host_count=args.hosts, resume=args.resume,
              log=lambda line: print(line, flush=True))
    except TallyError as exc:
        print(f"tally: error: host {args.host}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # Grain worker processes re-import this module: keep the guard
    sys.exit(main())
