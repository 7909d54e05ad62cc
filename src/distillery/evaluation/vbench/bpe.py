"""CLIP's byte-pair tokenizer, read from the published ``bpe_simple_vocab_16e6.txt.gz`` (the vocabulary ViCLIP's
text tower uses, as OpenAI's CLIP): text → token ids, as the published tokenizer computes them.

The text is cleaned (``ftfy.fix_text`` when it is not plain printable ASCII — on such text that function changes
nothing, so ``ftfy`` is needed only for other text —, HTML entities unescaped twice, whitespace runs collapsed),
lower-cased, split by CLIP's pattern (contractions, letter runs, single digits, other non-space runs), each piece's
UTF-8 bytes mapped to printable characters and merged by the ranked merges (the first 48,894 lines after the
header). :meth:`ClipBPE.tokenize` adds the start and end tokens and pads/truncates to a context length, the last
kept token replaced by the end token when cut.
"""

from __future__ import annotations

import gzip
import html
from functools import lru_cache
from pathlib import Path

from distillery.common.errors import UserError

MERGES = 49152 - 256 - 2  # merges the vocabulary keeps
START, END = "<|startoftext|>", "<|endoftext|>"
PATTERN = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


@lru_cache()
def byte_characters() -> dict[int, str]:
    """Each byte → a printable character: the printable Latin-1 bytes themselves, the others 256 + n in order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, (chr(c) for c in chars)))


def clean(text: str) -> str:
    """The published cleaning (module doc)."""
    import regex

    if not (text.isascii() and text.isprintable()):
        try:
            import ftfy
        except ImportError:
            raise UserError("the ViCLIP tokenizer needs the package ftfy for prompts that are not plain printable ASCII "
                            f"({text[:40]!r}...): pip install ftfy") from None
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return regex.sub(r"\s+", " ", text).strip()


class ClipBPE:
    """The tokenizer of one ``bpe_simple_vocab_16e6.txt.gz`` (module doc)."""

    def __init__(self, path: str | Path) -> None:
        import regex

        lines = gzip.open(path).read().decode("utf-8").split("\n")[1:MERGES + 1]
        merges = [tuple(line.split()) for line in lines]
        vocab = list(byte_characters().values())
        vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + [START, END]
        self.encoder = {token: i for i, token in enumerate(vocab)}
        self.ranks = {m: i for i, m in enumerate(merges)}
        self.cache = {START: START, END: END}
        self.pattern = regex.compile(PATTERN, regex.IGNORECASE)

    def bpe(self, token: str) -> list[str]:
        """The merged symbols of one byte-mapped piece (the last symbol marked ``</w>``)."""
        if token in self.cache:
            return self.cache[token].split(" ")
        word = tuple(token[:-1]) + (token[-1] + "</w>",)
        while len(word) > 1:
            pairs = {(a, b) for a, b in zip(word[:-1], word[1:])}
            best = min(pairs, key=lambda pair: self.ranks.get(pair, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == best[0] and word[i + 1] == best[1]:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        self.cache[token] = " ".join(word)
        return list(word)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without start/end tokens."""
        chars = byte_characters()
        ids: list[int] = []
        for piece in self.pattern.findall(clean(text).lower()):
            mapped = "".join(chars[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[s] for s in self.bpe(mapped))
        return ids

    def tokenize(self, text: str, context_length: int) -> list[int]:
        """``[START] + ids + [END]``, cut to ``context_length`` (the last kept id then END) and zero-padded to it."""
        ids = [self.encoder[START]] + self.encode(text) + [self.encoder[END]]
        if len(ids) > context_length:
            ids = ids[:context_length]
            ids[-1] = self.encoder[END]
        return ids + [0] * (context_length - len(ids))
