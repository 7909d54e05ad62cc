"""A word-level tokenizer for the tiny base model.

No UMT5 sentencepiece model exists offline, so the tiny Wan uses a word-level tokenizer
built with the ``tokenizers`` library and wrapped as a ``transformers`` fast tokenizer.
Contract (what ``diffusers.WanPipeline`` relies on):

- ``AutoTokenizer.from_pretrained(folder)`` loads it offline;
- text is NFKC-normalised and lower-cased, split on whitespace, punctuation characters
  become their own tokens;
- ids: ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2, then the words (built-in vocabulary
  first, sorted, then caption words not already present, sorted); unknown words map to
  ``<unk>``;
- ``</s>`` is appended to every sequence (``add_special_tokens=True``) and survives
  truncation; padding is on the right with ``<pad>``, so the attention mask is 1 over
  the words and ``</s>``, 0 over the padding.

The vocabulary depends only on the captions given, never on their order or on the
machine, so the same captions always give the same ids.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)  # ids 0, 1, 2

COLOURS: tuple[str, ...] = (
    "red", "green", "blue", "yellow", "cyan", "magenta", "white", "orange", "purple",
    "black", "gray", "grey", "pink", "brown",
)  # fmt: skip
SHAPES: tuple[str, ...] = (
    "circle", "square", "triangle", "rectangle", "star", "diamond", "ellipse", "hexagon",
    "pentagon", "cross", "ring", "dot", "disc", "disk", "shape", "object",
)  # fmt: skip
DIRECTIONS: tuple[str, ...] = (
    "left", "right", "up", "down", "upward", "upwards", "downward", "downwards",
    "leftward", "rightward", "diagonally", "still", "static", "stationary",
)  # fmt: skip
COMMON_WORDS: tuple[str, ...] = (
    "a", "an", "the", "and", "on", "in", "of", "to", "from", "with", "over", "across",
    "toward", "towards", "is", "moving", "moves", "move", "slowly", "quickly", "fast",
    "slow", "small", "large", "big", "bright", "dark", "light", "background", "video",
    "frame", "scene", "plain", "solid", "colour", "color",
    ",", ".", "-",
)  # fmt: skip

BUILTIN_VOCABULARY: tuple[str, ...] = tuple(sorted(set(COLOURS + SHAPES + DIRECTIONS + COMMON_WORDS)))
"""Words every tiny tokenizer knows, so it works with no captions at all."""


def _normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")]
    )


def caption_words(captions: Iterable[str]) -> set[str]:
    """The words of ``captions`` exactly as the tokenizer splits them (normalised)."""
    normalizer, pre_tokenizer = _normalizer(), _pre_tokenizer()
    words: set[str] = set()
    for caption in captions:
        pieces = pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(caption))
        words.update(piece for piece, _ in pieces)
    return words


def build_vocabulary(captions: Iterable[str] | None = None) -> dict[str, int]:
    """Map token → id: special tokens, the built-in words, then new caption words."""
    tokens = list(SPECIAL_TOKENS) + list(BUILTIN_VOCABULARY)
    known = set(tokens)
    tokens += sorted(caption_words(captions or ()) - known)
    return {token: index for index, token in enumerate(tokens)}


def build_tokenizer(captions: Iterable[str] | None = None, model_max_length: int = 32) -> PreTrainedTokenizerFast:
    """Build the word-level fast tokenizer from ``captions`` (may be empty).

    ``model_max_length`` is the prompt length the model is meant to be used with (the
    pipeline's ``max_sequence_length``); it is recorded in ``tokenizer_config.json``.
    """
    vocabulary = build_vocabulary(captions)
    backend = Tokenizer(WordLevel(vocab=vocabulary, unk_token=UNK_TOKEN))
    backend.normalizer = _normalizer()
    backend.pre_tokenizer = _pre_tokenizer()
    eos_id = vocabulary[EOS_TOKEN]
    backend.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS_TOKEN}",
        pair=f"$A {EOS_TOKEN} $B {EOS_TOKEN}",
        special_tokens=[(EOS_TOKEN, eos_id)],
    )
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=model_max_length,
        padding_side="right",
        truncation_side="right",
    )
