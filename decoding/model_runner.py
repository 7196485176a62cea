"""What every model runner shares: loading a local Hugging Face causal LM, the model's facts and the
pair checks (decoding.batched_runner.BatchedModelRunner is the runner engines use).

The engine's protocol lives a level up (decoding.scheduler, decoding.block_manager): every call
names the FULL token history it wants the cache to hold; the block manager reuses the longest
common prefix of that history with what the sequence holds (cropping the rest: that is the
rollback) and the runner runs ONE forward over the remainder. So a worker never trusts its own
speculative tail, and an engine that has never seen a sequence simply prefills it.
"""

from __future__ import annotations

import inspect

import torch
from transformers import AutoModelForCausalLM

from specserve.decoding.checkpoint import check_weight_files, quantization_method, resolve_device, resolve_dtype

# Draft and target must split text into the same ids; code-like text exercises merges and spaces.
_PROBE_TEXT = "def fibonacci(n):\n    return n"


class IncompatibleModelsError(ValueError):
    """Draft and target cannot be paired (different vocabulary or tokenization)."""


def load_causal_lm(model_path: str, dtype: str = "auto", device: str = "auto",
                   num_threads: int | None = None, tensor_parallel_size: int = 1):
    """A local Hugging Face causal LM in eval mode on `device` (no download). dtype and device
    'auto' are resolved by decoding.checkpoint. On CUDA the weights load straight onto the device
    (device_map), never staged in host memory first (written with care, not run here: no GPU).

    tensor_parallel_size > 1: this process is one rank of a group it has already joined
    (decoding.tensor_parallel.join_group) and loads only its shards, by transformers' tp plan."""
    check_weight_files(model_path)
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, model_path, device)
    if num_threads is not None:
        # Process-wide: a worker process owns one runner, so this is its thread budget.
        torch.set_num_threads(num_threads)
    on_gpu = device.startswith("cuda")
    if tensor_parallel_size > 1:
        from transformers import AutoConfig, DistributedConfig

        from specserve.decoding.tensor_parallel import check_divisible

        check_divisible(AutoConfig.from_pretrained(model_path, local_files_only=True).get_text_config(decoder=True),
                        tensor_parallel_size)
        # The plan places each shard on this rank's device itself (no device_map beside it).
        placement = {"distributed_config": DistributedConfig(tp_size=tensor_parallel_size)}
    else:
        placement = {"device_map": device} if on_gpu else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch_dtype,
                                                     **placement)
    except Exception as error:
        method = quantization_method(model_path)
        if method is None:
            raise
        # Quantized weights run through transformers' own quantized modules (torchao runs on CPU
        # and GPU); a method whose kernels this device or install lacks is refused, named.
        raise ValueError(f"{model_path}: a checkpoint quantized with quantization_config.quant_method={method!r} "
                         f"cannot be served on {device}: {error}") from error
    return (model if on_gpu or tensor_parallel_size > 1 else model.to(torch.device(device))).eval()


def checkpoint_weights(model_path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A checkpoint's weights as a state dict on the CPU in dtype: what a hot swap copies into a
    serving model of the same architecture (BatchedModelRunner.load_weights), and what the draft
    trainer puts in Ray's object store for draft engines on every node."""
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=dtype)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


