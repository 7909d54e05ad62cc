"""Trainer callbacks: gradient clipping, EMA, validation sampling (:mod:`.validation`)."""

from distillery.callbacks.base import Callback, CallbackContext

__all__ = ["Callback", "CallbackContext"]
