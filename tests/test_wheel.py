"""What a wheel installs: one top-level package, `specserve`, holding the repository's folders
(specserve.decoding is decoding/, ...) and the shipped default pair, so nothing collides with other
projects' `cluster` or `bench` and `specserve generate` answers outside a checkout.

The checkout's side is checked in every run (fast): specserve/ links every top-level package and
nothing imports one by its bare name. The wheel itself is built, installed into a fresh venv
outside the checkout and served once under the `slow` marker (a whole start-up, about a minute
on a 2-core box). Nothing is downloaded: the build uses the running venv's setuptools
(--no-build-isolation) and the fresh venv reads the running venv's site-packages for the
dependencies through a .pth file (pip --no-index --no-deps)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.local_server import free_port

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = REPO / "specserve"
BARE_IMPORT = re.compile(r"^\s*(?:from|import)\s+(decoding|deployments|policies|cluster|common|bench|training)\b", re.M)


def top_level_packages() -> list[str]:
    return sorted(p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name not in ("tests", "specserve"))


def test_specserve_links_every_top_level_package_and_the_shipped_pair():
    linked = {entry.name: entry.resolve() for entry in NAMESPACE.iterdir() if entry.is_symlink()}
    assert {name: REPO / name for name in [*top_level_packages(), "models"]} == linked
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["specserve*"]


def test_no_module_imports_a_top_level_folder_by_its_bare_name():
    """Importing decoding.x by its bare name would load a second copy of the module beside
    specserve.decoding.x in a checkout, and fail in a wheel (code from before the namespace: prefix
    its imports with `specserve.`)."""
    paths = [*REPO.glob("*/*.py"), *REPO.glob("*/*/*.py")]
    bare = [f"{p.relative_to(REPO)}: {m.group(0).strip()}" for p in paths if ".venv" not in p.parts
            for m in BARE_IMPORT.finditer(p.read_text())]
    assert bare == []


def test_the_bare_import_check_sees_a_bare_import():
    assert BARE_IMPORT.search("import torch\n    from cluster.config import load_config\n")  # namespace-rewrite: keep
    assert not BARE_IMPORT.search("from specserve.common.config import load_config\nimport clusters\n")


def build_wheel(out: Path) -> Path:
    """The wheel of a copy of the sources (the build's own build/ and egg-info stay out of the checkout)."""
    source = out / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(NAMESPACE, source / "specserve", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for link in NAMESPACE.iterdir():
        if link.is_symlink():
            shutil.copytree(link.resolve(), source / link.resolve().name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-index", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out / "dist"), str(source)], check=True)
    (wheel,) = (out / "dist").glob("specserve-*.whl")
    return wheel


def fresh_venv(path: Path) -> tuple[Path, Path]:
    """A venv that sees the running venv's packages (the dependencies), not the checkout: its python
    and its own site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    dependencies = [entry for entry in sys.path if entry.endswith("site-packages")]  # .pth files in them are not read
    (Path(purelib) / "dependencies.pth").write_text("\n".join(dependencies) + "\n")
    return python, Path(purelib)


@pytest.mark.ray
@pytest.mark.slow   # `make reliability`: a wheel build plus a whole `specserve generate` start-up
def test_the_wheel_installs_one_namespace_and_generate_answers_outside_the_checkout(tmp_path):
    wheel = build_wheel(tmp_path)
    python, purelib = fresh_venv(tmp_path / "venv")
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "RAY_ADDRESS")}
    env.update(PIP_NO_INDEX="1", SPECSERVE__HTTP__PORT=str(free_port()))
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", str(wheel)],
                   check=True, cwd=away, env=env)

    installed = {p.name for p in purelib.iterdir() if p.is_dir() and not p.name.endswith(".dist-info")}
    assert installed - {"__pycache__"} == {"specserve"}
    probe = ("import specserve.common.config as c, importlib.util as u; "
             "print(c.__file__); print(c.DEFAULT_MODELS_DIR); print(u.find_spec('cluster'))")
    where, models, bare = subprocess.run([python, "-c", probe], check=True, cwd=away, env=env,
                                         capture_output=True, text=True).stdout.split()
    assert Path(where).is_relative_to(purelib) and Path(models).is_relative_to(purelib)
    assert (Path(models) / "target" / "model.safetensors").is_file() and bare == "None"

    done = subprocess.run([str(python.parent / "specserve"), "generate", "--max-tokens", "8", "--temperature", "0"],
                          cwd=away, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^--- [1-8] tokens in ", done.stdout, re.M), done.stdout[-2000:]