class RunnerBase:
    """What every runner shares: loading and the model's facts."""

    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu",
                 num_threads: int | None = None, max_sequences: int = 256) -> None:
        model = load_causal_lm(model_path, dtype=dtype, device=device, num_threads=num_threads)
        self._init_from_model(model, max_sequences=max_sequences, model_path=model_path)

    # Attributes: vocab_size: int, max_context: int (max_position_embeddings), eos_token_id: int | None,
    # model_path: str, device: torch.device, max_sequences: int

    @classmethod
    def from_model(cls, model, max_sequences: int = 256):
        """Wrap an already-built model (tests build tiny random ones from a config)."""
        runner = cls.__new__(cls)
        runner._init_from_model(model, max_sequences=max_sequences, model_path=model_path_of(model))
        return runner

    def _init_from_model(self, model, max_sequences: int, model_path: str, max_model_len: int | None = None) -> None:
        """max_sequences: sequences an engine over it holds at once (its block manager's slots);
        max_model_len: the longest history served (default and upper bound: max_position_embeddings)."""
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        model.eval()
        self.model = model
        self.model_path = model_path
        self.max_sequences = max_sequences
        self.device = next(model.parameters()).device
        config = model.config.get_text_config(decoder=True)
        self.config = config
        output_embeddings = model.get_output_embeddings()
        if output_embeddings is not None and getattr(output_embeddings, "weight", None) is not None:
            self.vocab_size = int(output_embeddings.weight.shape[0])
        else:
            self.vocab_size = int(config.vocab_size)
        self.max_context = int(config.max_position_embeddings)
        if max_model_len is not None:
            if not 1 <= max_model_len <= self.max_context:
                raise ValueError(f"max_model_len={max_model_len} must be between 1 and the model's "
                                 f"max_position_embeddings={self.max_context}")
            self.max_context = max_model_len
        eos = getattr(config, "eos_token_id", None)
        eos = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
        self.eos_token_id = int(eos[0]) if eos else None
        self.eos_token_ids = frozenset(int(token) for token in eos)
        forward_params = inspect.signature(model.forward).parameters
        self._takes_logits_to_keep = "logits_to_keep" in forward_params

    def serve_as(self, vocab_size: int | None = None, eos_token_ids=None) -> None:
        """What the served pair decided (cluster.builder.served_model_specs): logits only over the
        tokenizer's vocab_size ids (padding columns of a padded embedding are cut, so they are
        never sampled nor drafted, and draft and target rows have one width), and the EOS set."""
        if vocab_size is not None:
            if vocab_size > self.vocab_size:
                raise IncompatibleModelsError(f"{self.model_path}: the tokenizer has {vocab_size} ids but the "
                                              f"model's output layer only {self.vocab_size}")
            self.vocab_size = int(vocab_size)
        if eos_token_ids is not None:
            self.eos_token_ids = frozenset(int(token) for token in eos_token_ids)

    def _served_columns(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., width] -> [..., vocab_size] (a no-op when the widths agree)."""
        return logits if logits.shape[-1] == self.vocab_size else logits[..., :self.vocab_size].contiguous()


def model_path_of(model) -> str:
    return getattr(model.config, "_name_or_path", "") or "<in-memory>"


def check_compatible(draft: RunnerBase, target: RunnerBase, draft_tokenizer, target_tokenizer) -> int:
    """served_vocab_size of two loaded runners (IncompatibleModelsError if they cannot be paired)."""
    return _check_pair(draft.model_path, draft.vocab_size, draft_tokenizer,
                       target.model_path, target.vocab_size, target_tokenizer)


def output_width(path: str) -> int:
    """Rows of a checkpoint's output layer (its padded embedding width), from config.json."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path, local_files_only=True).get_text_config(decoder=True).vocab_size)


def check_compatible_paths(draft_path: str, target_path: str, tokenizer_path: str | None = None) -> int:
    """check_compatible from local model directories, without loading the weights: the draft's
    own tokenizer against the served one (tokenizer_path, default the target's). Returns
    served_vocab_size."""
    from transformers import AutoTokenizer

    def tokenizer(path: str):
        return AutoTokenizer.from_pretrained(path, local_files_only=True)

    return _check_pair(draft_path, output_width(draft_path), tokenizer(draft_path),
                       target_path, output_width(target_path), tokenizer(tokenizer_path or target_path))


def served_vocab_size(tokenizer, target_width: int) -> int:
    """The ids a request can hold: the tokenizer's (len(tokenizer)), within the target's output
    layer. Columns past it (Qwen2.5 pads 151,665 ids to 152,064 rows) are never sampled."""
    return min(len(tokenizer), target_width)


def _tokenizer_difference(draft_tokenizer, target_tokenizer) -> str | None:
    """How two tokenizers differ, in words, or None when they split text into the same ids."""
    if len(draft_tokenizer) != len(target_tokenizer):
        return f"they hold {len(draft_tokenizer)} and {len(target_tokenizer)} tokens"
    for name in ("bos_token_id", "eos_token_id"):
        draft_id, target_id = getattr(draft_tokenizer, name, None), getattr(target_tokenizer, name, None)
        if draft_id != target_id:
            return f"their {name} differ ({draft_id} vs {target_id})"
    draft_ids = list(draft_tokenizer.encode(_PROBE_TEXT, add_special_tokens=False))
    target_ids = list(target_tokenizer.encode(_PROBE_TEXT, add_special_tokens=False))
    if draft_ids != target_ids:
        return f"they split {_PROBE_TEXT!r} differently ({draft_ids} vs {target_ids})"
    return None


def _check_pair(draft_name: str, draft_width: int, draft_tokenizer,
                target_name: str, target_width: int, target_tokenizer) -> int:
    """served_vocab_size when the draft can speculate for the target: the same tokenizer (the
    embedding widths may differ: padding), and a draft output layer covering every served id."""
    difference = _tokenizer_difference(draft_tokenizer, target_tokenizer)
    if difference is not None:
        raise IncompatibleModelsError(
            f"draft {draft_name!r} and target {target_name!r} do not share a tokenizer: {difference}. A draft "
            "must use the target's tokenizer; to serve the target alone set speculation.proposer: none")
    vocab_size = served_vocab_size(target_tokenizer, target_width)
    if draft_width < vocab_size:
        raise IncompatibleModelsError(
            f"draft {draft_name!r} scores {draft_width} ids but the target's tokenizer has {vocab_size}; "
            "to serve the target alone set speculation.proposer: none")
    return vocab_size
