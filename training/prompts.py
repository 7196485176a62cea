"""The fixed, versioned prompt sets every measurement of the pair uses: the pair evaluation (and
so the model card) and the benchmark read prompts only through this module.

- `v2` (bench/prompts_v2.json): code prompts from the training corpus's HELD-OUT files
  (training.corpus), so acceptance is measured on code neither model was trained on, plus a few
  hand-written prose prompts that show how the code pair does off-distribution. Generated once
  and committed: readers use only the JSON, so results stay comparable when the interpreter (and
  with it the stdlib the corpus is built from) changes. Regenerate with
  ``python -m specserve.training.prompts --write`` only together with a version bump.
- `thirdparty` (bench/prompts_thirdparty_v1.json): hand-written third-party-style Python (web
  handlers, data pipelines, training loops, tests, ...), code UNLIKE the stdlib corpus the
  default pair was trained on: a pair's speed-up depends on what it is asked.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

PROMPT_SET_VERSION = 2
REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS_DIR = REPO_ROOT / "bench"  # the JSON files sit beside the benchmark whose results cite them
DEFAULT_PROMPTS_PATH = PROMPTS_DIR / f"prompts_v{PROMPT_SET_VERSION}.json"
PROMPT_SETS = {"v2": DEFAULT_PROMPTS_PATH, "thirdparty": PROMPTS_DIR / "prompts_thirdparty_v1.json"}
DEFAULT_PROMPT_SET = "v2"
NUM_CODE_PROMPTS = 12
MIN_CODE_CHARS, TARGET_CODE_CHARS, MAX_CODE_CHARS = 100, 160, 400

PROSE_PROMPTS = [
    "Speculative decoding lets a small draft model propose several tokens that a larger model then "
    "checks in a single forward pass. Because every proposal is verified,",
    "The quick way to read this report is to start with the summary table: each row names one way of "
    "generating text, and the columns show",
    '"""Return the number of seconds until the cached entry expires.\n\n'
    "    The value is computed from the time the entry was stored and",
    "# Release checklist\n\nBefore tagging a new release, make sure that the changelog lists every "
    "user-visible change and that",
]


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    kind: str      # "code" | "prose"
    source: str    # where it came from: "path.py:Name" or "hand-written"
    text: str

    def to_dict(self) -> dict:
        return {**asdict(self), "chars": len(self.text)}


@dataclass(frozen=True)
class PromptSet:
    name: str                 # "v2", "thirdparty", or the file's stem for a path
    version: int
    path: Path
    description: str
    prompts: list[Prompt]

    def describe(self) -> dict:
        """What a report records about the set (the path relative to the repo when inside it)."""
        path = self.path.resolve()
        shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
        return {"name": self.name, "version": self.version, "path": str(shown), "description": self.description,
                "num_prompts": len(self.prompts)}


def _node_prompt(lines: list[str], node: ast.AST) -> str | None:
    """Signature plus the start of the body (the docstring when there is one), cut at a line
    boundary between MIN and MAX chars; None when no cut fits."""
    header = lines[node.lineno - 1:node.body[0].lineno - 1]
    text = "".join(header)
    for line in lines[node.body[0].lineno - 1:node.end_lineno]:
        if len(text) >= TARGET_CODE_CHARS or len(text) + len(line) > MAX_CODE_CHARS:
            break
        text += line
    # End at the end of a line but without its newline: the BPE merges "\n" with the next line's
    # indentation, so a prompt ending in a bare "\n" would leave both models mid-token.
    text = text.rstrip()
    return text if MIN_CODE_CHARS <= len(text) <= MAX_CODE_CHARS else None


def _has_docstring(node: ast.AST) -> bool:
    first = node.body[0]
    return isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)


