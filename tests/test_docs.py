"""The manual: README.md (the front door) and the pages of docs/ (the site,
mkdocs.yml). scripts/build-docs.sh builds the site strictly in CI; these
checks need no MkDocs: the generated reference pages are what the schemas
and the parser make, nothing the README used to say was lost, the README's
safety rules are the docs' own, and every relative link, anchor and test
named resolves where the Markdown is read on a git forge too."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README = REPO / "README.md"
PAGES = sorted(DOCS.rglob("*.md"))

# Every heading of README.md before the manual moved into docs/ (issue 29):
# each must still be a heading of the README or of a page.
README_HEADINGS_BEFORE_THE_SITE = (
    "rbd-reconciler", "Set up (fresh Debian 12, as root)", "Desired-volume files",
    "Mount options", "Snapshots and clones", "Group snapshots", "QoS (I/O limits)",
    "Encryption at rest (LUKS2)", "Node config", "Command line", "The daemon",
    "Install (systemd)", "Shutdown and reboot", "Logs", "GitOps source",
    "When Ceph is unreachable", "Metrics (Prometheus)", "Troubleshooting",
    "RbdReconcilerDown", "RbdVolumeFailed", "RbdVolumeFrozen", "RbdVolumeUnknown",
    "RbdReconcilerNoSuccessfulPass", "RbdStateDirNotWritable", "RbdVolumeStalled",
    "RbdVolumeFenced", "RbdCephUnreachable", "RbdPublishShadowed", "RbdFilesystemReadOnly",
    "RbdSourceNotSynced", "RbdSourceRefused", "The CSI adapter (Kubernetes)", "How it works",
    "Threat model", "Safety rules", "Safety guarantees", "Commands and files",
    "Environment notes", "Tests and benchmarks",
)


def headings(markdown: str) -> list[str]:
    """ATX headings outside fenced code blocks."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+?)\s*#*$", line)):
            out.append(m.group(1).strip())
    return out


def forge_anchors(markdown: str) -> set[str]:
    """The anchors a git forge gives headings (GitHub's rule: lower case,
    punctuation but - and _ dropped, spaces to -, repeats numbered). MkDocs'
    toc gives the same for these headings; the strict build checks its own."""
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(markdown):
        text = re.sub(r"`|\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(markdown: str) -> list[str]:
    """Inline link targets outside fenced code blocks."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            out += re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line)
    return out


def test_the_reference_pages_are_what_the_schemas_and_the_parser_make() -> None:
    proc = subprocess.run([sys.executable, REPO / "scripts" / "gen-docs.py", "--check"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr  # stale: run scripts/gen-docs.py


def test_every_field_of_every_schema_is_in_its_reference_page() -> None:
    import json

    def fields(node: dict, defs: dict, path: str = "") -> set[str]:
        while "$ref" in node:
            node = {**defs[node["$ref"].rsplit("/", 1)[1]],
                    **{k: v for k, v in node.items() if k != "$ref"}}
        if node.get("type") == "array":
            return fields(node.get("items", {}), defs, path + "[]")
        out = set()
        for name, child in node.get("properties", {}).items():
            field = f"{path}.{name}" if path else name
            out |= {field} | fields(child, defs, field)
        return out

    for schema, page in (("volume", "volume"), ("snapshot", "snapshot"),
                         ("snapshotgroup", "snapshotgroup"), ("config", "config")):
        doc = json.loads((REPO / "schemas" / f"{schema}.schema.json").read_text())
        text = (DOCS / "reference" / f"{page}.md").read_text()
        for field in fields(doc, doc.get("$defs", {})):
            cell = "<code>" + field.replace("[", "&#91;").replace("]", "&#93;").replace(
                "_", "&#95;") + "</code>"
            assert f"| {cell}" in text, (schema, field)


def test_every_readme_heading_of_before_is_still_a_heading() -> None:
    now = set(headings(README.read_text()))
    for page in PAGES:
        now |= set(headings(page.read_text()))
    lost = [h for h in README_HEADINGS_BEFORE_THE_SITE if h not in now]
    assert not lost, f"moved nowhere: {lost}"


def _numbered(markdown: str, section: str) -> list[str]:
    """The numbered list of a section, links reduced to their text."""
    body = markdown[markdown.index(f"\n## {section}\n"):]
    items: list[str] = []
    for line in body.splitlines()[2:]:
        if re.match(r"\d+\. ", line):
            items.append(line.split(". ", 1)[1])
        elif items and line.startswith(" "):
            items[-1] += " " + line
        elif items and line.strip():
            break  # the list has ended
    return [" ".join(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", i).split()) for i in items]


def test_the_readme_cites_the_safety_rules_as_the_docs_state_them() -> None:
    readme = _numbered(README.read_text(), "Safety rules")
    docs = _numbered((DOCS / "safety.md").read_text(), "Safety rules")
    assert len(readme) == 12 and readme == docs


def test_the_nav_lists_every_page_once() -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())

    def walk(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for item in node for p in walk(item)]
        assert isinstance(node, dict)
        return [p for value in node.values() for p in walk(value)]

    nav = walk(config["nav"])
    assert sorted(nav) == sorted(str(p.relative_to(DOCS)) for p in PAGES)


@pytest.mark.parametrize("source", [README, *PAGES], ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(source: Path) -> None:
    for target in links(source.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        assert file.exists(), (target, "no such file")
        assert REPO in file.parents or file == REPO, (target, "outside the repository")
        if anchor:
            assert file.suffix == ".md", (target, "an anchor into a file that is not Markdown")
            assert anchor in forge_anchors(file.read_text()), (target, "no such heading")


def test_every_test_and_script_named_exists() -> None:
    """The threat model and the guarantees name the tests that prove them
    (`tests/...py::test_name`); a renamed test must not leave a dead name."""
    for source in [README, *PAGES]:
        text = source.read_text()
        for path, name in re.findall(r"\b((?:tests|benchmarks|scripts)/[\w/.-]+\.(?:py|sh))"
                                     r"(?:::(\w+))?", text):
            file = REPO / path
            assert file.is_file(), (source.name, path)
            if name:
                assert re.search(rf"^\s*(?:async )?def {name}\b", file.read_text(), re.M), \
                    (source.name, f"{path}::{name}")


def test_the_readme_stays_a_front_door() -> None:
    """What it is, the two commands, a tour, the safety rules, links: not the
    manual again (issue 29: about 200 lines)."""
    text = README.read_text()
    assert len(text.splitlines()) <= 220
    for command in ("./scripts/demo.sh", "./scripts/test.sh"):
        assert f"\n    {command}\n" in text, command
    for page in PAGES:
        if page.parent == DOCS and page.name != "index.md":
            assert f"(docs/{page.name})" in text, f"the README does not link {page.name}"
