"""The benchmarks' JSON results (``--json docs/benchmarks.json``): one entry per benchmark
(``engine``, ``checkpoint``, ``checksum``), each replaced whole by its benchmark's next run and
read by ``ftsdp-report --bench`` for the charts in docs/benchmarks.md.

Every entry holds ``command`` (the command line that measured it), ``date`` and
``environment`` (torch, CPUs, load), and its benchmark's numbers (see each benchmark's
``json_entry``)."""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from typing import Any


def read(path: str) -> dict[str, Any]:
    """The results file as a dict (empty when it does not exist); ValueError naming the file
    when it is not a JSON object."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); fix or remove it") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object of benchmark entries")
    return data


def write_entry(
    path: str, name: str, entry: dict[str, Any], command: str, environment: str
) -> None:
    """Replace the entry ``name`` of the results file ``path`` (the others are kept), stamped
    with ``command``, today's date and ``environment``; written atomically."""
    data = read(path)
    data[name] = {
        "command": command,
        "date": datetime.date.today().isoformat(),
        "environment": environment,
        **entry,
    }
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".benchmarks-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)  # in the benchmark's order (engines as in its table)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
