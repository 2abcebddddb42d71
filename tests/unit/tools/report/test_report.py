"""``ftsdp-report`` on metrics files written here, record by record: every panel holds the
records' numbers (read from the figure's artists, not its pixels), the fault table is measured
from the records, truncated and unknown lines are skipped and named, the HTML page is one
self-contained file, a missing matplotlib is one line and exit code 2; the benchmarks' JSON
results become bar charts of their numbers. The real run (torchrun, kill -9) is in
tests/e2e/test_faults.py."""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import pathlib
import re
import struct
import sys
import tracemalloc

import pytest

from ftsdp.tools import _bench_json
from ftsdp.tools.report import build_bench, build_report, main

T0 = 1_700_000_000.0


def _write(path, records, tail: str = "") -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return str(path)


def _incarnation(t, world, steps, *, restarts=0, url="/ck/run", resumed=None, saves=(), end=None):
    """The records ftsdp.train writes for one incarnation (start, resume, steps, saves, end)."""
    out = [{"event": "start", "time": t, "world_size": world, "config": {"checkpoint_url": url}}]
    t += 1.0
    if resumed is not None:
        out.append(
            {
                "event": "resume",
                "time": t,
                "step": resumed[0],
                "saved_world_size": resumed[1],
                "world_size": world,
                "restarts": restarts,
                "seconds": 0.2,
            }
        )
    for step in steps:
        t += 0.5
        out.append(
            {
                "event": "step",
                "time": t,
                "step": step,
                "loss": 5.0 - 0.1 * step,
                "tokens_per_s": 1000.0 + step,
                "s_per_step": 0.5 - 0.01 * step,
                "world_size": world,
                "restarts": restarts,
            }
        )
        if step in saves:
            out.append(
                {"event": "checkpoint", "time": t + 0.01, "step": step, "blocking_s": step / 100}
            )
    if end is not None:
        out.append(
            {"event": end, "time": t + 0.3, **({"step": steps[-1]} if end == "preempted" else {})}
        )
    return out


@pytest.fixture
def killed_run(tmp_path):
    """A run killed after step 5 (fault log: kill at step 5), resumed from step 4."""
    first = _incarnation(T0, 2, [1, 2, 3, 4], saves=(2, 4), end="error")
    fault = {
        "event": "fault",
        "kind": "kill",
        "point": None,
        "rank": 1,
        "step": 5,
        "time": T0 + 3.2,
    }
    second = _incarnation(
        T0 + 8, 2, [5, 6, 7, 8], restarts=1, resumed=(4, 2), saves=(6, 8), end="done"
    )
    metrics = _write(tmp_path / "metrics.jsonl", first + second)
    faults = _write(tmp_path / "faults.jsonl", [fault])
    return metrics, faults, first, second, fault


def _real(xs) -> list[float]:
    return [x for x in xs if not math.isnan(x)]


