"""What `pip install .` installs: the packages `planner` and `planner_service` (from api/), nothing else.

Why it exists: the folder api/ once installed as a top-level package `api`, which collides with any user
module of that name (issue 36). It now installs as `planner_service` through pyproject.toml's
`package-dir`, and since `packages.find` cannot rename a folder, pyproject.toml lists every package by
hand. A subpackage forgotten there passes every other test, which run on the editable install, and only
breaks the wheel and the container image; these tests catch it here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
FOLDERS = {"planner": "planner", "api": "planner_service"}
"""Each source folder at the repository's top level and the package it installs as."""


def installed_name(path: Path) -> str:
    """The installed dotted name of a folder or .py file under one of FOLDERS (relative to the repository)."""
    top, *rest = path.with_suffix("").parts
    return ".".join([FOLDERS[top], *rest])


def source_packages() -> set[str]:
    """Every folder under planner/ and api/ that holds an __init__.py, as the package it installs as."""
    return {
        installed_name(init.parent.relative_to(REPOSITORY))
        for folder in FOLDERS
        for init in (REPOSITORY / folder).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }


def source_modules() -> set[str]:
    """Every .py file under planner/ and api/, as the wheel should hold it (api/ -> planner_service/)."""
    return {
        "/".join(installed_name(path.relative_to(REPOSITORY)).split(".")) + ".py"
        for folder in FOLDERS
        for path in (REPOSITORY / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def test_pyproject_lists_every_package_and_maps_api_to_planner_service() -> None:
    setuptools = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"planner_service": "api"}
    listed = setuptools["packages"]
    assert len(listed) == len(set(listed)), "a package is listed twice"
    assert set(listed) == source_packages(), (
        "pyproject.toml's [tool.setuptools] packages must name every folder of planner/ and api/ holding "
        f"an __init__.py; missing {sorted(source_packages() - set(listed))}, "
        f"extra {sorted(set(listed) - source_packages())}"
    )


def test_the_wheel_installs_planner_and_planner_service_only(tmp_path: Path) -> None:
    # Built from a copy, so that setuptools' build/ and egg-info stay out of the working tree; offline, with
    # this interpreter's setuptools (no build isolation, no index).
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPOSITORY / name, source / name)
    for folder in FOLDERS:
        shutil.copytree(REPOSITORY / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--quiet", "--disable-pip-version-check", "--wheel-dir", str(wheels)],
        cwd=source,
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("planner-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top_levels = [name for name in names if name.endswith(".dist-info/top_level.txt")]
        if top_levels:
            assert set(archive.read(top_levels[0]).decode().split()) == {"planner", "planner_service"}
    modules = {name for name in names if name.endswith(".py")}
    assert {name.split("/")[0] for name in modules} == {"planner", "planner_service"}
    assert modules == source_modules(), (
        f"missing from the wheel {sorted(source_modules() - modules)}, "
        f"extra in it {sorted(modules - source_modules())}"
    )
