"""Release files: the sdist and the wheel hold exactly the intended files, the wheel installs
and runs, the version is defined once, the licence and project URLs are there.

The archives are built with ``python -m build --no-isolation`` (``build`` and ``hatchling``
are in the dev extra; nothing is downloaded) from a copy of the release inputs into which
the test plants what ``make test``, ``make demo`` and benchmarks leave behind.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import precisebn

ROOT = Path(__file__).resolve().parents[1]
VERSION = precisebn.__version__
INPUTS = ["src", "tests", "README.md", "LICENSE", "CHANGELOG.md", "pyproject.toml", ".gitignore"]
JUNK = [
    ".hypothesis/examples/0a/1b",
    ".pytest_cache/v/cache/nodeids",
    "precisebn-demo/results.json",
    "precisebn-demo/demo.png",
    "benchmarks/results/results.md",
    "src/precisebn/__pycache__/cli.cpython-311.pyc",
    "tests/__pycache__/conftest.cpython-311-pytest-9.pyc",
    "build/lib/precisebn/__init__.py",
    "dist/old.whl",
]


def _package_files() -> set[str]:
    src = ROOT / "src" / "precisebn"
    return {
        p.relative_to(src.parent).as_posix()
        for p in src.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in {".py", ".typed"}
    }


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("tree")
    for name in INPUTS:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, tree / name)
    for junk in JUNK:
        (tree / junk).parent.mkdir(parents=True, exist_ok=True)
        (tree / junk).write_text("left behind by a test run\n")
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(tree)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


def test_the_wheel_holds_the_package_and_its_metadata_only(dist: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    assert wheel.name == f"precisebn-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = Parser().parsestr(archive.read(f"precisebn-{VERSION}.dist-info/METADATA").decode())
        entry_points = archive.read(f"precisebn-{VERSION}.dist-info/entry_points.txt").decode()
        licence = archive.read(f"precisebn-{VERSION}.dist-info/licenses/LICENSE").decode()
    info = f"precisebn-{VERSION}.dist-info/"
    assert {n for n in names if not n.startswith(info)} == _package_files()
    assert {n[len(info) :] for n in names if n.startswith(info)} == {
        "METADATA",
        "WHEEL",
        "RECORD",
        "entry_points.txt",
        "licenses/LICENSE",
    }
    assert metadata["Name"] == "precisebn" and metadata["Version"] == VERSION
    assert metadata["License-Expression"] == "Apache-2.0"
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    urls = dict(u.split(", ", 1) for u in metadata.get_all("Project-URL"))
    assert urls["Source"].startswith("https://") and "Changelog" in urls
    extras = set(metadata.get_all("Provides-Extra"))
    assert {"lightning", "mmengine", "transformers", "ignite", "timm", "dev"} <= extras
    assert metadata.get_all("Requires-Dist")[0].startswith("torch")  # the only unconditional dependency
    assert all("extra ==" in r for r in metadata.get_all("Requires-Dist")[1:])
    assert "precisebn = precisebn.cli:run" in entry_points


def test_the_sdist_holds_exactly_the_release_inputs(dist: Path) -> None:
    (sdist,) = dist.glob("*.tar.gz")
    top = f"precisebn-{VERSION}/"
    with tarfile.open(sdist) as archive:
        names = {m.name[len(top) :] for m in archive.getmembers() if m.isfile()}
    expected = {f"src/{p}" for p in _package_files()}
    expected |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("*.py")}
    expected |= {"README.md", "LICENSE", "CHANGELOG.md", "pyproject.toml", ".gitignore", "PKG-INFO"}
    assert names == expected
    assert not [n for n in names if re.search(r"__pycache__|\.pyc$|hypothesis|pytest_cache|demo/|benchmarks|^dist/", n)]


def test_the_wheel_installs_and_runs(dist: Path, tmp_path: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}  # ahead of this checkout's editable install
    script = target / "bin" / "precisebn"  # the console script pip generated from the entry point
    code = (
        "import runpy, sys, precisebn\n"
        "print(precisebn.__file__, precisebn.__version__, flush=True)\n"
        f"sys.argv = [{str(script)!r}, '--version']\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    where, version, *printed = out.stdout.split("\n", 1)[0].split() + out.stdout.split("\n", 1)[1].split()
    assert Path(where).is_relative_to(target) and version == VERSION
    assert printed == ["precisebn", VERSION]


def test_the_version_is_defined_once() -> None:
    assert re.fullmatch(r'__version__ = "\d+\.\d+\.\d+"\n', (ROOT / "src/precisebn/_version.py").read_text())
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"', pyproject, re.M) and not re.search(r"^version\s*=", pyproject, re.M)
    assert f"## [{VERSION}]" in (ROOT / "CHANGELOG.md").read_text()


def test_readme_links_work_on_an_index_page(dist: Path) -> None:
    """PyPI shows the README (the wheel's long description) without the repository: every
    link and image there is absolute, into the repository named in pyproject's URLs, and
    points at a file that exists in the repository."""
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        metadata = Parser().parsestr(archive.read(f"precisebn-{VERSION}.dist-info/METADATA").decode())
    assert metadata["Description-Content-Type"] == "text/markdown"
    description = metadata.get_payload()
    assert description.startswith("# precisebn")
    source = re.search(r'^Source = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    raw = source.replace("https://github.com/", "https://raw.githubusercontent.com/")
    targets = re.findall(r"\]\(([^)\s]+)\)", description)
    assert len(targets) >= 4
    for target in targets:
        if target.startswith("#"):
            continue
        assert re.match(r"https?://", target), f"relative link {target!r} breaks on an index page"
        for prefix in (f"{source}/blob/main/", f"{raw}/main/"):
            if target.startswith(prefix):
                assert (ROOT / target[len(prefix) :]).exists(), f"{target!r}: no such file in the repository"


def test_the_core_imports_no_framework() -> None:
    code = (
        "import sys, precisebn, precisebn.compat, precisebn.scheduler\n"
        "frameworks = ('lightning', 'pytorch_lightning', 'mmengine', 'transformers', 'ignite', 'accelerate', 'timm',"
        " 'fvcore', 'matplotlib', 'safetensors')  # torch itself imports tqdm\n"
        "print(sorted(m for m in frameworks if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
