"""Adaptive speculation: per round, per row, the draft lengths that maximise expected tokens per second.

Pure Python over numbers the engine measures. Row i's drafts are accepted with per-position rates
(its own first-draft rate α_i, then pair-wide rates for d_2, d_3, ... given the earlier ones were
accepted: acceptance comes in runs; scaled by how the request's own drafts after the first fared
against the pair's, `later_factors`), so verifying d_i1..d_ij adds G_ij = rate_1 ... rate_j expected
tokens to the one token every row commits anyway. A hybrid drafter's lookup keeps records of its own
(`estimates`), and what it found for a row is known before the plan, each copied token with its
confidence (`drafters/ngram.py`, `match_confidence`), which calibrates that row's rates as q does a
draft model's (`lookup_calibration`). A round in which row i drafts γ_i tokens costs

    draft   Σ_j D(b_j)         one draft step per depth j, feeding the b_j rows drafting >= j tokens
    verify  V(b, 1 + max γ_i)  one target pass over b rows as wide as the longest row, less what the
      - s (b max γ_i - Σγ_i)   rows fed fewer tokens save (s per token): the lean forward computes only
                               real tokens, but its attention runs at the longest row's width (without
                               it nothing is saved, s = 0, and the policy is told `packed=False`)

`plan` ranks every (row, position) by G_ij (TETRIS, `sched/tetris.py`) and keeps the prefix of that
ranking with the most tokens per second; all γ_i = 0 is a plain decoding round (no draft step at
all), which it keeps unless speculating is predicted `margin` (5 %) faster, e.g. at large batch
sizes on a CPU, where a verify pass is compute-bound and a verified token costs about what a
plain step's token does. While the draft model drafts, `cut` stops a greedy row between steps once
its next draft is not worth a step (what it drafted so far, calibrated by the draft's own
probabilities, made the rest unlikely). `prune` then reranks what was drafted with the draft's own
probability of each token (greedy rows) and keeps the best budget of verified tokens, the draft
time now spent.

D and V come from a short profile at start-up (`profile_costs`, a few forwards per grid point,
cached per model, device, dtype and thread count) interpolated linearly in rows and columns, and
are corrected online by the ratio of measured to predicted stage times (an exponential average;
a verify pass's also per batch size and depth, relative to the rest: `CostModel.spec_scale`).
α_i starts from the pair's running acceptance and follows the request's own record; a rate resting
on few drafts gets an optimism bonus (`_bonus`), so a pessimistic prior is tried and corrected;
every estimated gain is then scaled by accepted over expected drafts in recent speculative rounds
(`gain_scale`), which corrects what the estimates get wrong on the whole. When no request
waits, rows are weighed by the work they have left (`plan`), and a drafter that is behind on a
row has its catch-up priced (`first_fed`); the round that does the catch-up is then left out of
the draft scale and the guard (a one-off, not what speculating costs); a lookup drafter's catch-up
on tokens no round looked up is taken out of the round's draft time the same way (`run_round`,
`LookupDrafter.catch_up_s`). A row a hybrid drafter's
lookup drafts costs no draft step (first_fed 0; `drafters/hybrid.py`). While requests wait, a row
that shares its tokens left with others (they end together and share one refill) is charged a
share of the prefill forward it would need alone if it got ahead (`split_s`). Plain and speculative
rounds are timed whole and corrected apart, and a `SpecGuard` corrects per batch size what the
global scales miss: where speculative rounds take longer than predicted relative to plain ones,
speculating must be predicted that much faster (with rare explorations).

Example, b = 8, D = 2 ms, V(8, n) = 20 + 4 (n - 1) ms, s = 0.5 ms (so 0.5 ms per verified draft
in any row: a cost linear in tokens; `CostModel` has a measured one where it is not), every α = 0.6
(later rates 0.6 too): plain decoding 8 tokens / 20 ms = 400 tok/s; every row drafting 1 token
8 x 1.6 / (2 + 24) ms = 492 tok/s; 2 tokens 8 x 1.96 / 32 ms = 490; 3 tokens 458 -> γ_i = 1.
Rows at α = 0.95 next to rows at α = 0.1: the first four draft 2 tokens, the others none. Every
α = 0.2: 8 x 1.2 / 26 ms = 369 tok/s at best -> plain decoding.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .cost_model import CostModel, rows_bucket
from .guard import SpecGuard
from .standing import StandingGate
from .tetris import best_budget, cumulative, rate_of, select


class Calibration:
    """P(draft token accepted | its draft probability q, the earlier drafts accepted), online: counts
    per bin of q, each bin shrunk toward a prior rate (the position's rate) until it has data. A
    draft token the draft model itself doubted is less likely to be accepted."""

    def __init__(self, bins: int = 10, strength: float = 8.0) -> None:
        self.bins, self.strength = bins, strength
        self.counts = [[0.0, 0.0] for _ in range(bins)]  # [accepted, reached] per bin

    def _bin(self, q: float) -> int:
        return min(self.bins - 1, max(0, int(q * self.bins)))

    def rates(self, qs: list[float], priors: list[float]) -> list[float]:
        """P(accepted) of drafts with probabilities qs, each bin's count shrunk toward its prior (a
        row's drafts at once: a prune asks for every draft of the batch)."""
        counts, strength = self.counts, self.strength
        out = []
        for q, prior in zip(qs, priors):
            acc, reached = counts[self._bin(q)]
            out.append(min(0.99, (acc + strength * prior) / (reached + strength)))
        return out

    def add(self, q: float, accepted: bool) -> None:
        counts = self.counts[self._bin(q)]
        counts[0] += accepted
        counts[1] += 1


@dataclass
class AdaptivePolicy:
    """Per-row draft lengths for each round, in two steps (`decode/round.py` calls both):

    plan   before drafting: from each row's acceptance estimate and the cost model, how deep each
           row drafts (0 for every row is a plain decoding round: no draft step at all);
    prune  after drafting (TETRIS, `sched/tetris.py`): which of the drafted tokens to verify, by
           cumulative acceptance estimated from the draft's own probabilities where it gave them,
           under the budget that maximises expected tokens per second (the draft time is spent
           by then), or under a fixed `budget` of verified drafts per round.

    Where planning costs more than it earns (at batch 1: a plan has little to choose and costs ~3 %
    of a round), most rounds skip both and run at a *standing length*, as fixed γ would
    (`standing`, sched/standing.py; each plan rates its lengths against that one: `_edge`).

    `packed`: the target's forward computes only real tokens (core/forward.py), so a verify pass
    costs by the tokens it verifies, not by rows x the longest; without it a row's shorter draft
    saves nothing in the pass and the cost counts the longest row. With `cost` None (a fixed
    budget without --adaptive) every row drafts its cap and prune takes the top `budget`.
    """

    cost: CostModel | None
    gamma_max: int
    budget: int | None = None  # fixed verified drafts per round (TETRIS); None: chosen by the cost model
    packed: bool = True
    prior: float = 0.6  # acceptance of the pair before anything is measured
    strength: float = 4.0  # how many drafted tokens the prior weighs
    margin: float = 1.05  # speculate only when it is predicted this much faster than plain decoding
    optimism: float = 0.5  # the bonus on rates measured on few drafts (see `_bonus`)
    # per source (True: a hybrid drafter's lookup, False: the drafter itself, `looked`), per draft
    # position j: [accepted, reached] over all rows (reached: d_j drafted, d_1..d_{j-1} accepted)
    _positions: dict[bool, list[list[float]]] = field(default_factory=lambda: {False: [], True: []})
    calibration: Calibration = field(default_factory=Calibration)  # of the drafter's q(d_j)
    lookup_calibration: Calibration = field(default_factory=Calibration)  # of a hybrid's lookup's confidence
    last: dict = field(default_factory=dict)  # the last decision, for stats
    guard: SpecGuard = field(default_factory=SpecGuard)  # what the cost model misses, per batch size
    replan_every: int = 8  # see `plain_now`
    replan_share: float = 0.02  # see `keep_rounds`
    settled_rounds: int = 64  # see `plain_now`
    # rows bucket -> [share of rows that verified drafts (exponential average over rounds), rounds]: `speculates`
    _drafting: dict = field(default_factory=dict, repr=False)
    record_rounds: int = 16
    record_share: float = 0.1
    record_weight: float = 0.05
    index_floor: float = 0.05  # see `index_shares`
    _planning: dict = field(default_factory=dict, repr=False)  # batch-size bucket -> seconds a plan takes
    # the last plain plan: [key, rounds since, kept plain by the guard, settled (see `plain_now`)]
    _memo: list | None = field(default=None, repr=False)
    # whether the last round timed (one that prefilled no prompt) verified no draft (None: none was
    # timed yet): see `plain_now`, and `decode/round.py` (a hybrid's lookups)
    last_plain: bool | None = field(default=None, repr=False)
    # accepted drafts and what the estimates expected of them, exponential averages over speculative
    # rounds, and how many rounds they rest on
    _realised: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0], repr=False)
    scale_prior_rounds: float = 8.0  # see `gain_scale`
    realised_weight: float = 0.01  # see `gain_scale`
    own_strength: float = 8.0  # how many later drafts the pair's rate weighs in a request's (`later_factors`)
    _observed: int = field(default=0, repr=False)  # rounds observed (what `later_rates` rests on moved)
    _later_cache: dict = field(default_factory=dict, repr=False)
    standing: StandingGate = field(default_factory=StandingGate, repr=False)  # planned or standing rounds

    def alpha(self, first_accepted: int, first_drafted: int, looked: bool = False) -> float:
        """A row's first-draft acceptance: its own record, shrunk toward the pair's running rate,
        plus the optimism bonus while the pair's rate rests on little data; `looked`: of drafts a
        hybrid drafter's lookup proposes (their own record and rates, see `estimates`)."""
        positions = self._positions[looked]
        acc, reached = positions[0] if positions else (0.0, 0.0)
        prior = (acc + self.strength * self.prior) / (reached + self.strength)  # the pair's running rate
        prior += self._bonus(reached)
        return min(0.99, (first_accepted + self.strength * prior) / (first_drafted + self.strength))

    def estimates(self, stats: list, looked: list[bool] | None = None) -> tuple[list[float], list[float]]:
        """Each row's α and `later_factors` from its request's `RequestStats`, from the record of
        the source that drafts for it (`looked[i]`: a hybrid drafter's lookup, else the drafter).
        The two are far apart: on the bundled prompts at batch 1, rounds the suffix lookup drafted
        made 2.3-2.5 tokens for 2 drafts verified and 2.3 for 4, the draft model's 2.1 for 2; one
        record for both priced the model's drafts at the lookup's rates and the lookup's fourth
        draft at the model's (the default 6 % behind fixed γ = 2)."""
        looked = looked or [False] * len(stats)
        alphas = [self.alpha(*self.own_record(s, by)[:2], looked=by) for s, by in zip(stats, looked)]
        return alphas, self.later_factors(stats, looked)

    @staticmethod
    def own_record(s, looked: bool) -> tuple[int, int, int, int]:
        """(first accepted, first drafted, later accepted, later reached) of a request's drafts
        from one source (`RequestStats`: totals, and the lookup's part of them)."""
        mine = (s.looked_accepted, s.looked_up, s.looked_later_accepted, s.looked_later_reached)
        if looked:
            return mine
        total = (s.first_accepted, s.first_drafted, s.later_accepted, s.later_reached)
        return tuple(t - m for t, m in zip(total, mine))

    def later_factors(self, stats: list, looked: list[bool] | None = None) -> list[float]:
        """Per request (its `RequestStats`), how it accepts drafts after its first, relative to the
        pair (whose rate is read once for all): its own rate over those drafts (`later_accepted`
        of `later_reached`), shrunk toward the pair's (`own_strength` drafts' worth), over the
        pair's. It multiplies the pair's later rates for
        that request's row. The pair's rates come from the rows that drafted deep, those that
        accept well; a row whose first draft passes and whose next ones do not was priced at their
        rates (the draft model at 8 rows on the echo workload: the rows that end a draining batch
        accepted 15 of 56 drafts, 76 tokens/s against 117 for plain rounds of as many rows).

        Example: the pair accepted 300 of 400 later drafts (0.75); a request 2 of 12: (2 + 8 x
        0.75) / (12 + 8) = 0.4, factor 0.53, so its d_2 rate 0.8 becomes 0.43."""
        looked = looked or [False] * len(stats)
        pairs = {}
        for by in set(looked):
            acc = sum(p[0] for p in self._positions[by][1:])
            reached = sum(p[1] for p in self._positions[by][1:])
            pairs[by] = (acc + self.strength * self.prior) / (reached + self.strength)
        k, out = self.own_strength, []
        for s, by in zip(stats, looked):
            _, _, accepted, reached = self.own_record(s, by)
            out.append((accepted + k * pairs[by]) / (reached + k) / pairs[by] if reached else 1.0)
        return out

    def _bonus(self, reached: float) -> float:
        """Optimism in the face of uncertainty (as in UCB): a rate measured on few drafts is taken
        as optimism / sqrt(n) higher. Without it a pessimistic prior is never corrected: a policy
        that predicts drafting does not pay never drafts, so never measures (seen at batch 1 with a
        prior of 0.6 for a pair that accepts 0.8). After 100 drafts the bonus is 0.05."""
        return self.optimism / (reached + self.strength) ** 0.5

    def later_rates(self, looked: bool = False) -> list[float]:
        """P(d_j accepted | d_1..d_{j-1} accepted) for j = 2..γ, pair-wide, each with its bonus. A
        position reached rarely or never borrows its predecessor's rate as its prior, starting
        from d_1's (rates grow along a run). `looked`: of a hybrid drafter's lookup's drafts. Read
        several times a round (plan, prune, cut), computed once per `observe`."""
        key = (looked, self._observed, self.prior, self.strength, self.optimism, self.gamma_max)
        cached = self._later_cache.get(looked)
        if cached is None or cached[0] != key:
            cached = self._later_cache[looked] = (key, self._later_rates(looked))
        return cached[1]

    def _later_rates(self, looked: bool) -> list[float]:
        positions = self._positions[looked]
        acc, reached = positions[0] if positions else (0.0, 0.0)
        rates, prior = [], (acc + self.strength * self.prior) / (reached + self.strength)
        for j in range(1, self.gamma_max):
            acc, reached = positions[j] if j < len(positions) else (0.0, 0.0)
            prior = (acc + self.strength * prior) / (reached + self.strength)
            rates.append(min(0.99, prior + self._bonus(reached)))
        return rates or [self.prior]

    def gain_scale(self) -> float:
        """Accepted drafts over the expected (1 until measured; within [0.5, 2]), by which every
        estimated gain is multiplied. The estimates are biased where the plan looks: a row's
        later rates are the pair's (scaled by its own record only once it has one: `later_factors`),
        while the rows that speculate are those with a high first rate, whose later rates are high
        too (seen: 5-12 % more accepted than expected). The ratio
        of n rounds counts n / (n + `scale_prior_rounds`) against 1: a warm-up's few rounds do not
        decide it (2 requests of 8 tokens had set it to its floor, 0.5, at batch 1).

        Both sides are averaged over speculative rounds, the mean of the first 1 / w and then
        exponentially, weight w = `realised_weight` (0.01: about the last 100 rounds). The bias it
        corrects moves slowly, and the rounds that measure it stop when it falls: at w = 0.05 a
        stretch of ~20 rounds that accepted little (at batch 2 on the bundled prompts, 0.93 of the
        expected over the run) set it to 0.54-0.58, every later round was plain, and nothing
        measured it again (in-process, 3 repeats: 1.10-1.13 of `autoregressive` at w = 0.05,
        1.15-1.16 at 0.01; level at batch 1)."""
        accepted, expected, n = self._realised
        if expected <= 0:
            return 1.0
        return min(2.0, max(0.5, (n * accepted / expected + self.scale_prior_rounds) / (n + self.scale_prior_rounds)))

    def _gains(self, rates: list[float], weight: float, scale: float) -> list[float]:
        return [weight * min(1.0, scale * g) for g in cumulative(rates)]

    @staticmethod
    def _rates(alpha: float, later: list[float], n: int, factor: float = 1.0) -> list[float]:
        """A row's first n rates: its α, then the pair's later rates times its `later_factors`."""
        if factor != 1.0:
            later = [min(0.99, factor * r) for r in later]
        return ([alpha] + later)[:n]

    # ------------------------------------------------------------------ costs
    def verify_s(self, rows: int, total: int, deepest: int) -> float:
        """A verify pass over `rows` rows verifying `total` drafts, the longest row `deepest`."""
        return self.cost.ragged(rows, total, deepest) if self.packed else self.cost.verify(rows, 1 + deepest)

    def draft_s(self, rows: int, fed: list[float]) -> float:
        """A draft step per depth j feeding fed[j] tokens (one per row drafting more than j, and
        at depth 0 what the drafter has to catch up on); a step costs as a step of that many rows,
        or of all rows when the forward is not packed."""
        return sum(self.cost.draft(n if self.packed else max(n, rows)) for n in fed if n)

    def catch_up(self, rows: int, tokens: float) -> float:
        """A row's catch-up of `tokens` in rows' worth of a draft step (see `plan`'s first_fed)."""
        return tokens if self.cost is None else self.cost.catch_up(rows, tokens)

    @staticmethod
    def rounds_left(req) -> float:
        """The rounds `req` has left: its remaining tokens at the tokens per round it has made so
        far (at least 2 a round)."""
        s = req.stats
        per_round = max(2.0, req.num_generated / s.rounds if s.rounds else 0.0)
        return max(1, req.remaining) / per_round

    def index_shares(self, reqs: list) -> list[float]:
        """Per request of a batch, the share of a lookup's indexing of it one round is charged: the
        indexing serves the lookups of the rounds it has left in which it drafts, which at this
        batch size (once `record_rounds` rounds of it ran) is the share of rows that verified
        drafts (`drafting_share`, at least `index_floor`). Spread over every round left, exploring
        speculation at 16 rows on the bundled prompts (64 x 32, the default) paid each time for
        indexing every prompt and finished request into the suffix tries, then went back to plain
        rounds: 0.07-0.16 s of draft stage in 4.5-5.7 s runs that verified drafts in 0-93
        row-rounds of ~1900 (in-process, 0.96-0.97x `autoregressive`; 0.98-1.00x with this).

        Example: 16 rounds left, rounds of this size drafted in 10 % of their rows: 1 / 1.6 of the
        indexing (1/16 before anything is recorded)."""
        share = self.drafting_share(len(reqs))
        drafting = 1.0 if share is None else max(self.index_floor, share)
        return [min(1.0, 1.0 / (self.rounds_left(r) * drafting)) for r in reqs]

    def intake(self, reqs: list) -> float:
        """Tokens per round the requests of a batch bring a shared index once they finish (what a
        lookup drafter's shared index takes in per round: `LookupDrafter.index_s`): each row's
        tokens at its end over the rounds of its life (`rounds_left` more).

        Example: 4 rows, each 60 prompt + 32 new tokens, 10 rounds run and 8 new tokens made:
        24 left at 2 a round (its pace, 0.8, is below the floor of 2) = 12 rounds; 92 / 22 = 4.2
        tokens a round each, 16.7 for the batch."""
        return sum((r.num_tokens + r.remaining) / (r.stats.rounds + self.rounds_left(r)) for r in reqs)

    @staticmethod
    def catch_up_share(req, model_share: float = 1.0) -> float:
        """The share of the draft model's catch-up on `req` one round is charged. The catch-up
        serves the rounds in which the model drafts for it from now on: the rounds it has left
        (remaining tokens at the tokens per round it has made so far, at least 2) times
        the share of its speculative rounds that the model drafted rather than a hybrid's lookup,
        counted from a prior of one round at `model_share`: for a hybrid the share of rows its
        lookup found nothing for (`HybridDrafter.model_share`), 1 for a draft model alone.

        Example: 60 tokens left at 3 a round = 20 rounds; the lookup drafted 9 of its 10
        speculative rounds, the model's share (1 + 1) / (10 + 1): ~3.6 rounds -> 1/3.6 of the
        catch-up (it was charged 1/30 when every round was taken for the model's: rows the
        lookups serve then caught up over and over for one model round each; echo workload,
        batch 32: catch-up rounds took 58-90 ms predicted at 12-14). A request new to drafting
        is priced by the prior: on the echo workload a hybrid's lookup finds nothing for a small
        share of rows, so a new request's prompt (~300 tokens, ~11 ms of draft model at batch 1)
        serves few of its rounds left and is charged that much more. Taken as 1 (every round
        left), the model caught up 12-15 prompts a run at batch 1 for 2-5 model rounds each
        (0.13-0.16 s of the 0.2-0.3 s its draft model ran); with the prior it ran 4-9 times a run.

        Example, the prior 0.1, nothing drafted yet, 60 tokens left at 3 a round: 1/2 of it."""
        s = req.stats
        share = (s.first_drafted - s.looked_up + model_share) / (s.first_drafted + 1)
        return min(1.0, 1.0 / (AdaptivePolicy.rounds_left(req) * max(share, 1e-3)))

    def split_s(self, reqs: list, refilling: bool) -> list[float] | None:
        """Seconds a round is charged per row for verifying drafts of that row while it is in a
        cohort: rows with as many tokens left (admitted together, advanced alike) end in the same
        round and are refilled by one prefill forward; a row that gets ahead ends apart, and its
        refill is a forward of its own. Charged only while requests wait to be admitted
        (`refilling`; never where the engine prefills a refill inside a round's pass,
        `SpecEngine.fuses_prefill`, which costs no forward of its own): the fixed cost of a
        forward (one row, one token) times the share of the cohort's prefill forward the row no
        longer shares, 1 - 1/m for a cohort of m, spread over
        the rounds the row has left (`rounds_left`): leaving the cohort is paid once, and buys
        speculation in every round after it, so it pays where speculation pays over the row's
        life, not only where it pays in this round (charged whole to the round, the split kept
        every cohort plain at batch 4 in-process, where fixed γ made 1.02-1.15x in the benches of
        waves 15-17).

        Example, 16 rows, a one-row pass 11 ms: a row in a cohort of 4 with 16 rounds left is
        charged 11 x 3/4 / 16 = 0.5 ms, a third of what a token is worth at 16 rows (a plain
        round ~25 ms); with 2 rounds left, 4 ms. A row alone, or any row once the queue is
        empty, is charged nothing."""
        if self.cost is None or not refilling:
            return None
        sizes = Counter(r.remaining for r in reqs)
        one = self.cost.verify(1, 1)
        out = [one * (1 - 1 / sizes[r.remaining]) / self.rounds_left(r) for r in reqs]
        return out if any(out) else None

    @staticmethod
    def _fed(lengths: list[int], first_fed: list[float] | None) -> list[float]:
        """Tokens the draft step at each depth feeds (see `tetris.best_budget`: first_fed[i] = 0
        for a row no draft step feeds)."""
        first_fed = first_fed or [1.0] * len(lengths)
        fed = [float(sum(1 for n, f in zip(lengths, first_fed) if n > j and f > 0))
               for j in range(max(lengths, default=0))]
        if fed:
            fed[0] = sum(f for f, n in zip(first_fed, lengths) if n > 0)
        return fed

    # ------------------------------------------------------------------ decisions
    def plan(self, alphas: list[float], caps: list[int], weights: list[float] | None = None,
             first_fed: list[float] | None = None, key: tuple | None = None,
             held: list[int] | None = None, index_s: float = 0.0, split_s: list[float] | None = None,
             settle: bool = True, factors: list[float] | None = None,
             looked: list[bool] | None = None, confidence: list[list[float] | None] | None = None) -> list[int]:
        """How many tokens each row drafts this round (row i at most caps[i]). weights[i] (default
        1) is what a token of row i is worth: when nothing waits for a row, the batch lasts as long
        as its longest request, so the round passes weigh rows by the work they have left; a row
        starved of drafts would otherwise be the one everyone waits for. first_fed[i] (default 1)
        is what a round is charged for the drafter starting row i: 1, or a share of the catch-up
        when the drafter is behind on it (the round that does it is then left out of the
        measurements: see `observe`). key: the batch's requests, for `plain_now`. held[i] (default
        0): row i drafts at least that many tokens, whatever the plan (rows whose output must not
        depend on their batch: see `decode/round.py`); a round with held drafts is speculative
        anyway, so the plan only chooses what the other rows add to it. index_s: seconds a
        lookup drafter would index before drafting (its share: `LookupDrafter.index_s`), charged
        to a speculative round. split_s[i] (default 0): seconds charged if row i verifies a draft
        (see `split_s`). settle: a plain plan may be found settled (see `plain_now`); not when
        caps are what a lookup found this round (they change from round to round). factors[i]
        (default 1): row i's `later_factors`. looked[i] (default False): a hybrid drafter's lookup
        drafts row i (its later rates are the lookup's: `estimates`). confidence[i]: what the
        lookup found for row i already, each token's confidence (`drafters/ngram.py`,
        `match_confidence`), by which its rates are calibrated as `prune` calibrates drafts."""
        if self.cost is None:
            return list(caps)
        b = len(caps)
        if not any(caps):  # nothing to draft (a lookup found nothing, and the model is off): no
            self._memo = None  # choice to make, nor one to keep (~45 us a round at batch 1)
            return self.plain(b)
        if self.guard.plain_due(b) and not any(held or ()):
            return self.plain(b)
        lengths, blocked, rated = self._best_lengths(alphas, caps, weights, first_fed, held, index_s, split_s,
                                                     factors, looked, confidence)
        if blocked:
            self.guard.kept_plain(b)
        memo, self._memo = self._memo, None
        if key is not None and not any(lengths):
            # found unsettled before for the same requests, it is again: plain rounds change nothing
            # it rests on, and checking costs what the plan does
            known = memo is not None and memo[0] == key and not memo[3]
            free = first_fed is not None and not any(first_fed)  # this plan priced every draft free already
            settled = settle and not blocked and not known and (
                free or not any(self._best_lengths(alphas, caps, weights, [0.0] * b, held, index_s, split_s,
                                                   factors, looked, confidence)[0]))
            self._memo = [key, 0, blocked, settled]
        self.last = {"rows": b, "draft_s": self.draft_s(b, self._fed(lengths, first_fed)),
                     "verify_s": self.verify_s(b, sum(lengths), max(lengths, default=0))}
        if self.budget is None and not any(held or ()) and (standing := self.standing.to_rate(b)) is not None:
            self.standing.rated(b, self._edge(lengths, standing.lengths(caps, looked), rated))
        return lengths

    def _edge(self, lengths: list[int], standing: list[int], rated: tuple) -> float:
        """What the plan's `lengths` are worth over the `standing` ones (min(cap, L) per row: `sched/
        standing.py`), relative, by the rates and costs the plan weighed (`rated`: `_best_lengths`'s
        gains, seconds, base tokens and first_fed): a speculative round at its predicted
        tokens per second over the margin and the guard's penalty (what it must beat plain decoding
        by to be chosen), a plain one at plain decoding's."""
        gains, seconds, tokens, first_fed = rated
        if first_fed is not None:  # a catch-up is paid once whichever kind of round drafts the row
            first_fed = [min(1.0, f) for f in first_fed]  # first: what the rounds are worth after it
        b = len(lengths)
        plain, spec = tokens / self.cost.verify(b, 1), self.margin * self.guard.penalty(b)

        def value(ls: list[int]) -> float:
            return rate_of(gains, seconds, tokens, ls, first_fed) / spec if any(ls) else plain

        return max(0.0, value(lengths) / value(standing) - 1.0)

    def stood(self) -> None:
        """This round runs at the standing length (`sched/standing.py`): no decision to record, and
        `observe` learns its acceptance but corrects no cost by it (nothing was predicted)."""
        self.last = {}

    def plain(self, rows: int) -> list[int]:
        """A plain round, recorded as the decision (one is due, or `plain_now` said so: the caller
        need not estimate anything per row)."""
        self.last = {"rows": rows, "draft_s": 0.0, "verify_s": self.cost.verify(rows, 1)}
        return [0] * rows

    def plain_now(self, key: tuple | None, rows: int | None = None, joining: bool = False) -> bool:
        """Whether the round of the requests `key` is plain without planning it: a plain round is
        due (the guard measures that side), or requests join the round with their prompts
        (`joining`, `decode/round.py`: they draft nothing there) and the last round without any was
        plain (where plain rounds are the rule, a refill would otherwise cost a plan of its own
        besides the one its batch gets next round: at 16 rows on the bundled prompts, ~1 ms each,
        one refill every ~3 rounds of ~20 ms), or the same requests' last plan was plain fewer than
        `keep_rounds` rounds ago, or fewer than `settled_rounds` if it was settled: plain even
        had every row drafted for free (no draft step, no lookup to wait for). Nothing a plan rests
        on moves much in a few plain rounds (they change no acceptance record), and a settled plan
        could only turn if the costs or the acceptance record moved far, which plain rounds do not
        do. A plan is not free: ~0.3 ms at 64 rows (~1.5 ms, 3 % of a plain round there, before
        `CostModel.round_seconds`), more with a hybrid's lookups; kept `keep_rounds`, replanning
        costs `replan_share` (2 %) of the plain rounds, and kept 64 rounds, almost nothing (at 8
        to 64 rows on the bundled prompts, where the default runs nearly every round plain)."""
        if self.cost is None:
            return False
        rows = len(key) if rows is None else rows  # (a key may carry more than the requests)
        if self.guard.plain_due(rows) or (joining and self.last_plain):
            return True
        memo = self._memo
        if memo is None or memo[0] != key or (memo[2] and self.guard.exploring(rows)) or \
                memo[1] >= (self.settled_rounds if memo[3] else self.keep_rounds(rows)):
            return False
        memo[1] += 1
        if memo[2]:
            self.guard.kept_plain(rows)
        return True

    def planned(self, rows: int, seconds: float) -> None:
        """A plan over `rows` rows took `seconds`, a hybrid's lookups included (`decode/round.py`)."""
        k, before = SpecGuard.bucket(rows), self._planning.get(SpecGuard.bucket(rows))
        self._planning[k] = seconds if before is None else before + 0.1 * (seconds - before)

    def keep_rounds(self, rows: int) -> int:
        """How many rounds a plain plan stands for the same requests: as many as keep replanning
        within `replan_share` of their time, at most `replan_every` (that many until a plan was
        timed). Planning each round is right where a plan is cheap: at batch 1, plans (0.03 ms)
        and lookups next to 6 ms rounds, a plain plan kept for 8 rounds ran 200-480 of ~600 rounds
        plain where replanning ran 30-110 (the draft model then lags further behind, and its
        catch-up makes the next plan plain too); with 64 rows the lookups alone cost ~15 % of a
        plain round, and a plain plan is kept for ~7 rounds."""
        planning = self._planning.get(SpecGuard.bucket(rows))
        if planning is None:
            return self.replan_every
        return min(self.replan_every, int(planning / (self.replan_share * self.cost.verify(rows, 1))))

    def replan_s(self, rows: int) -> float:
        """What speculating costs in planning beyond what a plain plan does: the round after a
        speculative one is planned again (a hybrid's lookups included), while a plain plan stands
        for `keep_rounds`, so a speculative round is charged a plan less that plan's share over
        the rounds it would stand. Nothing until plans are timed. Example, 32 rows: plans with
        lookups take 2.5 ms, a plain round 17 ms, so a plain plan stands 7 rounds and a speculative
        round is charged 2.5 x 6/7 = 2.1 ms (measured: lookups and plans made the adaptive
        engine's plain rounds 10 % slower than autoregressive ones, and its speculative rounds,
        which the plan had predicted faster, no faster than those)."""
        planning = self._planning.get(SpecGuard.bucket(rows))
        if planning is None:
            return 0.0
        return planning * (1.0 - 1.0 / max(1, self.keep_rounds(rows)))

    def _best_lengths(self, alphas: list[float], caps: list[int], weights: list[float] | None,
                      first_fed: list[float] | None, held: list[int] | None = None,
                      index_s: float = 0.0, split_s: list[float] | None = None,
                      factors: list[float] | None = None, looked: list[bool] | None = None,
                      confidence: list[list[float] | None] | None = None) -> tuple[list[int], bool, tuple]:
        """`plan`'s decision, without recording it: the lengths, whether they are all 0 only
        because of the guard's penalty (a speculative round's predicted time times the penalty:
        the same factor for every way of speculating, so the best of them stays the best), and
        what it weighed (gains, seconds, base tokens, first_fed: `_edge`)."""
        weights = weights or [1.0] * len(caps)
        scale = self.gain_scale()
        gains = [self._gains(rates, w, scale)
                 for rates, w in zip(self._row_rates(alphas, caps, factors, looked, confidence), weights)]
        b = len(caps)
        # a speculative round is planned again next round; a plain plan stands a while
        seconds = self.cost.round_seconds(b, self.packed, spec_s=self.replan_s(b) + index_s)
        lengths, rate = best_budget(self._capped(gains, held), seconds, sum(weights), first_fed, held, split_s)
        rated = (gains, seconds, sum(weights), first_fed)
        if any(held or ()):  # no plain round to weigh it against
            return lengths, False, rated
        plain_rate = self.margin * sum(weights) / self.cost.verify(b, 1)
        if rate < plain_rate:
            return [0] * b, False, rated
        if rate < plain_rate * self.guard.penalty(b) and not self.guard.exploring(b):
            return [0] * b, True, rated
        return lengths, False, rated

    def _row_rates(self, alphas: list[float], lengths: list[int], factors: list[float] | None,
                   looked: list[bool] | None, confidence: list[list[float] | None] | None) -> list[list[float]]:
        """Each row's acceptance rates for its first lengths[i] drafts: its α, the later rates of
        its source times its factor, calibrated by each draft's confidence where known."""
        later, out = self._later_by(looked), []
        for i, (a, n) in enumerate(zip(alphas, lengths)):
            rates = self._rates(a, later[bool(looked and looked[i])], n, factors[i] if factors else 1.0)
            if confidence is not None and confidence[i] is not None:
                rates = self._calibration(looked, i).rates(confidence[i], rates)
            out.append(rates)
        return out

    def prune(self, alphas: list[float], lengths: list[int], confidence: list[list[float] | None] | None,
              draft_spent_s: float, weights: list[float] | None = None, held: list[int] | None = None,
              split_s: list[float] | None = None, factors: list[float] | None = None,
              looked: list[bool] | None = None) -> list[int]:
        """Which drafted tokens to verify: a prefix of lengths[i] per row (TETRIS). confidence[i]
        is row i's q(d_j), given only for greedy rows: for a sampled row, choosing whether to
        verify d_j by its own q(d_j) would bias the output (q = (0.9, 0.1) over {a, b}, p = (0.5,
        0.5), verifying d only when d = a emits a with probability 0.9 x 0.5/0.9 + 0.1 x 0.5 =
        0.55), so sampled rows are ranked by their acceptance record alone, which no draft of this
        round influences. weights, held, factors and looked as in `plan` (a fixed `budget` counts
        held drafts first, and is exceeded only by them)."""
        weights = weights or [1.0] * len(lengths)
        scale = self.gain_scale()
        rows = self._row_rates(alphas, lengths, factors, looked, confidence)
        expected = [cumulative(rates) for rates in rows]
        gains = [self._gains(rates, w, scale) for rates, w in zip(rows, weights)]
        b = len(lengths)
        if self.cost is None:
            return select(gains, self.budget, held)
        seconds = self.cost.round_seconds(b, self.packed, drafted_s=draft_spent_s)
        chosen, _ = best_budget(self._capped(gains, held), seconds, sum(weights), held=held, row_s=split_s)
        if self.last.get("rows") == b:
            self.last["verify_s"] = self.verify_s(b, sum(chosen), max(chosen, default=0))
            self.last["expected"] = sum(sum(g[:n]) for g, n in zip(expected, chosen))  # (unscaled)
        return chosen

    def cut(self, reqs: list, depth: int, confidence: list[list[float]], lengths: list[int]) -> list[int]:
        """Between draft steps of a greedy round (`DraftModelDrafter.stop`): each row drafting past
        `depth` goes on only while its next draft is worth a step. Row i's drafts so far are
        accepted with probability G = the product of their calibrated rates (`Calibration`, from
        q(d_1..d_depth)); drafting d_{depth+1} adds G x its position's rate expected tokens, and
        costs its share of one more draft step plus a verified token (`CostModel.saving`), which a
        plain round turns into price = that time x b / V(b, 1) tokens. The row stops if the gain
        is below the price. The test looks one draft ahead, and the plan's own rate is higher than
        a plain round's: both make it stop later than a full replan would, never sooner.

        Example, batch 1, D(1) 1.1 ms, V(1, 1) 6.1 ms: price 0.18 tokens. A first draft the draft
        model gave q = 0.2 (calibrated rate 0.3), next position's rate 0.8: 0.24, it goes on; a
        second at q = 0.2 too: G = 0.09, 0.07 < 0.18, it stops at 2 of its 4 planned drafts. Only
        greedy rows are cut (a sampled row's length must not follow its own q: see `prune`)."""
        going = [i for i, n in enumerate(lengths) if n > depth]
        if self.cost is None or not going:
            return lengths
        b = self.last.get("rows", len(lengths))
        per_row = self.cost.draft(len(going)) / len(going) + self.cost.verify_scale * self.cost.saving(b)
        price = per_row * b / self.cost.verify(b, 1)
        later, scale, out = self.later_rates(), self.gain_scale(), list(lengths)
        after = later[depth - 1] if depth - 1 < len(later) else later[-1]  # d_{depth+1}'s rate
        factors = self.later_factors([reqs[i].stats for i in going])
        for i, factor in zip(going, factors):
            r = reqs[i]
            priors = self._rates(self.alpha(*self.own_record(r.stats, False)[:2]), later, depth, factor)
            if scale * cumulative(self.calibration.rates(confidence[i][:depth], priors))[-1] * after < price:
                out[i] = depth
        return out

    def _calibration(self, looked: list[bool] | None, i: int) -> Calibration:
        """Row i's: of its lookup's confidence where a hybrid's lookup drafts it, else of q."""
        return self.lookup_calibration if looked and looked[i] else self.calibration

    def _later_by(self, looked: list[bool] | None) -> dict[bool, list[float]]:
        """`later_rates` of each source `looked` names (the drafter's alone when None)."""
        return {by: self.later_rates(by) for by in set(looked or [False])}

    def _capped(self, gains: list[list[float]], held: list[int] | None = None) -> list[list[float]]:
        """With a fixed budget, only its worth of the ranking can be chosen."""
        if self.budget is None:
            return gains
        lengths = select(gains, self.budget, held)
        return [g[:n] for g, n in zip(gains, lengths)]

    def may_speculate(self, alphas: list[float], caps: list[int], weights: list[float] | None = None,
                      held: list[int] | None = None, index_s: float = 0.0, split_s: list[float] | None = None,
                      key: tuple | None = None, factors: list[float] | None = None,
                      looked: list[bool] | None = None) -> bool:
        """Whether `plan` could speculate if no row's drafting cost a draft step (an upper bound: a
        hybrid drafter's lookups, which bound lengths and make rows free, cost time of their own,
        so they are done only when they can change a plain plan), the indexing `index_s` charged
        as in `plan`. Given the batch's `key`, a no is the round's plan: a plain one, recorded as
        `plan` records one (settled unless the guard's penalty made it: see `plain_now`), so the
        caller runs the round plain without planning it again."""
        if self.cost is None or any(held or ()):
            return True
        b = len(caps)
        lengths, blocked, _ = self._best_lengths(alphas, caps, weights, [0.0] * b, held, index_s, split_s,
                                                 factors, looked)
        if any(lengths):
            return True
        if key is not None:
            if blocked:
                self.guard.kept_plain(b)
            self._memo = [key, 0, blocked, not blocked]
            self.plain(b)
        return False

    def speculates(self, rows: int) -> bool:
        """Whether a batch of `rows` requests will draft enough to prefill the draft model (else
        its prefill waits: the drafter catches up on a row if and when it drafts for it, and
        `plan` prices that). A plan for fresh requests would draft, and, once `record_rounds`
        rounds of that batch size ran, they verified drafts in at least `record_share` of their
        rows, by an exponential average (`observe`). A wrong yes costs the whole prompt's prefill
        in the draft model; a wrong no only moves it into the first round that drafts for the
        row (the same tokens, priced there), so both must say yes.
        The prediction alone missed what rounds weigh and a fresh plan does not (a cohort's
        refill, the guard's penalty once measured): the draft model at 32 rows on the echo
        workload prefilled every prompt, 11 % more prefill time, and verified drafts in 1
        row-round of 1473. Counted by rounds instead of rows, the rare round that explores
        speculation turned the prefill on again (17 row-rounds of 1464 drafted there, and prefill
        took 15 % longer). The record alone lags what the policy has learnt since: at 32 rows on
        echo a repeat whose rounds had drafted a lot was followed by one that prefilled every
        prompt (0.3 s, 7 % of the run) and then drafted in 1 row-round of ~1600."""
        if self.cost is None:
            return True
        share = self.drafting_share(rows)
        if share is not None and share < self.record_share:
            return False
        return any(self._best_lengths([self.alpha(0, 0)] * rows, [self.gamma_max] * rows, None, None)[0])

    def drafting_share(self, rows: int) -> float | None:
        """The share of rows that verified drafts in rounds of `rows` rows (an exponential average,
        `observe`), or None until `record_rounds` such rounds ran."""
        record = self._drafting.get(rows_bucket(rows))
        return record[0] if record is not None and record[1] >= self.record_rounds else None

    def observe(self, accepted: list[int], verified: list[int], confidence: list[list[float]] | None,
                verify_s: float, draft_s: float, caught_up: bool = False, timed: bool = True,
                looked: list[bool] | None = None) -> None:
        """After a round: each row's accepted / verified drafts, the drafts' probabilities, the
        draft stage's seconds and the rest of the round's (the verify pass and everything around
        it: what the decision between a plain and a speculative round has to weigh); caught_up:
        the draft model first fed what it had missed (`DraftProposal.caught_up`); timed False: the
        pass also prefilled prompts (`decode/round.py`), its seconds say nothing of the costs, or
        the round ran at the standing length (`stood`: nothing was predicted); looked[i]: a hybrid
        drafter's lookup drafted row i (its record is the lookup's)."""
        self._observed += 1
        for positions in self._positions.values():
            while len(positions) < self.gamma_max:
                positions.append([0.0, 0.0])
        if timed:  # (a round that prefilled a prompt drafted for its other rows only if the last did)
            self.last_plain = not any(verified)
            record = self._drafting.setdefault(rows_bucket(len(verified)), [0.0, 0])
            record[1] += 1
            drafted = sum(1 for n in verified if n) / max(1, len(verified))
            record[0] += max(self.record_weight, 1 / record[1]) * (drafted - record[0])
        for i, (a, n) in enumerate(zip(accepted, verified) if any(verified) else ()):
            positions = self._positions[bool(looked and looked[i])]
            for j in range(min(a + 1, n)):  # d_1..d_min(a+1, n) were reached; the first a accepted
                positions[j][1] += 1
                positions[j][0] += j < a
                if confidence is not None and confidence[i] is not None:
                    self._calibration(looked, i).add(confidence[i][j], j < a)
        if self.last.get("expected") and self.last.get("rows") == len(verified):
            realised = self._realised
            realised[2] += 1
            w = max(self.realised_weight, 1 / realised[2])
            realised[0] += w * (sum(accepted) - realised[0])
            realised[1] += w * (self.last["expected"] - realised[1])
        if self.cost is not None and self.last.get("rows") == len(verified) and timed:
            if caught_up:
                # the draft model fed what it missed (rows it did not draft for): a one-off that
                # serves later rounds, so neither the draft scale nor the guard hears of it. If
                # they did, a round drafting after many plain ones would pay for all of them,
                # speculation would measure slow, rounds would stay plain, and the next catch-up
                # would be longer still (seen at batch 1: measured draft steps 2.5x the profile).
                self.cost.correct(self.last["verify_s"], verify_s, 0.0, 0.0, rows=len(verified),
                                  deepest=max(verified, default=0))
                return
            self.cost.correct(self.last["verify_s"], verify_s, self.last["draft_s"], draft_s, plain=not any(verified),
                              rows=len(verified), deepest=max(verified, default=0))
            predicted = self.last["draft_s"] + self.last["verify_s"]
            if predicted > 0 and verify_s + draft_s > 0:
                slow = (verify_s + draft_s) / predicted
                self.guard.record(len(verified), slow, speculative=draft_s > 0 or any(verified))

    def predicted_s(self) -> float | None:
        """The last round's predicted draft + verify seconds (None without a cost model)."""
        return self.last["draft_s"] + self.last["verify_s"] if "verify_s" in self.last else None
