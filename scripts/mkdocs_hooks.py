"""mkdocs hooks (mkdocs.yml `hooks:`): the docs pages link into the rest of the repository with relative paths
(`../bench/results/x.md`, `../recipes/quickstart.yaml`) that work where the repository is browsed as files, while
mkdocs only knows the files under docs/. Each repository file a page links to (and, for a linked markdown file, the
files it links to in turn) is added to the site under `_repo/`, and the links are pointed there, so
`mkdocs build --strict` checks them like any other link and the built site serves the result files too.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files, InclusionLevel

PREFIX = "_repo/"
LINK = re.compile(r"(\]\()([^)\s]+)(\))")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def _paths(config: Any) -> tuple[Path, str]:
    """The repository root and the docs folder's path inside it."""
    docs = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).resolve().parent
    return root, docs.relative_to(root).as_posix()


def _repo_path(src_uri: str, docs: str) -> str:
    """The repository path of a site file."""
    return src_uri[len(PREFIX) :] if src_uri.startswith(PREFIX) else f"{docs}/{src_uri}"


def _site_uri(repo_path: str, docs: str) -> str:
    """The site path of a repository file: under docs/ as mkdocs has it, elsewhere under _repo/."""
    return repo_path[len(docs) + 1 :] if repo_path.startswith(docs + "/") else PREFIX + repo_path


def _targets(markdown: str, src_uri: str, docs: str) -> list[tuple[str, str]]:
    """(link as written, repository path it points to) of every relative link outside code fences."""
    out = []
    for m in LINK.finditer(FENCE.sub("", markdown)):
        url = m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", url) or url.startswith(("#", "/")):
            continue
        path = url.split("#", 1)[0]
        if path:
            here = posixpath.dirname(_repo_path(src_uri, docs))
            out.append((url, posixpath.normpath(posixpath.join(here, path))))
    return out


def on_files(files: Files, config: Any) -> Files:
    root, docs = _paths(config)
    queue = [f for f in files if f.src_uri.endswith(".md")]
    while queue:
        page = queue.pop()
        text = Path(page.abs_src_path or "").read_text(encoding="utf-8")
        for _, target in _targets(text, page.src_uri, docs):
            uri = _site_uri(target, docs)
            path = root / target
            if target.startswith("../") or not path.is_file() or files.get_file_from_path(uri) is not None:
                continue  # outside the repository, a folder, missing (mkdocs reports it) or already there
            added = File.generated(config, uri, abs_src_path=str(path), inclusion=InclusionLevel.NOT_IN_NAV)
            files.append(added)
            if uri.endswith(".md"):
                queue.append(added)
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    _, docs = _paths(config)
    here = posixpath.dirname(page.file.src_uri)

    def point(m: re.Match[str]) -> str:
        url = m.group(2)
        found = dict(_targets(m.group(0), page.file.src_uri, docs))
        if url not in found:
            return m.group(0)
        uri = _site_uri(found[url], docs)
        if files.get_file_from_path(uri) is None:
            return m.group(0)
        anchor = "#" + url.split("#", 1)[1] if "#" in url else ""
        return m.group(1) + posixpath.relpath(uri, here or ".") + anchor + m.group(3)

    return LINK.sub(point, markdown)
