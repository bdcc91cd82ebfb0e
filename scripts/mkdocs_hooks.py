"""MkDocs hooks of the documentation site (mkdocs.yml: hooks).

A page links a file of the repository outside docs/ relatively
(``[volume.schema.json](../schemas/volume.schema.json)``), so the link works
where the Markdown is read on a git forge. The site has no such file: the
link is rewritten to the file on the forge (``repo_url``/blob/main/...), and a
link to a file that does not exist is a warning, which fails the strict build
like any other broken link.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.plugins.rbd_reconciler")

# An inline link or image target: ](target) or ](target "title").
_LINK = re.compile(r"(\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
_FENCE = re.compile(r"^(```|~~~)")


def _rewrite(target: str, page_dir: str, repo: Path, base: str, where: str) -> str:
    if "://" in target or target.startswith(("#", "mailto:")):
        return target
    path, _, anchor = target.partition("#")
    resolved = posixpath.normpath(posixpath.join("docs", page_dir, path))
    if resolved == "docs" or resolved.startswith("docs/"):
        return target  # a page of the site: MkDocs checks it
    if resolved.startswith("../"):
        log.warning("%s: link %r leaves the repository", where, target)
        return target
    file = repo / resolved
    if not file.exists():
        log.warning("%s: link %r names %s, which is not in the repository", where,
                    target, resolved)
        return target
    kind = "tree" if file.is_dir() else "blob"
    return f"{base}/{kind}/main/{resolved}" + (f"#{anchor}" if anchor else "")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    repo = Path(config["config_file_path"]).resolve().parent
    base = str(config["repo_url"]).rstrip("/")
    page_dir = posixpath.dirname(page.file.src_uri)
    out = []
    fenced = False
    for line in markdown.split("\n"):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced:
            line = _LINK.sub(lambda m: m.group(1) + _rewrite(
                m.group(2), page_dir, repo, base, page.file.src_uri) + m.group(3), line)
        out.append(line)
    return "\n".join(out)
