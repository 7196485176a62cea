"""Top-k / top-p cut among each row's top candidates (decoding.sampling.truncate_rows) equals the
cut of the whole sorted row.

Property tests over random rows wider than TOP_CANDIDATES: peaked rows (the cut lies among the
candidates of the first rung), rows whose cut lies only among the second rung's, flat ones (in
neither: the full sort), rows full of ties (at each rung's boundary too), under temperature, min-p,
top-k and top-p combinations, in one batch. Two references:
- the whole-row path called directly (`cut_by_prefix` over `sorted_prefix`): the candidate path must
  give bitwise the same probabilities, as it does the same float operations on the same numbers;
- the processing before candidates (a stable sort of every truncating row, masses from the sorted
  row's softmax; `full_sort_reference` below): the same kept set, probabilities within float32
  rounding. Its float32 softmax sums the row in another order, which can move a token whose exact
  mass before it lies within rounding of top_p across the boundary: such a token (a near-tie at the
  top-p boundary, found in float64 by `top_p_near_ties`) may be in one set and not the other, each
  being a correct cut; the sets must agree everywhere else, and the near-ties are counted, not hidden.
  Which rows have one depends on the CPU's vector width (AVX2 and AVX-512 sum in different orders).
The comparison must reject a candidate path that never falls back to the full sort.
"""

from __future__ import annotations

import pytest
import torch

import specserve.decoding.sampling as sampling
from specserve.decoding.sampling import (CANDIDATE_RUNGS, TOP_CANDIDATES, RowParams, SamplingParams, cut_by_prefix,
                                         process_rows, sorted_prefix, truncate_rows)

VOCAB_SIZE = 4 * TOP_CANDIDATES
ATOL = 1e-6  # float32 probabilities summed in another order
# A float32 sum of V positive terms is within V * 2**-24 of the exact one, relatively: how far two
# softmaxes of one row, summed in different orders, can put a token's mass before it apart.
BOUNDARY_TOL = VOCAB_SIZE * 2.0 ** -24


