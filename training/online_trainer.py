"""The draft trainer's state and one training pass, without Ray (docs/online-learning.md).

`OnlineTrainer` holds the captured blocks, the numbered draft versions and the live acceptance
routers report per version. A pass distils a copy of the serving version on the training slice,
scores both on the held-back slice (the canary) and, only if the candidate wins by the margin,
writes it to disk as the next version: a version exists on disk before any engine is offered it.
After a swap, `rollback_to` compares the new version's live acceptance with its predecessor's, like
with like (per-position acceptance at the depths both ran, over recent windows: `rolls_back`), and
names the version to go back to when the new one does worse. deployments/draft_trainer.py is the
Ray actor around it.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specserve.common.messages import PositionCounts
from specserve.decoding.capture import CaptureBuffer, CapturedBlock
from specserve.training.online_distill import (DistillSettings, TrainingDevice, canary_accepts, distill_on_positions,
                                     mean_expected_acceptance, position_batch)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass
class DraftVersion:
    """One set of draft weights the trainer can offer, and how it came to be."""

    version: int
    path: str
    trained_at: float | None = None          # wall-clock time it was written (None: the start-up draft)
    trained_positions: int = 0               # captured positions its training slice held
    expected_before: float | None = None     # canary: the draft it replaced, on the held-back slice
    expected_after: float | None = None      # canary: this version, on the same slice
    live_before: float | None = None         # live acceptance of the version it replaced, when swapped in
    baseline: PositionCounts | None = None   # that version's recent per-position counts, judged against
    rolled_back: bool = False                # it did worse live and its predecessor came back


# A position is compared only where both versions drafted it this often.
MIN_ROUNDS_PER_POSITION = 20


def rolls_back(before: PositionCounts | None, after: PositionCounts, min_drafted: int, margin: float) -> bool:
    """A swapped-in version goes back when, over at least min_drafted of its drafted tokens, its
    acceptance is below its predecessor's by more than margin, like with like: at each position
    both drafted (MIN_ROUNDS_PER_POSITION rounds each), weighted by how often the new version
    drafted it. Accepted/drafted over all positions would punish a better draft, because adaptive
    K drafts deeper, lower-acceptance positions once the draft improves."""
    if before is None or after.total_drafted < min_drafted:
        return False
    shared = [j for j in range(min(len(before.drafted), len(after.drafted)))
              if min(before.drafted[j], after.drafted[j]) >= MIN_ROUNDS_PER_POSITION]
    weight = sum(after.drafted[j] for j in shared)
    if not weight:
        return False
    new = sum(after.accepted[j] for j in shared) / weight
    old = sum(after.drafted[j] * before.accepted[j] / before.drafted[j] for j in shared) / weight
    return new < old - margin


class RecentCounts:
    """A version's PositionCounts over its most recent pushes, about `window` drafted first
    positions (rounds) at most: the baseline a successor is judged against is what the version did
    lately, not a lifetime average mixing traffic from before a domain shift."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.pushes: list[PositionCounts] = []

    def add(self, counts: PositionCounts) -> None:
        self.pushes.append(counts)
        while len(self.pushes) > 1 and sum(p.drafted[0] for p in self.pushes[1:] if p.drafted) >= self.window:
            self.pushes.pop(0)

    def total(self) -> PositionCounts:
        total = PositionCounts([], [])
        for counts in self.pushes:
            total.add(counts)
        return total


