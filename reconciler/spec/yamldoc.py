"""YAML documents that remember where every field came from.

PyYAML's composer keeps a source mark on every node; we construct plain data
from the nodes ourselves so that each JSON path maps to the line and column
it was written at. That is what lets every error name ``file:line:column``.

Imported by spec/ (8 modules).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field

import yaml

from reconciler.spec.diagnostics import FORBIDDEN_CHARS, excerpt

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up (`validate` never loads it)
if TYPE_CHECKING:
    from typing import Any

Path_ = tuple[str | int, ...]

# Deeper nesting than this is never a volume spec; refusing it keeps the
# recursive walk far from Python's recursion limit on hostile input.
MAX_DEPTH = 64
# A volume document is tens of nodes. Aliases make a node reachable many times
# (a 446-byte "billion laughs" file expands to 10^9), so the walk counts every
# visit, aliases included, and stops here.
MAX_NODES = 10_000
_MERGE_TAG = "tag:yaml.org,2002:merge"
# PyYAML's messages quote tags and anchors the user wrote; keep them short.
MAX_PROBLEM_CHARS = 160


class YamlError(Exception):
    """A document that is not valid YAML or not plain data."""

    def __init__(self, message: str, line: int, column: int, path: Path_ = ()) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.column = column
        self.path = path


@dataclass
class Document:
    """One YAML document: its data, and the source position of every path."""

    data: Any
    line: int
    column: int
    marks: dict[Path_, tuple[int, int]] = field(default_factory=dict)
    key_marks: dict[Path_, tuple[int, int]] = field(default_factory=dict)

    def where(self, path: Path_, *, key: bool = False) -> tuple[int, int]:
        """Line and column of ``path``, or of its deepest ancestor that exists.

        The key is preferred when asked for (an unknown field is the key the
        user wrote) or when the value starts on another line (a block mapping
        or list: the line that names the field is the one to show).
        """
        p = tuple(path)
        while p not in self.marks and p:
            p = p[:-1]
        value = self.marks.get(p, (self.line, self.column))
        at_key = self.key_marks.get(p)
        if at_key is not None and (key or at_key[0] != value[0]):
            return at_key
        return value


def _pos(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


def _check_chars(text: str, node: yaml.Node, path: Path_, what: str) -> None:
    if (m := FORBIDDEN_CHARS.search(text)) is not None:
        raise YamlError(f"{what} {excerpt(text)} holds U+{ord(m.group()):04X}, a control or "
                        f"bidi character (not allowed in any value or key)", *_pos(node), path)


def _too_many(node: yaml.Node) -> YamlError:
    return YamlError(f"more than {MAX_NODES} YAML nodes (alias expansion?)", *_pos(node))


class _Builder:
    def __init__(self, loader: yaml.SafeLoader, doc: Document) -> None:  # or CSafeLoader
        self.loader = loader
        self.doc = doc
        self.visited = 0
        self.merged_len: dict[int, int] = {}  # id(mapping node) -> entries after "<<"

    def count(self, node: yaml.Node, n: int = 1) -> None:
        self.visited += n
        if self.visited > MAX_NODES:
            raise _too_many(node)

    def expanded_len(self, node: yaml.MappingNode) -> int:
        """Entries ``node`` holds once its "<<" merge keys are expanded, computed
        before PyYAML builds that list (merges of merges double it per level)."""
        known = self.merged_len.get(id(node))
        if known is not None:
            if known < 0:
                raise YamlError("a merge key refers to its own mapping", *_pos(node))
            return known
        self.merged_len[id(node)] = -1  # in progress
        total = 0
        for key_node, value_node in node.value:
            if key_node.tag != _MERGE_TAG:
                total += 1
                continue
            subs = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            total += sum(self.expanded_len(s) for s in subs if isinstance(s, yaml.MappingNode))
            if total > MAX_NODES:
                raise _too_many(node)
        self.merged_len[id(node)] = total
        return total

    def construct(self, node: yaml.Node, path: Path_) -> Any:
        try:
            return self.loader.construct_object(node)
        except yaml.YAMLError:
            raise  # an unknown tag: reported with PyYAML's marks
        except Exception as exc:
            # PyYAML's scalar constructors fail in many ways on bad input
            # (``!!timestamp 2020-01-01x`` raises AttributeError).
            raise YamlError(f"invalid value {excerpt(node.value)} for tag {excerpt(node.tag)} "
                            f"({type(exc).__name__})", *_pos(node), path) from None

    def build(self, node: yaml.Node, path: Path_, depth: int = 0) -> Any:
        self.count(node)
        self.doc.marks[path] = _pos(node)
        if depth > MAX_DEPTH:
            raise YamlError(f"nesting deeper than {MAX_DEPTH} levels", *_pos(node), path)
        if isinstance(node, yaml.MappingNode):
            if self.visited + self.expanded_len(node) > MAX_NODES:
                raise _too_many(node)
            self.loader.flatten_mapping(node)  # resolves "<<" merge keys
            out: dict[str, Any] = {}
            for key_node, value_node in node.value:
                self.count(key_node)
                if not isinstance(key_node, yaml.ScalarNode):
                    raise YamlError("mapping keys must be plain strings", *_pos(key_node), path)
                key = self.construct(key_node, path)
                if not isinstance(key, str):
                    raise YamlError(
                        f"mapping key {excerpt(key)} must be a string", *_pos(key_node), path
                    )
                _check_chars(key, key_node, path, "key")
                child = (*path, key)
                if key in out:
                    line, _ = self.doc.key_marks[child]
                    raise YamlError(f"duplicate key {excerpt(key)} (first at line {line})",
                                    *_pos(key_node), child)
                self.doc.key_marks[child] = _pos(key_node)
                out[key] = self.build(value_node, child, depth + 1)
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.build(v, (*path, i), depth + 1) for i, v in enumerate(node.value)]
        value = self.construct(node, path)
        if isinstance(value, str):
            _check_chars(value, node, path, "value")
        elif isinstance(value, float) and not math.isfinite(value):
            # .nan passes every JSON Schema bound (all comparisons are false).
            raise YamlError(f"{value!r} is not a finite number", *_pos(node), path)
        if not isinstance(value, str | int | float | bool | type(None)):
            # Timestamps, binary and the like are never meaningful in a spec;
            # say so instead of letting a datetime reach the schema checker.
            raise YamlError(
                f"unsupported value of type {type(value).__name__}; quote it to make a string",
                *_pos(node),
                path,
            )
        return value


def _line_col(text: str, offset: int) -> tuple[int, int]:
    before = text[:offset]
    return before.count("\n") + 1, offset - (before.rfind("\n") + 1) + 1


def _syntax_error(exc: yaml.YAMLError, text: str, kind: str = "YAML syntax error") -> YamlError:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = "; ".join(p for p in (exc.context, exc.problem) if p) or "invalid YAML"
        problem = textwrap.shorten(problem, MAX_PROBLEM_CHARS, placeholder=" …")
        return YamlError(f"{kind}: {problem}", line, col)
    position = getattr(exc, "position", None)
    line, col = _line_col(text, position) if isinstance(position, int) else (1, 1)
    reason = getattr(exc, "reason", None) or str(exc).splitlines()[0]
    reason = textwrap.shorten(str(reason), MAX_PROBLEM_CHARS, placeholder=" …")
    return YamlError(f"unreadable YAML: {reason}", line, col)


# libyaml parses ~15x faster; its error positions differ slightly from the
# pure-Python parser's, so a file with any error is parsed again by the latter.
_FAST_LOADER = getattr(yaml, "CSafeLoader", None)


# libyaml's composer recurses in C: some 30,000 nested collections overflow
# the stack (a segfault, not an exception). Each level costs at least a byte,
# so a text this short cannot get near that; a longer one has its event
# stream (the parser is iterative) checked for depth before composing.
SHALLOW_BY_LENGTH = 4096


def _too_deep(text: str) -> YamlError | None:
    depth = 0
    try:
        for event in yaml.parse(text, Loader=_FAST_LOADER or yaml.SafeLoader):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH + 1:
                    mark = event.start_mark
                    return YamlError(f"nesting deeper than {MAX_DEPTH} levels",
                                     mark.line + 1, mark.column + 1)
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError:
        pass  # reported by the composer, which stops there too (not deeper)
    return None


def load_documents(text: str) -> list[Document | YamlError]:
    """Every document in ``text``; a YAML syntax error ends the stream.

    Empty documents (``---`` with nothing after it) are skipped, like kubectl.
    """
    if len(text) > SHALLOW_BY_LENGTH and (deep := _too_deep(text)) is not None:
        return [deep]
    if _FAST_LOADER is not None:
        docs = list(_load_documents(text, _FAST_LOADER))
        if not any(isinstance(d, YamlError) for d in docs):
            return docs
    return list(_load_documents(text, yaml.SafeLoader))


def _load_documents(text: str, loader_cls: type) -> Iterator[Document | YamlError]:
    try:
        loader = loader_cls(text)
    except yaml.YAMLError as exc:  # the reader rejects control characters up front
        yield _syntax_error(exc, text)
        return
    try:
        while True:
            try:
                if not loader.check_node():
                    return
                node = loader.get_node()
            except yaml.YAMLError as exc:
                yield _syntax_error(exc, text)
                return
            except RecursionError:  # the pure-Python composer recurses too
                yield YamlError(f"nesting deeper than {MAX_DEPTH} levels", 1, 1)
                return
            if node is None or (isinstance(node, yaml.ScalarNode)
                                and node.tag == "tag:yaml.org,2002:null" and node.value == ""):
                continue  # an empty document, e.g. a trailing "---"
            doc = Document(data=None, line=node.start_mark.line + 1,
                           column=node.start_mark.column + 1)
            try:
                doc.data = _Builder(loader, doc).build(node, ())
            except YamlError as exc:
                yield exc
                continue
            except yaml.YAMLError as exc:  # an unknown tag
                yield _syntax_error(exc, text, "invalid value")
                continue
            except RecursionError:  # a chain of merge keys thousands long
                yield YamlError("merge keys nested too deeply", doc.line, doc.column)
                continue
            yield doc
    finally:
        loader.dispose()