def test_every_panel_holds_the_records_numbers(killed_run) -> None:
    metrics, faults, first, second, fault = killed_run
    report = build_report([metrics, faults])
    steps = [r for r in first + second if r["event"] == "step"]
    assert set(report.axes) == {
        "loss", "tokens_per_s", "s_per_step", "world_size", "checkpoint", "faults"
    }  # fmt: skip
    assert report.axes["loss"].get_title() == "loss"

    loss = report.axes["loss"]
    (line,) = [ln for ln in loss.lines if ln.get_gid() is None]
    assert line.get_label() == "metrics.jsonl"
    assert _real(line.get_xdata()) == [r["step"] for r in steps]
    assert _real(line.get_ydata()) == [r["loss"] for r in steps]
    assert sum(math.isnan(x) for x in line.get_xdata()) == 1  # a gap between incarnations

    (tps,) = report.axes["tokens_per_s"].lines
    assert _real(tps.get_xdata()) == pytest.approx([r["time"] - T0 for r in steps])
    assert _real(tps.get_ydata()) == [r["tokens_per_s"] for r in steps]
    (sps,) = report.axes["s_per_step"].lines
    assert _real(sps.get_ydata()) == [r["s_per_step"] for r in steps]
    (world,) = report.axes["world_size"].lines
    assert set(_real(world.get_ydata())) == {2.0}

    saves = [r for r in first + second if r["event"] == "checkpoint"]
    bars = report.axes["checkpoint"].patches
    assert [b.get_height() for b in bars] == [r["blocking_s"] for r in saves]
    assert [b.get_x() + b.get_width() / 2 for b in bars] == [r["step"] for r in saves]

    # One restart marker, at the step the resume loaded, labelled.
    (marker,) = [ln for ln in loss.lines if ln.get_gid()]
    assert marker.get_gid() == "marker:restart"
    assert list(marker.get_xdata()) == [4, 4]
    assert marker.get_label() == "restart 1: from step 4 (world 2)"

    # The fault table, measured from the records as the fault suite measures.
    error = next(r for r in first if r["event"] == "error")
    (row,) = report.faults
    assert (row.kind, row.step, row.detected_by, row.origin) == ("kill", 5, "error", "fault log")
    assert row.detection_s == pytest.approx(error["time"] - fault["time"])
    assert row.first_new_step_s == pytest.approx(second[2]["time"] - fault["time"])
    assert (row.steps_lost, row.resumed_from, row.world) == (1, 4, "2 → 2")
    (table,) = report.axes["faults"].tables
    cells = {(r, c): cell.get_text().get_text() for (r, c), cell in table.get_celld().items()}
    columns = range(1 + max(c for _, c in cells))
    header = [cells[(0, c)] for c in columns]
    values = dict(zip(header, [cells[(1, c)] for c in columns], strict=True))
    assert values["kind"] == "kill" and values["step"] == "5" and values["steps lost"] == "1"
    assert values["detection s"] == f"{error['time'] - fault['time']:.2f}"
    # downtime shading in the time panels: fault to first new step
    (span,) = report.axes["tokens_per_s"].patches
    x0, x1 = span.get_x(), span.get_x() + span.get_width()
    assert (x0, x1) == pytest.approx((fault["time"] - T0, second[2]["time"] - T0))


def test_without_a_fault_log_times_count_from_the_last_record(killed_run) -> None:
    metrics, _, first, _, _ = killed_run
    (row,) = build_report([metrics]).faults
    last = [r for r in first if r["event"] in ("step", "checkpoint")][-1]
    error = next(r for r in first if r["event"] == "error")
    assert (row.kind, row.step, row.origin) == ("error", 4, "last record")
    assert row.detection_s == pytest.approx(error["time"] - last["time"])
    assert (row.steps_lost, row.resumed_from) == (0, 4)  # step 5 was never recorded


def test_preemption_and_a_resize_are_marked_at_their_steps(tmp_path) -> None:
    first = _incarnation(T0, 4, [1, 2, 3, 4], saves=(2, 4), end="preempted")
    second = _incarnation(T0 + 20, 2, [5, 6], restarts=1, resumed=(4, 4), end="done")
    report = build_report([_write(tmp_path / "m.jsonl", first + second)])
    assert [(m.kind, m.step) for m in report.markers] == [("preempted", 4), ("resize", 4)]
    lines = [ln for ln in report.axes["loss"].lines if ln.get_gid()]
    assert [(ln.get_gid(), ln.get_xdata()[0]) for ln in lines] == [
        ("marker:preempted", 4),
        ("marker:resize", 4),
    ]
    assert lines[1].get_label() == "resize: from step 4 (world 4→2)"
    (row,) = report.faults
    assert (row.kind, row.detected_by, row.steps_lost, row.world) == (
        "preempted", "preempted", 0, "4 → 2"
    )  # fmt: skip
    world = report.axes["world_size"].lines[0]
    assert _real(world.get_ydata()) == [4.0] * 6 + [2.0] * 5  # start, (resume), steps, last record


