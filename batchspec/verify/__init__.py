"""Verification: which drafted tokens a round keeps, and the one token the target adds."""

from .greedy import greedy_verify
from .rejection import VerifyResult, rejection_verify

__all__ = ["VerifyResult", "greedy_verify", "rejection_verify"]
