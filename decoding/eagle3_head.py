"""An EAGLE-3 draft head as a torch module: what one drafting step of the head computes.

Why a module of its own: an EAGLE-3 head is not a causal LM a runner can load. It is one Llama
decoder layer fed by the *target*: a fusion layer (`fc`) maps three of the target's hidden layers
(3 x target hidden) to one feature; the layer's attention reads [token embedding ; feature] (2 x
hidden in, with the target's embeddings); its own norm and lm_head score a reduced vocabulary, and
a draft -> target id map (`d2t`) says which target token each row is. vLLM's and SGLang's
`llama_eagle3.py` compute the same (docs/eagle3.md); this is our own writing of it.

The head's step for one sequence: rows (feature, token) at positions p, p+1, ... each attend to
the head's earlier entries of that sequence and to each other causally; each row's output is the
next token's scores and the pre-norm hidden state that feeds the head's next step when the
target's feature is not known yet (a drafted position). Keys and values go to the caller's
HeadKV: the proposer (decoding.eagle3_proposer) owns each sequence's entries and crops them on
rollback.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specserve.decoding.compiled_forward import CompiledForward
from specserve.decoding.lean_forward import apply_rope, rope_signs


def aux_features(hidden_states: Sequence[torch.Tensor], aux_layers: Sequence[int]) -> torch.Tensor:
    """What a head fuses, from transformers' hidden_states (layer i's input is hidden_states[i],
    index 0 the embeddings): the aux layers' concatenated in layer order."""
    return torch.cat([hidden_states[layer] for layer in aux_layers], dim=-1)


@dataclass(frozen=True)
class Eagle3Shape:
    """The numbers a head's weights are built from (read from its config.json, decoding.eagle3_checkpoint)."""

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int              # the target's vocabulary (what d2t maps into)
    draft_vocab_size: int        # the head's lm_head rows
    rms_norm_eps: float
    norm_before_residual: bool   # the residual is the normed feature (speculators' option), else the raw one
    rope_config: LlamaConfig     # rotary embedding settings (rope_theta, rope_scaling) of the head's layer


@dataclass
class HeadStep:
    """One head step's results for rows at consecutive positions of one sequence."""

    logits: torch.Tensor     # [T, draft_vocab] scores over the head's vocabulary
    prenorm: torch.Tensor    # [T, hidden]: the feature of the head's next step at a drafted position


