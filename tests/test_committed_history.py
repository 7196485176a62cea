"""The committed-history protocol's two ends (deployments.committed_history), without engines:
what the router sends and what an engine rebuilds, and every way an engine says it cannot."""

from dataclasses import replace

from specserve.common.messages import HistoryUpdate
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.sequence import RequestState
from specserve.deployments.committed_history import CommittedHistories, HistorySender, RunningDigest, history_digest

PROMPT = [5, 17, 42, 8]


def new_state() -> RequestState:
    return RequestState("r", PROMPT, SamplingParams(temperature=0, max_tokens=64), None, 256)


def test_the_digest_does_not_depend_on_how_the_history_was_split():
    tokens = list(range(3, 40))
    assert history_digest(tokens[10:], history_digest(tokens[:10])) == history_digest(tokens)
    assert history_digest(tokens) != history_digest(tokens[:-1] + [tokens[-1] + 1])
    assert history_digest([0]) != history_digest([])  # an id of 0 still counts


def test_each_update_carries_the_tokens_committed_since_and_the_engine_rebuilds_the_history():
    state, engine = new_state(), CommittedHistories()
    sender = HistorySender(RunningDigest())
    sizes = []
    for committed in ([], [7, 7, 1], [2], [], [9, 9, 9, 9, 9]):
        state.commit(committed)
        update = sender.update(state)
        sizes.append(len(update.new_tokens))
        assert engine.apply("r", update) == state.history
    assert sizes == [len(PROMPT), 3, 1, 0, 5]


def test_an_engine_that_cannot_rebuild_the_history_says_so_and_keeps_nothing():
    state, engine = new_state(), CommittedHistories()
    sender = HistorySender(RunningDigest())
    sender.update(state)  # told an engine that is then replaced by this one
    state.commit([7, 7])
    assert engine.apply("r", sender.update(state)) is None and "r" not in engine  # never saw it
    sender.forget()
    assert engine.apply("r", sender.update(state)) == state.history  # the whole history, once
    state.commit([1])
    update = sender.update(state)
    assert engine.apply("r", replace(update, digest=update.digest + 1)) is None and "r" not in engine
    beyond = HistoryUpdate(len(state.history) + 2, (), history_digest(state.history))
    assert engine.apply("r", beyond) is None


def test_a_whole_history_sent_again_replaces_what_the_engine_held():
    state, engine = new_state(), CommittedHistories()
    sender = HistorySender(RunningDigest())
    engine.apply("r", sender.update(state))
    state.commit([4, 4, 4])
    sender.forget()  # e.g. the router could not tell whether its last call arrived
    assert engine.apply("r", sender.update(state)) == state.history
    state.commit([6])
    assert engine.apply("r", sender.update(state)) == state.history
