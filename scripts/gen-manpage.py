#!/usr/bin/env python3
"""Write the man page and the bash completion from the CLI's own parser.

    .venv/bin/python scripts/gen-manpage.py          # rewrites both files
    .venv/bin/python scripts/gen-manpage.py --check  # exit 1 if either is stale

One source of truth: every command, option, choice and help text comes from
``reconciler.cli.main.build_parser()``; tests/unit/cli/test_manpage.py fails when the
checked-in files differ from what this writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from reconciler import __version__  # noqa: E402
from reconciler.cli.main import build_parser  # noqa: E402

MAN = REPO / "man" / "rbd-reconciler.1"
COMPLETION = REPO / "completions" / "rbd-reconciler.bash"
# A fixed date keeps the output a function of the parser alone (no churn).
DATE = "2026-11-23"

EXIT_STATUS = [
    ("0", "Success; for plan: nothing to do."),
    ("1", "Failed, or cannot run at all: one line on stderr names what to fix (not root, "
          "the config, the Ceph conf or keyring with its path, Ceph not answering with the "
          "monitor address)."),
    ("2", "plan only: changes pending."),
    ("64", "Usage error (an unknown flag or command)."),
    ("130", "Interrupted (Ctrl-C)."),
    ("141", "The reader of the output went away (a closed pipe, as in status | head); quietly."),
]


def roff(text: str) -> str:
    """Escape text for a roff line: backslashes, hyphens, and a leading dot or quote."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + text if text[:1] in (".", "'") else text


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _option_label(action: argparse.Action) -> str:
    label = ", ".join(f"\\fB{roff(o)}\\fR" for o in action.option_strings)
    if action.nargs != 0:
        metavar = action.metavar or (
            "{" + ",".join(map(str, action.choices)) + "}" if action.choices else
            action.dest.upper())
        label += f" \\fI{roff(str(metavar))}\\fR"
    return label


def _options(parser: argparse.ArgumentParser) -> list[str]:
    lines: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            lines += [".TP", _option_label(action)]
        else:
            lines += [".TP", f"\\fI{roff(str(action.metavar or action.dest))}\\fR"]
        lines.append(roff(action.help or ""))
    return lines


def _usage(parser: argparse.ArgumentParser) -> str:
    usage = parser.format_usage().removeprefix("usage: ").strip()
    return " ".join(usage.split())


def render_man() -> str:
    parser = build_parser()
    sub = _subparsers(parser)
    helps = {a.dest: a.help for a in sub._choices_actions}
    out = [
        f'.TH RBD\\-RECONCILER 1 "{DATE}" "rbd\\-reconciler {__version__}" "User Commands"',
        ".SH NAME",
        f"rbd\\-reconciler \\- {roff(parser.description or '').rstrip('.')}",
        ".SH SYNOPSIS",
        "\\fBrbd\\-reconciler\\fR [\\fIOPTIONS\\fR] \\fICOMMAND\\fR [\\fIARGS\\fR]",
        ".SH DESCRIPTION",
        "Converges a node's Ceph RBD volumes (images, mappings, filesystems, mounts) to the "
        "desired\\-volume files in the config's \\fBdesiredDir\\fR. Every command but "
        "\\fBvalidate\\fR needs root. \\fB\\-c\\fR and \\fB\\-v\\fR go before or after "
        "\\fICOMMAND\\fR. While the daemon (\\fBrun\\fR) runs, \\fBapply\\fR, "
        "\\fBrelease\\fR, \\fBplan\\fR, \\fBstatus\\fR, \\fBexplain\\fR, "
        "\\fBrotate\\-key\\fR, \\fBtakeover\\fR and \\fBallow\\-removal\\fR are done by it, "
        "through its control socket, and print what they would print alone; without it they "
        "run in their own process.",
        ".SH OPTIONS",
        *_options(parser),
        ".SH COMMANDS",
    ]
    for name, cmd in sub.choices.items():
        out += [".SS " + roff(name), roff(_usage(cmd)), ".PP", roff(cmd.description or
                                                                      helps.get(name) or "")]
        out += [".RS", *_options(cmd), ".RE"]
    out.append(".SH EXIT STATUS")
    for code, meaning in EXIT_STATUS:
        out += [".TP", f"\\fB{code}\\fR", roff(meaning)]
    out += [
        ".SH FILES",
        ".TP", "\\fI/etc/rbd\\-reconciler/config.yaml\\fR",
        "The node config (built\\-in defaults if it is missing).",
        ".TP", "\\fI/etc/rbd\\-reconciler/volumes.d/\\fR",
        "The default \\fBdesiredDir\\fR: one desired\\-volume file per volume.",
        ".TP", "\\fI/run/rbd\\-reconciler/control.sock\\fR",
        "The default \\fBcontrolSocket\\fR: the running daemon's control socket (root only), "
        "through which the commands above are done.",
        ".SH SEE ALSO",
        "\\fBrbd\\fR(8), \\fBceph\\fR(8), \\fBsystemd.service\\fR(5); the project's README.md "
        "and docs/ (in the Debian package, /usr/share/doc/rbd\\-reconciler/) for the file "
        "formats, the config keys and the safety rules.",
    ]
    return "\n".join(out) + "\n"


