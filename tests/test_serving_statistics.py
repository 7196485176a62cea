"""Sampled requests over HTTP follow the target's distribution (end to end, real local Ray cluster).

Speculation must be lossless for sampled requests too: the text a client receives is distributed
exactly as target-only sampling under the same temperature / top-k / top-p. Each case sends
NUM_REQUESTS short completions (NUM_TOKENS tokens, distinct seeds, 8 concurrent) of one prompt:
token 1 comes from the target's prefill, token 2 from the first speculative round, which drafts
one token (an accepted draft token or the recovered one), and token 3 from that verify's bonus row
or the next round. Three, not two: a round never drafts past the tokens a request still wants,
so a two-token completion has no speculative round at all, and every case checks its requests
drafted. The reference is the in-process target's processed distribution, exact in float64:
P(t1, t2, t3) = p(t1 | prompt) p(t2 | prompt, t1) p(t3 | prompt, t1, t2), mapped onto the text a
client sees (special tokens dropped; EOS ends the text) and summed per text.

Tolerances (stated, not tuned to pass): chi-square goodness of fit on the texts whose expected
count is >= 5, the rest pooled into one cell, must not reject at 1e-3; the total-variation
distance between the empirical and the exact text distribution must stay under exact sampling's
own 99.9% quantile at that many samples (tests.test_generate.null_tv_bound). The same test must
reject the target's distribution at half the temperature (same filters), so it has the power to
see a real error.

A verifier that accepts every draft token fails every case, and each case checks so in process
before sending anything: texts drawn from what such a server would send (the prefill's token from
the target, the round's draft token from the draft's processed row, the bonus token from the
target) fail the case's assertions in at least 99% of seeded simulated runs. The shared pair's
draft is a close copy of its target, so on most prompts these few texts cannot tell the two
apart; the top-k and top-p cases ask after a prompt where they can (docs/testing.md).

The penalties case's third token follows the target only if the verify's second row (and the
draft's second step) saw the block's first draft token; it must also reject the unpenalized
distribution, as the logit_bias case must reject the unbiased one. Greedy with penalties, greedy
with a logit_bias and allowed_token_ids, and greedy with bad_words, through the official openai
client, equal HF `generate` with the same processors.

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md).
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoTokenizer, LlamaForCausalLM, LogitsProcessorList, SequenceBiasLogitsProcessor

import openai

from specserve.decoding.row_processors import bad_words_token_ids, history_processor
from specserve.decoding.sampling import SamplingParams, logits_to_probs
from tests.local_server import SHARED_MODEL, wait_until_a_lone_greedy_request_drafts
from tests.test_generate import null_tv_bound
from tests.test_logit_bias import AllowedTokens, OutputBadWords
from tests.test_penalties import hf_processors

pytestmark = pytest.mark.ray
MODEL = SHARED_MODEL
PROMPT = "def fibonacci(n):\n"
NUM_REQUESTS = 200
MUTANT_PASS_RATE_CEILING = 0.01   # how often a server accepting every draft token may pass a case
SIMULATED_RUNS = 400
CONCURRENCY = 8
P_VALUE_FLOOR = 1e-3
NUM_TOKENS = 3   # per completion: the prefill's, then a speculative round's
TOP_K_CASE = ("for i in range(", {"temperature": 1.5, "top_k": 3})
CASES = {   # name -> (prompt, sampling)
    "temperature-top-k": TOP_K_CASE,
    # top-k bounds the texts to enumerate; the nucleus cuts them further (a server ignoring top_p fails it)
    "temperature-top-p": ("for i in range(", {"temperature": 1.5, "top_k": 6, "top_p": 0.8}),
    "penalties-min-p": (PROMPT, {"temperature": 1.5, "top_k": 4, "min_p": 0.05, "repetition_penalty": 1.3,
                                 "presence_penalty": 0.5, "frequency_penalty": 0.5}),
}
NEUTRAL_PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


@pytest.fixture(scope="module")
def server(tiny_pair_server):
    return tiny_pair_server


@pytest.fixture(scope="module")
def target(server):
    _, config = server
    return (LlamaForCausalLM.from_pretrained(config.target.path).eval(),
            AutoTokenizer.from_pretrained(config.target.path))


@pytest.fixture(scope="module")
def draft(server):
    return LlamaForCausalLM.from_pretrained(server[1].draft.path).eval()


def text_distribution(model, tokenizer, prompt: str, params: SamplingParams, num_tokens: int = NUM_TOKENS,
                      drafted_by=None) -> dict[str, float]:
    """Exact distribution of the client-visible text of a num_tokens completion, in float64,
    enumerated over the processed (penalized) model's support; EOS ends a branch. The prompt is
    tokenized as the server tokenizes a completion's text (with the tokenizer's special tokens:
    a BOS where it has one). drafted_by: a draft model whose processed row gives the second token
    instead, as a verifier accepting every draft token would send it (the first round drafts one
    token: a round never drafts past what the request still wants)."""
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
    eos = tokenizer.eos_token_id
    texts: Counter[str] = Counter()
    growing = {(): 1.0}
    for step in range(num_tokens):
        prefixes = list(growing)
        drawing = drafted_by if drafted_by is not None and step == 1 else model
        with torch.no_grad():
            logits = drawing(torch.tensor([prompt_ids + list(p) for p in prefixes])).logits[:, -1].float()
        grown = {}
        for prefix, row in zip(prefixes, logits):
            processor = history_processor(params, prompt_ids + list(prefix), len(prompt_ids), row.shape[-1])
            probs = logits_to_probs(row if processor is None else processor.process(row[None])[0], params).double()
            for token in torch.nonzero(probs).flatten().tolist():
                mass = growing[prefix] * float(probs[token])
                if token == eos or step == num_tokens - 1:
                    ids = list(prefix) + ([] if token == eos else [token])
                    texts[tokenizer.decode(ids, skip_special_tokens=True)] += mass
                else:
                    grown[prefix + (token,)] = mass
        growing = grown
    return dict(texts)


def sample_texts(url: str, sampling: dict, seeds: range, num_tokens: int = NUM_TOKENS, model: str = MODEL,
                 prompt: str = PROMPT) -> tuple[list[str], int]:
    """(each seed's completion text, draft tokens the requests drafted in all)."""
    def one(seed: int) -> tuple[str, int]:
        body = {"model": model, "prompt": prompt, "max_tokens": num_tokens, "seed": seed, **sampling}
        response = client.post(f"{url}/v1/completions", json=body, timeout=60)
        response.raise_for_status()
        answer = response.json()
        return answer["choices"][0]["text"], answer["speculation"]["num_drafted"]

    with httpx.Client() as client, ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(one, seeds))
    return [text for text, _ in answers], sum(drafted for _, drafted in answers)


