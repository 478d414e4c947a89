"""Choose a batch of B sequences from a window by length.

Rows of equal length stack without padding (the batch needs no realignment); rows of
different lengths are left-padded to the longest. The policy:

1. Fewer than B candidates: take them all (never run a batch below capacity by choice).
2. Requests that have waited `max_wait` rounds are taken first (no starvation).
3. The rest of the batch is the run of consecutive candidates, in length order, that adds
   the least padding to the batch; a same-length group of B is such a run with zero padding.
   Ties go to the shorter run, which lets laggards catch up and keeps the window's lengths
   clustered, and then to the run that has waited longest.

Example, B = 3, lengths [10, 40, 11, 12, 41, 40], no one waiting long:
    runs in length order: (10, 11, 12) pads 2+1+0 = 3;  (11, 12, 40) pads 57;  (12, 40, 40) 28;
    (40, 40, 41) pads 2  -> picks the indices of 40, 40, 41: [1, 5, 4]
"""

from __future__ import annotations


def pick_batch(lengths: list[int], waits: list[int], batch_size: int, max_wait: int) -> list[int]:
    """Indices (into `lengths`) of the batch, at most `batch_size` of them."""
    n = len(lengths)
    if n <= batch_size:
        return list(range(n))
    forced = sorted((i for i in range(n) if waits[i] >= max_wait), key=lambda i: -waits[i])[:batch_size]
    slots = batch_size - len(forced)
    if slots == 0:
        return forced
    taken = set(forced)
    rest = sorted((i for i in range(n) if i not in taken), key=lambda i: (lengths[i], -waits[i]))
    forced_max = max((lengths[i] for i in forced), default=0)
    forced_sum = sum(lengths[i] for i in forced)

    prefix = [0]
    for i in rest:
        prefix.append(prefix[-1] + lengths[i])
    best, best_key = 0, None
    for s in range(len(rest) - slots + 1):
        longest = max(lengths[rest[s + slots - 1]], forced_max)
        padding = batch_size * longest - (prefix[s + slots] - prefix[s]) - forced_sum
        key = (padding, longest, -sum(waits[i] for i in rest[s:s + slots]))
        if best_key is None or key < best_key:
            best, best_key = s, key
    return forced + rest[best:best + slots]
