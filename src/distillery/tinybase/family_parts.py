"""What the tiny bases of the families beside Wan (:mod:`.cosmos`, :mod:`.hunyuan15`) are made from alike: where they
may be written, the words their tokenizer knows, the tiny Qwen2.5-VL text model's shapes, and their model card's record of how they were made."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError

QWEN_HEADS = 2  # the tiny Qwen2.5-VL's attention heads (one key/value head)


def check_empty_destination(out_dir: Path) -> None:
    """A :class:`UserError` line unless ``out_dir`` is absent or an empty folder (a maker never writes over a folder)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir} exists and is not an empty folder")


def clip_words() -> list[str]:
    """The shipped tiny Wan's tokenizer words, its special tokens left out: the synthetic clips' captions' words, which
    a tiny base's tokenizer knows so that the pipeline's captions encode without unknown tokens."""
    from distillery.tinybase.shipped import shipped_tiny_base
    from distillery.tinybase.tokenizer import SPECIAL_TOKENS

    words = json.loads((shipped_tiny_base() / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    return sorted(set(words) - set(SPECIAL_TOKENS))


def qwen_text_config(hidden: int, layers: int, vocab_size: int, max_positions: int, pad_id: int, eos_id: int) -> dict[str, Any]:
    """The keyword arguments of a tiny Qwen2.5-VL language model (``Qwen2_5_VLTextConfig``'s names): ``hidden`` wide,
    ``layers`` deep, :data:`QWEN_HEADS` heads, multimodal RoPE split over its head width, ``eos_id`` also its BOS."""
    return dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=QWEN_HEADS, num_key_value_heads=1, max_position_embeddings=max_positions,
                rope_theta=10000.0, rope_scaling={"type": "mrope", "mrope_section": [1, 1, hidden // QWEN_HEADS // 2 - 2]},
                bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id)


def made_with(command: str, config: Any) -> str:
    """The end of a tiny base's model card: the command that made it and its config (a dataclass) as JSON."""
    return f"""Made with:

```
{command}
```

```json
{json.dumps(asdict(config), indent=2)}
```
"""