def assert_follows_the_target(url: str, model: str, target, sampling: dict, seeds: range, prompt: str = PROMPT,
                              draft=None) -> tuple[SamplingParams, Counter]:
    """NUM_TOKENS-token completions of prompt, one per seed, follow the target's exact text
    distribution under `sampling` (the module docstring's tolerances), and reject the target at
    half the temperature; the requests drafted. With the served draft model: first, that a
    verifier accepting every draft token would fail this (`mutant_pass_rate`). -> (the requests'
    sampling parameters, the texts counted)."""
    params = SamplingParams(max_tokens=NUM_TOKENS, **sampling)
    expected = text_distribution(*target, prompt, params)
    tv_bound = null_tv_bound(torch.tensor(list(expected.values())), len(seeds))
    if draft is not None:
        accepting_all = text_distribution(*target, prompt, params, drafted_by=draft)
        rate = mutant_pass_rate(expected, tv_bound, accepting_all, len(seeds))
        assert rate <= MUTANT_PASS_RATE_CEILING, f"a server accepting every draft token passes {rate:.0%} of the time"
    texts, drafted = sample_texts(url, sampling, seeds, model=model, prompt=prompt)
    assert drafted > 0, "no request drafted: the test would see target-only sampling"
    observed = Counter(texts)
    assert follows(observed, expected, tv_bound), (observed.most_common(8), expected)
    colder = params.model_copy(update={"temperature": sampling["temperature"] / 2})
    assert chi_square_p_value(observed, text_distribution(*target, prompt, colder)) < P_VALUE_FLOOR
    return params, observed


def follows(observed: Counter, expected: dict[str, float], tv_bound: float) -> bool:
    """The module docstring's two tolerances: chi-square does not reject at P_VALUE_FLOOR and the
    total variation is under tv_bound (exact sampling's own 99.9% quantile at this many samples)."""
    return chi_square_p_value(observed, expected) > P_VALUE_FLOOR and total_variation(observed, expected) < tv_bound


