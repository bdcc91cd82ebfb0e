"""Command line: ``rbd-reconciler COMMAND``.

Each command imports what it needs when it runs: ``--version`` and
``validate`` never load Ceph's bindings, the planner or the drivers.

Imported by __main__.py; cli/ (6 modules); entry.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from reconciler import __version__
from reconciler.cli.exits import (  # noqa: F401  (the commands import them from here)
    EXIT_CHANGES,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
)
from reconciler.cli.pipe import (  # and exit 141 (EXIT_PIPE) when the reader is gone
    no_stdout_is_nowhere,
    reader_gone,
)

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    from typing import Any, NoReturn

    from reconciler.spec.config import Config


# Only these run as any user: they read files and change nothing on the node.
UNPRIVILEGED = ("validate",)
# Commands whose path logs only through spec.lazylog (an internal error).
LAZY_LOGGING = ("validate",)
# Commands that read node keys or unseal passphrases (the daemon: through its
# passes and CSI calls): made non-dumpable before anything is read.
HOLDS_KEYS = ("apply", "release", "run", "rotate-key", "recover", "fleet")


def _columns() -> int:
    """The terminal's width as ``shutil.get_terminal_size`` finds it
    ($COLUMNS, then stdout's terminal, else 80), without importing shutil
    (and bz2, lzma, fnmatch with it) for every parser built."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class _HelpFormatter(argparse.HelpFormatter):
    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        super().__init__(prog, indent_increment, max_help_position,
                         _columns() - 2 if width is None else width)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


class _Command:
    """A command's function, imported when that command runs: ``--help`` and
    ``validate`` do not pay for the others' modules."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, args: argparse.Namespace, config: Config) -> int:
        module = __import__(f"reconciler.cli.{self.module}", fromlist=[self.name])
        return getattr(module, self.name)(args, config)


def _version() -> str:
    # A constant, not importlib.metadata: that import alone costs ~15 ms per command.
    return __version__


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", choices=("human", "json"), default="human",
                   help="output format (default: human)")


def _add_paths_and_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="*", type=Path, metavar="PATH",
                   help="files or directories (default: the config's desiredDir)")
    _add_output(p)


def _add_targets_and_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="*", metavar="PATH|NAME",
                   help="files or directories, or volume names (metadata.name) among the "
                        "config's desiredDir and csi.dir (default: all of them); an argument "
                        "that names an existing file, or has a / in it, is a PATH")
    _add_output(p)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < 86400:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds in (0, 86400)")
    return value


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; ``only``: with that command's subparser alone (a
    command runs with its own; help and errors about COMMAND need them all)."""
    parser = _Parser(
        prog="rbd-reconciler",
        description="Declarative reconciler for Ceph RBD volumes on bare nodes.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-c", "--config", type=Path, default=None,
                        help="node config file (default: /etc/rbd-reconciler/config.yaml; "
                             "built-in defaults if that is missing)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every command run")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=_Parser)

    if only in (None, "validate"):
        p = sub.add_parser("validate", help="check desired-volume files; change nothing",
                           description="Load and validate desired-volume files. Exit 0 when all "
                                       "are valid, 1 otherwise; every error is reported as "
                                       "file:line:column: field: message.")
        _add_paths_and_output(p)
        p.set_defaults(func=_Command("reconcile", "cmd_validate"))

    if only in (None, "plan"):
        p = sub.add_parser("plan",
                           help="show what apply would change (check + diff); change nothing",
                           description="Observe the node and Ceph, and print the steps that would "
                                       "converge them to the desired files (with the daemon "
                                       "running: from what its passes saw, noting the steps it "
                                       "runs now). Exit 0: nothing to do; 2: changes pending; 1: "
                                       "an error or a refusal.")
        _add_targets_and_output(p)
        p.set_defaults(func=_Command("reconcile", "cmd_plan"))

    if only in (None, "apply"):
        p = sub.add_parser("apply", help="converge the node to the desired files",
                           description="Plan and execute. Prints each volume's result (ok, "
                                       "changed, failed) and a recap; exit 1 if any failed. With "
                                       "the daemon running, it does it: a pass over those volumes "
                                       "now (a chain it already runs for them is the answer), each "
                                       "volume printed as its chain ends; held-down volumes "
                                       "(release) come back up.")
        _add_targets_and_output(p)
        p.set_defaults(func=_Command("reconcile", "cmd_apply"))

    if only in (None, "release"):
        p = sub.add_parser("release", help="unpublish, unstage and unmap; keep every image",
                           description="Take the volumes of the given files down to CREATED "
                                       "(unpublish, unstage, unmap) whatever the files want. "
                                       "Images are never deleted. For maintenance, and for "
                                       "giving a node back. With the daemon running, it does it "
                                       "and keeps them down until apply names them. With --all "
                                       "(never through the daemon): every volume of ours on "
                                       "this node (files, the daemon's records, and mappings ours "
                                       "by identity), after a sync; for shutdown and reboot. Exit "
                                       "1 if anything is still mounted or mapped afterwards. "
                                       "With --orphans (never through the daemon): what status "
                                       "lists as unaccounted for and provably ours; exit 1 if "
                                       "something of ours is left.")
        _add_targets_and_output(p)
        p.add_argument("--all", action="store_true",
                       help="release everything of ours on this node (what "
                            "rbd-reconciler-shutdown.service runs at shutdown)")
        p.add_argument("--orphans", action="store_true",
                       help="remove what status lists as unaccounted for and provably ours "
                            "(mounts, dm-crypt, loop devices, then mappings and helpers), "
                            "never one in use; print what is left and why")
        p.add_argument("--dry-run", action="store_true",
                       help="with --all: only say what it would take down (one 'held:' line "
                            "each; another tool's kernel mappings, left alone, as 'not ours:'); "
                            "exit 0 when nothing of ours, 2 when something, 1 when it cannot "
                            "tell (a listing of the mappings failed)")
        p.add_argument("--step-timeout", type=_positive_seconds, default=30.0, metavar="SECONDS",
                       help="with --all or --orphans: deadline of the sync and of each "
                            "unmount/unmap command (default: 30)")
        p.add_argument("--deadline", type=_positive_seconds, default=240.0, metavar="SECONDS",
                       help="with --all: the whole release ends by then and prints what it "
                            "could not release; commands still running are killed (default: "
                            "240, under the shutdown unit's TimeoutStopSec=300s)")
        p.set_defaults(func=_Command("reconcile", "cmd_release"), release=True)

    if only in (None, "run"):
        p = sub.add_parser("run", help="the daemon: watch desiredDir and converge continuously",
                           description="Watch the desired directory, converge on every change and "
                                       "every resyncSeconds, write status under stateDir/status. "
                                       "SIGTERM finishes the chains in flight and exits; SIGHUP "
                                       "reloads the config. Speaks sd_notify under systemd.")
        p.add_argument("--allow-mass-removal", action="store_true",
                       help="let volumes go even when most or all files vanish at once")
        p.add_argument("--log-format", choices=("auto", "journal", "json", "plain"), default="auto",
                       help="auto (default): journal under journald, plain otherwise; journal: "
                            "native journal fields (python3-systemd) or <N> priority prefixes; "
                            "JSON lines; plain lines with ISO 8601 timestamps")
        p.add_argument("--csi-endpoint", metavar="unix:///PATH",
                       help="also serve CSI v1 (Identity, Controller, Node) on this unix socket "
                            "(default: the config's csi.endpoint; with neither, no CSI)")
        p.set_defaults(func=_Command("run", "cmd_run"))

    if only in (None, "allow-removal"):
        p = sub.add_parser("allow-removal", help="let the daemon's held-back removals go",
                           description="Let the daemon release managed volumes whose files "
                                       "vanished but that it holds back (the mass-removal guard; "
                                       "a name given here also passes the hold while another file "
                                       "fails to load). With the daemon running, it lets them go "
                                       "at once and prints each release; else it writes "
                                       "stateDir/allow-removal.json, which the daemon consumes at "
                                       "its next pass, used or not.")
        p.add_argument("names", nargs="*", metavar="NAME", help="volume names (metadata.name)")
        p.add_argument("--all", action="store_true",
                       help="every removal pending at the next pass (past the mass-removal guard "
                            "only: never one held because a file fails to load)")
        p.set_defaults(func=_Command("run", "cmd_allow_removal"))

    if only in (None, "explain"):
        p = sub.add_parser("explain", help="why a volume is where it is",
                           description="Image watchers, mapping, device holders, mounts, the "
                                       "daemon's last result and the next steps the planner would "
                                       "take. Exit 1 when its state is UNKNOWN (not seen in time).")
        p.add_argument("name", help="volume name (metadata.name)")
        _add_output(p)
        p.set_defaults(func=_Command("status", "cmd_explain"))

    if only in (None, "takeover"):
        p = sub.add_parser("takeover",
                           help="fence the node holding a volume's claim; claim it here",
                           description="For a node that is gone for good: blocklist the Ceph "
                                       "clients of the node holding the image's claim (so it "
                                       "cannot write if it comes back), then take the claim for "
                                       "this node; the next apply maps it here (the daemon, when "
                                       "it runs: it does the takeover, then maps it at once). "
                                       "Without --yes-i-am-sure it only prints what it would do "
                                       "(exit 1).")
        p.add_argument("name", help="volume name (metadata.name)")
        p.add_argument("--yes-i-am-sure", dest="sure", action="store_true",
                       help="really blocklist the holder's clients and take the claim")
        p.set_defaults(func=_Command("takeover", "cmd_takeover"))

    if only in (None, "recover"):
        p = sub.add_parser("recover", help="take a fenced volume down here; leave or reclaim it",
                           description="For a volume whose mapping here is fenced (another node "
                                       "took it over, or Ceph blocklisted this node's client): "
                                       "refuse while any process still uses its mounts or "
                                       "device (stopping them is yours); then unmount, close, "
                                       "unmap (krbd: -o force), and leave the image to its new "
                                       "holder (--leave) or claim it back for this node "
                                       "(--reclaim --yes-i-am-sure, as takeover). Under the "
                                       "node's lock: stop the daemon first.")
        p.add_argument("name", help="volume name (metadata.name)")
        how = p.add_mutually_exclusive_group()
        how.add_argument("--leave", action="store_true",
                         help="leave the image to the node that holds it (release this "
                              "node's claim, if it still has one)")
        how.add_argument("--reclaim", action="store_true",
                         help="claim the image back for this node (fencing the holder's "
                              "clients, as takeover does); apply maps it here afresh")
        p.add_argument("--yes-i-am-sure", dest="sure", action="store_true",
                       help="with --reclaim: really fence the node that holds the claim")
        p.set_defaults(func=_Command("recover", "cmd_recover"))

    if only in (None, "rotate-key"):
        p = sub.add_parser("rotate-key", help="give an encrypted volume a new LUKS2 passphrase",
                           description="For a volume with spec.encryption, mapped on this node: "
                                       "add a keyslot for the new passphrase, prove it opens, then "
                                       "remove the old one; safe to interrupt and run again. "
                                       "key wrappedBy: a new random passphrase, sealed in "
                                       "image-meta. key file: the new key file is named with "
                                       "--new-key-file; point the spec at it afterwards. With the "
                                       "daemon running, it runs inside it, which holds the volume "
                                       "meanwhile.")
        p.add_argument("name", help="volume name (metadata.name)")
        p.add_argument("--new-key-file", metavar="PATH",
                       help="key: file only: the new key file (under encryption.keyRoot)")
        p.set_defaults(func=_Command("rotate", "cmd_rotate_key"))

    if only in (None, "status"):
        p = sub.add_parser("status", help="show the observed state of every desired volume",
                           description="Phase (ABSENT, CREATED, MAPPED, STAGED, PUBLISHED; "
                                       "DEGRADED, or UNKNOWN with the reason when its pool, image "
                                       "or device did not answer within observeTimeoutSeconds or "
                                       "an image-meta value of ours is not UTF-8 text), "
                                       "device, mounts and size of each desired volume; PENDING "
                                       "(not converged) for one not at its wanted phase while "
                                       "stateDir cannot take a write. Exit 1 on load errors, any "
                                       "DEGRADED or UNKNOWN volume, or a full stateDir.")
        _add_targets_and_output(p)
        p.set_defaults(func=_Command("status", "cmd_status"))
    if only in (None, "source"):
        p = sub.add_parser("source", help="the git source: status, sync now, verify, rollback, "
                                          "hold",
                           description="The GitOps source (docs/gitops-source.md). status: "
                                       "the URL, ref, observed, attempted and applied revision, "
                                       "signer and conditions (exit 1 unless Ready). sync: fetch, "
                                       "verify and apply now, as the daemon would (it picks the "
                                       "switch up at once). verify REV: verify a revision, apply "
                                       "nothing (REV: a commit or ref of the mirror; default: the "
                                       "remote's). rollback: back to the previous revision and "
                                       "hold there; hold [--reason TEXT]: stay at the applied "
                                       "revision (a fleet sees this node held, with the "
                                       "reason); resume: apply new revisions again.")
        p.add_argument("action", nargs="?", default="status",
                       choices=("status", "sync", "verify", "rollback", "hold", "resume"),
                       help="default: status")
        p.add_argument("rev", nargs="?", default="", metavar="REV",
                       help="verify: the revision (default: the remote's)")
        p.add_argument("--reason", default="", metavar="TEXT",
                       help="hold: why (reported to the fleet; at most 512 characters)")
        _add_output(p)
        p.set_defaults(func=_Command("source", "cmd_source"))
    if only in (None, "fleet"):
        p = sub.add_parser("fleet", help="the fleet: every node's revision and health, "
                                         "each rollout's progress",
                           description="The fleet's reports in RADOS (docs/fleets.md). status: "
                                       "per node its wave, applied revision, health, held-back "
                                       "revision and why, the report's age (stale marked); per "
                                       "revision being rolled out: the waves done, the wave now "
                                       "applying, whom it waits for, or who halted it and why. "
                                       "Exit 1 when the node is in no fleet or Ceph does not "
                                       "answer.")
        p.add_argument("action", nargs="?", default="status", choices=("status",),
                       help="default: status")
        _add_output(p)
        p.set_defaults(func=_Command("fleet", "cmd_fleet"))
    for p in sub.choices.values():
        # `rbd-reconciler plan -c FILE` works like `rbd-reconciler -c FILE plan`;
        # SUPPRESS: not given here, the top-level value stands.
        p.add_argument("-c", "--config", type=Path, default=argparse.SUPPRESS,
                       help="node config file (also accepted before COMMAND)")
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                       help="log every command run")
    return parser


