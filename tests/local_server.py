"""A local Ray Serve app on a tiny random pair, for end-to-end test modules (free port, no downloads).

tests/test_serving.py still carries its own copy of this fixture; it can switch to this helper."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

from cluster.config import SpecServeConfig
from cluster.local import start_local, stop_local
from tests.tiny_pair import make_tiny_pair


def greedy_reference(target_path: str):
    """greedy_text(prompt, max_tokens): the target's own greedy text, in-process and target-only:
    the oracle a served request must equal, whatever was lost on the way."""
    from transformers import AutoTokenizer

    from decoding.generate import generate
    from decoding.batched_runner import BatchedModelRunner
    from decoding.sampling import SamplingParams
    from decoding.sequence import RequestState

    runner = BatchedModelRunner(target_path)
    tokenizer = AutoTokenizer.from_pretrained(target_path)

    def greedy_text(prompt: str, max_tokens: int) -> str:
        state = RequestState(request_id="ref", prompt_ids=tokenizer.encode(prompt, add_special_tokens=False),
                             params=SamplingParams(temperature=0, max_tokens=max_tokens),
                             eos_token_id=tokenizer.eos_token_id, max_context=runner.max_context,
                             detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        for _ in generate(runner, state):
            pass
        return state.output_text

    return greedy_text


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_tiny_pair(root: Path, model_name: str, **overrides) -> Iterator[tuple[str, SpecServeConfig]]:
    """Start the app on a fresh tiny pair under root; yield (base URL, config); stop it after."""
    target_path, draft_path = make_tiny_pair(root)
    config = SpecServeConfig.model_validate({
        "model_name": model_name,
        "target": {"path": str(target_path)},
        "draft": {"path": str(draft_path)},
        "http": {"port": free_port()},
        **overrides,
    })
    url = start_local(config)
    try:
        yield url, config
    finally:
        stop_local()
