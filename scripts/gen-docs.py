#!/usr/bin/env python3
"""Write the documentation site's reference pages from the sources of truth.

    .venv/bin/python scripts/gen-docs.py          # rewrites docs/reference/*.md
    .venv/bin/python scripts/gen-docs.py --check  # exit 1 if any is stale

Every field of a desired file and of the node config comes from
``schemas/*.schema.json`` (its type, allowed values, bounds, pattern, default
and description); every command and option from
``reconciler.cli.main.build_parser()``, as the man page (scripts/gen-manpage.py).
The pages are checked in, so they read on a git forge too;
tests/test_docs.py fails while they differ from what this writes, and
scripts/build-docs.sh runs it before building the site.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from reconciler.cli.main import build_parser  # noqa: E402

OUT = REPO / "docs" / "reference"
SCHEMAS = REPO / "schemas"

# (page, schema, title, what it is, the prose page that explains it)
SCHEMA_PAGES = [
    ("volume.md", "volume.schema.json", "Volume fields",
     "A desired-volume document, `kind: Volume`.",
     "[Desired-volume files](../desired-files.md), [QoS](../qos.md), "
     "[Encryption at rest](../encryption.md), [Snapshots and groups](../snapshots.md)"),
    ("snapshot.md", "snapshot.schema.json", "Snapshot fields",
     "A desired snapshot document, `kind: Snapshot`.",
     "[Snapshots and clones](../snapshots.md#snapshots-and-clones)"),
    ("snapshotgroup.md", "snapshotgroup.schema.json", "SnapshotGroup fields",
     "A desired group snapshot document, `kind: SnapshotGroup`.",
     "[Group snapshots](../snapshots.md#group-snapshots)"),
    ("config.md", "config.schema.json", "Node config fields",
     "The node config, `/etc/rbd-reconciler/config.yaml` (or `--config FILE`).",
     "[Node config](../node-config.md)"),
]


def _load_gen_manpage() -> Any:
    """scripts/gen-manpage.py (not importable by name): its exit statuses and usage."""
    spec = importlib.util.spec_from_file_location("gen_manpage", REPO / "scripts" /
                                                  "gen-manpage.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def code(value: object) -> str:
    """Inline code that survives a table cell on MkDocs and on a git forge
    (a '|' inside backticks splits a forge's cell)."""
    text = html.escape(value if isinstance(value, str) else json.dumps(value), quote=False)
    # Markdown reads on inside inline HTML: what it would take as a link,
    # emphasis, an escape or a cell's end is written as an entity.
    for ch in "|[]()*_\\`":
        text = text.replace(ch, f"&#{ord(ch)};")
    return "<code>" + text + "</code>"


def prose(text: str) -> str:
    """Schema or help text as Markdown in a table cell: shown as written."""
    for ch in "\\`*[]|":
        text = text.replace(ch, "\\" + ch)
    return html.escape(text, quote=False).replace("\n", " ")


# ---------------------------------------------------------------- schemas


@dataclass
class Row:
    field: str
    required: bool
    type: str
    default: str
    description: str


class SchemaDoc:
    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        self.defs: dict[str, Any] = schema.get("$defs", {})

    def resolve(self, node: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """The node with its $ref followed (its own keys win), and the
        description of what it refers to, when it has its own as well."""
        ref_desc = ""
        while "$ref" in node:
            target = self.defs[node["$ref"].rsplit("/", 1)[1]]
            own = {k: v for k, v in node.items() if k != "$ref"}
            if "description" in own and "description" in target:
                ref_desc = target["description"]
            node = {**target, **own}
        return node, ref_desc

    def type_text(self, node: dict[str, Any]) -> str:
        node, _ = self.resolve(node)
        if "const" in node:
            return "exactly " + code(node["const"])
        if "enum" in node:
            return "one of " + ", ".join(code(v) for v in node["enum"])
        if "oneOf" in node:
            return " or ".join(self.type_text(alt) for alt in node["oneOf"])
        if "allOf" in node:
            merged: dict[str, Any] = {}
            patterns = []
            for part in node["allOf"]:
                part, _ = self.resolve(part)
                if "pattern" in part:
                    patterns.append(part["pattern"])
                merged.update({k: v for k, v in part.items() if k not in ("pattern",
                                                                          "description")})
            text = self.type_text(merged)
            return text + "; matching " + " and ".join(code(p) for p in patterns)
        kind = node.get("type")
        bits: list[str] = []
        if kind == "string":
            text = "string"
            if "minLength" in node:
                bits.append(f"at least {node['minLength']} characters")
            if "maxLength" in node:
                bits.append(f"at most {node['maxLength']} characters")
            if "pattern" in node:
                bits.append("matching " + code(node["pattern"]))
        elif kind in ("integer", "number"):
            text = kind
            if "minimum" in node:
                bits.append(f"≥ {node['minimum']}")
            if "exclusiveMinimum" in node:
                bits.append(f"> {node['exclusiveMinimum']}")
            if "maximum" in node:
                bits.append(f"≤ {node['maximum']}")
        elif kind == "boolean":
            text = "boolean"
        elif kind == "null":
            text = "null"
        elif kind == "array":
            text = "list of " + self.type_text(node.get("items", {}))
            if node.get("minItems"):
                bits.append(f"at least {node['minItems']} item(s)")
            if "maxItems" in node:
                bits.append(f"at most {node['maxItems']} items")
            if node.get("uniqueItems"):
                bits.append("no item twice")
        elif kind == "object":
            extra = node.get("additionalProperties")
            if isinstance(extra, dict):
                text = "mapping of string to " + self.type_text(extra)
            else:
                text = "mapping"
                if node.get("minProperties") == node.get("maxProperties") == 1:
                    text += ": exactly one of " + ", ".join(
                        code(k) for k in node.get("properties", {}))
        else:
            text = "any"
        return text + (" (" + ", ".join(bits) + ")" if bits else "")

    def rows(self, node: dict[str, Any], path: str = "") -> list[Row]:
        node, _ = self.resolve(node)
        required = set(node.get("required", []))
        out: list[Row] = []
        for name, child in node.get("properties", {}).items():
            field = f"{path}.{name}" if path else name
            resolved, ref_desc = self.resolve(child)
            description = resolved.get("description", "")
            if ref_desc:
                description = description.rstrip(".") + f". Value: {ref_desc}"
            out.append(Row(field, name in required, self.type_text(child),
                           code(resolved["default"]) if "default" in resolved else "",
                           description))
            out += self.children(resolved, field)
        return out

    def children(self, node: dict[str, Any], field: str) -> list[Row]:
        if node.get("type") == "object" and "properties" in node:
            return self.rows(node, field)
        if node.get("type") == "array":
            items, _ = self.resolve(node.get("items", {}))
            if items.get("type") == "object" and "properties" in items:
                return self.rows(items, field + "[]")
        return []


def render_schema_page(schema_file: str, title: str, what: str, prose_pages: str) -> str:
    schema = json.loads((SCHEMAS / schema_file).read_text())
    doc = SchemaDoc(schema)
    lines = [
        f"# {title}",
        "",
        f"<!-- Generated by scripts/gen-docs.py from schemas/{schema_file}: do not edit. -->",
        "",
        f"{what} Generated from [`schemas/{schema_file}`](../../schemas/{schema_file}) "
        "(JSON Schema 2020-12), the schema the loader validates against: every field, "
        "its type and bounds, its default and its description. What the loader checks "
        f"beyond the schema, and what each part does: {prose_pages}.",
        "",
    ]
    if schema.get("description"):
        lines += [prose(schema["description"]), ""]
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for row in doc.rows(schema):
        field = code(row.field) + (" **(required)**" if row.required else "")
        lines.append(f"| {field} | {row.type} | {row.default} | {prose(row.description)} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the CLI


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            name = ", ".join(code(o) for o in action.option_strings)
            if action.nargs == 0:
                value = ""
            elif action.choices:
                value = " \\| ".join(code(str(c)) for c in action.choices)
            else:
                value = code(str(action.metavar or action.dest.upper()))
        else:
            name = code(str(action.metavar or action.dest))
            value = " \\| ".join(code(str(c)) for c in action.choices) if action.choices else ""
            if action.nargs in ("*", "?"):
                name += " (optional" + (", repeatable)" if action.nargs == "*" else ")")
        rows.append(f"| {name} | {value} | {prose(action.help or '')} |")
    return rows


def render_commands_page() -> str:
    man = _load_gen_manpage()
    parser = build_parser()
    sub = _subparsers(parser)
    helps = {a.dest: a.help for a in sub._choices_actions}
    lines = [
        "# Commands and options",
        "",
        "<!-- Generated by scripts/gen-docs.py from the command-line parser: do not edit. -->",
        "",
        "Every command, option and help text as `reconciler.cli.main.build_parser()` "
        "defines them (the man page `rbd-reconciler(1)` is made from the same parser by "
        "`scripts/gen-manpage.py`). What each command does, its output and its exit "
        "codes in full: [Command line](../cli.md).",
        "",
        "    rbd-reconciler [OPTIONS] COMMAND [ARGS]",
        "",
        "## Options",
        "",
        "Before or after `COMMAND`.",
        "",
        "| option | value | description |",
        "|---|---|---|",
        *_option_rows(parser),
        "",
        "## Commands",
        "",
        "| command | summary |",
        "|---|---|",
        *(f"| [`{name}`](#{name}) | {prose(helps.get(name) or '')} |" for name in sub.choices),
    ]
    for name, cmd in sub.choices.items():
        lines += [
            "",
            f"### {name}",
            "",
            "    " + man._usage(cmd),
            "",
            prose(cmd.description or helps.get(name) or ""),
            "",
            "| option | value | description |",
            "|---|---|---|",
            *_option_rows(cmd),
        ]
    lines += ["", "## Exit status", "", "| code | meaning |", "|---|---|",
              *(f"| {status} | {prose(meaning)} |" for status, meaning in man.EXIT_STATUS)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def pages() -> dict[Path, str]:
    out = {OUT / page: render_schema_page(schema, title, what, prose_pages)
           for page, schema, title, what, prose_pages in SCHEMA_PAGES}
    out[OUT / "commands.md"] = render_commands_page()
    return out


def main() -> int:
    check = sys.argv[1:] == ["--check"]
    if sys.argv[1:] not in ([], ["--check"]):
        print("usage: gen-docs.py [--check]", file=sys.stderr)
        return 64
    stale = []
    for path, text in pages().items():
        if check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path)
        elif not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"{path.relative_to(REPO)} is stale: run scripts/gen-docs.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
