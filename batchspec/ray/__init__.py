"""Scale out on Ray (`pip install 'batchspec[ray]'`): one engine per Ray Data actor.

    import ray
    from batchspec.ray import BatchSpecPredictor

    ds = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(prompts)])
    out = ds.map_batches(BatchSpecPredictor, fn_constructor_kwargs={"max_new_tokens": 64},
                         batch_size=32, num_cpus=1,
                         compute=ray.data.ActorPoolStrategy(size=2))

`job` holds the rest of `batchspec generate --ray`: connecting, fault-tolerance settings and the
check that every prompt is answered exactly once. Nothing else in batchspec imports Ray.
"""

from __future__ import annotations

try:
    import ray  # noqa: F401  (absolute: the Ray package, not this module)
except ImportError as exc:
    raise ImportError("batchspec.ray needs Ray Data: pip install 'batchspec[ray]'") from exc

from .job import JobIncomplete, connect, predict, prompt_dataset, served_in_order
from .predictor import OUTPUT_COLUMNS, BatchSpecPredictor

__all__ = ["OUTPUT_COLUMNS", "BatchSpecPredictor", "JobIncomplete", "connect", "predict", "prompt_dataset",
           "served_in_order"]
