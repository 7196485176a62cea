"""Every import runs one way: the packages form layers, each importing only the ones below it.

    bench/        tools that run a served stack or the engines and write results
    cluster/      the roof: builder, bring-up, status, CLI
    deployments/  the Ray Serve glue
    training/     draft training, offline and online
    policies/     decisions (pure) and the policy actor
    common/       the floor: config schema, messages, actor names, metric names
    decoding/     the core: no Ray, nothing above it

The graph is read from the source (every `import` and `from ... import`, also those inside
functions, which run just as surely), so a lazy import cannot hide an edge that points up.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ["decoding", "common", "policies", "training", "deployments", "cluster", "bench"]  # lowest first


def top_level_packages() -> list[str]:
    return sorted(p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name not in ("tests", "specserve"))


def modules() -> dict[str, Path]:
    """Dotted name (without the `specserve.` prefix) of every module in the top-level packages."""
    found = {}
    for package in top_level_packages():
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imported_names(source: str) -> set[str]:
    """Every absolute module name the source imports, and `module.name` for each `from module import name`
    (which may itself be a module)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_graph(sources: dict[str, str], known: set[str]) -> dict[str, set[str]]:
    """Module -> the specserve modules it imports (names outside `known` are third-party or attributes)."""
    graph = {}
    for module, source in sources.items():
        targets = {name.removeprefix("specserve.") for name in imported_names(source) if name.startswith("specserve.")}
        graph[module] = {target for target in targets if target in known and target != module}
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Edges from a package to one at its own level or above (another package): each breaks the layering."""
    rank = {package: level for level, package in enumerate(LAYERS)}
    return sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                  if module.split(".")[0] != target.split(".")[0]
                  and rank[target.split(".")[0]] >= rank[module.split(".")[0]])


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


@functools.cache
def repository_graph() -> dict[str, set[str]]:
    found = modules()
    return import_graph({name: path.read_text() for name, path in found.items()}, set(found))


def test_every_top_level_package_has_a_layer():
    assert sorted(LAYERS) == top_level_packages()


def test_every_import_runs_down_the_layers():
    assert upward_imports(repository_graph()) == []


def test_no_modules_import_each_other_in_a_circle():
    assert cycles(repository_graph()) == set()


def test_decoding_imports_no_ray():
    """The core runs in a plain process (tests, the in-process generator, the engines' own loop)."""
    ray_users = [str(path.relative_to(REPO)) for name, path in modules().items() if name.startswith("decoding")
                 and any(imported == "ray" or imported.startswith("ray.") for imported in imported_names(path.read_text()))]
    assert ray_users == []


def test_the_checks_see_an_upward_import_and_a_circle():
    sources = {"common.config": "def f():\n    from specserve.cluster.builder import build_app\n",
               "cluster.builder": "from specserve.cluster.local import start_local\nimport specserve.decoding.sampling\n",
               "cluster.local": "from specserve.cluster import builder\n", "decoding.sampling": ""}
    graph = import_graph(sources, set(sources))
    assert upward_imports(graph) == ["common.config -> cluster.builder"]
    assert cycles(graph) == {frozenset({"cluster.builder", "cluster.local"})}


# The processes that load no model: Serve's ingress, router and engine-host replicas (an engine's
# own actor loads it) and the CLI. What they import each replica pays at every start (a
# failover's, an autoscaled replica's), beside the engines importing theirs on the same cores; the
# engine-only modules below cost seconds. The Serve controller (the autoscaling policy) and the
# policy actor import the policies, which need no tensors at all.
POLICIES = ["specserve.policies.autoscaling", "specserve.policies.actor"]
MODEL_FREE = ["specserve.deployments.ingress", "specserve.deployments.router", "specserve.deployments.engine_host",
              "specserve.cluster.cli"]
ENGINE_ONLY = ["torch._dynamo", "transformers.modeling_utils"]


def test_the_processes_that_load_no_model_import_no_engine_code():
    """One fresh interpreter imports the policies, then the model-free processes' modules, then
    an engine module, and says what each step brought in: no torch for the first, no engine-only
    module for the second, and all of them for the third (so the probe sees an import when there
    is one)."""
    probe = (f"import importlib, json, sys\n"
             f"def loaded(names): return [name for name in names if name in sys.modules]\n"
             f"for name in {POLICIES!r}: importlib.import_module(name)\n"
             f"policies = loaded(['torch'])\n"
             f"for name in {MODEL_FREE!r}: importlib.import_module(name)\n"
             f"light = loaded({ENGINE_ONLY!r})\n"
             f"importlib.import_module('specserve.decoding.batched_runner')\n"
             f"print(json.dumps([policies, light, loaded({ENGINE_ONLY!r})]))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    policies, light, engine = json.loads(out.stdout.strip().splitlines()[-1])
    assert policies == []
    assert light == []
    assert engine == ENGINE_ONLY
