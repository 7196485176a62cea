"""What pyproject promises an install: every package the served code needs at run time, at a
version whose API it calls (a GPU install is not run here, so these are read from pyproject)."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main_dependencies() -> dict[str, str]:
    """name -> version specifier of pyproject's [project] dependencies (no extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = (re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(.*)$", dep) for dep in project["dependencies"])
    return {match.group(1).lower(): match.group(3) for match in found}


def test_accelerate_is_installed_with_the_server_as_device_map_needs_it_on_gpu():
    assert "device_map" in (ROOT / "decoding" / "model_runner.py").read_text()  # loads onto a GPU this way
    assert "accelerate" in main_dependencies()


def test_the_torch_floor_has_the_sdpa_enable_gqa_argument_the_attention_calls():
    assert any("enable_gqa=" in path.read_text() for path in (ROOT / "decoding").glob("*.py"))
    floor = re.search(r">=\s*(\d+)\.(\d+)", main_dependencies()["torch"])
    assert floor is not None and (int(floor.group(1)), int(floor.group(2))) >= (2, 5)  # enable_gqa came in 2.5
