"""A draft model's LM head over a token map: the draft scores, and so proposes, only the tokens the
map names (FR-Spec's frequency-ranked draft vocabulary; SGLang's `--speculative-token-map`).

Why: a small draft's step is mostly its LM head where the vocabulary is large (at Llama-3's
128,256 tokens the head is a fifth of a 1B draft's weights and most of a tiny one's), and a step
reads every row of it. Text keeps to a small share of a vocabulary most of the time, so the rows
of its most frequent tokens make nearly every greedy proposal the full head would, for the cost
of those rows. It stays lossless: rejection sampling is exact for any q the draft token was drawn
from, and a token outside the map gets q = 0, so the target's residual alone supplies it; what a
map costs is acceptance where the target's token lies outside it: a greedy row only where the
full head's argmax does, a sampled row on all the mass outside. So only a step whose rows are all
greedy scores the map, any other the whole head, unless the map is for sampled rows too
(`draft.token_map_sampled`). Measured in docs/token-map.md.

`MappedHead` keeps the head's parameters and state dict (a weight swap of the draft loads into
them as before, `remap_heads` then copies the map's rows again) and returns logits over the whole
vocabulary, FLOOR outside the map, so everything downstream (penalties, grammar masks, sampling,
the speculation cache's guesses, the verify's q) runs unchanged. FLOOR is finite rather than -inf
so a row whose grammar allows only tokens outside the map is still a distribution (uniform over
what it allows); its softmax weight beside any real logit is exactly zero in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specserve.decoding.weight_layout import PackedLinear, linear, pack_weight

# A ModelSpec's token_map that asks for the draft folder's own map (`folder_token_map`).
AUTO_TOKEN_MAP = "auto"
# Where a draft checkpoint keeps its map, beside its weights (the default pair's draft does).
FOLDER_TOKEN_MAP = "token_map.json"

# The logit of a token outside the map: exp(FLOOR - m) underflows to 0 in float32 for any row
# whose largest logit m is above FLOOR + 104, and it survives a temperature's division in half
# precision.
FLOOR = -1.0e4


class TokenMapError(ValueError):
    """A token map that cannot be served: missing, unreadable, empty, or naming ids the model lacks."""


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The token ids a map file names, ascending and distinct (int64). The file is a JSON list of
    ids, or a tensor of them saved with torch.save (SGLang's token-map format). TokenMapError
    naming why it cannot be served over a vocabulary of vocab_size tokens."""
    path = Path(path)
    if not path.is_file():
        raise TokenMapError(f"token map {path} not found")
    try:
        if path.suffix == ".json":
            raw = json.loads(path.read_text())
            ids = torch.tensor(raw, dtype=torch.long) if isinstance(raw, list) and all(
                type(value) is int for value in raw) else None
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            ids = loaded.long() if isinstance(loaded, torch.Tensor) and not loaded.is_floating_point() else None
    except (OSError, ValueError, RuntimeError) as error:
        raise TokenMapError(f"token map {path} cannot be read: {error}") from None
    if ids is None or ids.dim() != 1:
        raise TokenMapError(f"token map {path} must hold one list of integer token ids")
    ids = ids.unique()
    if ids.numel() == 0:
        raise TokenMapError(f"token map {path} names no tokens")
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise TokenMapError(f"token map {path} names token ids outside the draft's vocabulary of {vocab_size} "
                            f"(from {int(ids[0])} to {int(ids[-1])})")
    return ids


def folder_token_map(model_path: str | Path) -> str | None:
    """The map a draft checkpoint carries (FOLDER_TOKEN_MAP in its folder), or None."""
    path = Path(model_path) / FOLDER_TOKEN_MAP
    return str(path) if path.is_file() else None


def served_token_map(token_map: str | None, model_path: str | Path, drafts: bool) -> str | None:
    """The map a model serves with, given its spec's token_map: AUTO_TOKEN_MAP is its folder's own
    map where the model drafts as a draft model on one rank (drafts), else none; a path or None
    as it is (the config refuses a path where the model does not draft so)."""
    if token_map != AUTO_TOKEN_MAP:
        return token_map
    return folder_token_map(model_path) if drafts else None


def frequent_tokens(stream: torch.Tensor, count: int, vocab_size: int) -> torch.Tensor:
    """The count most frequent token ids of a token stream, ascending: a token map (or an EAGLE-3
    head's reduced vocabulary)."""
    counts = torch.bincount(stream.flatten().long(), minlength=vocab_size)
    return counts.topk(count).indices.sort().values