def test_several_files_overlay_with_a_legend(tmp_path) -> None:
    a = _write(tmp_path / "a.jsonl", _incarnation(T0, 2, [1, 2, 3], url=None, end="done"))
    b = _write(tmp_path / "b.jsonl", _incarnation(T0 + 99, 1, [1, 2, 3, 4], url=None, end="done"))
    report = build_report([a, b])
    assert [r.label for r in report.runs] == ["a.jsonl", "b.jsonl"]
    lines = report.axes["loss"].lines
    assert [ln.get_label() for ln in lines] == ["a.jsonl", "b.jsonl"]
    assert [len(ln.get_xdata()) for ln in lines] == [3, 4]
    legend = [t.get_text() for t in report.axes["loss"].get_legend().get_texts()]
    assert legend == ["a.jsonl", "b.jsonl"]
    # each run's wall time counts from its own first record
    assert [ln.get_xdata()[0] for ln in report.axes["tokens_per_s"].lines] == [1.5, 1.5]
    assert report.faults == []


def test_attempts_in_several_files_are_one_run(tmp_path, killed_run) -> None:
    _, faults, first, second, _ = killed_run
    a = _write(tmp_path / "attempt1.jsonl", first)
    b = _write(tmp_path / "attempt2.jsonl", second)
    report = build_report([a, b, faults])
    assert [r.label for r in report.runs] == ["attempt1.jsonl + attempt2.jsonl"]
    assert [m.step for m in report.markers] == [4] and len(report.faults) == 1
    assert [ln.get_label() for ln in report.axes["loss"].lines if not ln.get_gid()] == [
        "attempt1.jsonl",
        "attempt2.jsonl",
    ]


BAD_LINES = [
    '{"event": "mystery", "time": 1.0}',  # unknown record
    '{"event": "step", "step": 9, "time": 2.0}',  # no loss
    "[1, 2, 3]",  # not an object
    '{"step": 3}',  # neither a record nor a fault-suite row
    '{"event": "checkpoint", "step": 2, "blocking_s": "slow", "time": 3.0}',
]


def test_truncated_and_unknown_lines_are_skipped_counted_and_named(
    tmp_path, killed_run, caplog, capsys
) -> None:
    _, _, first, second, _ = killed_run
    records = first + second
    text = "".join(json.dumps(r) + "\n" for r in records) + "\n".join(BAD_LINES) + "\n"
    path = tmp_path / "metrics.jsonl"
    path.write_text(text + json.dumps(records[-1])[:17])  # the writer died mid-line
    n = len(records)
    with caplog.at_level(logging.WARNING, logger="ftsdp.tools.report"):
        report = build_report([path])
    assert [(s.line, s.reason) for s in report.skipped] == [
        (n + 1, "unknown event 'mystery'"),
        (n + 2, "step record without 'loss'"),
        (n + 3, "a JSON list, not an object"),
        (n + 4, "no 'event' field, and not a fault-suite report row"),
        (n + 5, "checkpoint record blocking_s='slow' is not a finite number"),
        (n + 6, "not JSON (truncated: the writer stopped mid-line)"),
    ]
    assert f"skipped 6 lines of {path}" in caplog.text and f"line {n + 6})" in caplog.text
    steps = [r for r in records if r["event"] == "step"]
    assert len(_real(report.axes["loss"].lines[0].get_xdata())) == len(steps)  # the rest renders

    out = tmp_path / "report.png"
    assert main([str(path), "-o", str(out)]) == 0
    stdout, stderr = capsys.readouterr()
    assert stderr.count("\n") == 1 and f"skipped 6 lines of {path}: " in stderr
    assert "1 unknown event 'mystery' (line " in stderr and stdout.startswith(f"wrote {out}")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _losses(report) -> list[float]:
    (line,) = [ln for ln in report.axes["loss"].lines if not ln.get_gid()]
    return _real(line.get_ydata())


