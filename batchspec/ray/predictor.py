"""`BatchSpecPredictor`: the callable class Ray Data runs, one engine per actor.

    ds = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(prompts)])
    out = ds.map_batches(BatchSpecPredictor, fn_constructor_kwargs={"max_new_tokens": 64, "seed": 0},
                         batch_size=32, num_cpus=1,
                         compute=ray.data.ActorPoolStrategy(size=2))

This module does not import Ray: the class works on the plain {column: numpy array} batches
Ray Data hands it, so it can be called (and tested) without a cluster.

Seeds: a sampled request's output depends only on its prompt, parameters and seed (see
`sampling.py`), and its seed is `request_seed(seed, id)` from the run seed and the row's `id`
column, never its position in a batch. However Ray shards the rows, a seeded run gives the same
output, and the same as `batchspec generate --seed` without Ray (request i gets i's seed there).
"""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np

from ..config import EngineConfig
from ..core.request import Output
from ..sampling import SamplingParams, request_seed

ENGINE_FIELDS = tuple(f.name for f in fields(EngineConfig))
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name != "seed")  # seed: the run seed
OUTPUT_COLUMNS = ("text", "token_ids", "finish_reason", "prompt_tokens", "rounds", "drafted", "accepted",
                  "acceptance_rate")


def split_fields(fields_: dict) -> tuple[EngineConfig, SamplingParams]:
    """{EngineConfig and SamplingParams fields} -> both, validated. Raises on unknown names, so
    a driver can check a predictor's keyword arguments before any actor starts."""
    unknown = sorted(set(fields_) - set(ENGINE_FIELDS) - set(SAMPLING_FIELDS))
    if unknown:
        raise TypeError(f"unknown BatchSpecPredictor arguments {unknown}; engine fields are {list(ENGINE_FIELDS)}, "
                        f"sampling fields {list(SAMPLING_FIELDS)}")
    config = EngineConfig(**{k: v for k, v in fields_.items() if k in ENGINE_FIELDS})
    params = SamplingParams(**{k: v for k, v in fields_.items() if k in SAMPLING_FIELDS})
    return config, params


def row_params(params: SamplingParams, seed: int | None, ids) -> list[SamplingParams]:
    """Each row's SamplingParams: seeded from (run seed, row id) when a run seed is given."""
    if seed is None:
        return [params] * len(ids)
    return [replace(params, seed=request_seed(seed, int(i))) for i in ids]


def output_columns(outs: list[Output]) -> dict[str, np.ndarray]:
    """The columns added to a batch, one entry per output. token_ids is an object array of int64
    arrays (Ray Data stores it as a list column)."""
    token_ids = np.empty(len(outs), dtype=object)
    token_ids[:] = [np.asarray(o.token_ids, dtype=np.int64) for o in outs]
    return {
        "text": np.array([o.text or "" for o in outs], dtype=object),
        "token_ids": token_ids,
        "finish_reason": np.array([o.finish_reason for o in outs], dtype=object),
        "prompt_tokens": np.array([len(o.prompt_token_ids) for o in outs], dtype=np.int64),
        "rounds": np.array([o.stats.rounds for o in outs], dtype=np.int64),
        "drafted": np.array([o.stats.drafted for o in outs], dtype=np.int64),
        "accepted": np.array([o.stats.accepted for o in outs], dtype=np.int64),
        "acceptance_rate": np.array([o.stats.acceptance_rate for o in outs], dtype=np.float64),
    }


class BatchSpecPredictor:
    """Generates for the `prompt` column of each batch and adds OUTPUT_COLUMNS.

    target, draft   model paths or hub ids (default: the bundled pair), loaded once per actor.
    seed            run seed: row `id` is sampled with request_seed(seed, id); needs the id column.
    dtype, device   as for SpecEngine.from_pretrained ("auto": cuda if the actor sees a GPU).
    threads         torch intra-op threads for this actor (default: torch's own choice; Ray sets
                    OMP_NUM_THREADS to the actor's num_cpus).
    chat            wrap text prompts in the tokenizer's chat template.
    **fields        EngineConfig fields (method, gamma, batch_size, ...) and SamplingParams fields
                    (max_new_tokens, temperature, top_k, top_p, stop, ...).

    A prompt is a string, or an array of token ids. The batch's other columns pass through; columns
    named like OUTPUT_COLUMNS are replaced.
    """

    def __init__(self, target: str | None = None, draft: str | None = None, *, seed: int | None = None,
                 dtype: str | None = None, device: str | None = None, threads: int | None = None,
                 chat: bool = False, prompt_column: str = "prompt", id_column: str = "id", **fields_) -> None:
        import torch
        from transformers.utils import logging as hf_logging

        from ..engine import SpecEngine

        config, self.params = split_fields(fields_)
        hf_logging.disable_progress_bar()  # N actors' loading bars would interleave on the driver
        if threads is not None:
            torch.set_num_threads(threads)
        self.seed, self.chat = seed, chat
        self.prompt_column, self.id_column = prompt_column, id_column
        self.engine = SpecEngine.from_pretrained(target, draft, config, dtype=dtype, device=device)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.prompt_column not in batch:
            raise ValueError(f"batch has no {self.prompt_column!r} column (columns: {sorted(batch)})")
        if self.seed is not None and self.id_column not in batch:
            raise ValueError(f"a seeded run needs an {self.id_column!r} column, added before the rows are sharded, "
                             "so that each row's seed does not depend on its batch")
        prompts = [p if isinstance(p, str) else [int(t) for t in p] for p in batch[self.prompt_column]]
        ids = batch[self.id_column] if self.id_column in batch else range(len(prompts))
        if self.chat:
            from ..prompts import chat_token_ids

            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("chat=True needs text prompts, not token ids")
            prompts = chat_token_ids(self.engine.pair.tokenizer, prompts)
        outs = self.engine.generate(prompts, row_params(self.params, self.seed, ids))
        return {**batch, **output_columns(outs)}
