"""Base models the pipeline starts from: the tiny Wan 2.1 the project makes itself."""

from distillery.tinybase.tiny import (
    TinyBaseConfig,
    TinyTextEncoderConfig,
    TinyTransformerConfig,
    TinyVAEConfig,
    make_tiny_base,
)
from distillery.tinybase.tokenizer import build_tokenizer

__all__ = [
    "TinyBaseConfig",
    "TinyTextEncoderConfig",
    "TinyTransformerConfig",
    "TinyVAEConfig",
    "build_tokenizer",
    "make_tiny_base",
]
