"""The package as a user installs it: one top-level name, ``ftsdp``, that keeps working beside
the user's own ``storage/`` and ``tools/`` packages, from an editable and from a regular install.

The user's packages raise on import, so any code of ours that still imports a top-level
``storage`` or ``tools`` fails here instead of silently picking up the user's.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)

TINY = [
    *["--vocab-size", "32", "--block-size", "16", "--n-layer", "1", "--n-head", "2"],
    *["--n-embd", "32", "--global-batch", "4", "--micro-batch", "2", "--steps", "2"],
    *["--log-every", "1", "--device", "cpu"],
]


@pytest.fixture
def user_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A working directory holding the user's own ``storage`` and ``tools`` packages."""
    work = tmp_path / "work"
    for name in ("storage", "tools"):
        (work / name).mkdir(parents=True)
        (work / name / "__init__.py").write_text(
            f"raise ImportError('the user\\'s own {name!r} package was imported')\n"
        )
    return work


def _env() -> dict[str, str]:
    """The environment of a user's shell: nothing points into the repository."""
    drop = ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], cwd: pathlib.Path, timeout: float = 150) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


NO_ENGINE = (
    "import sys, ftsdp.storage as s; "
    "loaded = sorted(m for m in sys.modules if m.startswith(('ftsdp.fsdp', 'ftsdp.trainer', "
    "'ftsdp.elastic', 'ftsdp.testing'))); "
    "assert not loaded, loaded; print(s.__file__)"
)


def _console_script(bindir: pathlib.Path, name: str) -> str:
    path = bindir / name
    assert path.exists(), f"console script {name} not installed in {bindir}"
    return str(path)


def test_editable_install_beside_the_users_packages(user_dir: pathlib.Path) -> None:
    bindir = pathlib.Path(sysconfig.get_path("scripts"))
    where = _run([sys.executable, "-c", NO_ENGINE], user_dir).strip()
    assert pathlib.Path(where).resolve() == (REPO / "storage" / "__init__.py").resolve()
    assert "inspect" in _run([_console_script(bindir, "ftsdp-ckpt"), "--help"], user_dir)
    assert "inspect" in _run([sys.executable, "-m", "ftsdp.tools.ckpt", "--help"], user_dir)
    # The main job, checkpointing to a folder of the user's, then the CLI reading it back.
    out = _run(
        [sys.executable, "-m", "ftsdp.train", *TINY, "--checkpoint-url", "ck",
         "--checkpoint-every", "1"],
        user_dir,
    )  # fmt: skip
    assert "done | 2 steps" in out, out
    listing = _run([_console_script(bindir, "ftsdp-ckpt"), "inspect", "ck"], user_dir)
    assert "committed steps: [1, 2]" in listing, listing


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A wheel built from a copy of the repository's package sources (no network)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    for name in ("ftsdp", "storage", "tools"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(dist), str(src)],
        check=True, capture_output=True, timeout=240,
    )  # fmt: skip
    (whl,) = dist.glob("ftsdp-*.whl")
    return whl


def test_the_wheel_holds_one_top_level_package(wheel: pathlib.Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"ftsdp"}, sorted(top)
    for path in (
        "ftsdp/storage/format/_manifest.py",
        "ftsdp/storage/saving/_save.py",
        "ftsdp/tools/ckpt/__main__.py",
        "ftsdp/fsdp/__init__.py",
        "ftsdp/examples/gpt.py",
        "ftsdp/train.py",
    ):
        assert path in names, path
    assert not any(n.startswith(("tests/", "ftsdp/tests/")) for n in names)
    # development scripts run from a checkout only (docs/design.md, "The map")
    assert not any(n.startswith("ftsdp/tools/dev/") for n in names)
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "ftsdp-ckpt = ftsdp.tools.ckpt:main" in text
    assert "ftsdp/py.typed" in names  # PEP 561
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    meta = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "License-Expression: BSD-3-Clause" in meta and "License-File: LICENSE" in meta, meta
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names


def site_dirs() -> list[str]:
    """The site-packages folders of the environment running the tests, whatever it is (the
    base interpreter, a venv, with or without the system's packages, a conda env): where its
    torch & co. are installed."""
    return [p for p in sys.path if pathlib.PurePath(p).name in ("site-packages", "dist-packages")]


def test_regular_install_beside_the_users_packages(
    wheel: pathlib.Path, user_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    # A fresh venv that sees torch & co. from this environment, ftsdp from the wheel. Not
    # ``--system-site-packages``: from a venv, that gives the base interpreter's packages, not
    # this venv's. A .pth file of the new venv names this environment's site folders instead;
    # they come after its own (the wheel's ftsdp wins), and their .pth files are not run, so
    # this environment's editable ftsdp stays out (checked below: ftsdp is the wheel's).
    venv = tmp_path / "venv"
    # no pip of its own (seeding one costs seconds): this environment's pip installs into it
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    inner = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    (pathlib.Path(inner) / "outer-environment.pth").write_text("\n".join(site_dirs()) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        check=True, capture_output=True, timeout=240,
    )  # fmt: skip
    where = pathlib.Path(_run([str(python), "-c", NO_ENGINE], user_dir).strip())
    assert venv in where.parents and where.parts[-3:] == ("ftsdp", "storage", "__init__.py")
    assert "inspect" in _run([_console_script(venv / "bin", "ftsdp-ckpt"), "--help"], user_dir)
