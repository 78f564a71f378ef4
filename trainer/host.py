"""One training host: `python -m tally.trainer.host`.

`tally train --hosts H` (trainer/launch.py) starts H of these on one machine and tells each its
index. On a cluster where every host runs the same container (docker compose `--scale`,
a Kubernetes headless service), `--rendezvous NAME` finds the index instead: NAME resolves to
every host's address; sorted, the position of this host's own address is its index and the
first address runs jax.distributed's coordinator.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import sys
import time

from tally.audit.core.errors import TallyError


def rank(own: str, addresses: list[str]) -> tuple[int, str]:
    """(this host's index, the coordinator's address) from every host's address."""
    ordered = sorted(set(addresses), key=ipaddress.ip_address)
    if own not in ordered:
        raise TallyError(f"this host's address {own} is not among {', '.join(ordered)}")
    return ordered.index(own), ordered[0]


def rendezvous(name: str, hosts: int, port: int, timeout_s: float = 300.0) -> tuple[int, str]:
    """Wait until `name` resolves to `hosts` addresses; (index, coordinator host:port)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            addresses = sorted({a[4][0] for a in socket.getaddrinfo(name, port, socket.AF_INET,
                                                                    proto=socket.IPPROTO_TCP)})
        except socket.gaierror:
            addresses = []
        if len(addresses) == hosts:
            break
        if time.monotonic() > deadline:
            raise TallyError(f"rendezvous: {name} resolves to {len(addresses)} address(es) "
                             f"after {timeout_s:.0f} s, expected {hosts}")
        time.sleep(1.0)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addresses[0], port))  # no packet is sent: this only picks the interface
        own = s.getsockname()[0]
    index, first = rank(own, addresses)
    return index, f"{first}:{port}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tally.trainer.host", description=__doc__.splitlines()[0])
    p.add_argument("--config-json", help="the TrainConfig as JSON (instead of --config)")
    p.add_argument("--config", help="JSON file of TrainConfig fields")
    p.add_argument("--host", type=int, help="this host's index (or --rendezvous)")
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--coordinator", help="host:port of jax.distributed's coordinator")
    p.add_argument("--rendezvous", metavar="NAME",
                   help="DNS name that resolves to every host (index and coordinator from it)")
    p.add_argument("--port", type=int, default=int(os.environ.get("TALLY_PORT", 12355)),
                   help="coordinator port with --rendezvous")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--force", action="store_true",
                   help="restore loader states saved on another host count (after pre-flight)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tally.trainer.config import TrainConfig
    from tally.trainer.distributed import initialize
    from tally.trainer.loop import train

    try:
        if args.config_json:
            cfg = TrainConfig(**json.loads(args.config_json))
        else:
            cfg = TrainConfig.load(args.config, args.overrides)
        if args.rendezvous:
            args.host, args.coordinator = rendezvous(args.rendezvous, args.hosts, args.port)
        if args.host is None:
            raise TallyError("give --host or --rendezvous")
        initialize(args.host, args.hosts, args.coordinator)
        train(cfg, host=args.host, host_count=args.hosts, resume=args.resume, force=args.force,
              log=lambda line: print(line, flush=True))
    except TallyError as exc:
        print(f"tally: error: host {args.host}: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        lost = peer_lost(exc)
        if lost is None:
            raise
        print(f"tally: error: host {args.host}: another host left the job mid-step ({lost})",
              file=sys.stderr)
        return PEER_LOST
    return 0


PEER_LOST = 3  # exit status of a host whose collective failed because another host is gone


def peer_lost(exc: BaseException) -> str | None:
    """Why a collective failed when another host went away (its socket closed): the gloo
    error's last part ("Read error [127.0.0.1]:24482: Connection reset by peer"), else None.

    This host's traceback of a JaxRuntimeError from deep in jax.device_get said nothing the
    launcher's line about the host that died does not say better."""
    text = str(exc)
    if type(exc).__name__ != "JaxRuntimeError" or "Gloo" not in text:
        return None
    return "gloo: " + text.rsplit("] ", 1)[-1].strip()


if __name__ == "__main__":  # Grain worker processes re-import this module: keep the guard
    sys.exit(main())