def ranked_tokens(stream: torch.Tensor, size: int, vocab_size: int, eos_token_id: int | None) -> list[int]:
    """A token map of a token stream: its size most frequent ids (ascending), EOS always among them."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"--size must be between 1 and the vocabulary's {vocab_size} tokens, got {size}")
    ids = set(frequent_tokens(stream, size, vocab_size).tolist())
    if eos_token_id is not None:
        ids.add(eos_token_id)
    return sorted(ids)


def write_folder_map(model_dir: str | Path, ids: list[int]) -> Path:
    """Save ids as the map a draft checkpoint carries (`draft.token_map: auto` serves it)."""
    path = Path(model_dir) / FOLDER_TOKEN_MAP
    path.write_text(json.dumps(ids))
    return path


class MappedHead(PackedLinear):
    """An LM head (an nn.Linear: same parameters, same state dict) that, in a step whose rows it
    may map (`for_step`), computes only the rows of its token map and returns logits over the
    whole vocabulary, FLOOR elsewhere; in any other step it is the whole head. The map's ids and
    its rows (copied from the weight, input-major: a single row's product is the faster over that
    layout on the CPU, with a oneDNN-packed copy for several rows, as the whole weight has) and
    their bias are left out of the state dict."""

    token_ids: torch.Tensor
    mapped_weight: torch.Tensor
    mapped_bias: torch.Tensor | None
    maps_sampled: bool   # sampled rows scored over the map too (else greedy steps only)
    over_map: bool       # the step running now is scored over the map

    def for_step(self, over_map: bool) -> None:
        """Score the next forwards over the map when their rows may be (all greedy, or never read:
        decoding.block_manager.ForwardCall.over_map), or always when the map is for sampled rows
        too. Why not sampled rows by default: a greedy row loses a proposal only where the full
        head's argmax lies outside the map, a sampled row loses acceptance on all the mass the
        target puts outside it (docs/token-map.md)."""
        self.over_map = over_map or self.maps_sampled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.over_map:
            return linear(x, self.weight, self.bias)
        scores = linear(x, self.mapped_weight, self.mapped_bias)
        logits = scores.new_full((*x.shape[:-1], self.out_features), FLOOR)
        return logits.index_copy_(-1, self.token_ids, scores)

    def remap(self) -> None:
        """Copy the map's rows from the weight as it is now (after a weight swap), and on the CPU
        their packed copy for products of several rows (decoding.weight_layout)."""
        with torch.no_grad():
            rows = self.weight.detach().index_select(0, self.token_ids)
            self.mapped_weight = rows.t().contiguous().t() if rows.device.type == "cpu" else rows
            self.mapped_bias = None if self.bias is None else self.bias.detach().index_select(0, self.token_ids)
            pack_weight(self.mapped_weight)


def map_lm_head(model: torch.nn.Module, token_ids: torch.Tensor, maps_sampled: bool = False) -> MappedHead:
    """Make model's output embedding (its LM head) a MappedHead over token_ids (ascending, in range:
    `load_token_map`), in place; a head tied to the input embedding stays tied. maps_sampled: score
    sampled rows over the map too (MappedHead.for_step); it starts over the map."""
    head = model.get_output_embeddings()
    if type(head) not in (torch.nn.Linear, PackedLinear):
        raise TokenMapError(f"a token map needs a plain nn.Linear LM head, this model's is {type(head).__name__}")
    if int(token_ids[-1]) >= head.out_features:
        raise TokenMapError(f"token map names token {int(token_ids[-1])}, the LM head has {head.out_features} rows")
    head.__class__ = MappedHead
    head.register_buffer("token_ids", token_ids.to(head.weight.device), persistent=False)
    head.register_buffer("mapped_weight", torch.empty(0, device=head.weight.device), persistent=False)
    head.register_buffer("mapped_bias", None, persistent=False)
    head.maps_sampled = maps_sampled
    head.over_map = True
    head.remap()
    return head


def mapped_head(model: torch.nn.Module) -> MappedHead | None:
    """model's LM head where it is a MappedHead, else None."""
    head = model.get_output_embeddings()
    return head if isinstance(head, MappedHead) else None


def remap_heads(model: torch.nn.Module) -> None:
    """Every MappedHead of model copies its rows again: after a weight swap, which loads new
    values into the weights but not into the copies."""
    for module in model.modules():
        if isinstance(module, MappedHead):
            module.remap()
