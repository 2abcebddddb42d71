"""Markdown results files shared by the benchmarks: each owns one ``## `` section."""

from __future__ import annotations

import os


def replace_section(path: str, text: str, title: str) -> None:
    """Replace (or append) the ``title`` section of the Markdown file ``path``; keep the rest."""
    old = "# Benchmarks\n"
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
    lines = old.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip() == title), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        new = "\n".join([*lines[:start], text.rstrip("\n"), "", *lines[end:]])
    with open(path, "w") as f:
        f.write(new.rstrip("\n") + "\n")
