"""Write a token map for a draft model: the most frequent tokens of a text corpus, as FR-Spec
ranks them (docs/token-map.md).

    python -m specserve.training.token_map --tokenizer DIR --size N --out token_map.json [FILE_OR_DIR ...]

Files given are read as UTF-8 text (a folder: every file under it); none given, the default
pair's own training corpus (the standard library's training split, training/corpus.py). The
map is a JSON list of ascending token ids, what `draft.token_map` (or `--token-map`) serves.
A corpus like the traffic the draft will see ranks the tokens best.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

from specserve.decoding.token_map import ranked_tokens
from specserve.training.corpus import iter_stdlib_files, split_corpus
from specserve.training.default_pair import encode_files


def corpus_texts(paths: Iterable[str]) -> list[str]:
    """The texts of the given files (a folder: every file under it, sorted); none: the stdlib's
    training split."""
    paths = list(paths)
    if not paths:
        train, _ = split_corpus(iter_stdlib_files())
        return [source.text for source in train]
    files = []
    for name in paths:
        path = Path(name)
        files += sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [file.read_text(encoding="utf-8", errors="replace") for file in files]


def token_map(tokenizer, texts: list[str], size: int) -> list[int]:
    """The size most frequent token ids over texts (ascending); the tokenizer's EOS always among them."""
    return ranked_tokens(encode_files(tokenizer, texts), size, len(tokenizer), tokenizer.eos_token_id)


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(prog="python -m specserve.training.token_map", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="text files or folders (default: the stdlib's training split)")
    parser.add_argument("--tokenizer", required=True, help="the draft's (and target's) tokenizer folder")
    parser.add_argument("--size", type=int, required=True, help="tokens in the map")
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON list")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    ids = token_map(tokenizer, corpus_texts(args.paths), args.size)
    args.out.write_text(json.dumps(ids))
    print(f"wrote {len(ids)} token ids to {args.out}")


if __name__ == "__main__":
    main()
