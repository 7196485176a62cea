"""Sampled requests over HTTP follow the target's distribution (end to end, real local Ray cluster).

Speculation must be lossless for sampled requests too: the text a client receives is distributed
exactly as target-only sampling under the same temperature / top-k / top-p. Each case sends
NUM_REQUESTS short completions (max_tokens 2, distinct seeds, 8 concurrent) of one prompt: token 1
comes from the target's prefill, token 2 from the first speculative round (an accepted draft token
or the recovered one). The reference is the in-process target's processed distribution, exact in
float64: P(t1, t2) = p(t1 | prompt) * p(t2 | prompt, t1), mapped onto the text a client sees
(decode([t1, t2]), special tokens dropped; EOS first ends the text) and summed per text.

Tolerances (stated, not tuned to pass): chi-square goodness of fit on the texts whose expected
count is >= 5, the rest pooled into one cell, must not reject at 1e-3; the total-variation
distance between the empirical and the exact text distribution must stay under 0.2 (its expectation
at 200 samples over these few cells is a few hundredths). The same test must reject the target's
distribution at half the temperature (same filters), so it has the power to see a real error.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoTokenizer, LlamaForCausalLM

from decoding.sampling import SamplingParams, logits_to_probs
from tests.local_server import serve_tiny_pair

pytestmark = pytest.mark.ray
MODEL = "tiny-pair"
PROMPT = "def fibonacci(n):\n"
NUM_REQUESTS = 200
CONCURRENCY = 8
P_VALUE_FLOOR = 1e-3
TV_BOUND = 0.2
CASES = {
    "temperature-top-k": {"temperature": 1.5, "top_k": 8},
    "temperature-top-p": {"temperature": 1.2, "top_p": 0.5},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_tiny_pair(tmp_path_factory.mktemp("pair"), MODEL)


@pytest.fixture(scope="module")
def target(server):
    _, config = server
    return (LlamaForCausalLM.from_pretrained(config.target.path).eval(),
            AutoTokenizer.from_pretrained(config.target.path))


def text_distribution(model, tokenizer, prompt: str, params: SamplingParams) -> dict[str, float]:
    """Exact distribution of the client-visible text of a 2-token completion, in float64."""
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        first = logits_to_probs(model(torch.tensor([prompt_ids])).logits[0, -1], params).double()
        support = [int(t) for t in torch.nonzero(first).flatten()]
        continuing = [t for t in support if t != eos]
        second = logits_to_probs(model(torch.tensor([prompt_ids + [t] for t in continuing])).logits[:, -1],
                                 params).double()
    texts: Counter[str] = Counter()
    if eos in support:
        texts[""] += float(first[eos])
    for t1, row in zip(continuing, second):
        for t2 in torch.nonzero(row).flatten().tolist():
            texts[tokenizer.decode([t1, t2], skip_special_tokens=True)] += float(first[t1] * row[t2])
    return dict(texts)


def sample_texts(url: str, sampling: dict, seeds: range) -> list[str]:
    def one(seed: int) -> str:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "seed": seed, **sampling}
        response = client.post(f"{url}/v1/completions", json=body, timeout=60)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]

    with httpx.Client() as client, ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(one, seeds))


def chi_square_p_value(observed: Counter, expected_probs: dict[str, float]) -> float:
    total = sum(observed.values())
    mass = sum(expected_probs.values())  # 1 up to float rounding; scipy wants equal sums
    expected_probs = {text: p / mass for text, p in expected_probs.items()}
    frequent = [text for text, p in expected_probs.items() if p * total >= 5]
    observed_cells = [observed[text] for text in frequent]
    expected_cells = [expected_probs[text] * total for text in frequent]
    rest_observed = total - sum(observed_cells)
    rest_expected = total - sum(expected_cells)
    if rest_expected > 1e-6:
        observed_cells.append(rest_observed)
        expected_cells.append(rest_expected)
    elif rest_observed:
        return 0.0  # a text the distribution gives no mass at all was sent
    else:
        expected_cells[-1] += total - sum(expected_cells)
    return float(chisquare(observed_cells, expected_cells).pvalue)


def total_variation(observed: Counter, expected_probs: dict[str, float]) -> float:
    total = sum(observed.values())
    texts = set(observed) | set(expected_probs)
    return 0.5 * sum(abs(observed[t] / total - expected_probs.get(t, 0.0)) for t in texts)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_text_over_http_follows_the_targets_distribution(server, target, case):
    url, _ = server
    sampling = CASES[case]
    params = SamplingParams(max_tokens=2, **sampling)
    start = 10_000 * sorted(CASES).index(case)
    observed = Counter(sample_texts(url, sampling, range(start, start + NUM_REQUESTS)))
    expected = text_distribution(*target, PROMPT, params)

    assert chi_square_p_value(observed, expected) > P_VALUE_FLOOR, (observed.most_common(8), expected)
    assert total_variation(observed, expected) < TV_BOUND
    # Power: a server sampling at the wrong temperature would be caught.
    colder = SamplingParams(max_tokens=2, **{**sampling, "temperature": sampling["temperature"] / 2})
    assert chi_square_p_value(observed, text_distribution(*target, PROMPT, colder)) < P_VALUE_FLOOR
