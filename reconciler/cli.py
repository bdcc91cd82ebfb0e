"""Command line: ``rbd-reconciler COMMAND``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .config import Config, ConfigError, load_config
from .loader import load

EXIT_OK = 0
EXIT_FAILED = 1


def _version() -> str:
    try:
        return version("rbd-reconciler")
    except PackageNotFoundError:
        return "unknown"


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", choices=("human", "json"), default="human",
                   help="output format (default: human)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rbd-reconciler",
        description="Declarative reconciler for Ceph RBD volumes on bare nodes.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-c", "--config", type=Path, default=None,
                        help="node config file (default: /etc/rbd-reconciler/config.yaml; "
                             "built-in defaults if that is missing)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("validate", help="check desired-volume files; change nothing",
                       description="Load and validate desired-volume files. Exit 0 when all "
                                   "are valid, 1 otherwise; every error is reported as "
                                   "file:line:column: field: message.")
    p.add_argument("paths", nargs="*", type=Path, metavar="PATH",
                   help="files or directories (default: the config's desiredDir)")
    _add_output(p)
    p.set_defaults(func=cmd_validate)
    return parser


def cmd_validate(args: argparse.Namespace, config: Config) -> int:
    paths = args.paths or [config.desired_dir]
    result = load(paths, config)
    if args.output == "json":
        json.dump({
            "valid": result.ok,
            "files": [str(f) for f in result.files],
            "volumes": [{"name": v.name, "file": str(v.source.file), "line": v.source.line,
                         "wantedPhase": v.wanted_phase.name} for v in result.volumes],
            "errors": [d.as_dict() for d in result.diagnostics],
        }, sys.stdout, indent=2)
        print()
    else:
        for d in result.diagnostics:
            print(d)
        status = "valid" if result.ok else f"{len(result.diagnostics)} error(s)"
        print(f"{len(result.files)} file(s), {len(result.volumes)} valid volume(s): {status}",
              file=sys.stderr)
    return EXIT_OK if result.ok else EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        for d in exc.diagnostics:
            print(d, file=sys.stderr)
        return EXIT_FAILED
    return args.func(args, config)


if __name__ == "__main__":
    sys.exit(main())
