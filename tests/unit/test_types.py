"""The package passes mypy (pinned in the test extra, configured in pyproject.toml).

mypy runs on the files ``[tool.mypy]`` lists, each named by the module it installs as: the
repository folders storage/ and tools/ install as ftsdp.storage and ftsdp.tools (package-dir), a
mapping a bare ``mypy`` cannot see (the editable install makes it with an import hook, which mypy
does not follow). Run this file directly (``python tests/unit/test_types.py [mypy options]``) to
see the errors without pytest.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tempfile

import pytest
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def check(args: list[str]) -> int:
    """Type-check the package; print mypy's messages, return 1 if there are errors, else 0."""
    from mypy import build, errors, main
    from mypy.modulefinder import BuildSource

    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    installed = {folder: package for package, folder in package_dir.items()}
    sources, options = main.process_options(["--config-file", str(ROOT / "pyproject.toml"), *args])
    renamed = []
    for source in sources:
        # a file under storage/ is found as storage.*, its installed name is ftsdp.storage.*
        top, dot, rest = (source.module or "").partition(".")
        module = installed.get(top, top) + dot + rest
        renamed.append(BuildSource(source.path, module, source.text, source.base_dir))
    try:
        result = build.build(renamed, options)
    except errors.CompileError as e:  # a blocking error (a syntax error, a module found twice)
        print("\n".join(e.messages))
        return 1
    print("\n".join(result.errors))
    return 1 if any(": error:" in line for line in result.errors) else 0


def start(config: pytest.Config) -> subprocess.Popen:
    """Start the check in the background (conftest.py calls this at collection when
    ``test_mypy`` is selected and the run is serial, ``-n 0``): a cold run takes half a minute of
    one core, which the rest of a serial suite, about one core busy on average, leaves free. At
    the lowest priority (nice 19), so that it takes only the time the tests leave idle."""
    # pytest's cache folder keeps mypy's cache between runs (a warm run rechecks changed files)
    cache = config.cache
    if cache is not None:
        cache_dir = cache.mkdir("mypy")
    else:
        cache_dir = pathlib.Path(tempfile.mkdtemp(prefix="ftsdp-mypy-"))
    return subprocess.Popen(
        ["nice", "-n", "19", sys.executable, __file__, "--cache-dir", str(cache_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


CHECK = pytest.StashKey[subprocess.Popen]()


@pytest.mark.timeout(900)  # a cold cache first analyses about 2,400 modules (torch's 1,500)
def test_mypy(request: pytest.FixtureRequest) -> None:
    check = request.config.stash.get(CHECK, None) or start(request.config)
    output, _ = check.communicate(timeout=880)
    assert check.returncode == 0, output


if __name__ == "__main__":
    sys.exit(check(sys.argv[1:]))