def mutant_pass_rate(expected: dict[str, float], tv_bound: float, sent: dict[str, float], num_samples: int) -> float:
    """How often num_samples texts drawn from `sent` pass `follows(..., expected, tv_bound)`:
    seeded multinomial runs (SIMULATED_RUNS)."""
    texts = list(sent)
    probs = torch.tensor([sent[text] for text in texts], dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    passed = 0
    for _ in range(SIMULATED_RUNS):
        counts = torch.bincount(torch.multinomial(probs, num_samples, replacement=True, generator=generator),
                                minlength=len(texts))
        passed += follows(Counter({text: int(n) for text, n in zip(texts, counts) if n}), expected, tv_bound)
    return passed / SIMULATED_RUNS


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
def test_sampled_text_over_http_follows_the_targets_distribution(server, target, draft, case):
    url, _ = server
    prompt, sampling = CASES[case]
    start = 10_000 * sorted(CASES).index(case)
    params, observed = assert_follows_the_target(url, MODEL, target, sampling, range(start, start + NUM_REQUESTS),
                                                 prompt, draft)
    if params.uses_penalties:   # a server ignoring penalties would be caught too
        unpenalized = params.model_copy(update=NEUTRAL_PENALTIES)
        assert chi_square_p_value(observed, text_distribution(*target, prompt, unpenalized)) < P_VALUE_FLOOR


def test_sampled_text_with_a_logit_bias_follows_the_biased_target(server, target, draft):
    """logit_bias lowers the target's likeliest first token and lifts its third: the texts follow
    the biased target, and the unbiased target's distribution is rejected."""
    url, _ = server
    model, tokenizer = target
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    with torch.no_grad():
        ranked = model(torch.tensor([prompt_ids])).logits[0, -1].argsort(descending=True).tolist()
    sampling = {"temperature": 1.5, "top_k": 4, "logit_bias": {ranked[0]: -1.5, ranked[2]: 1.5}}
    params, observed = assert_follows_the_target(url, MODEL, target, sampling, range(40_000, 40_000 + NUM_REQUESTS),
                                                 PROMPT, draft)
    unbiased = params.model_copy(update={"logit_bias": {}})
    assert chi_square_p_value(observed, text_distribution(*target, PROMPT, unbiased)) < P_VALUE_FLOOR


def test_greedy_with_a_logit_bias_and_allowed_ids_over_the_openai_client_equals_hf_generate(server, target):
    url, _ = server
    model, tokenizer = target
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    wait_until_a_lone_greedy_request_drafts()
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    plain_ids = tokenizer.encode(plain.choices[0].text, add_special_tokens=False)
    # Ban the unbiased text's first token; allow only ids the unbiased text and a few others use.
    bias = {plain_ids[0]: -100, plain_ids[1]: 2.0}
    allowed = sorted(set(plain_ids[1:]) | set(range(20, 60)) | {tokenizer.eos_token_id})
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                      logit_bias={str(token): value for token, value in bias.items()},
                                      extra_body={"allowed_token_ids": allowed})
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False,
                                logits_processor=LogitsProcessorList([AllowedTokens(allowed), SequenceBiasLogitsProcessor(
                                    {(token,): value for token, value in bias.items()})]),
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    ids = output[0, len(prompt_ids):].tolist()
    ids = ids[:ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids
    assert reply.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True)
    assert ids and ids[0] != plain_ids[0] and set(ids) <= set(allowed)
    assert reply.model_extra["speculation"]["num_drafted"] > 0


def test_greedy_with_bad_words_over_the_openai_client_equals_hf_generate(server, target):
    """The tiny target repeats the prompt's last character; banning it (and a two-token word)
    changes the text, which equals HF `generate` with the same bad words (multi-token matching is
    checked in process, tests/test_logit_bias.py)."""
    url, _ = server
    model, tokenizer = target
    prompt = TOP_K_CASE[0]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    wait_until_a_lone_greedy_request_drafts()
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    bad_words = [plain.strip()[0], "i in"]
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"bad_words": bad_words})
    words = bad_words_token_ids(bad_words, lambda text: tokenizer.encode(text, add_special_tokens=False))
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False,
                                logits_processor=LogitsProcessorList([OutputBadWords(len(prompt_ids), words)]),
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    ids = output[0, len(prompt_ids):].tolist()
    ids = ids[:ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids
    assert reply.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True) != plain
    assert bad_words[0] not in reply.choices[0].text
    assert reply.model_extra["speculation"]["num_drafted"] > 0


def test_greedy_with_penalties_over_the_openai_client_equals_hf_generate(server, target):
    url, _ = server
    model, tokenizer = target
    penalties = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.8}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                      presence_penalty=penalties["presence_penalty"],
                                      frequency_penalty=penalties["frequency_penalty"],
                                      extra_body={"repetition_penalty": penalties["repetition_penalty"]})
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False,
                                logits_processor=hf_processors(len(prompt_ids), penalties),
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    ids = output[0, len(prompt_ids):].tolist()
    ids = ids[:ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids
    assert reply.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True)
    unpenalized = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert unpenalized.choices[0].text != reply.choices[0].text  # the penalties changed the text
