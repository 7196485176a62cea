"""bench/tree_turns.py: a bench run per tree and turn, the trees taking turns (each turn starting one tree further on),
each label with its own arguments."""

import pytest

from specserve.bench.tree_turns import label_configs, parse_trees, runs_per_tree

ECHO = '''import json, sys
from pathlib import Path
args = sys.argv[1:]
out, name = Path(args[args.index("--out") + 1]), args[args.index("--name") + 1]
order = Path(__file__).with_name("order.txt")
order.write_text(order.read_text() + name + "\\n" if order.exists() else name + "\\n")
(out / f"{name}.json").write_text(json.dumps({"args": args}))
'''


def test_labels_take_turns_and_each_runs_with_its_own_arguments(tmp_path):
    (tmp_path / "echo_args.py").write_text(ECHO)
    trees = parse_trees([f"plain={tmp_path}", f"configured={tmp_path}"])
    runs = runs_per_tree("echo_args", ["--shared", "1"], trees, 2, {"configured": ["--config", "c.yaml"]})
    # each turn starts one label further on, so neither always runs first
    assert (tmp_path / "order.txt").read_text().split() == ["plain-turn0", "configured-turn0", "configured-turn1",
                                                           "plain-turn1"]
    assert all(run["args"][:2] == ["--shared", "1"] and "--config" not in run["args"] for run in runs["plain"])
    assert all(run["args"][2:4] == ["--config", "c.yaml"] for run in runs["configured"])
    assert len(runs["plain"]) == len(runs["configured"]) == 2


def test_each_label_serves_its_own_config_or_the_shared_one(tmp_path):
    trees = parse_trees([f"a={tmp_path}", f"b={tmp_path}"])
    assert label_configs([], trees, None) == {}
    own = label_configs(["b=own.yaml"], trees, None)
    assert list(own) == ["b"] and own["b"][0] == "--config" and own["b"][1].endswith("/own.yaml")
    shared = label_configs(["b=own.yaml"], trees, "shared.yaml")
    assert shared["a"][1].endswith("shared.yaml") and shared["b"][1].endswith("own.yaml")
    with pytest.raises(SystemExit, match="no --compare gives"):
        label_configs(["c=own.yaml"], trees, None)
