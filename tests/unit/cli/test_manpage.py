"""The man page and the bash completion are generated from the CLI's parser
(scripts/gen-manpage.py) and checked in: they stay in step with it, the man
page renders without a roff warning, and the completion completes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
GEN = REPO / "scripts" / "gen-manpage.py"
MAN = REPO / "man" / "rbd-reconciler.1"
COMPLETION = REPO / "completions" / "rbd-reconciler.bash"


def test_the_checked_in_files_are_what_the_parser_makes() -> None:
    proc = subprocess.run([sys.executable, GEN, "--check"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr  # stale: run scripts/gen-manpage.py


def test_every_command_and_option_is_in_the_man_page() -> None:
    from reconciler.cli.main import build_parser

    text = MAN.read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, cmd in sub.choices.items():
        assert f".SS {name.replace('-', chr(92) + '-')}\n" in text, name
        for action in cmd._actions:
            for option in action.option_strings:
                assert option.replace("-", "\\-") in text, (name, option)
    for code in ("0", "1", "2", "64", "130", "141"):
        assert f".TP\n\\fB{code}\\fR\n" in text, code


def test_the_man_page_renders_without_warnings() -> None:
    proc = subprocess.run(["groff", "-man", "-ww", "-z", "-Tutf8", MAN], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    shown = subprocess.run(["man", "-l", MAN], capture_output=True, text=True, timeout=60,
                           check=True, env={"MANWIDTH": "100", "PATH": "/usr/bin:/bin"}).stdout
    assert "EXIT STATUS" in shown and "rbd-reconciler plan" in shown


@pytest.mark.parametrize(("words", "want"), [
    (["pl"], ["plan"]),
    (["-c", "node.yaml", "st"], ["status"]),   # an option's value is not the command
    (["-c", "no"], ["node.yaml"]),             # a config is a file
    (["plan", "-o", ""], ["human", "json"]),
    (["plan", "--o"], ["--output"]),
    (["run", "--log-format", "j"], ["journal", "json"]),
    (["status", "ot"], ["other.txt"]),          # PATH arguments are files
    (["explain", ""], []),                      # a volume name is not a file
    (["release", "--step-timeout", ""], []),
    (["release", "--all", "--dead"], ["--deadline"]),
])
def test_the_completion_completes(words: list[str], want: list[str], tmp_path: Path) -> None:
    (tmp_path / "node.yaml").touch()
    (tmp_path / "other.txt").touch()
    script = (f"source {COMPLETION}\n"
              'COMP_WORDS=(rbd-reconciler "$@"); COMP_CWORD=$(($# ))\n'
              "_rbd_reconciler\n"
              'printf "%s\\n" "${COMPREPLY[@]}"\n')
    proc = subprocess.run(["bash", "-c", script, "bash", *words], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=True)
    assert sorted(proc.stdout.split()) == want, proc.stderr