class HeadKV:
    """One sequence's head keys and values, [kv_heads, capacity, head_dim] each, the entry at
    position p in slot p. A step writes its rows in place and attends over slots 0..its last
    position, so adding an entry copies nothing already there (the capacity doubles when full),
    and entries past the committed ones (a round's drafted tokens) are simply written over by the
    next round's. The head is one layer: a per-sequence buffer is its whole cache, where the
    draft engine's paged cache serves many layers and many sequences sharing prefixes."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 64) -> None:
        self.keys = torch.empty(num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Entries start..start+T-1 from keys and values [kv_heads, T, head_dim]."""
        end = start + keys.shape[1]
        if end > self.keys.shape[1]:
            capacity = max(end, 2 * self.keys.shape[1])
            grown = self.keys.new_empty(self.keys.shape[0], capacity, self.keys.shape[2])
            grown_values = torch.empty_like(grown)
            grown[:, :start], grown_values[:, :start] = self.keys[:, :start], self.values[:, :start]
            self.keys, self.values = grown, grown_values
        self.keys[:, start:end] = keys
        self.values[:, start:end] = values

    def entries(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the keys and values of entries 0..end-1."""
        return self.keys[:, :end], self.values[:, :end]


class Eagle3Head(nn.Module):
    """fc, one decoder layer over [embedding ; feature], norm, lm_head over the reduced vocabulary,
    and `draft_to_target` (absolute target ids of the head's rows). `embed` is the target's input
    embedding (shared, not copied) unless the checkpoint ships its own."""

    def __init__(self, shape: Eagle3Shape, embed: nn.Embedding) -> None:
        super().__init__()
        self.shape = shape
        hidden, heads, kv_heads, head_dim = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.embed = embed
        self.fc = nn.Linear(3 * shape.target_hidden_size, hidden, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(hidden))
        self.hidden_norm = nn.Parameter(torch.ones(hidden))
        self.post_attention_layernorm = nn.Parameter(torch.ones(hidden))
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, hidden, bias=False)
        self.norm = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, shape.draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target", torch.arange(shape.draft_vocab_size), persistent=False)
        self.rotary = LlamaRotaryEmbedding(shape.rope_config)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None   # (cos, signed sin) [P, head_dim]
        self.compiled_steps: tuple[CompiledForward, CompiledForward] | None = None   # `compile_steps`

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.shape.rms_norm_eps)

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """[T, 3 x target hidden] (the target's three layers, concatenated in layer order) -> [T, hidden]."""
        return self.fc(target_features)

    def new_kv(self) -> HeadKV:
        """An empty cache for one sequence, on the head's device in its dtype."""
        weight = self.k_proj.weight
        return HeadKV(self.shape.num_kv_heads, self.shape.head_dim, weight.dtype, weight.device)

    def step(self, token_ids: torch.Tensor, features: torch.Tensor, start: int, kv: HeadKV | None = None
             ) -> HeadStep:
        """Rows t = 0..T-1 of one sequence at positions start..start+T-1: token_ids [T] (the token
        AFTER each row's feature's position), features [T, hidden] (fused target features or the
        head's own prenorm). The rows' keys and values are written to kv (a fresh one if None) at
        their positions; each row attends to the entries before start and to rows <= t. Every
        row's output: the reference drafting from scratch is (the proposer drafts with
        step_sequences, which answers each sequence's last row)."""
        kv = self.new_kv() if kv is None else kv
        length = token_ids.shape[0]
        q, k, v, residual = self._projected(token_ids, features,
                                            torch.arange(start, start + length, device=token_ids.device),
                                            start + length)
        kv.write(start, k, v)
        attended = self._attend(q, *kv.entries(start + length))
        logits, prenorm = self._rows_out(attended, residual)
        return HeadStep(logits, prenorm)

    def step_sequences(self, token_ids: torch.Tensor, features: torch.Tensor, starts: Sequence[int],
                       lengths: Sequence[int], kvs: Sequence[HeadKV]) -> list[HeadStep]:
        """Consecutive rows of B sequences at once: token_ids [N] and features [N, hidden] hold
        sequence b's lengths[b] rows (positions starts[b], starts[b] + 1, ...) after those of the
        sequences before it; their keys and values are written to kvs[b]. -> per sequence, the
        output of its LAST row (a one-row HeadStep): a row's entry is its keys and values, which
        need none of its output, and only the last row drafts next. The projections, the MLP and
        the LM head run once for every sequence's rows, so the head's weights are read once a
        call, not once a sequence (a drafting step: one row each; making entries from the
        target's features: the rows each round committed); each row attends over its own
        sequence's entries."""
        positions = torch.tensor([start + row for start, length in zip(starts, lengths) for row in range(length)],
                                 device=token_ids.device)
        q, k, v, residual = self._projected(token_ids, features, positions,
                                            max(start + length for start, length in zip(starts, lengths)))
        ends = list(itertools.accumulate(lengths))
        attended = []
        for kv, start, length, end in zip(kvs, starts, lengths, ends):
            kv.write(start, k[:, end - length:end], v[:, end - length:end])
            attended.append(self._attend(q[:, end - 1:end], *kv.entries(start + length)))
        if len(ends) < residual.shape[0]:   # some sequence has rows before its last
            residual = residual.index_select(0, torch.tensor([end - 1 for end in ends], device=residual.device))
        logits, prenorm = self._rows_out(torch.cat(attended, dim=1), residual)
        return [HeadStep(logits[b:b + 1], prenorm[b:b + 1]) for b in range(len(kvs))]

    def compile_steps(self, enforce_eager: bool | None = None, inductor_options: dict | None = None,
                      name: str = "EAGLE-3 head") -> str:
        """Compile a step's dense parts, the rows in (norms, projections, rotary) and the rows out
        (output projection, MLP, norm, LM head), as the engines compile their forwards
        (decoding.compiled_forward: on a GPU unless enforce_eager, on CPU only where it is False;
        dynamic in the number of rows; eager, with one warning, where compiling fails; no CUDA
        graphs, whose rungs the rows are not padded to). Attention over each sequence's own entries
        runs eagerly between them. Why: a drafting step is a few
        small products among tens of elementwise ops whose dispatch (launches, on a GPU) costs more
        than their arithmetic; compiled, they run fused. -> what runs, for the start-up line."""
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        rows_in = CompiledForward(self._rows_in, device, enforce_eager, inductor_options, cuda_graphs=False)
        rows_out = CompiledForward(self._output, device, enforce_eager, inductor_options, cuda_graphs=False)
        self.compiled_steps = (rows_in, rows_out)
        shape = self.shape
        rows_in_args, rows_out_args = [], []
        for rows in (1, 3):   # one row (a drafting step) and several (a round's entries)
            features = torch.zeros(rows, shape.hidden_size, dtype=dtype, device=device)
            rows_in_args.append((torch.zeros(rows, dtype=torch.long, device=device), features,
                                 *self._rope(torch.arange(rows, device=device), rows, dtype)))
            rows_out_args.append((torch.zeros(shape.num_heads, rows, shape.head_dim, dtype=dtype, device=device),
                                  features))
        with torch.inference_mode():   # as drafting runs (a compiled graph is kept per grad mode)
            rows_in.warm_up(lambda: [rows_in(*args) for args in rows_in_args], name)
            rows_out.warm_up(lambda: [rows_out(*args) for args in rows_out_args], name)
        return f"rows in: {rows_in.describe()}; rows out: {rows_out.describe()}"

    def _projected(self, token_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                   end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows [T] at positions (every one below end) -> their rotated queries [heads, T,
        head_dim], keys and values [kv_heads, T, head_dim], and the residual [T, hidden] the
        attention output adds to."""
        cos, signed_sin = self._rope(positions, end, features.dtype)
        rows_in = self._rows_in if self.compiled_steps is None else self.compiled_steps[0]
        return rows_in(token_ids, features, cos, signed_sin)

    def _rows_in(self, token_ids: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_projected` once the rows' cos and signed sin [T, head_dim] are read (no leading 1: a
        compiled graph's sizes are symbols, not specialised to 1, so a [1, T] would not broadcast)."""
        shape = self.shape
        length = token_ids.shape[0]
        embeds = self._rms(self.embed(token_ids).to(features.dtype), self.input_layernorm)
        if shape.norm_before_residual:
            normed = self._rms(features, self.hidden_norm)
            residual = normed
        else:
            residual = features
            normed = self._rms(features, self.hidden_norm)
        x = torch.cat([embeds, normed], dim=-1)
        # The modules' own forwards, without their call's hook machinery (a drafting step is a few
        # small products, where that bookkeeping shows).
        q = self.q_proj.forward(x).view(length, shape.num_heads, shape.head_dim).transpose(0, 1)
        k = self.k_proj.forward(x).view(length, shape.num_kv_heads, shape.head_dim).transpose(0, 1)
        v = self.v_proj.forward(x).view(length, shape.num_kv_heads, shape.head_dim).transpose(0, 1)
        return apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin), v, residual

    def _rope(self, positions: torch.Tensor, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, head_dim] of positions [T] (each below end), read from tables
        of positions 0..P-1 made by the rotary module once (P doubling as positions grow). A row of
        the table equals the module's own output at that position (each entry is one product of
        the position and a frequency, then elementwise functions), so a step indexes rows instead
        of recomputing them."""
        table = self._rope_table
        if table is None or table[0].shape[0] < end or table[0].dtype != dtype or table[0].device != positions.device:
            size = max(end, 2 * (0 if table is None else table[0].shape[0]), 256)
            every = torch.arange(size, device=positions.device)
            cos, sin = self.rotary(torch.empty(0, dtype=dtype, device=positions.device), every.unsqueeze(0))
            table = self._rope_table = (cos[0], rope_signs(sin)[0])
        return table[0][positions], table[1][positions]

    def _attend(self, q: torch.Tensor, all_keys: torch.Tensor, all_values: torch.Tensor) -> torch.Tensor:
        """Consecutive rows of one sequence, the last T of its entries, over the entries before
        them and each other, causally: q [heads, T, head_dim], the entries' keys and values
        [kv_heads, P + T, head_dim] -> [heads, T, head_dim]. Two batched products with the query
        heads of a key head side by side (no copy of the keys per query head, no mask for a lone
        row): a drafting step attends one row, where SDPA's dispatch and a repeated copy of every
        entry cost more than the arithmetic."""
        heads, length, head_dim = q.shape
        kv_heads, entries = all_keys.shape[0], all_keys.shape[1]
        groups = heads // kv_heads
        # query head h = key head h // groups (transformers' repeat_kv); rows (group, t) in that order
        scores = torch.matmul(q.reshape(kv_heads, groups * length, head_dim), all_keys.transpose(1, 2))
        scores = scores * head_dim ** -0.5
        if length > 1:   # row t sees every past entry and the new rows up to itself
            last_seen = (torch.arange(length, device=q.device) + entries - length).repeat(groups)
            scores = scores.masked_fill(torch.arange(entries, device=q.device) > last_seen[:, None], float("-inf"))
        # the softmax in float32 whatever the head's dtype, as transformers' eager attention does
        weights = scores.softmax(-1, dtype=torch.float32).to(all_values.dtype)
        return torch.matmul(weights, all_values).view(heads, length, head_dim)

    def _rows_out(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_output`, compiled where `compile_steps` compiled it."""
        return (self._output if self.compiled_steps is None else self.compiled_steps[1])(attended, residual)

    def _output(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output [heads, T, head_dim] and residual [T, hidden] -> (scores over the
        head's vocabulary [T, draft_vocab], the pre-norm hidden state [T, hidden])."""
        hidden = self.o_proj.forward(attended.transpose(0, 1).reshape(residual.shape[0], -1)) + residual
        x = self._rms(hidden, self.post_attention_layernorm)
        prenorm = hidden + self.down_proj.forward(F.silu(self.gate_proj.forward(x)) * self.up_proj.forward(x))
        return self.lm_head.forward(self._rms(prenorm, self.norm)), prenorm

    def target_logits(self, draft_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Scores over the target's vocabulary [T, vocab_size]: the head's rows at their target ids,
        -inf elsewhere, so any processing (temperature, top-k/p) gives zero probability to tokens
        the head cannot propose, and q stays the distribution the token was drawn from."""
        full = draft_logits.new_full((draft_logits.shape[0], vocab_size), float("-inf"))
        return full.index_copy(1, self.draft_to_target, draft_logits)

