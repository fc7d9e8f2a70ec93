"""The entry point of each service process: `python -m target_service|draft_service|orchestrator`.

Every field of the service's config section is also a flag (`--kv-pool-tokens 32768`);
`--config FILE` loads a TOML file first and the flags override it. Each service hands its
own `serve` in, so the core never imports a service.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from typing import Awaitable, Callable

from specdec.config import ServiceConfig, SpecdecConfig, apply_overrides

MODULES = {"target": "target_service", "draft": "draft_service", "orchestrator": "orchestrator"}


def service_parser(kind: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULES[kind]}", description=f"specdec {kind} service")
    ap.add_argument("--config", help="TOML config file ([target], [draft], [orchestrator])")
    for f in dataclasses.fields(getattr(SpecdecConfig(), kind)):
        default = getattr(getattr(SpecdecConfig(), kind), f.name)
        ap.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=type(default), default=None,
                        help=f"(default: {default!r})")
    return ap


def parse_service_args(kind: str, argv: list[str] | None = None) -> ServiceConfig:
    """The service's config section: defaults, then --config FILE, then the flags."""
    args = vars(service_parser(kind).parse_args(argv))
    section = getattr(SpecdecConfig.load(args.pop("config")), kind)
    apply_overrides(section, args, "flag")
    return section


def run_service(kind: str, serve: Callable[[ServiceConfig], Awaitable[None]], argv: list[str] | None = None) -> None:
    section = parse_service_args(kind, argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {kind} %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(section))
    except KeyboardInterrupt:
        pass
