"""An engine's steps land on pages already mapped (decoding/host_memory.py): counted as the page
faults a process takes over sampled verify answers, in a worker thread as an engine runs them."""

import os
import subprocess
import sys

from specserve.decoding.host_memory import ENGINE_ENV, keep_freed_memory, malloc_env

# Prints the minor page faults per step of 20 sampled verify answers (8 requests, K = 4, an 8k
# vocabulary) after 5 to warm up; argv[1] "call": keep_freed_memory() first.
STEPS = """
import resource, sys, threading, torch
torch.set_num_threads(1)
if sys.argv[1] == "call":
    from specserve.decoding.host_memory import keep_freed_memory
    assert keep_freed_memory()
from specserve.decoding.compact_verify import DraftSupport
from specserve.decoding.proposers import Proposal
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.speculation import RowsCall, answer_verifies

def run():
    calls, vocab = 8, 8192
    params = SamplingParams(temperature=0.8, max_tokens=16)
    row_calls = [RowsCall(5, params, 10, list(range(20)), None, [2]) for _ in range(calls)]
    support = DraftSupport(torch.tensor([[t, t + 100] for t in (1, 2, 3, 4)]), torch.full((4, 2), 0.5))
    proposals = [Proposal([1, 2, 3, 4], support) for _ in range(calls)]
    rows = list(torch.randn(calls * 5, vocab).split([5] * calls))
    generators = [torch.Generator().manual_seed(i) for i in range(calls)]
    step = lambda: answer_verifies(rows, row_calls, proposals, lambda i: generators[i], ["block"] * calls)
    for _ in range(5):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)

thread = threading.Thread(target=run)
thread.start()
thread.join()
"""


def test_an_engine_process_takes_a_tenth_of_the_page_faults_or_fewer_with_its_malloc_settings():
    """Three processes over the same steps: malloc as glibc starts it (the test's own check that the
    steps fault at all), started with ENGINE_ENV (as a local cluster's processes are: a misspelt
    name would be ignored silently), and set from inside by keep_freed_memory (an in-process engine)."""
    assert keep_freed_memory()   # glibc, as every machine this project runs on
    plain_env = {name: value for name, value in os.environ.items() if not name.startswith("MALLOC_")}
    runs = {"default": (plain_env, "plain"), "ENGINE_ENV": ({**plain_env, **ENGINE_ENV}, "plain"),
            "keep_freed_memory": (plain_env, "call")}
    # One at a time: three torch processes at once would crowd the served tests beside this one.
    faults = {name: float(subprocess.run([sys.executable, "-c", STEPS, how], env=env, capture_output=True, text=True,
                                         check=True, timeout=120).stdout.split()[-1])
              for name, (env, how) in runs.items()}
    assert faults["default"] > 100, faults
    assert faults["ENGINE_ENV"] < faults["default"] / 10, faults
    assert faults["keep_freed_memory"] < faults["default"] / 10, faults


def test_a_malloc_setting_the_user_made_stands():
    assert malloc_env({}) == ENGINE_ENV
    assert malloc_env({"MALLOC_ARENA_MAX": "4"}) == {name: value for name, value in ENGINE_ENV.items()
                                                    if name != "MALLOC_ARENA_MAX"}


def test_kuberay_pods_start_with_the_malloc_settings():
    from specserve.cluster.kuberay import rayservice_manifest
    from specserve.common.config import PROJECT_ROOT, load_config

    manifest = rayservice_manifest(load_config(PROJECT_ROOT / "k8s" / "specserve-gpu.yaml", environ={}))
    cluster = manifest["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for pod in pods:
        env = {entry["name"]: entry["value"] for entry in pod["template"]["spec"]["containers"][0]["env"]}
        assert ENGINE_ENV.items() <= env.items()
