"""Benchmarks that compare code: the same bench run under each tree, the trees taking turns.

Why: this box drifts by more than most changes measured on it, so a before and an after run one
after the other meet different minutes; running each tree's turn in alternation gives both the
same minutes. Each run is the bench itself in a child process whose PYTHONPATH and working
directory are the tree (a `git worktree` of the commit to compare), so that tree's code is what
serves (Ray's workers inherit both); a child's result that names the code it ran (`served_code`;
older trees' benches may not) is checked against its tree. A figure script newer than the trees it
compares runs itself instead, from this checkout, importing the tree's code (`script_in_tree`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path


def parse_trees(entries: list[str]) -> list[tuple[str, Path]]:
    """["before=/tmp/tree", "after=."] -> [(label, resolved tree)]."""
    trees = [entry.split("=", 1) for entry in entries]
    if any(len(tree) != 2 for tree in trees):
        raise SystemExit("--compare takes LABEL=TREE")
    return [(label, Path(tree).resolve()) for label, tree in trees]


def label_configs(entries: list[str], trees: list[tuple[str, Path]], default: str | None) -> dict[str, list[str]]:
    """The `--config` arguments of each compared label: its own (`--compare-config LABEL=YAML`
    entries), else default (none where neither is given); paths resolved, as each run's working
    directory is its tree."""
    configs = dict(parse_trees(entries)) if entries else {}
    unknown = sorted(set(configs) - {label for label, _ in trees})
    if unknown:
        raise SystemExit(f"--compare-config names labels no --compare gives: {unknown}")
    fallback = Path(default).resolve() if default else None
    return {label: ["--config", str(configs.get(label, fallback))] for label, _ in trees
            if configs.get(label, fallback) is not None}


def served_code() -> str:
    """The tree whose specserve this process imported: what a child run reports as its code."""
    return str(Path(sys.modules["specserve"].__file__).resolve().parents[1])


def runs_per_tree(module: str, child_args: list[str], trees: list[tuple[str, Path]], turns: int,
                  label_args: dict[str, list[str]] | None = None) -> dict[str, list[dict]]:
    """`python -m module *child_args --name N --out SCRATCH` once per tree and turn, the trees
    taking turns (label_args: arguments one label's runs add, such as its own config, so two labels
    may run one tree two ways); -> each tree's results (the JSON each run wrote), in turn order.
    Each turn starts one tree further on (turn t runs tree t first), so over as many turns as
    trees each tree has run at every place in a turn: a box that drifts within a turn (each run
    starts a cluster right after the last one stopped) favours none of them."""
    runs: dict[str, list[dict]] = defaultdict(list)
    label_args = label_args or {}
    with tempfile.TemporaryDirectory() as scratch:
        for turn in range(turns):
            first = turn % len(trees)
            for label, root in trees[first:] + trees[:first]:
                name = f"{label}-turn{turn}"
                arguments = [*child_args, *label_args.get(label, []), "--name", name, "--out", scratch]
                subprocess.run([sys.executable, "-m", module, *arguments],
                               env={**os.environ, "PYTHONPATH": str(root)}, cwd=root, check=True,
                               stdout=subprocess.DEVNULL)
                run = json.loads((Path(scratch) / f"{name}.json").read_text())
                if "code" in run and Path(run["code"]) != root:
                    raise SystemExit(f"{label}: {run.get('code')}'s code served, not {root}'s")
                runs[label].append(run)
    return runs


def script_in_tree(script: Path, tree: Path, args: list[str]) -> str:
    """`python script *args` with `specserve` imported from tree (PYTHONPATH and working directory
    the tree; the script itself from this checkout, so a tree older than it can run it): the last
    line it printed."""
    out = subprocess.run([sys.executable, str(script), *args], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def turn_order(labels: list[str], turn: int) -> list[str]:
    """The order the trees run in at a turn: as given, then reversed, so none always goes first."""
    return list(labels) if turn % 2 == 0 else list(reversed(labels))
