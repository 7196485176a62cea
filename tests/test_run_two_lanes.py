"""tests/run_two_lanes.py, the runner of `make test`: the served modules and the in-process ones
in two pytest processes side by side. Together the lanes must select exactly what one pytest
process selects, or a test would silently leave `make test`."""

import re
import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from run_two_lanes import LANES, NOT_IN_MAKE_TEST, main  # noqa: E402

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


def test_the_lanes_split_pytests_own_selection_by_the_ray_marker():
    addopts = tomllib.loads(PYPROJECT.read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    configured = re.search(r"-m '([^']+)'", addopts).group(1)
    assert NOT_IN_MAKE_TEST == configured
    assert [expression for _, expression in LANES] == [f"ray and {configured}", f"not ray and {configured}"]


@pytest.mark.parametrize("options", [["-m", "ray"], ["-k", "serving"], ["tests/test_serving.py"]])
def test_a_selection_of_its_own_is_refused(options):
    with pytest.raises(SystemExit, match="the lanes are the selection"):
        main(["-q", *options])
