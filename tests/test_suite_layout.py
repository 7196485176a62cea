"""The suite's own layout: make test runs one Ray cluster at a time (its two workers: tests/conftest.py)
only if every module that starts one is seen as doing so."""

from pathlib import Path

from tests.conftest import _starts_ray

STARTS_RAY = ("ray.init(", "init_local_ray(", "start_local(", "serve_tiny_pair(")


def modules_starting_ray_unseen(tests: Path) -> list[str]:
    return sorted(path.name for path in tests.glob("test_*.py")
                  if any(call in path.read_text() for call in STARTS_RAY) and not _starts_ray(path))


def test_every_module_that_starts_ray_carries_the_ray_marker():
    assert modules_starting_ray_unseen(Path(__file__).parent) == []


def test_the_check_sees_an_unmarked_module(tmp_path):
    (tmp_path / "test_a.py").write_text("def test_x():\n    start_local(config)\n")
    (tmp_path / "test_b.py").write_text("import pytest\npytestmark = pytest.mark.ray\ndef test_y():\n    start_local(config)\n")
    assert modules_starting_ray_unseen(tmp_path) == ["test_a.py"]