COMMANDS = ("validate", "plan", "apply", "release", "run", "allow-removal", "explain",
            "takeover", "recover", "rotate-key", "status", "source", "fleet")


def _command_of(argv: Sequence[str]) -> str | None:
    """The command named on ``argv`` when it is plain to see (after -c FILE,
    --config FILE or =FILE, -v, --verbose); else None: anything else before
    it (--help, an abbreviation, a typo) is parsed with every command."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-c", "--config"):
            i += 2
            continue
        if a.startswith("--config=") or a in ("-v", "--verbose"):
            i += 1
            continue
        return a if a in COMMANDS else None
    return None


def main(argv: Sequence[str] | None = None, *, after_fast: bool = False) -> int:
    """``after_fast``: cli/fast.py ran first in this process (the console
    script): what it found of the daemon stands, and is not asked again."""
    no_stdout_is_nowhere()
    if not after_fast:
        from reconciler.cli.ask import begin

        begin()  # a command of its own (a test's, in one process): nothing found yet
    # A path or name that is not UTF-8 (a foreign mount point) is printed
    # escaped, as stderr prints it, never a UnicodeEncodeError.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        try:
            return _main(argv)
        finally:
            # A closed pipe shows here, not at interpreter exit; this covers
            # argparse's --help and --version too (they exit from parse_args).
            sys.stdout.flush()
    except BrokenPipeError:
        return reader_gone()
    except KeyboardInterrupt:  # while parsing, or loading the config (the command says more)
        print("rbd-reconciler: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: Sequence[str] | None) -> int:
    if list(sys.argv[1:] if argv is None else argv) == ["--version"]:
        print(f"rbd-reconciler {_version()}")  # argparse's help formatter costs ~5 ms
        return EXIT_OK
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(only=_command_of(argv))
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except BrokenPipeError:
        raise  # main() ends quietly
    except KeyboardInterrupt:
        print("rbd-reconciler: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # never a traceback at a user: one line, and -v for details
        import logging
        import traceback

        if getattr(args, "verbose", False):
            traceback.print_exc()
        logging.getLogger("reconciler").debug("unexpected error", exc_info=True)
        print(f"rbd-reconciler {args.command}: internal error: {type(exc).__name__}: {exc}"
              + ("" if getattr(args, "verbose", False) else " (-v shows the traceback)"),
              file=sys.stderr)
        return EXIT_FAILED


def _setup_logging(verbose: bool) -> None:
    import logging

    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


def _no_core_dumps(command: str) -> None:
    from reconciler.drivers.nodump import forbid_core_dumps

    try:
        forbid_core_dumps()
    except OSError as exc:  # a seccomp filter that forbids prctl: the unit's LimitCORE=0 stands
        print(f"rbd-reconciler {command}: warning: cannot forbid core dumps ({exc})",
              file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    from reconciler.spec.config import ConfigError, load_config

    if args.command not in UNPRIVILEGED and os.geteuid() != 0:
        print(f"rbd-reconciler {args.command}: needs root (it reads devices, mounts and the "
              "Ceph keyring, and maps and mounts volumes); only `validate` runs as any user",
              file=sys.stderr)
        return EXIT_FAILED
    if args.command in HOLDS_KEYS:
        _no_core_dumps(args.command)
    if args.command in LAZY_LOGGING and not args.verbose:
        # Nothing on its path logs but an internal error: logging is loaded
        # (and set up, the same way) only then.
        from reconciler.spec.lazylog import defer_setup

        defer_setup(lambda: _setup_logging(False))
    else:
        _setup_logging(args.verbose)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        for d in exc.diagnostics:
            print(d, file=sys.stderr)
        return EXIT_FAILED
    return args.func(args, config)


if __name__ == "__main__":
    sys.exit(main())
