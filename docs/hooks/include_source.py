"""mkdocs hook: ``<!-- include PATH -->`` on a line of its own becomes PATH's text in a code block.

PATH is relative to the repository root, so a page shows a tested script as it is, never a copy
that drifts from it. A missing file fails the build.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
_INCLUDE = re.compile(r"^<!-- include (\S+) -->$", re.MULTILINE)
_LANGUAGES = {".py": "python", ".sh": "bash", ".yaml": "yaml", ".yml": "yaml"}


def on_page_markdown(markdown: str, page, config, files) -> str:
    def block(match: re.Match) -> str:
        path = REPO_ROOT / match[1]
        if not path.is_file():
            raise FileNotFoundError(f"docs/{page.file.src_uri} includes {match[1]}, which does not exist")
        return f"```{_LANGUAGES.get(path.suffix, '')}\n{path.read_text().rstrip()}\n```"

    return _INCLUDE.sub(block, markdown)
