"""Shared test fixtures. Tests run on CPU in float32 with one torch thread (CI has 2 cores)."""

import os
import sys

import pytest
import torch

torch.set_num_threads(1)
# Runners built by tests run the eager forward: compiling costs tens of seconds a model on this
# machine, and the suite builds hundreds of runners. The tests that compile ask for it
# (enforce_eager=False; tests/test_compiled_forward.py); docs/testing.md says which.
os.environ.setdefault("SPECSERVE_ENFORCE_EAGER", "1")

SHARED_SERVER = "tiny_pair_server"  # the fixture of the one served default tiny pair modules share


def _shares_the_server(module_items: list) -> bool:
    return any(SHARED_SERVER in item.fixturenames for item in module_items)


@pytest.hookimpl(tryfirst=True)   # before pytest-xdist's worker reads the groups
def pytest_collection_modifyitems(config, items):
    """Run the modules that use the shared served tiny pair one after another (each module whole,
    in collection order, at the place of the first of them), so its Ray cluster and Serve app
    start once for all of them instead of once per module. A test using it must be marked `ray`,
    so that `-m "not ray"` selects tests that start no Ray cluster.

    Under pytest-xdist (`make test` runs two workers, `--dist loadgroup`), every test marked `ray`
    joins one group, which one worker runs in this order: one Ray cluster at a time on the
    machine, the shared server started once. Each other module is a group of its own, so its
    module-scoped fixtures (models built once) are built on one worker only."""
    unmarked = [item.nodeid for item in items
                if SHARED_SERVER in item.fixturenames and item.get_closest_marker("ray") is None]
    if unmarked:
        raise pytest.UsageError(f"these tests use {SHARED_SERVER} but are not marked ray: {unmarked[:3]}")
    _run_the_shared_server_modules_together(items)
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            group = "ray" if item.get_closest_marker("ray") else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Refuse to run in parallel where pytest-xdist did not group the tests (it names a test's group
    in its node id, which some pytest releases do not let it set): two Ray clusters would start at
    once and the shared server's modules would be split across workers."""
    if node.config.getvalue("dist") == "loadgroup" and ids and not all("@" in nodeid for nodeid in ids):
        pytest.exit("pytest-xdist could not group the tests: this pytest and pytest-xdist disagree on node "
                    "ids; install the versions in constraints-cpu.txt", returncode=pytest.ExitCode.USAGE_ERROR)


UNSERVED_NICENESS = 10   # of an xdist worker while it runs a test that starts no Ray cluster


def pytest_runtest_protocol(item):
    """Under pytest-xdist, a worker running a test that starts no Ray cluster yields the CPU to the
    worker running the served ones: a Serve start keeps both cores busy (replicas importing torch
    at once) and, starved, it takes over twice as long, which makes the served group the run's
    longest path. Raising a niceness needs no privilege; lowering it back (a worker that ran other
    tests before the served group) does, and where it is refused the worker stays nice."""
    if not hasattr(item.config, "workerinput"):
        return
    niceness = 0 if item.get_closest_marker("ray") else UNSERVED_NICENESS
    if os.getpriority(os.PRIO_PROCESS, 0) == niceness:
        return
    # Linux keeps a niceness per thread: every thread of the worker (torch's too), and what it starts.
    threads = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for thread in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, int(thread), niceness)
        except (PermissionError, ProcessLookupError):
            pass


def _run_the_shared_server_modules_together(items: list) -> None:
    modules: dict = {}
    for item in items:
        modules.setdefault(getattr(item, "module", None), []).append(item)
    sharing = [group for group in modules.values() if _shares_the_server(group)]
    if len(sharing) < 2:
        return
    position = {id(item): i for i, item in enumerate(items)}
    first = position[id(sharing[0][0])]
    grouped = [item for group in sharing for item in group]
    rest = [item for group in modules.values() if not _shares_the_server(group) for item in group]
    before = [item for item in rest if position[id(item)] < first]
    items[:] = before + grouped + rest[len(before):]


def _next_module_shares_the_server(request) -> bool:
    items = request.session.items
    indices = [i for i, item in enumerate(items) if getattr(item, "module", None) is request.module]
    if not indices or indices[-1] + 1 >= len(items):
        return False
    following = getattr(items[indices[-1] + 1], "module", None)
    return _shares_the_server([item for item in items if getattr(item, "module", None) is following])


@pytest.fixture(autouse=True, scope="module")
def no_ray_left_behind(request):
    """A module that fails half-way (an assertion between start and stop, a timeout) must not leave
    its Ray cluster to the next module, whose own ray.init would then fail: one real failure,
    not a cascade of errors. The one exception is the shared served tiny pair, kept up while the
    next module uses it too."""
    yield
    from tests import local_server

    if local_server.shared_server_running() and _next_module_shares_the_server(request):
        return
    local_server.forget_shared_server()
    local_server.stop_test_cluster()


@pytest.fixture(scope="module")
def tiny_pair_server(tmp_path_factory):
    """(base URL, config) of the default tiny pair served on a local Ray cluster, started once for
    the consecutive modules that use it (tests/local_server.py says what it serves). A module using
    it must leave it as it found it: no request or sequence held, every deployment healthy."""
    from tests.local_server import shared_server

    return shared_server(tmp_path_factory)


@pytest.fixture(scope="session")
def checkpoint_families(tmp_path_factory):
    """Look-alikes of the Llama-3, Qwen2.5 and Mistral checkpoints (tests/checkpoint_fixtures.py),
    built once per session."""
    from tests.checkpoint_fixtures import build_all

    return build_all(tmp_path_factory.mktemp("checkpoints"))


_SESSION = pytest.StashKey["pytest.Session"]()


def pytest_sessionstart(session):
    session.config.stash[_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the process with pytest's own exit status once everything pytest does is done (results
    printed, every plugin unconfigured), without the interpreter's teardown. Why: that teardown,
    in a process that has been a Ray driver with Ray's and torch's native threads still alive, can
    end in a segmentation fault after every test passed, turning a green run red (docs/testing.md).
    Failures, errors, interruptions and "no tests" keep their status; SPECSERVE_TEST_NORMAL_EXIT=1
    keeps the teardown (to debug it)."""
    session = config.stash.get(_SESSION, None)
    if session is None or os.environ.get("SPECSERVE_TEST_NORMAL_EXIT"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(session.exitstatus))
