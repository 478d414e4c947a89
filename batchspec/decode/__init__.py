"""Decoding rounds. Every method runs the same round: autoregressive is γ = 0."""

from .round import run_round

__all__ = ["run_round"]