def test_a_line_nested_too_deeply_is_skipped(tmp_path, killed_run, capsys) -> None:
    """json raises RecursionError, not JSONDecodeError, on 5,000 nested lists: a bad line."""
    _, _, first, second, _ = killed_run
    path = _write(tmp_path / "m.jsonl", first)
    with open(path, "a") as f:
        f.write("[" * 5000 + "]" * 5000 + "\n" + "".join(json.dumps(r) + "\n" for r in second))
    report = build_report([path])
    assert [(s.line, s.reason) for s in report.skipped] == [
        (len(first) + 1, "not JSON (nested too deeply)")
    ]
    assert _losses(report) == [r["loss"] for r in first + second if r["event"] == "step"]
    assert main([path, "-o", str(tmp_path / "r.png")]) == 0
    assert f"(line {len(first) + 1})" in capsys.readouterr().err


@pytest.mark.parametrize(
    "bad",
    [
        {"step": 1e308},  # the review's record: "arange: cannot compute length"
        {"step": 2.5},
        {"step": -1},
        {"step": 2.0**60},
        {"world_size": 1e300},
        {"loss": 1e308},
        {"tokens_per_s": -1e308},
        {"time": 1e308},
        {"grad_norm": 10**400},  # an int no float holds: math.isfinite raised OverflowError
        {"step": 10**400},
        {"loss": 10**400},
    ],
)
def test_a_number_no_run_writes_is_skipped_and_named(tmp_path, killed_run, bad) -> None:
    """Counts (step, world sizes) are whole numbers from 0 to 2**53 and no value is beyond
    1e100; a record that breaks either is skipped, the rest renders."""
    _, _, first, second, _ = killed_run
    records = first + second
    at = next(i for i, r in enumerate(records) if r["event"] == "step")
    records.insert(at + 1, {**records[at], **bad})
    path = _write(tmp_path / "m.jsonl", records)
    report = build_report([path])
    ((name, value),) = bad.items()
    (skipped,) = report.skipped
    assert skipped.line == at + 2 and skipped.reason.startswith(f"step record {name}={value!r} ")
    assert _losses(report) == [r["loss"] for r in first + second if r["event"] == "step"]
    assert main([path, "-o", str(tmp_path / "r.png")]) == 0


def test_an_overlong_line_is_skipped_unread(tmp_path, killed_run, monkeypatch) -> None:
    """A line longer than 1 MiB is skipped without holding it (memory stays bounded); an
    endless one (/dev/zero) ends the file's reading."""
    from ftsdp.tools.report import _records

    _, _, first, second, _ = killed_run
    path = _write(tmp_path / "m.jsonl", first)
    with open(path, "a") as f:
        f.write(json.dumps({"event": "step", "pad": "x" * (12 << 20)}) + "\n")
        f.write("".join(json.dumps(r) + "\n" for r in second))
    tracemalloc.start()
    try:
        source, skipped = _records.read_source(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # the whole file is 12 MiB
    assert [(s.line, s.reason) for s in skipped] == [(len(first) + 1, "longer than 1 MiB")]
    assert [r["_line"] for r in source.events] == [
        *range(1, len(first) + 1),
        *range(len(first) + 2, len(first) + len(second) + 2),
    ]
    if pathlib.Path("/dev/zero").exists():
        monkeypatch.setattr(_records, "MAX_SKIP", 16 << 20)  # 16 MiB of it read, not 256
        source, skipped = _records.read_source("/dev/zero")
        assert skipped == [
            _records.Skipped("/dev/zero", 1, "longer than 16 MiB: the rest of the file is not read")
        ]


def test_a_write_cut_by_a_kill_then_appended_to_is_truncated(tmp_path) -> None:
    """kill -9 mid-line, then the restarted job appends its start record to that line: the cut
    record is a truncated write, the start record is read, and the kill stays in the fault
    table, as when the kill fell between two lines."""
    first = _incarnation(T0, 2, [1, 2, 3, 4], saves=(2, 4))  # killed: no end record
    second = _incarnation(T0 + 8, 2, [5, 6], restarts=1, resumed=(4, 2), end="done")
    cut = json.dumps(_incarnation(T0 + 3, 2, [5])[1])[:40]
    (tmp_path / "cut").mkdir()
    (tmp_path / "clean").mkdir()
    path = _write(tmp_path / "cut" / "m.jsonl", first, tail=cut)
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in second))
    clean = build_report([_write(tmp_path / "clean" / "m.jsonl", first + second)])
    report = build_report([path])
    assert [(s.line, s.reason) for s in report.skipped] == [
        (len(first) + 1, "not JSON (truncated: the writer stopped mid-line)")
    ]
    assert len(clean.faults) == 1 and report.faults == clean.faults
    assert report.markers == clean.markers and _losses(report) == _losses(clean)
    (row,) = report.faults
    assert (row.step, row.resumed_from) == (4, second[1]["step"])


