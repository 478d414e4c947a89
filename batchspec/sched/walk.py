"""Walks: a policy judged on runs it steers, rows advancing by what they accept.

`replay.py` keeps a recorded run's rounds: its rows reach each round at the pace the recorded
drafter set. A policy that drafts differently would move its rows differently: which rows finish
first, and so which are left in a draining batch's part-empty rounds, follows what each row
accepts (on the SmolLM2 mixed set at 32 rows, rows whose lookups copy well finish first, and the
tail is left with rows whose lookups fail). A walk sees that.

Recording (greedy requests only): the engine runs with a `Probe` (drafters/probe.py) at fixed γ.
Every round each row's model part drafts its cap and its lookup part is asked, nothing is
verified, and each row gains one token: the run visits every position k (tokens emitted so far)
of every request, and each proposal is judged afterwards against the row's final tokens. A
walk holds, per request and position, [cap, model accepted, lookup proposed, lookup accepted]
(None where a part is missing), then, for a confident model part (an EAGLE head), its max q at
each depth it drafted, and for one that scores its runner-ups (`DraftProposal.runner_ups`) their
q at each depth and the rank of the target's token among those at the depth of the first
rejection (None: not among them, or nothing rejected); each request's length, and per round what
its stages took. Simulated, a confident model's rows are gated by those confidences
(`gate.drive`), as the engine gates them, and a policy with a sibling width chooses runner-ups to
verify beside the chains (`SpecPolicy.siblings`): a row commits one token more where the chosen
include the recorded hit, and the pass is priced with the siblings fed.

Simulating a chooser (`replay.py`'s: the policy, fixed γ, the oracles): requests fill the slots
in order; each round every resident row at position k has its recorded cap there and an offer
by the view (`model`: None, a model step; `lookup`: what the lookup proposed; `hybrid`: the
lookup where it proposed something, as the engine's hybrid drafts, else the model); the chooser
plans n_i, the row accepts min(a_i, n_i) of them and moves to k + 1 + that. A round is priced as
replay prices one (the cost table scaled to the rounds' medians, plus host time, plus the
lookups' time if the plan asked them). Plain decoding (`fixed(0)`) on the same engine is then
what a plain engine runs.

Example, one slot, γ 2, a request of 4 tokens whose model accepts [1, 0, 2, -] at k = 0..3 (caps
2, 2, 1, 0): fixed γ 2 runs k = 0 (accepts 1: to k 2), k = 2 (cap 1, accepts 1: to 4), done in
2 rounds; plain decoding takes 4 (tests/test_walk.py prices them).
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..core.request import AcceptanceRecord, RequestStats
from .costs import CostTable
from .policy import SpecPolicy
from .replay import Hindsight, PolicyChooser, RoundCosts, clairvoyant, fixed

VERSION = 1
VIEWS = ("model", "hybrid", "lookup")


@dataclass
class Walk:
    gamma: int
    table: CostTable
    # request id -> {"emitted": tokens it emitted, "at": {k: [cap, model a, lookup n, lookup a(, confidences)]}}
    requests: dict[int, dict] = field(default_factory=dict)
    # per round: rows, caps (the model's depth per row), offer_s, draft_s, verify_s, round_s, fused
    rounds: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @property
    def views(self) -> tuple[str, ...]:
        """The views its asks allow: a model part, a lookup part, or both (then also the hybrid)."""
        asks = [a for req in self.requests.values() for a in req["at"].values()]
        model, lookup = any(a[1] is not None for a in asks), any(a[2] is not None for a in asks)
        return tuple(v for v in VIEWS if (v == "model" and model) or (v == "lookup" and lookup)
                     or (v == "hybrid" and model and lookup))

    def costs(self) -> tuple[RoundCosts, float]:
        """(replay's costs: the table scaled to the rounds' medians, host time), and the lookups'
        seconds per row looked up. The rounds verified nothing: the verify stage is scaled by
        plain passes, the draft stage by the model's steps at each row's cap."""
        table, draft, verify, host, offer = self.table, [], [], [], []
        for rnd in (r for r in self.rounds if not r["fused"]):
            fed = [sum(1 for c in rnd["caps"] if c > j) for j in range(max(rnd["caps"], default=0))]
            if any(fed) and table.draft_s:
                draft.append(rnd["draft_s"] / sum(map(table.draft, fed)))
            verify.append(rnd["verify_s"] / table.verify(rnd["rows"], 0, 0))
            host.append(rnd["round_s"] - rnd["draft_s"] - rnd["verify_s"] - rnd["offer_s"])
            offer.append(rnd["offer_s"] / rnd["rows"])
        def med(xs: list[float], default: float) -> float:
            return statistics.median(xs) if xs else default
        return (RoundCosts(table, med(draft, 1.0), med(verify, 1.0), max(0.0, med(host, 0.0))), med(offer, 0.0))

    @property
    def runner_up_width(self) -> int:
        """Runner-ups recorded at each depth (0: none; siblings cannot be simulated)."""
        return max((len(a[5][0]) for req in self.requests.values() for a in req["at"].values()
                    if len(a) > 5 and a[5]), default=0)

    def runner_ups(self, request: int, k: int, view: str) -> tuple[list[list[float]], int | None] | None:
        """(q of the model's runner-ups at each depth it drafted, the rank of the target's token among
        them at the first rejection's depth or None) of `request` at position k, where `view`
        drafts it with the model and they were recorded; else None."""
        at = self.requests[request]["at"].get(k)
        if at is None or len(at) < 7 or _looked(at, view):
            return None
        return at[5], at[6]

    @property
    def confident(self) -> bool:
        """Whether its model part's confidence in each draft was recorded (a gate can be walked)."""
        return any(len(a) > 4 for req in self.requests.values() for a in req["at"].values())

    def ask(self, request: int, k: int, view: str) -> tuple[int, int | None, int, list[float] | None]:
        """(cap, offer, accepted, confidences) of `request` at position k as `view` drafts: offer
        None for a model's rows, a lookup's proposal length otherwise; accepted of that proposal;
        the model's max q at each depth up to the cap (None: a lookup's row, or not recorded)."""
        at = self.requests[request]["at"].get(k)
        if at is None:
            return 0, None, 0, None
        cap, model, proposed, got = at[:4]
        if _looked(at, view):
            return cap, min(cap, proposed or 0), min(cap, got or 0), None
        sure = at[4] if len(at) > 4 else None
        return cap, None, min(cap, model or 0), None if sure is None else (sure + [0.0] * cap)[:cap]

    def truth(self, view: str) -> dict[tuple[int, bool], AcceptanceRecord]:
        """Per (request, source): its acceptance at every position at its cap (the hindsight oracle's rates)."""
        out: dict[tuple[int, bool], AcceptanceRecord] = {}
        for i, req in self.requests.items():
            for k in req["at"]:
                cap, offer, a, _ = self.ask(i, k, view)
                n = cap if offer is None else offer
                if n:
                    out.setdefault((i, offer is not None), AcceptanceRecord()).add(a, n)
        return out

    def sources(self, view: str) -> tuple[bool, ...]:
        return {"model": (False,), "lookup": (True,), "hybrid": (False, True)}[view]

    def save(self, path: str | Path) -> None:
        requests = {str(i): {**r, "at": {str(k): a for k, a in r["at"].items()}} for i, r in self.requests.items()}
        Path(path).write_text(json.dumps({"version": VERSION, "kind": "walk", "gamma": self.gamma,
                                          "table": self.table.to_json(), "meta": self.meta,
                                          "requests": requests, "rounds": [_rounded(r) for r in self.rounds]},
                                         separators=(",", ":")))

    @classmethod
    def load(cls, path: str | Path) -> Walk:
        data = json.loads(Path(path).read_text())
        if data.get("kind") != "walk" or data.get("version") != VERSION:
            raise ValueError(f"{path}: not a walk of version {VERSION}")
        requests = {int(i): {**r, "at": {int(k): a for k, a in r["at"].items()}} for i, r in data["requests"].items()}
        return cls(data["gamma"], CostTable.from_json(data["table"]), requests, data["rounds"], data.get("meta", {}))


def _looked(at: list, view: str) -> bool:
    """Whether `view` drafts a position asked as `at` with its lookup (else with its model)."""
    return view == "lookup" or (view == "hybrid" and bool(at[2]))


def _rounded(rnd: dict) -> dict:
    """A round's seconds to the tenth of a microsecond (a walk on disk: a third the size)."""
    return {k: round(v, 7) if isinstance(v, float) else v for k, v in rnd.items()}


def simulate(walk: Walk, choose, view: str = "model", observe=None) -> float:
    """Tokens per second of `choose` (replay's chooser protocol) steering the walk's requests."""
    if view not in walk.views:
        raise ValueError(f"this walk can be simulated as {', '.join(walk.views)}, not {view!r}")
    costs, offer_s = walk.costs()
    slots = int(walk.meta.get("batch_size") or 1)
    queue = sorted(walk.requests, reverse=True)
    active: list[list[int]] = []  # [request, position k]
    stats: dict[int, RequestStats] = {}
    tokens, seconds, siblings = 0, 0.0, walk.runner_up_width > 0
    while queue or active:
        while queue and len(active) < slots:
            active.append([queue.pop(), 0])
        ids = [i for i, _ in active]
        caps, offer, accepted, sure = (list(x) for x in zip(*(walk.ask(i, k, view) for i, k in active)))
        ups = [walk.runner_ups(i, k, view) for i, k in active] if siblings else [None] * len(ids)
        records = [stats.setdefault(i, RequestStats()) for i in ids]
        lengths, asked, fed, chosen = [0] * len(ids), False, None, None
        left = None if queue else [walk.requests[i].get("limit", walk.requests[i]["emitted"]) - k for i, k in active]
        if any(caps):
            known = {"sure": sure} if any(c is not None for c in sure) else {}  # (a walk with confidences)
            if any(u is not None for u in ups):  # (and runner-ups: the chooser may verify some)
                known["ups"] = [u and u[0] for u in ups]
            lengths, asked, *more = choose(ids, records, caps, offer, [False] * len(ids), accepted, costs, left=left,
                                           **known)
            fed = more[0] if more else None
            chosen = more[1] if len(more) > 1 and more[1] and any(more[1]) else None
        got = [min(a, n) for a, n in zip(accepted, lengths)]
        # a sibling taken: the chain's first rejection is within the verified drafts, and the target's
        # token there is a chosen runner-up of that depth
        hits = [int(bool(chosen) and u is not None and a < n and (a, u[1]) in chosen[i]) for i, (a, n, u) in
                enumerate(zip(accepted, lengths, ups))]
        widths = [n + len(c) for n, c in zip(lengths, chosen)] if chosen else None
        draft_s, verify_s = costs.seconds(lengths, [o is None and n > 0 for o, n in zip(offer, lengths)], fed, widths)
        for rec, a, n, o in zip(records, got, lengths, offer):
            rec.rounds += 1
            if n:
                rec.count_drafts(a, n, o is not None)
        if observe is not None and any(caps):
            observe(lengths, got, [o is not None for o in offer], draft_s, verify_s,
                    **({"fed": widths, "hits": sum(hits)} if chosen else {}))
        lookups = asked and view != "model"
        seconds += draft_s + verify_s + costs.host_s + (offer_s * len(ids) if lookups else 0.0)
        tokens += len(ids) + sum(got) + sum(hits)
        for row, a, h in zip(active, got, hits):
            row[1] += 1 + a + h
        active = [row for row in active if row[1] < walk.requests[row[0]]["emitted"]]
    return tokens / seconds if seconds else 0.0


def compare(walk: Walk, view: str = "model", policy: SpecPolicy | None = None) -> dict[str, float]:
    """Tokens per second over the walk, as `view` drafts, of the policy (default: the engine's, on
    the walk's table, verifying every runner-up recorded where it pays, as the engine's default
    does), plain decoding, every fixed γ, the hindsight oracle and the clairvoyant plan (chains
    only, both); where runner-ups were recorded, also the policy on chains alone."""
    sources = walk.sources(view)
    confident = walk.confident and view != "lookup"
    width = walk.runner_up_width if view != "lookup" else 0

    def engine(w: int) -> SpecPolicy:
        return SpecPolicy(walk.gamma, copy.deepcopy(walk.table), sources=sources, confident=confident, sibling_width=w)
    chooser = PolicyChooser(policy or engine(width))
    out = {"policy": simulate(walk, chooser, view, chooser.observe)}
    if policy is None and width:
        chains = PolicyChooser(engine(0))
        out["policy, chains"] = simulate(walk, chains, view, chains.observe)
    for k in range(walk.gamma + 1):
        out[f"fixed γ={k}" if k else "plain"] = simulate(walk, fixed(k), view)
    oracle = PolicyChooser(Hindsight(walk.gamma, walk.table, sources, walk.truth(view)))
    out["oracle"] = simulate(walk, oracle, view, oracle.observe)
    out["clairvoyant"] = simulate(walk, clairvoyant, view)
    return out


class WalkRecorder:
    """Set as `SpecEngine.trace` on an engine whose drafter is a `Probe`: each round's asks and
    seconds land in `walk`; `finish` judges every ask against its row's final tokens."""

    def __init__(self, probe, gamma: int, table: CostTable, meta: dict) -> None:
        self.probe, self.walk = probe, Walk(gamma, table, meta=meta)
        self._asked: list[tuple] = []  # (request, k, cap, its length then, model proposal, lookup proposal,
        # the model's confidences, its runner-ups)

    def record(self, batch, caps, offer, accepted, offer_s, draft_s, verify_s, round_s, fused) -> None:
        asked = self.probe.take()
        if asked is None:  # (no row could draft: nothing asked)
            return
        for (req, at, model, lookup, sure, ups), cap in zip(asked, caps):
            self._asked.append((req, at - req.prompt_len, cap, at, model, lookup, sure, ups))
        self.walk.rounds.append({"rows": len(batch), "caps": list(caps) if self.probe.model is not None else [],
                                 "offer_s": offer_s, "draft_s": draft_s, "verify_s": verify_s,
                                 "round_s": round_s, "fused": fused})

    def finish(self) -> Walk:
        from ..drafters.hybrid import lookup_outcome

        for req, k, cap, at, model, lookup, sure, ups in self._asked:
            entry = self.walk.requests.setdefault(req.index, {"emitted": req.num_generated,
                                                              "limit": req.params.max_new_tokens, "at": {}})
            a = lookup_outcome(req, at, model)[1] if model is not None else None
            entry["at"][k] = [cap, a, *(lookup_outcome(req, at, lookup) if lookup is not None else (None, None))]
            if sure is not None:
                entry["at"][k].append(sure)
                if ups is not None:  # (their q at each depth, and the rank of the target's token at the rejection)
                    y = req.token_ids[at + a] if a < len(model) and at + a < req.num_tokens else None
                    tokens = [t for t, _ in ups[a]] if a < len(ups) else []
                    entry["at"][k] += [[[round(q, 3) for _, q in depth] for depth in ups],
                                       tokens.index(y) if y in tokens else None]
        self._asked = []
        return self.walk


def record(engine, prompts, params, meta: dict | None = None) -> Walk:
    """Walk `prompts` on `engine` (fixed γ: adaptive=False; greedy): its drafter is probed at every
    position (`Probe`), with the cost table measured for its models (sched/profile.py)."""
    from ..drafters.probe import Probe
    from ..sampling import SamplingParams
    from .profile import cost_table

    cfg = engine.config
    if cfg.adaptive or not cfg.speculative:
        raise ValueError("record a walk at fixed γ (adaptive=False, a speculative method)")
    if not all(p.greedy for p in (params if isinstance(params, (list, tuple)) else [params or SamplingParams()])):
        raise ValueError("a walk judges proposals against final tokens: greedy requests only")
    drafter = engine.drafter
    probe = Probe.of(drafter)
    table = cost_table(engine.pair.target, drafter, engine.pair.draft if engine.draft_runner else None,
                       cfg.batch_size, cfg.gamma, cfg.forward)
    recorder = WalkRecorder(probe, cfg.gamma, copy.deepcopy(table),
                            {"batch_size": cfg.batch_size, "drafter": cfg.drafter, "method": cfg.method,
                             "recorded": time.time(), **(meta or {})})
    engine.drafter, engine.trace = probe, recorder
    try:
        engine.generate(prompts, params)
    finally:
        engine.trace, engine.drafter = None, drafter
    return recorder.finish()
