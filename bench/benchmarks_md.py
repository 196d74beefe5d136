"""BENCHMARKS.md is written by several scripts: each owns one `## ` section and replaces only it."""

from __future__ import annotations

import re
from pathlib import Path


def write_section(path: Path, heading: str, body: str) -> None:
    """Replace the section under `heading` (up to the next `## ` heading) or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"{heading}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)