def load_draft_model(path: str | Path, device: str = "cpu") -> torch.nn.Module:
    """A draft checkpoint as a float32 training copy on device (the trainer's own)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()


def save_draft_version(model: torch.nn.Module, source: str | Path, destination: str | Path) -> Path:
    """Write model as a draft folder `serve --draft` takes: the weights (in the source's dtype),
    config, and every non-weight file of the source folder (tokenizer, generation config). Written
    under a temporary name and renamed, so a folder that exists is complete."""
    source, destination = Path(source), Path(destination)
    partial = destination.with_name(destination.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    source_config = json.loads((source / "config.json").read_text())
    dtype = getattr(torch, source_config.get("dtype") or source_config.get("torch_dtype") or "float32")
    copy.deepcopy(model).to(dtype).save_pretrained(partial)
    for item in source.iterdir():
        if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and not (partial / item.name).exists():
            shutil.copy2(item, partial / item.name)
    shutil.rmtree(destination, ignore_errors=True)
    partial.rename(destination)
    return destination


@dataclass
class _Pass:
    """A training pass in progress: what it trains, on what, and how far it got."""

    base: int                          # the serving version it started from
    candidate: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train_batch: Any
    held_batch: Any
    before: float                      # the base's expected acceptance on held_batch
    positions: int                     # captured positions when it started
    steps: int = 0
    resumed: int = 0                   # times it was stopped and taken up again


class OnlineTrainer:
    """Captured blocks in, numbered draft versions out; `settings` is a DraftTrainingSpec dump."""

    def __init__(self, draft_path: str, settings: Mapping[str, Any], versions_dir: str | Path,
                 on: TrainingDevice = TrainingDevice()) -> None:
        self.settings = dict(settings)
        self.on = on   # where passes train (training_device)
        self.buffer = CaptureBuffer(int(settings["max_positions"]))  # the routers sample rounds
        self.versions_dir = Path(versions_dir)
        self.versions = [DraftVersion(0, str(draft_path))]
        self.serving = self.versions[0]
        self.live: dict[int, PositionCounts] = {}   # version -> all its counts, as routers report
        self.recent: dict[int, RecentCounts] = {}    # version -> its recent counts (a successor's baseline)
        self.live_at_swap: dict[int, PositionCounts] = {}
        self.positions_at_last_pass = 0
        self.passes = {"accepted": 0, "refused": 0, "stopped": 0}
        self.last_pass: dict[str, Any] | None = None
        self._paused: _Pass | None = None   # a stopped pass, resumed by the next one

    def add(self, blocks: Iterable[CapturedBlock]) -> None:
        for block in blocks:
            self.buffer.add(block)

    def record_live(self, counts: Mapping[int, tuple[Sequence[int], Sequence[int]]]) -> None:
        """Add routers' per-position (drafted, accepted) counts per draft version since their last report."""
        window = 4 * int(self.settings["rollback_min_drafted"])
        for version, (drafted, accepted) in counts.items():
            pushed = PositionCounts(list(drafted), list(accepted))
            self.live.setdefault(int(version), PositionCounts([], [])).add(pushed)
            self.recent.setdefault(int(version), RecentCounts(window)).add(pushed)

    def live_acceptance(self, version: int) -> float | None:
        counts = self.live.get(version)
        return None if counts is None else counts.acceptance()

    def ready(self) -> bool:
        """Enough new captured positions since the last finished pass, and both slices non-empty."""
        if self.buffer.total_positions - self.positions_at_last_pass < int(self.settings["min_new_positions"]):
            return False
        train, held = self.buffer.split()
        return bool(train) and bool(held)

    def train_pass(self, should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """Distil a copy of the serving version, canary it; -> {"outcome": "accepted" (with
        "version"), "refused" or "stopped", and the figures}. Only an accepted candidate is written.

        A stopped pass is kept (candidate, optimizer state, steps done, its data) and the next
        pass resumes it while the serving version is the one it started from: under a trickle of
        traffic, passes shorter than a whole one still add up to a version."""
        started = time.perf_counter()
        work = self._paused if self._paused is not None and self._paused.base == self.serving.version else None
        self._paused = None
        if work is None:
            work = self._new_pass()
        distill = DistillSettings(lr=float(self.settings["lr"]), epochs=int(self.settings["epochs"]),
                                  batch_size=int(self.settings["batch_size"]), on=self.on)
        work.steps = distill_on_positions(work.candidate, work.train_batch, distill, should_stop, work.optimizer,
                                          work.steps)
        result: dict[str, Any] = {"steps": work.steps, "train_positions": work.train_batch.num_positions,
                                  "held_positions": work.held_batch.num_positions, "expected_before": work.before,
                                  "resumed": work.resumed}
        if should_stop():
            work.resumed += 1
            self._paused = work
            return self._finish(result | {"outcome": "stopped"}, started)
        candidate, held_batch, before, positions = work.candidate, work.held_batch, work.before, work.positions
        train_batch = work.train_batch
        after = mean_expected_acceptance(candidate, held_batch, on=self.on)
        self.positions_at_last_pass = positions
        result["expected_after"] = after
        if not canary_accepts(before, after, float(self.settings["canary_margin"])):
            return self._finish(result | {"outcome": "refused"}, started)
        version = max(v.version for v in self.versions) + 1
        path = save_draft_version(candidate, self.versions[0].path, self.versions_dir / f"v{version}")
        self.versions.append(DraftVersion(version, str(path), time.time(), train_batch.num_positions, before, after))
        self.prune()
        return self._finish(result | {"outcome": "accepted", "version": version}, started)

    def prune(self) -> list[int]:
        """Delete the trained versions older than the newest keep_versions, except the serving one
        (the draft the server started with is never this trainer's to delete); -> versions deleted.
        A rollback goes to the newest earlier version still kept."""
        keep = int(self.settings.get("keep_versions", 3))
        written = [v for v in self.versions if v.version > 0 and Path(v.path).parent == self.versions_dir]
        deleted = []
        for old in written[:-keep]:
            if old is self.serving:
                continue
            shutil.rmtree(old.path, ignore_errors=True)
            self.versions.remove(old)
            deleted.append(old.version)
        return deleted

    def _new_pass(self) -> "_Pass":
        """A pass from the serving version over the captures so far."""
        positions = self.buffer.total_positions
        train, held = self.buffer.split()
        max_context = int(self.settings["max_context"])
        train_batch, held_batch = position_batch(train, max_context), position_batch(held, max_context)
        candidate = load_draft_model(self.serving.path, self.on.device)
        before = mean_expected_acceptance(candidate, held_batch, on=self.on)
        optimizer = torch.optim.AdamW(candidate.parameters(), lr=float(self.settings["lr"]))
        return _Pass(self.serving.version, candidate, optimizer, train_batch, held_batch, before, positions)

    def _finish(self, result: dict[str, Any], started: float) -> dict[str, Any]:
        result["seconds"] = time.perf_counter() - started
        self.passes[result["outcome"]] += 1
        self.last_pass = result
        return result

    def version(self, number: int) -> DraftVersion:
        return next(v for v in self.versions if v.version == number)

    def adopt(self, number: int, path: str) -> None:
        """A version engines serve that this trainer did not make (it was restarted): the newest
        such becomes the serving one, so a restarted trainer never takes engines back."""
        if any(v.version == number for v in self.versions):
            return
        self.versions.append(DraftVersion(number, path))
        self.versions.sort(key=lambda v: v.version)
        if number > self.serving.version:
            self.serving = self.version(number)

    def swap_to(self, number: int) -> DraftVersion:
        """Make version `number` the serving one (its engines are told by the caller)."""
        chosen = self.version(number)
        if chosen.version > self.serving.version:  # a new version: remember what it must beat live
            chosen.live_before = self.live_acceptance(self.serving.version)
            recent = self.recent.get(self.serving.version)
            chosen.baseline = None if recent is None else recent.total()
        now = self.live.get(chosen.version, PositionCounts([], []))
        self.live_at_swap[chosen.version] = PositionCounts(list(now.drafted), list(now.accepted))
        self.serving = chosen
        return chosen

    def rollback_to(self) -> DraftVersion | None:
        """The version to go back to, if the serving one does worse live than its predecessor."""
        current = self.serving
        if current.version == 0 or current.rolled_back:
            return None
        since_swap = self.live.get(current.version, PositionCounts([], [])).minus(
            self.live_at_swap.get(current.version, PositionCounts([], [])))
        if not rolls_back(current.baseline, since_swap, int(self.settings["rollback_min_drafted"]),
                          float(self.settings["rollback_margin"])):
            return None
        current.rolled_back = True
        earlier = [v for v in self.versions if v.version < current.version and not v.rolled_back]
        return earlier[-1]

    def status(self) -> dict[str, Any]:
        """What `specserve status` shows about online training."""
        serving = self.serving
        return {"draft_version": serving.version, "trained_at": serving.trained_at,
                "trained_positions": serving.trained_positions,
                "expected_acceptance_before": serving.expected_before,
                "expected_acceptance_after": serving.expected_after,
                "live_acceptance_before": serving.live_before,
                "live_acceptance_after": self.live_acceptance(serving.version),
                "captured_positions": self.buffer.num_positions, "captured_total": self.buffer.total_positions,
                "passes": dict(self.passes), "last_pass": self.last_pass,
                "versions": [{k: value for k, value in asdict(v).items() if k != "baseline"} for v in self.versions]}
