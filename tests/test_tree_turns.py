"""bench/tree_turns.py: a bench run per tree and turn, the trees taking turns, each label with its own arguments."""

from specserve.bench.tree_turns import parse_trees, runs_per_tree

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
    assert (tmp_path / "order.txt").read_text().split() == ["plain-turn0", "configured-turn0", "plain-turn1",
                                                           "configured-turn1"]
    assert all(run["args"][:2] == ["--shared", "1"] and "--config" not in run["args"] for run in runs["plain"])
    assert all(run["args"][2:4] == ["--config", "c.yaml"] for run in runs["configured"])
    assert len(runs["plain"]) == len(runs["configured"]) == 2