def sorted_top_k(logits: torch.Tensor, row_params: RowParams, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The processing before candidates, in dtype: every row scaled by its temperature and cut by
    min-p, then the truncating rows stably sorted and cut to their top-k by position;
    -> (the scaled rows, the truncating rows' sorted logits, their ids)."""
    logits = logits.to(dtype) / row_params.temperature.to(dtype).unsqueeze(-1)
    if row_params.uses_min_p:
        probs = torch.softmax(logits, dim=-1)
        min_p = row_params.min_p.to(dtype).unsqueeze(-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    rows = row_params.truncating
    sorted_logits, sorted_ids = torch.sort(logits[rows], dim=-1, descending=True, stable=True)
    positions = torch.arange(logits.shape[-1])
    sorted_logits = sorted_logits.masked_fill(positions >= row_params.top_k[rows].unsqueeze(-1), float("-inf"))
    return logits, sorted_logits, sorted_ids


def full_sort_reference(logits: torch.Tensor, row_params: RowParams) -> torch.Tensor:
    """process_rows as it was before candidates: every truncating row stably sorted, top-k by
    position, top-p on the softmax of the sorted row, scattered back. The rows are scaled in
    float32, as process_rows scales them, and cut and normalised in float64, so the reference's
    own rounding (a float32 sum over V terms) stays out of the comparison's tolerance."""
    logits, sorted_logits, sorted_ids = sorted_top_k(logits, row_params, torch.float32)
    probs = torch.softmax(logits, dim=-1)
    rows = row_params.truncating
    sorted_logits = sorted_logits.double()
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    outside_nucleus = sorted_probs.cumsum(dim=-1) - sorted_probs >= row_params.top_p[rows].double().unsqueeze(-1)
    outside_nucleus[..., 0] = False
    truncated = torch.softmax(sorted_logits.masked_fill(outside_nucleus, float("-inf")), dim=-1).float()
    return probs.index_copy(0, rows, torch.empty_like(truncated).scatter_(-1, sorted_ids, truncated))


def top_p_near_ties(logits: torch.Tensor, row_params: RowParams) -> torch.Tensor:
    """bool [truncating rows, V]: tokens whose exact mass before them (float64, the stable sorted
    order of full_sort_reference) lies within BOUNDARY_TOL of their row's top_p."""
    rows = row_params.truncating
    _, sorted_logits, sorted_ids = sorted_top_k(logits, row_params, torch.float64)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    margin = (sorted_probs.cumsum(dim=-1) - sorted_probs - row_params.top_p[rows].double().unsqueeze(-1)).abs()
    near = (margin < BOUNDARY_TOL) & (row_params.top_p[rows] < 1).unsqueeze(-1)
    return torch.zeros_like(near).scatter_(-1, sorted_ids, near)


def assert_same_processing(probs: torch.Tensor, reference: torch.Tensor,
                           near_ties: torch.Tensor | None = None) -> int:
    """The same kept sets but at near_ties (None: none allowed), the same probabilities within ATOL
    (rows that differ at a near-tie: over the tokens both keep, renormalised); -> how many rows
    differ at a near-tie."""
    differ = (probs > 0) != (reference > 0)
    allowed = torch.zeros_like(differ) if near_ties is None else near_ties
    assert not (differ & ~allowed).any(), "kept sets differ away from a top-p near-tie"
    same = ~differ.any(dim=-1)
    torch.testing.assert_close(probs[same], reference[same], atol=ATOL, rtol=0)
    both = (probs > 0) & (reference > 0)
    renormalised = [torch.where(both[~same], rows, 0.0) for rows in (probs[~same], reference[~same])]
    renormalised = [rows / rows.sum(dim=-1, keepdim=True) for rows in renormalised]
    torch.testing.assert_close(renormalised[0], renormalised[1], atol=ATOL, rtol=0)
    return int((~same).sum())


def boundary_tie(noise: torch.Tensor, place: int, generator: torch.Generator) -> torch.Tensor:
    """A row whose ids ranked place - 8 .. place + 7 tie (straddling the place-th), shuffled."""
    row = noise * 0.1 - 20
    row[: place - 8] = torch.linspace(10, 0, place - 8)
    row[place - 8: place + 8] = -1.0
    return row[torch.randperm(VOCAB_SIZE, generator=generator)]


def wide_nucleus(noise: torch.Tensor, size: int) -> torch.Tensor:
    """A row whose top-p 0.95 nucleus holds about `size` ids: that many within a small spread,
    far above the rest."""
    row = noise * 0.5 - 30
    row[:size] = noise[:size] * 0.2 + 10
    return row


def random_rows(seed: int) -> torch.Tensor:
    """Peaked, flat and tied rows [14, VOCAB_SIZE]; the caller adds bf16-rounded ones."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(12, VOCAB_SIZE, generator=generator)
    rows = [noise[0] * 8, noise[1] * 12, noise[2] * 4, noise[3] * 0.3, noise[4] * 0.05,
            (noise[5] * 3).round(),                      # ties everywhere, at the candidate boundary too
            (noise[6] * 8).round() / 2,                  # a peaked row tied at every value
            boundary_tie(noise[7], TOP_CANDIDATES, generator)]
    rows.append(torch.zeros(VOCAB_SIZE))              # all tied
    rows.extend(noise[9:] * 6)
    rows.append(boundary_tie(noise[8], CANDIDATE_RUNGS[0], generator))
    rows.append(wide_nucleus(noise[8], 2 * CANDIDATE_RUNGS[0]))   # cut among the second rung's candidates
    return torch.stack(rows)


PARAMS = [
    SamplingParams(temperature=1.0, top_p=0.95),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=0.7, top_p=0.5),
    SamplingParams(temperature=1.3, top_p=0.99),
    SamplingParams(temperature=1.0, top_k=50),
    SamplingParams(temperature=1.0, top_k=CANDIDATE_RUNGS[0]),
    SamplingParams(temperature=1.0, top_k=CANDIDATE_RUNGS[0] + 1, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=TOP_CANDIDATES),
    SamplingParams(temperature=1.0, top_k=TOP_CANDIDATES + 1, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=3 * TOP_CANDIDATES),
    SamplingParams(temperature=0.6, top_k=40, top_p=0.8),
    SamplingParams(temperature=1.0, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=1.5, top_p=0.999, min_p=0.3),
    SamplingParams(temperature=0.9, top_k=1, min_p=0.1),
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5, min_p=0.2),
]


def batch(seed: int) -> tuple[torch.Tensor, RowParams]:
    """Every row of random_rows under every PARAMS entry, in one batch."""
    rows = random_rows(seed)
    rows = torch.cat([rows, rows[[0, 1, 2, 9]].bfloat16().float()])  # a bf16 model's logits: ties everywhere
    logits = rows.repeat(len(PARAMS), 1)
    params = [p for p in PARAMS for _ in range(len(rows))]
    return logits, RowParams.of(params, VOCAB_SIZE)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_process_rows_keeps_the_full_sorts_set_with_its_probabilities(seed):
    logits, row_params = batch(seed)
    probs = process_rows(logits, row_params)
    reference = full_sort_reference(logits, row_params)
    truncating = row_params.truncating
    near_ties = top_p_near_ties(logits, row_params)
    rows_at_a_near_tie = assert_same_processing(probs[truncating], reference[truncating], near_ties)
    # Told apart, not hidden: at most the rows that have a near-tie differ, each at one token.
    assert rows_at_a_near_tie <= int(near_ties.any(dim=-1).sum())
    assert int(((probs[truncating] > 0) != (reference[truncating] > 0)).sum()) == rows_at_a_near_tie


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_candidate_path_is_bitwise_the_whole_sorted_rows_path(seed):
    logits, row_params = batch(seed)
    rows = row_params.truncating
    scaled = (logits / row_params.temperature.unsqueeze(-1))[rows]
    top_k, top_p = row_params.top_k[rows], row_params.top_p[rows]
    assert torch.equal(truncate_rows(scaled, top_k, top_p), cut_by_prefix(scaled, sorted_prefix(scaled), top_k, top_p)[1])


def rows_sorted_in_full(monkeypatch, logits: torch.Tensor, params: SamplingParams) -> int:
    """How many rows process_rows sorts whole (a spy on the real sorted_prefix)."""
    counted = []
    real = sampling.sorted_prefix

    def counting(rows: torch.Tensor) -> torch.Tensor:
        counted.append(rows.shape[0])
        return real(rows)

    monkeypatch.setattr(sampling, "sorted_prefix", counting)
    process_rows(logits, RowParams.of([params] * len(logits), VOCAB_SIZE))
    return sum(counted)


def test_peaked_rows_are_cut_among_their_candidates_and_flat_ones_sorted_whole(monkeypatch):
    rows = random_rows(0)
    top_p = SamplingParams(temperature=1.0, top_p=0.95)
    assert rows_sorted_in_full(monkeypatch, rows[[0, 1, 9, 10, 11]], top_p) == 0
    # bf16 logits tie all over the tail, across the candidate boundary too: still no sort
    assert rows_sorted_in_full(monkeypatch, rows[[0, 1, 6, 9]].bfloat16().float(), top_p) == 0
    assert rows_sorted_in_full(monkeypatch, rows[[3, 4]], top_p) == 2          # flat: the nucleus is wider
    # top-k reaching into a tie across the candidate boundary: which tied ids are in is the sort's to say
    assert rows_sorted_in_full(monkeypatch, rows[[7]], SamplingParams(top_k=TOP_CANDIDATES)) == 1
    assert rows_sorted_in_full(monkeypatch, rows[[3, 4]], SamplingParams(top_k=40)) == 0  # flat, but top-k cuts
    assert rows_sorted_in_full(monkeypatch, rows[[8]], SamplingParams(top_k=40)) == 1     # all tied


def candidate_calls(monkeypatch, logits: torch.Tensor, params: SamplingParams) -> list[tuple[int, int]]:
    """(width, rows) of each candidate_prefix call process_rows makes (a spy on the real one)."""
    calls = []
    real = sampling.candidate_prefix

    def counting(rows: torch.Tensor, width: int):
        calls.append((width, rows.shape[0]))
        return real(rows, width)

    monkeypatch.setattr(sampling, "candidate_prefix", counting)
    process_rows(logits, RowParams.of([params] * len(logits), VOCAB_SIZE))
    return calls


def test_a_row_goes_up_the_rungs_only_as_far_as_its_cut(monkeypatch):
    rows = random_rows(0)
    narrow, wide = CANDIDATE_RUNGS
    top_p = SamplingParams(temperature=1.0, top_p=0.95)
    assert candidate_calls(monkeypatch, rows[[0, 1, 9, 10, 11]], top_p) == [(narrow, 5)]   # peaked
    # a nucleus of about twice the first rung: the second rung for that row alone, and no full sort
    assert candidate_calls(monkeypatch, rows[[0, 13]], top_p) == [(narrow, 2), (wide, 1)]
    assert rows_sorted_in_full(monkeypatch, rows[[13]], top_p) == 0
    # top-k reaching into a tie across the first rung's boundary: settled among the second's
    top_k = SamplingParams(top_k=narrow)
    assert candidate_calls(monkeypatch, rows[[12]], top_k) == [(narrow, 1), (wide, 1)]
    assert rows_sorted_in_full(monkeypatch, rows[[12]], top_k) == 0


def test_the_comparison_rejects_a_candidate_path_that_never_sorts_whole(monkeypatch):
    logits, row_params = batch(0)
    reference = full_sort_reference(logits, row_params)

    def candidates_only(rows: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, exact: bool = True,
                        cuts_top_k: bool = True) -> torch.Tensor:
        return cut_by_prefix(rows, sampling.candidate_prefix(rows, TOP_CANDIDATES)[0], top_k, top_p)[1]

    monkeypatch.setattr(sampling, "truncate_rows", candidates_only)
    broken = process_rows(logits, row_params)
    with pytest.raises(AssertionError, match="away from a top-p near-tie"):
        assert_same_processing(broken[row_params.truncating], reference[row_params.truncating],
                               top_p_near_ties(logits, row_params))


def test_a_row_narrower_than_the_candidates_is_sorted_whole():
    logits = torch.randn(3, CANDIDATE_RUNGS[0] // 2, generator=torch.Generator().manual_seed(4)) * 3
    row_params = RowParams.of([SamplingParams(top_p=0.9), SamplingParams(top_k=7), SamplingParams(top_p=0.5, top_k=30)],
                              logits.shape[-1])
    assert_same_processing(process_rows(logits, row_params), full_sort_reference(logits, row_params))


def test_an_inexact_cut_as_a_drafts_keeps_the_nucleus_within_the_first_candidates():
    """process_rows(exact_cut=False), as a draft's rows are processed: a row whose top-p nucleus
    fits among its first CANDIDATE_RUNGS[0] candidates is cut exactly; a flatter row is cut at
    them: the likeliest CANDIDATE_RUNGS[0] tokens of its nucleus, renormalised."""
    generator = torch.Generator().manual_seed(9)
    logits = torch.cat([torch.randn(1, 4096, generator=generator) * 8, torch.randn(1, 4096, generator=generator) * 0.5])
    row_params = RowParams.of([SamplingParams(top_p=0.9)] * 2, logits.shape[-1])
    exact, inexact = process_rows(logits, row_params), process_rows(logits, row_params, exact_cut=False)
    width = CANDIDATE_RUNGS[0]
    assert (exact[0] > 0).sum() < width < (exact[1] > 0).sum()   # one row fits, the flat one does not
    torch.testing.assert_close(inexact[0], exact[0], atol=0, rtol=0)
    kept = inexact[1] > 0
    assert set(kept.nonzero().squeeze(-1).tolist()) == set(exact[1].topk(width).indices.tolist())
    torch.testing.assert_close(inexact[1], exact[1] * kept / (exact[1] * kept).sum())


def test_the_candidates_and_the_whole_row_are_in_the_stable_descending_order():
    """sorted_prefix and candidate_prefix order by one integer key (decoding.sampling.descending_keys):
    the order of a stable descending float sort, ties (bf16 rows, -0.0 beside +0.0, -inf) towards
    the lowest id."""
    rows = random_rows(1)
    rows = torch.cat([rows, rows[[0, 2]].bfloat16().float()])
    rows[0, :40] = torch.tensor([0.0, -0.0] * 20)[torch.randperm(40, generator=torch.Generator().manual_seed(2))]
    rows[1, ::3] = float("-inf")
    stable = torch.sort(rows, dim=-1, descending=True, stable=True).indices
    assert torch.equal(sorted_prefix(rows), stable)
    width = CANDIDATE_RUNGS[0]
    prefix_ids, exact_length, _ = sampling.candidate_prefix(rows, width)
    positions = torch.arange(width)
    exact = positions < exact_length.unsqueeze(-1)   # past those, tied values whose ids topk chose
    assert torch.equal(torch.where(exact, prefix_ids, 0), torch.where(exact, stable[:, :width], 0))
    assert torch.equal(rows.gather(-1, prefix_ids), rows.gather(-1, stable[:, :width]))
    assert bool((exact_length < width).any())   # the tied rows reach past an exact prefix
    with pytest.raises(TypeError, match="float32"):
        sorted_prefix(rows.double())


def test_rows_without_a_top_k_skip_its_arithmetic_and_cut_the_same():
    """truncate_rows(cuts_top_k=False), as process_rows calls it when no row has a top-k, gives
    bitwise what the top-k arithmetic gives there; where a row has a top-k the flag is not a no-op
    (so this comparison can fail)."""
    logits, row_params = batch(1)
    scaled = logits / row_params.temperature.unsqueeze(-1)
    no_top_k = (row_params.top_k == VOCAB_SIZE) & (row_params.top_p < 1)
    rows, top_k, top_p = scaled[no_top_k], row_params.top_k[no_top_k], row_params.top_p[no_top_k]
    for exact in (True, False):
        assert torch.equal(truncate_rows(rows, top_k, top_p, exact, cuts_top_k=False),
                           truncate_rows(rows, top_k, top_p, exact, cuts_top_k=True))
    with_top_k = row_params.top_k < VOCAB_SIZE
    rows, top_k, top_p = scaled[with_top_k], row_params.top_k[with_top_k], row_params.top_p[with_top_k]
    assert not torch.equal(truncate_rows(rows, top_k, top_p, cuts_top_k=False), truncate_rows(rows, top_k, top_p))


def test_on_an_accelerator_an_exact_cut_reads_nothing_back_to_the_host(monkeypatch):
    """process_rows over truncating, greedy and plain rows on PyTorch's meta device, where any read
    of a value on the host (item, bool, tolist) raises: the exact cut sorts whole rows there, the
    draft's inexact one keeps its first candidates, and neither waits on the device. The CPU's rung
    ladder, which asks which rows' cut fits, raises there (so this test can fail)."""
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(top_k=40), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0), SamplingParams(top_k=50, top_p=0.8, min_p=0.05)]
    meta = torch.device("meta")
    logits = torch.empty(len(params), VOCAB_SIZE, device=meta)
    row_params = RowParams.of(params, VOCAB_SIZE, meta)
    for exact_cut in (True, False):
        assert process_rows(logits, row_params, exact_cut=exact_cut).shape == logits.shape
    monkeypatch.setattr(sampling, "exact_cut_rungs", lambda device: CANDIDATE_RUNGS)
    with pytest.raises(RuntimeError, match="meta"):
        process_rows(logits, row_params)
