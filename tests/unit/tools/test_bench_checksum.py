"""Smoke test of the checksum benchmark (``python -m ftsdp.tools.bench_checksum``) at a tiny
size: every row measured, the verdict line, and only its own section of the results file."""

from __future__ import annotations

import json
import re

from ftsdp.tools.bench_checksum import main

OTHERS = "# Benchmarks\n\n## Checkpoint\n\ntheir table\n"


def test_tiny_run_writes_its_rows_and_verdict_only_in_its_section(tmp_path, capsys) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text(OTHERS)
    results = tmp_path / "benchmarks.json"
    argv = ["--size-mb", "4", "--repeat", "1", "--dir", str(tmp_path), "--out", str(out)]
    main([*argv, "--json", str(results)])
    printed = capsys.readouterr().out
    text = out.read_text()
    assert text.startswith(OTHERS) and printed.strip() in text
    for row in ("memory copy", "CRC-32C", "CRC-32 (zlib", "`storage.catalog.verify`, warm"):
        assert re.search(rf"\| {re.escape(row)}[^|]*\| \d+\.\d\d \| \d+\.\d\d \|", text), row
    assert re.search(r"^(MET|MISSED): verify \(warm\) at \d+\.\d\dx", text, re.M)
    # its checkpoint is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["benchmarks.json", "benchmarks.md"]
    # the JSON entry holds the table's numbers (ftsdp-report --bench charts them)
    entry = json.loads(results.read_text())["checksum"]
    assert entry["command"] == "python -m ftsdp.tools.bench_checksum " + " ".join(
        [*argv, "--json", str(results)]
    )
    for name, rate in entry["rates_gbps"].items():
        assert f"| {name} | {rate:.2f} |" in text, name
    assert f"| {entry['verify_warm_gbps']:.2f} |" in text