def test_a_resume_past_the_last_record_loses_no_steps(tmp_path) -> None:
    """The records of steps 5 and 6 (and step 6's save) were lost with the kill, but the restart
    resumed from step 6: it was completed, so no step was lost (not -2)."""
    first = _incarnation(T0, 2, [1, 2, 3, 4], saves=(2, 4))  # killed: no end record
    second = _incarnation(T0 + 8, 2, [7, 8], restarts=1, resumed=(6, 2), end="done")
    (row,) = build_report([_write(tmp_path / "m.jsonl", first + second)]).faults
    assert (row.steps_lost, row.resumed_from) == (0, 6)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_the_html_page_is_one_self_contained_file(tmp_path, killed_run) -> None:
    metrics, faults, *_ = killed_run
    out = tmp_path / "report.html"
    assert main([metrics, faults, "-o", str(out), "--title", "run <1>"]) == 0
    page = out.read_text()
    (data,) = re.findall(r'<img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    report = build_report([metrics, faults])
    width, height = (round(v * 80) for v in report.figure.get_size_inches())
    assert _png_size(base64.b64decode(data)) == (width, height)
    assert not re.search(r"""(src|href)=["'](?!data:)""", page)  # nothing fetched from elsewhere
    assert "<title>run &lt;1&gt;</title>" in page
    row = re.search(r"<tbody><tr>(.*?)</tr>", page).group(1)
    assert re.findall(r"<td>(.*?)</td>", row)[:3] == ["kill", "5", "error"]


def test_a_missing_matplotlib_is_one_line_and_exit_2(tmp_path, killed_run, monkeypatch) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    out, err = io.StringIO(), io.StringIO()
    assert main([killed_run[0], "-o", str(tmp_path / "r.png")], out=out, err=err) == 2
    assert err.getvalue() == (
        "ftsdp-report: error: the report needs matplotlib, which is not installed: "
        "pip install 'ftsdp[report]'\n"
    )
    assert not (tmp_path / "r.png").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{m}", "-o", "{d}/r.pdf"], "ftsdp-report: error: -o {d}/r.pdf: the output must end in .html or .png\n"),
        (["{d}/none.jsonl", "-o", "{d}/r.png"], "ftsdp-report: error: {d}/none.jsonl: No such file or directory\n"),
        (["{d}/empty.jsonl", "-o", "{d}/r.png"], "ftsdp-report: error: nothing to plot in {d}/empty.jsonl: no ftsdp.train --metrics record and no fault-suite report row (skipped 1 line of {d}/empty.jsonl: 1 unknown event 'x' (line 1))\n"),
        (["--bench", "{m}", "-o", "{d}/r.png"], "ftsdp-report: error: {m} is not valid JSON: Extra data: line 2 column 1 (char {c})\n"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(tmp_path, killed_run, argv, message) -> None:
    (tmp_path / "empty.jsonl").write_text('{"event": "x"}\n')
    metrics = killed_run[0]
    first_line = len(pathlib.Path(metrics).read_text().splitlines()[0]) + 1
    fill = {"m": metrics, "d": str(tmp_path), "c": str(first_line)}
    err = io.StringIO()
    assert main([a.format(**fill) for a in argv], out=io.StringIO(), err=err) == 2
    assert err.getvalue() == message.format(**fill)


SUITE = [
    {"scenario": "kill -9 one worker", "fault": "kill rank 1 step 3", "detection_s": 0.02,
     "detected_by": "error", "fault_to_first_new_step_s": 4.9, "steps_lost": 1,
     "resumed_step": 2, "world_sizes": "2 -> 2", "command": "torchrun ..."},
    {"scenario": "hung rank (SIGSTOP)", "fault": "stop rank 1 step 9", "detection_s": 3.93,
     "detected_by": "stall", "fault_to_first_new_step_s": 8.56, "steps_lost": 1,
     "resumed_step": 8, "world_sizes": "2 -> 2", "command": "torchrun ..."},
]  # fmt: skip


def test_the_fault_suite_report_becomes_the_recovery_panel(tmp_path) -> None:
    path = _write(tmp_path / "report.jsonl", SUITE)
    report = build_report([path])
    assert set(report.axes) == {"recovery"} and report.runs == []
    ax = report.axes["recovery"]
    bars = ax.patches
    assert [b.get_width() for b in bars] == [0.02, 3.93, 4.9, 8.56]  # detection, then recovery
    assert [t.get_text() for t in ax.get_yticklabels()] == [r["scenario"] for r in SUITE]
    out = tmp_path / "suite.html"
    assert main([path, "-o", str(out)]) == 0
    assert "<td>hung rank (SIGSTOP)</td>" in out.read_text()


def _bench_data(tmp_path) -> str:
    mem = {
        "start": 300, "params": 100, "optim": 200, "peak_fwd_bwd": 1000, "zero_target": 500,
        "above_start_by_role": {"full parameters": 400, "flat gradients": 200},
        "peak_opt_step": 400, "peak_step": 1200,
    }  # fmt: skip
    engine = {
        "runs": [
            {
                "label": "W=2 CPU/gloo", "world": 2, "device": "cpu", "psi": 10,
                "engines": {
                    name: {"step_ms": ms, "step_ms_iqr": [ms - 1, ms + 2], "bytes_per_step": 8,
                           "memory": {**mem, "peak_fwd_bwd": mem["peak_fwd_bwd"] + ms}}
                    for name, ms in (("ftsdp", 10.0), ("fsdp2", 12.0), ("ddp", 8.0))
                },
            }
        ]
    }  # fmt: skip
    rows = [
        {"measurement": "save GB/s", "storage": 1.0, "dcp": 0.8, "s3": 0.05, "target": ">= 1.5x DCP"},
        {"measurement": "load 2 -> 1 GB/s", "storage": 0.9, "dcp": 0.95, "s3": None, "target": ""},
        {"measurement": "bytes read / needed, 2 -> 1 (library's reads)", "storage": 1.0, "dcp": 1.0, "s3": None, "target": ""},
        {"measurement": "async save: blocking s, first save", "storage": 0.2, "dcp": 0.22, "s3": None, "target": ""},
        {"measurement": "async save: until committed s", "storage": 0.7, "dcp": 0.99, "s3": None, "target": ""},
    ]  # fmt: skip
    path = str(tmp_path / "benchmarks.json")
    _bench_json.write_entry(
        path, "engine", engine, "python -m ftsdp.tools.bench_engine --json x", "env"
    )
    _bench_json.write_entry(
        path, "checkpoint", {"rows": rows}, "python -m ftsdp.tools.bench_checkpoint", "env"
    )
    return path


def test_bench_charts_hold_the_json_numbers(tmp_path) -> None:
    path = _bench_data(tmp_path)
    data = _bench_json.read(path)
    assert data["engine"]["command"] == "python -m ftsdp.tools.bench_engine --json x"
    report = build_bench(path)
    assert set(report.axes) == {
        "engine_time", "engine_memory", "checkpoint_throughput", "checkpoint_async", "sources"
    }  # fmt: skip
    time = report.axes["engine_time"]
    assert [b.get_height() for b in time.patches] == [10.0, 12.0, 8.0]
    memory = report.axes["engine_memory"]
    tops: dict[float, float] = {}
    for bar in memory.patches:  # stacked: each bar's segments add up to its peak
        x = bar.get_x()
        tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    runs = data["engine"]["runs"][0]["engines"]
    assert sorted(tops.values()) == pytest.approx(
        sorted(v["memory"]["peak_fwd_bwd"] / 1e6 for v in runs.values())
    )
    legend = {t.get_text() for t in memory.get_legend().get_texts()}
    assert legend == {
        "parameters", "AdamW state", "peak: full parameters", "peak: flat gradients",
        "peak: not attributed", "ZeRO: 16ψ/W + largest unit",
    }  # fmt: skip
    tput = report.axes["checkpoint_throughput"]
    assert [b.get_height() for b in tput.patches] == [1.0, 0.9, 0.8, 0.95, 0.05]
    assert [t.get_text() for t in tput.get_xticklabels()] == ["save", "load 2 -> 1"]
    async_ = report.axes["checkpoint_async"]
    assert [b.get_height() for b in async_.patches] == [0.2, 0.7, 0.22, 0.99]
    (text,) = report.axes["sources"].texts
    assert "python -m ftsdp.tools.bench_checkpoint" in text.get_text()
    out = tmp_path / "bench.png"
    assert main(["--bench", path, "-o", str(out)]) == 0
    assert _png_size(out.read_bytes()) == tuple(
        round(v * 80) for v in report.figure.get_size_inches()
    )


def test_bench_json_entries_are_replaced_one_at_a_time(tmp_path) -> None:
    path = str(tmp_path / "b.json")
    _bench_json.write_entry(path, "engine", {"runs": [1]}, "cmd1", "env1")
    _bench_json.write_entry(path, "checksum", {"rates_gbps": {}}, "cmd2", "env2")
    _bench_json.write_entry(path, "engine", {"runs": [2]}, "cmd3", "env3")
    data = _bench_json.read(path)
    assert data["engine"]["runs"] == [2] and data["engine"]["command"] == "cmd3"
    assert data["checksum"]["command"] == "cmd2" and sorted(data) == ["checksum", "engine"]
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"]  # no temporary file left
    (tmp_path / "b.json").write_text("[1]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        _bench_json.write_entry(path, "engine", {}, "c", "e")


def test_checkpoint_benchmark_json_holds_its_table_rows() -> None:
    from argparse import Namespace

    from ftsdp.tools.bench_checkpoint import json_entry, table

    res = {
        "bytes": 2_000_000_000,
        "save": {
            "storage.save_s": [2.0, 2.2],
            "dcp.save_s": [2.5, 2.7],
            "raw.write": [4.0, 4.0],
            "raw.read": [1.0, 1.0],
            "storage.async_blocking_s": [0.3, 0.1],
            "dcp.async_blocking_s": [0.3, 0.2],
        },
        "load1": {"storage.load_s": [2.0, 2.0], "dcp.load_s": [4.0, 4.0]},
    }
    args = Namespace(ranks=2, repeats=2, load_ranks=[1])
    entry = json_entry(args, res)
    tab, verdicts = table(args, res)
    rows = {r["measurement"]: r for r in entry["rows"]}
    assert rows["save GB/s"]["storage"] == pytest.approx(2e9 / 2.1 / 1e9)
    assert rows["load 2 -> 1 GB/s"]["dcp"] == pytest.approx(0.5)
    assert rows["async save: blocking s, later saves"]["storage"] == pytest.approx(0.1)
    for name, row in rows.items():
        if name.endswith("GB/s"):
            shown = f"{row['storage']:.2f} | {row['dcp']:.2f}"
            assert re.search(rf"^\| {re.escape(name)} \| {re.escape(shown)} \|", tab, re.M), name
    assert entry["verdicts"] == verdicts and entry["raw_disk_gbps"] == {"write": 4.0, "read": 1.0}