def _words(parser: argparse.ArgumentParser) -> tuple[list[str], dict[str, str], bool]:
    """(every option string, {option taking a value: its completion}, whether
    the positional arguments are paths)."""
    opts: list[str] = []
    values: dict[str, str] = {}
    paths = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        opts += action.option_strings
        if not action.option_strings:
            paths |= action.type is Path or "PATH" in str(action.metavar or "")
        elif action.nargs != 0:
            values.update(dict.fromkeys(action.option_strings, _complete_value(action)))
    return opts, values, paths


def _complete_value(action: argparse.Action) -> str:
    if action.choices:
        return f'COMPREPLY=($(compgen -W "{" ".join(map(str, action.choices))}" -- "$cur"))'
    if action.type is Path:
        return 'COMPREPLY=($(compgen -f -- "$cur"))'
    return "COMPREPLY=()"  # a number, an endpoint: nothing to offer


def render_completion() -> str:
    parser = build_parser()
    sub = _subparsers(parser)
    top_opts, values, _ = _words(parser)
    cases = []
    for name, cmd in sub.choices.items():
        opts, more, paths = _words(cmd)
        values.update(more)
        cases.append(f'        {name}) opts="{" ".join(opts)}"; paths={int(paths)} ;;')
    value_cases = [f"        {opt}) {action}; return ;;" for opt, action in sorted(values.items())]
    takes_value = " ".join(sorted(values))
    return f"""# bash completion for rbd-reconciler {__version__}; generated from the CLI's
# parser by scripts/gen-manpage.py: do not edit. Install as
# /usr/share/bash-completion/completions/rbd-reconciler (or source it).
_rbd_reconciler() {{
    local cur=${{COMP_WORDS[COMP_CWORD]}} prev=${{COMP_WORDS[COMP_CWORD-1]}}
    case $prev in
{chr(10).join(value_cases)}
    esac
    # The command is the first word that is not an option or an option's value.
    local i word cmd="" skip=0
    for ((i = 1; i < COMP_CWORD; i++)); do
        word=${{COMP_WORDS[i]}}
        if ((skip)); then skip=0; continue; fi
        case " {takes_value} " in *" $word "*) skip=1; continue ;; esac
        [[ $word == -* ]] && continue
        cmd=$word; break
    done
    local opts paths
    case $cmd in
        "") COMPREPLY=($(compgen -W "{" ".join(top_opts)} {" ".join(sub.choices)}" -- "$cur"))
            return ;;
{chr(10).join(cases)}
        *) return ;;
    esac
    if [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
    elif ((paths)); then
        COMPREPLY=($(compgen -f -- "$cur"))
    fi
}}
complete -o filenames -F _rbd_reconciler rbd-reconciler
"""


def main() -> int:
    check = sys.argv[1:] == ["--check"]
    stale = []
    for path, text in ((MAN, render_man()), (COMPLETION, render_completion())):
        if check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path)
        else:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"{path.relative_to(REPO)} is stale: run scripts/gen-manpage.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