def code_prompt_from_file(relative_path: str, text: str) -> Prompt | None:
    """The first top-level def/class with a docstring that yields a prompt (else the first that
    yields one at all); None for files without top-level definitions or that do not parse."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    lines = text.splitlines(keepends=True)
    nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    for wanted_docstring in (True, False):
        for node in nodes:
            if _has_docstring(node) != wanted_docstring:
                continue
            prompt = _node_prompt(lines, node)
            if prompt is not None:
                return Prompt(prompt_id="", kind="code", source=f"{relative_path}:{node.name}", text=prompt)
    return None


def build_prompt_set(num_code: int = NUM_CODE_PROMPTS) -> dict:
    """Deterministic prompt set from the held-out corpus files plus the prose prompts.

    Files are taken round-robin over top-level packages (one per package first, then a second, ...)
    so near-identical siblings (the encodings/cp*.py codecs) do not dominate the set."""
    from specserve.training.corpus import iter_stdlib_files, split_corpus

    _, held_out = split_corpus(iter_stdlib_files())
    by_package: dict[str, list[Prompt]] = {}
    for source_file in sorted(held_out, key=lambda f: f.relative_path):
        prompt = code_prompt_from_file(source_file.relative_path, source_file.text)
        if prompt is not None:
            by_package.setdefault(source_file.relative_path.split("/")[0], []).append(prompt)
    chosen: list[Prompt] = []
    depth = 0
    while len(chosen) < num_code and any(len(p) > depth for p in by_package.values()):
        for package in sorted(by_package):
            if len(chosen) < num_code and len(by_package[package]) > depth:
                chosen.append(by_package[package][depth])
        depth += 1
    if len(chosen) < num_code:
        raise RuntimeError(f"only {len(chosen)} held-out files yield a code prompt; wanted {num_code}")
    prompts = [Prompt(f"code-{i:02d}", "code", p.source, p.text) for i, p in enumerate(chosen)]
    prompts += [Prompt(f"prose-{i:02d}", "prose", "hand-written", text) for i, text in enumerate(PROSE_PROMPTS)]
    return {
        "version": PROMPT_SET_VERSION,
        "description": "code prompts: signature + docstring start of top-level defs in training.corpus "
                       "held-out files; prose prompts: hand-written",
        "generated_with_python": sys.version.split()[0],
        "prompts": [asdict(p) for p in prompts],
    }


def load_prompt_set(name_or_path: str | Path = DEFAULT_PROMPT_SET) -> PromptSet:
    """A prompt set by name (PROMPT_SETS) or from a prompt-set JSON file."""
    if str(name_or_path) in PROMPT_SETS:
        name, path = str(name_or_path), PROMPT_SETS[str(name_or_path)]
    else:
        path = Path(name_or_path)
        if not path.exists():
            raise ValueError(f"unknown prompt set {name_or_path!r}: use one of {sorted(PROMPT_SETS)} or a JSON path")
        name = next((n for n, p in PROMPT_SETS.items() if p.resolve() == path.resolve()), path.stem)
    data = json.loads(path.read_text())
    if "version" not in data or not data.get("prompts"):
        raise ValueError(f"{path}: not a prompt set (needs 'version' and a non-empty 'prompts' list)")
    return PromptSet(name=name, version=int(data["version"]), path=path, description=data.get("description", ""),
                     prompts=[Prompt(**p) for p in data["prompts"]])


def select_prompts(prompts: list[Prompt], num_prompts: int | None) -> list[Prompt]:
    """The first num_prompts, interleaving code and prose so a small run still sees both kinds."""
    if num_prompts is None or num_prompts >= len(prompts):
        return list(prompts)
    code = [p for p in prompts if p.kind == "code"]
    prose = [p for p in prompts if p.kind != "code"]
    num_prose = min(len(prose), max(1, num_prompts // 4)) if num_prompts > 1 else 0
    return code[:num_prompts - num_prose] + prose[:num_prose]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print or (re)write the benchmark prompt set.")
    parser.add_argument("--write", action="store_true", help=f"write {DEFAULT_PROMPTS_PATH.name}")
    args = parser.parse_args(argv)
    text = json.dumps(build_prompt_set(), indent=2) + "\n"
    if args.write:
        DEFAULT_PROMPTS_PATH.write_text(text)
        print(f"wrote {DEFAULT_PROMPTS_PATH}")
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
