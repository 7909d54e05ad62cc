"""Which videos a VBench number is computed from — the protocol — chosen by the user and recorded with every number.

- ``vbench_standard``: VBench's prompt suite (``VBench_full_info.json`` of vbench 0.1.5, shipped in
  ``distillery/assets/vbench/``: 946 entries, each a prompt and the dimensions it serves), each prompt sampled with
  5 seeds (VBench's ``<prompt>-0`` … ``<prompt>-4``); a dimension is computed over the videos of its own prompts
  (the quality dimensions' 326 prompts and overall consistency's 93 for the numbers here).
- ``vbench_extended``: the same suite and scoring, each video sampled from the *extended* (rewritten, longer) prompt
  of the same line instead — the variant the Self-Forcing paper reports (its ``prompts/vbench/all_dimension_extended.txt``,
  946 lines in the suite's order). The user names the file; :data:`SELF_FORCING_EXTENDED_SHA256` is the digest of
  Self-Forcing's own copy, so a run records whether its rewrites are that paper's (``comparable``) or others. Overall
  consistency still compares each video with VBench's own prompt.
- ``custom``: the user's prompts (every computed dimension on every prompt); such numbers are labelled not
  comparable with any published VBench score.

:class:`Protocol` lists the videos to sample (:meth:`Protocol.videos`: suite index, the prompt to sample, the
prompt to score against, seed index, the dimensions it serves).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from distillery.common.errors import UserError
from distillery.evaluation.vbench.score import COMPUTED

PROTOCOLS = ("vbench_standard", "vbench_extended", "custom")
SEEDS_PER_PROMPT = 5  # VBench's videos per prompt
SUITE_FILE = "VBench_full_info.json"
SUITE_SHA256 = "5dd2de80ee43cda750b2b72ea7023657c0b90d3702041c7e4608c65dbe50dccd"  # vbench 0.1.5's file
# guandeh17/Self-Forcing at 33593df3e81fa3ec10239271dd2c100facac6de1, prompts/vbench/all_dimension_extended.txt
SELF_FORCING_EXTENDED_SHA256 = "c78f1ad32974503efaa8cc935347ace88f3a8b571adde6687bc8425bbf417cf3"


@dataclass(frozen=True)
class SuiteEntry:
    """One line of the prompt suite: its index, VBench's prompt, the prompt sampled, the dimensions it serves."""

    index: int
    prompt: str
    sampled: str
    dimensions: tuple[str, ...]


@dataclass(frozen=True)
class VideoSpec:
    """One video of a protocol: its suite entry and seed index (0 .. seeds − 1)."""

    entry: SuiteEntry
    seed_index: int

    @property
    def name(self) -> str:
        """VBench's file stem for it: ``<prompt>-<seed index>``."""
        return f"{self.entry.prompt}-{self.seed_index}"


def load_suite() -> list[dict]:
    """VBench 0.1.5's prompt suite (module doc), checked against its recorded digest."""
    data = resources.files("distillery").joinpath("assets", "vbench", SUITE_FILE).read_bytes()
    if hashlib.sha256(data).hexdigest() != SUITE_SHA256:
        raise UserError(f"distillery/assets/vbench/{SUITE_FILE} is not vbench 0.1.5's file (digest differs): reinstall distillery")
    return json.loads(data)


@dataclass
class Protocol:
    """A chosen protocol (module doc) and the dimensions computed under it."""

    name: str = "vbench_standard"
    dimensions: tuple[str, ...] = COMPUTED
    seeds_per_prompt: int = SEEDS_PER_PROMPT
    extended_prompts: str | None = None  # vbench_extended: the file of rewritten prompts, one per suite line
    custom_prompts: list[str] | None = None  # custom: the prompts
    entries: list[SuiteEntry] = field(default_factory=list, init=False)
    prompts_sha256: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.name not in PROTOCOLS:
            raise UserError(f"vbench.protocol: {self.name!r}; valid: {', '.join(PROTOCOLS)}")
        unknown = [d for d in self.dimensions if d not in COMPUTED]
        if unknown:
            raise UserError(f"vbench.dimensions: {unknown[0]!r} is not computed here; valid: {', '.join(COMPUTED)}")
        if self.seeds_per_prompt < 1:
            raise UserError(f"vbench.seeds_per_prompt must be >= 1, got {self.seeds_per_prompt}")
        if self.name == "custom":
            if not self.custom_prompts:
                raise UserError("vbench.protocol custom needs prompts (vbench.prompts)")
            self.entries = [SuiteEntry(i, p, p, tuple(self.dimensions)) for i, p in enumerate(self.custom_prompts)]
            self.prompts_sha256 = hashlib.sha256("\n".join(self.custom_prompts).encode()).hexdigest()
            return
        suite = load_suite()
        sampled = [e["prompt_en"] for e in suite]
        if self.name == "vbench_extended":
            sampled = self._read_extended(len(suite))
        self.entries = [SuiteEntry(i, e["prompt_en"], s, tuple(d for d in e["dimension"] if d in self.dimensions))
                        for i, (e, s) in enumerate(zip(suite, sampled))]
        self.entries = [e for e in self.entries if e.dimensions]

    def _read_extended(self, lines: int) -> list[str]:
        if not self.extended_prompts:
            raise UserError("vbench.protocol vbench_extended needs vbench.extended_prompts: a file of one rewritten prompt per "
                            "suite line (Self-Forcing's prompts/vbench/all_dimension_extended.txt)")
        path = Path(self.extended_prompts).expanduser()
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise UserError(f"vbench.extended_prompts: cannot read {path} ({exc.strerror or exc})") from None
        self.prompts_sha256 = hashlib.sha256(raw).hexdigest()
        try:
            text = raw.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            raise UserError(f"vbench.extended_prompts: {path} is not UTF-8 text") from None
        if len(text) != lines or not all(t.strip() for t in text):
            raise UserError(f"vbench.extended_prompts: {path} has {len(text)} lines ({sum(not t.strip() for t in text)} empty); "
                            f"the suite has {lines}, one non-empty rewrite per line in its order")
        return text

    @property
    def comparable(self) -> bool:
        """Whether the numbers can be set beside a published row of the same protocol: the standard suite with VBench's
        5 videos a prompt, or the extended variant with Self-Forcing's own rewrites and all dimensions' prompts."""
        if self.name == "custom" or self.seeds_per_prompt != SEEDS_PER_PROMPT:
            return False
        return self.name == "vbench_standard" or self.prompts_sha256 == SELF_FORCING_EXTENDED_SHA256

    def videos(self) -> list[VideoSpec]:
        """Every video to sample, suite order then seed index."""
        return [VideoSpec(e, s) for e in self.entries for s in range(self.seeds_per_prompt)]

    def describe(self) -> dict:
        """What a report records of the protocol."""
        return {"name": self.name, "dimensions": list(self.dimensions), "prompts": len(self.entries),
                "seeds_per_prompt": self.seeds_per_prompt, "videos": len(self.entries) * self.seeds_per_prompt,
                "suite_sha256": None if self.name == "custom" else SUITE_SHA256, "prompts_sha256": self.prompts_sha256,
                "comparable": self.comparable}
