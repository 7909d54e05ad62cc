"""Trainer callbacks: gradient clipping, EMA (validation sampling comes with the pipeline)."""

from distillery.callbacks.base import Callback, CallbackContext

__all__ = ["Callback", "CallbackContext"]
