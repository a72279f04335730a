"""The wheel is the product: `pip wheel --no-deps .` must hold every module and data file of
adapter/ and runtime/ (a hand-kept package list once left out 26 of 73), and the startup file that
arms the line without PYTHONPATH. Running it installed is .ci/run's job (scripts/wheel_check.sh)."""
import pathlib
import shutil
import subprocess
import sys
import zipfile

from conftest import REPO_ROOT, lock_pins

SOURCES = ("adapter", "runtime")
NOT_SHIPPED = ("__pycache__", ".pyc")


def source_files() -> list[str]:
    files = []
    for top in SOURCES:
        for path in sorted((REPO_ROOT / top).rglob("*")):
            rel = path.relative_to(REPO_ROOT)
            if not path.is_file() or any(part == "__pycache__" for part in rel.parts):
                continue
            if rel.parts[:2] == ("runtime", "build") or path.suffix == ".pyc":
                continue    # build outputs (swan's module is built into the installed package)
            files.append(rel.as_posix())
    return files


def project_copy(dest: pathlib.Path) -> pathlib.Path:
    """The project's files in a fresh directory: setuptools reuses a build/ left in the source
    tree, which would hide a package the configuration no longer finds."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info")
    for top in SOURCES:
        shutil.copytree(REPO_ROOT / top, dest / top, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "dsv41.pth", "README.md", "NOTICE", "sitecustomize.py"):
        shutil.copy2(REPO_ROOT / name, dest / name)
    return dest


def test_the_wheel_holds_every_source_and_data_file(tmp_path):
    src = project_copy(tmp_path / "src")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-w", str(tmp_path), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("dsv41-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = source_files()
    assert len(expected) > 70 and "runtime/swan256/swan256.cu" in expected     # the walk found the tree
    missing = [f for f in expected if f not in names]
    assert not missing, f"missing from the wheel: {missing}"
    assert "dsv41.pth" in names
    pth = zipfile.ZipFile(wheel).read("dsv41.pth").decode()
    assert pth.startswith("import ") and "arm_at_startup" in pth     # site runs lines that start with import
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "dsv41 = adapter.tools.cli:main" in text and "dsv41 = adapter.plugin:load" in text
    assert not [n for n in names if n.startswith("runtime/build/") or n.endswith((".so", ".pyc"))]


def test_the_images_install_the_packages_own_dependencies_pinned():
    """The images install the wheel --no-deps (the engine's packages must not move), so its own
    dependencies come from requirements/runtime.lock: every one pyproject declares, at the
    version the developers' .venv runs (requirements/cpu.lock)."""
    import tomllib

    from packaging.requirements import Requirement

    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {Requirement(d).name for d in declared}
    runtime, cpu = lock_pins("requirements/runtime.lock"), lock_pins("requirements/cpu.lock")
    assert set(runtime) == names
    assert {n: cpu.get(n) for n in runtime} == runtime
    assert "requirements/runtime.lock" in (REPO_ROOT / "scripts/image_install.sh").read_text()
