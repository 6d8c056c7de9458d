"""SpecController: how many drafted tokens each decoding sequence verifies in a step, and from which source.

Modes (`--spec`): `off`; `N` (up to N suffix-drafted tokens whenever the index has them); `mtp:N` (up to N
MTP-drafted tokens every step: no cost rule, the chain stops only at N or where no page is free); `suffix`,
`mtp` (drafts from the suffix index, or from the model's MTP block: mtp_drafter.py) with auto widths; `auto`
(default): suffix drafts, or with an MTP block per sequence and step the source with the larger expected
gain (SpecController._pick_mtp). Auto widths: the width that maximizes the expected generated tokens per
second of the step, from two things learned online:
  * acceptance: per source (suffix: per match-length bucket; MTP: one table) and draft depth i, the share
    of drafted tokens at depth i that
    were accepted when depth i was reached (counts decayed so the estimate follows the workload), and per
    sequence a running average of its first drafted token's acceptance. A token's chance to be reached and
    accepted, R_i, is the product of the per-depth estimates along the draft (each scaled by the share of
    candidate occurrences that voted for that token; for MTP drafts, by the block's softmax probability);
  * cost: the seconds of a step as a function of its tokens, a least-squares line over recent steps that
    read no prompt (decode and verify only), so its slope is the marginal cost c of one more token.
Drafted tokens of all sequences are taken best first while R / c exceeds the step's expected tokens per
second so far (E / T): a draft token is added only when it raises the step's rate. With many decoding
slots E / T is high and only confident drafts pass; a sequence whose drafts keep failing drops out, and
gets a one-token probe every PROBE_EVERY steps so it can come back.

An MTP-drafted token also costs the block's own forwards: token i costs m_i = head (+ block for i >= 1,
and for i = 0 where the block's KV rows wait for a draft: MtpCost.first_block) target decode steps
(mtp_drafter.mtp_cost: weight bytes read relative to one target forward), so its marginal seconds
are dt_i = c + m_i * t_1 (t_1: the cost line's one-token step; a suffix token's are c).
Priced at the step's rate before any draft, E0 / T0 tokens per second (n decoding sequences: E0 = n,
T0 = the cost line at n tokens), token i must bring P_i = E0 / T0 * dt_i tokens to pay: the width
choice's first test. A sequence drafts k tokens from the block only when the net gain
N(k) = (R_0 - P_0) + ... + (R_{k-1} - P_{k-1}) is positive for some k (and, in `auto`, beats the suffix
draft's, priced the same way). The block's head runs only for sequences that pass this test on estimates
(the running means of the block's first-token and per-step probabilities), so with many decoding
sequences, where E0 / T0 is high and the block's forwards hold up the whole step, it runs only for drafts
the width choice may take; the chain stops at a token that cannot pay for itself (R_i < P_i). When no
sequence has drafted from the block for PROBE_EVERY steps, one without a suffix draft gets a one-token
MTP probe, so the estimates can recover; the wait doubles after each probe (up to PROBE_MAX steps) while the
block is picked only for probes, and returns to PROBE_EVERY once it is picked on its price: where drafts do
not pay (many decoding sequences on a CPU), the probes' heads and verified tokens fade to ~1 step in 256.
Before any step is timed, P_i = m_i (MTP) or 0 (suffix).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .mtp_drafter import MtpCost
from .suffix_index import LENGTHS, MIN_CONF, NO_DRAFT, Draft, SequenceIndex, SuffixDrafter

MAX_DRAFT = 8            # drafted tokens per sequence and step at most (auto)
PROBE_EVERY = 16         # steps without a draft before a sequence gets a one-token probe
PROBE_MAX = 256          # the MTP probe's wait at most: it doubles after each probe (the block not picked between)
DECAY = 0.995            # acceptance counts fade by this per observation (~200 drafts of memory)
EMA = 0.2                # per-sequence first-token acceptance average
COST_WINDOW = 256        # decode / verify steps in the cost fit
PRIOR_SLOPE = 0.1        # before a slope is measured: one more token costs this share of a 1-token step


MODES = ("auto", "off", "suffix", "mtp")
MAX_WIDTH = 32           # the largest fixed width (`N`, `mtp:N`)


def parse_spec(value) -> int | str:
    """'auto' | 'off' | 'suffix' | 'mtp' | N | 'mtp:N', N = 1..MAX_WIDTH (CLI and config), normalized ('MTP:04'
    -> 'mtp:4', '5' -> 5); ValueError naming the accepted values."""
    v = str(value).strip().lower()
    if v in MODES:
        return v
    source, colon, width = v.rpartition(":")          # "mtp:4" -> ("mtp", ":", "4"); "4" -> ("", "", "4")
    try:
        n = int(width) if source == ("mtp" if colon else "") else 0
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_WIDTH:
        raise ValueError(f"spec must be 'auto', 'off', 'suffix', 'mtp', a number of drafted tokens 1..{MAX_WIDTH} "
                         f"or 'mtp:N' (N MTP-drafted tokens, 1..{MAX_WIDTH}), got {value!r}")
    return f"mtp:{n}" if colon else n


def split_spec(spec) -> tuple[str, int | str]:
    """A parse_spec value -> (mode, one of MODES: the draft source(s); width: "auto" or the fixed cap):
    N -> ("suffix", N), "mtp:N" -> ("mtp", N), any other -> (it, "auto")."""
    if isinstance(spec, int):
        return "suffix", spec
    mode, _, n = spec.partition(":")
    return mode, int(n) if n else "auto"


@dataclass
class SeqSpec:
    """Drafting state of one sequence (Sequence.spec)."""
    index: SequenceIndex | None   # suffix index (None when only MTP drafts)
    drafted: int = 0          # tokens proposed and verified
    accepted: int = 0         # of them, accepted
    steps: int = 0            # steps that verified a draft
    first_rate: dict = field(default_factory=lambda: {"suffix": 0.5, "mtp": 0.5})  # recent acceptance of the
                                                                                   # first drafted token, per source
    idle: int = 0             # steps since its last draft
    draft: Draft = field(default=NO_DRAFT)   # the draft of the open step
    source: str = "suffix"    # where it came from: "suffix" | "mtp"

    def log_text(self) -> str:
        return f"drafts accepted {self.accepted} of {self.drafted} in {self.steps} steps"


class StepCost:
    """Seconds of a decode / verify step by its token count: a least-squares line over recent steps.

    Asked once per step, so the fit is closed-form over running sums (token counts and their squares as
    exact integers; the float sums recomputed from the window every `window` samples so that rounding
    cannot drift): a few float operations instead of a numpy polyfit, whose ~40-250 us a step cost
    measurably against ~1 ms GPU decode steps."""

    def __init__(self, window: int = COST_WINDOW):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._sn = self._snn = 0             # sums of n and n * n (ints: exact)
        self._st = self._snt = 0.0           # sums of t and n * t
        self._since = 0                      # samples since the float sums were recomputed

    def observe(self, n_tokens: int, seconds: float) -> None:
        if not (n_tokens > 0 and seconds > 0):
            return
        s = self.samples
        if len(s) == s.maxlen:
            n0, t0 = s[0]
            self._sn -= n0
            self._snn -= n0 * n0
            self._st -= t0
            self._snt -= n0 * t0
        n, t = int(n_tokens), float(seconds)
        s.append((n, t))
        self._sn += n
        self._snn += n * n
        self._since += 1
        if self._since >= (s.maxlen or 1):
            self._since = 0
            self._st = math.fsum(x[1] for x in s)
            self._snt = math.fsum(x[0] * x[1] for x in s)
        else:
            self._st += t
            self._snt += n * t

    def line(self) -> tuple[float, float] | None:
        """(intercept, slope) in seconds; None before any step. Slope from PRIOR_SLOPE until two token
        counts were seen; never below 1% of a one-token step (timing noise can make it look free)."""
        m = len(self.samples)
        if not m:
            return None
        den = m * self._snn - self._sn * self._sn          # 0 exactly when every sample has the same n
        if den == 0:
            n0 = self.samples[0][0]
            per = self._st / m / (1 + PRIOR_SLOPE * (n0 - 1))
            return per, PRIOR_SLOPE * per
        slope = (m * self._snt - self._sn * self._st) / den
        icpt = (self._st - slope * self._sn) / m
        one = max(icpt + slope, 1e-6)
        return float(icpt), float(max(slope, 0.01 * one))


class Acceptance:
    """Decayed counts of drafted tokens reached / accepted, by match-length bucket and depth."""

    def __init__(self, depth: int):
        self.reached = np.full((len(LENGTHS), depth), 2.0)      # prior: 1 of 2 accepted
        self.accepted = np.full((len(LENGTHS), depth), 1.0)

    @staticmethod
    def bucket(match_len: int) -> int:
        return next((i for i, L in enumerate(LENGTHS) if match_len >= L), len(LENGTHS) - 1)

    def rate(self, match_len: int, depth: int) -> float:
        b, d = self.bucket(match_len), min(depth, self.reached.shape[1] - 1)
        return float(self.accepted[b, d] / self.reached[b, d])

    def observe(self, match_len: int, n_drafted: int, n_accepted: int) -> None:
        b = self.bucket(match_len)
        self.reached[b] *= DECAY
        self.accepted[b] *= DECAY
        depth = min(n_accepted + 1, n_drafted, self.reached.shape[1])     # depths reached
        self.reached[b, :depth] += 1
        self.accepted[b, :min(n_accepted, depth)] += 1


class SpecController:
    """Implements the Scheduler's drafter interface: drafts(seqs, limits) and observe(seq, n_drafted, n_accepted).

    Sources: the suffix index (spec/suffix_index.py) and, once use_mtp() gave it one, the model's MTP block
    (spec/mtp_drafter.py). `off`: none; `N`: suffix drafts of up to N tokens; `mtp:N`: MTP drafts of up to N
    tokens, whatever they cost; `suffix`: suffix drafts, auto widths; `mtp`: MTP drafts, auto widths; `auto`:
    per sequence and step the source with the larger expected gain net of what producing the draft costs
    (_pick_mtp), auto widths; without an MTP block `auto` is `suffix`."""

    def __init__(self, mode: int | str = "auto", drafter: SuffixDrafter | None = None):
        self.spec = parse_spec(mode)          # as given (`--spec`)
        self.mode, self.width = split_spec(self.spec)       # one of MODES; "auto" or a fixed cap
        self.max_draft = 0 if self.mode == "off" else MAX_DRAFT if self.width == "auto" else self.width
        self.drafter = drafter or SuffixDrafter()
        self.mtp = None                       # MtpDrafter (use_mtp)
        self.cost = StepCost()
        self.acceptance = Acceptance(max(1, self.max_draft))          # suffix drafts, by match length
        self.mtp_acceptance = Acceptance(max(1, self.max_draft))      # MTP drafts (one bucket)
        self.mtp_first_p = 0.5                # running mean of the MTP's first-token probability
        self.mtp_step_p = 0.5                 # running mean of the MTP's probability at depths >= 1
        self.mtp_idle = 0                     # steps with an MTP first token ready but no MTP draft verified
        self.mtp_probe_every = PROBE_EVERY    # mtp_idle that brings the next one-token MTP probe
        self._mtp_probe = None                # the sequence of this step's one-token MTP probe, if any
        self._price = None                    # this step's (E0 / T0, c, t_1): _token_price
        self.totals = dict(drafted=0, accepted=0, steps=0)
        self.by_source = {"suffix": dict(drafted=0, accepted=0), "mtp": dict(drafted=0, accepted=0)}
        self.outcomes: list[tuple[int, int]] = []     # (drafted, accepted) per verified draft, for metrics

    @property
    def enabled(self) -> bool:
        return self.max_draft > 0

    @property
    def wants_mtp(self) -> bool:
        """Whether an MTP block, when the model has one, should be loaded for this mode."""
        return self.mode in ("auto", "mtp")

    def use_mtp(self, mtp) -> None:
        """Draft with this MtpDrafter too (mode auto) or only (mode mtp)."""
        self.mtp = mtp

    @property
    def sources(self) -> tuple[str, ...]:
        if self.mode == "mtp":
            return ("mtp",)
        if self.mode == "auto" and self.mtp is not None:
            return ("suffix", "mtp")
        return ("suffix",) if self.enabled else ()

    # sequences in and out
    def attach(self, seq) -> None:
        """Give seq a drafting state (its prompt indexed now when suffix drafts are on); sequences without
        one never draft."""
        if self.enabled:
            seq.spec = SeqSpec(SequenceIndex(seq.tokens) if "suffix" in self.sources else None)

    def finished(self, seq) -> None:
        """Its output goes to the global index (drafts for later requests)."""
        if self.mtp is not None:
            self.mtp.forget(seq)
        if seq.spec is not None and seq.n_generated and "suffix" in self.sources:
            self.drafter.finished(seq.generated)

    # one step
    def drafts(self, seqs, limits: dict) -> dict:
        """seqs: the step's decoding sequences; limits[seq]: the most tokens it may draft (tokens left
        before max_tokens / the context, and KV pages). -> {seq: draft tokens} for those that draft."""
        chosen, ready = {}, {}
        self._mtp_probe = None
        line = self.cost.line()               # once a step: the price and the widths read it
        self._price = self._step_price(line, len(seqs))
        for seq in seqs:
            sp = seq.spec
            if sp is None:
                continue
            sp.draft, sp.source = NO_DRAFT, "suffix"
            cap = min(self.max_draft, limits.get(seq, 0))
            if cap < 1:
                continue
            if "suffix" in self.sources:
                sp.draft = self.drafter.propose(sp.index, cap)
            if "mtp" in self.sources and self.mtp is not None and self.mtp.ready(seq):
                ready[seq] = cap
        if ready:
            self._draft_mtp(ready)
        if self.width == "auto":
            widths = self._auto_widths([s for s in seqs if s.spec is not None and len(s.spec.draft)], len(seqs),
                                       line)
        else:
            widths = {s: min(len(s.spec.draft), self.width) for s in seqs if s.spec is not None}
        probe = self._mtp_probe
        if probe is not None and probe.spec.source == "mtp" and not widths.get(probe):
            widths[probe] = 1
        for seq in seqs:
            sp = seq.spec
            if sp is None:
                continue
            k = widths.get(seq, 0)
            sp.draft = Draft(sp.draft.tokens[:k], sp.draft.conf[:k], sp.draft.match_len) if k else NO_DRAFT
            sp.idle = 0 if k else sp.idle + 1
            if k:
                chosen[seq] = sp.draft.tokens
        if ready:
            took = any(s in chosen and s.spec.source == "mtp" for s in ready)
            self.mtp_idle = 0 if took else self.mtp_idle + 1
            if took:    # probes back off while only probes draft from the block; a draft it won resets them
                self.mtp_probe_every = (min(2 * self.mtp_probe_every, PROBE_MAX) if self._mtp_probe is not None
                                        else PROBE_EVERY)
        return chosen

    def _draft_mtp(self, ready: dict) -> None:
        """ready: seq -> cap, the sequences whose MTP first token can be had. Those that pick the block on
        estimates (_pick_mtp with the running means of its first-token and per-step probabilities: no head
        has run yet) get a chain (MtpDrafter.propose: the head, then one forward per further token, stopped
        where a token could no longer pay for itself; under a fixed width only at the cap or where no page is
        free); each takes its chain when _pick_mtp still holds with the chain's own confidences. With none
        picking the block for mtp_probe_every steps (auto widths: PROBE_EVERY, doubled after each probe up to
        PROBE_MAX until the block is picked on its price again), one sequence without a suffix draft gets a
        one-token probe."""
        cost = self._mtp_cost()
        caps, floors = {}, {}
        for seq, cap in ready.items():
            sp = seq.spec
            if self._pick_mtp(sp, [self.mtp_first_p * self.mtp_step_p ** i for i in range(cap)], cost):
                caps[seq] = cap
                if self.width == "auto":    # a fixed width drafts whatever the chain costs
                    # token i pays for itself when R_i = A_i * conf_i > P_i (A_i: R_i at confidence 1)
                    reach = self._reach(sp, "mtp", [1.0] * cap, 0)
                    floors[seq] = [self._token_price("mtp", i, cost) / a if a > 0 else math.inf
                                   for i, a in enumerate(reach)]
        probe = None
        if not caps and self.width == "auto" and self.mtp_idle >= self.mtp_probe_every:
            probe = next((s for s in ready if not len(s.spec.draft)), None)
            if probe is not None:
                caps[probe] = 1
        if not caps:
            return
        min_conf = MIN_CONF if self.width == "auto" else 0.0
        for seq, d in self.mtp.propose(caps, min_conf, floors).items():
            self.mtp_first_p += EMA * (d.conf[0] - self.mtp_first_p)
            for q in (c / p for p, c in zip(d.conf, d.conf[1:]) if p > 0):
                self.mtp_step_p += EMA * (q - self.mtp_step_p)
            if seq is probe or self._pick_mtp(seq.spec, d.conf, cost):
                seq.spec.draft, seq.spec.source = d, "mtp"
        self._mtp_probe = probe

    def _mtp_cost(self) -> MtpCost:
        """The MTP block's drafting cost (MtpDrafter.cost, in target decode steps) under auto widths; none
        under a fixed width, which drafts whatever is there."""
        return self.mtp.cost if self.width == "auto" else MtpCost(0.0, 0.0)

    def _pick_mtp(self, sp: SeqSpec, conf, cost: MtpCost) -> bool:
        """Whether a sequence drafts from the MTP block, given the MTP draft's confidences conf (estimated
        or its chain's): its net gain (_net: R_i, the chance that drafted token i is reached and accepted,
        the estimate the auto widths use, less its price P_i) is positive (mode mtp) or beats the suffix
        draft's net gain (mode auto). Under a fixed width mode mtp always drafts from the block."""
        net = self._net(sp, "mtp", conf, 0, cost)
        if self.sources == ("mtp",):
            return net > 0 or self.width != "auto"
        return net > self._net(sp, "suffix", sp.draft.conf, sp.draft.match_len, cost)

    def _net(self, sp: SeqSpec, source: str, conf, match_len: int, cost: MtpCost) -> float:
        """max over k >= 0 of N(k) = sum over i < k of R_i - P_i: the expected accepted tokens of the draft's
        best prefix less what its tokens cost, in tokens at the step's rate (module docstring)."""
        best = total = 0.0
        for i, R in enumerate(self._reach(sp, source, conf, match_len)):
            total += R - self._token_price(source, i, cost)
            best = max(best, total)
        return best

    @staticmethod
    def _step_price(line, n_decode: int):
        """(E0 / T0, c, t_1) of a step of n_decode one-token sequences, from the cost line (StepCost.line);
        None before any step was timed."""
        if line is None:
            return None
        icpt, slope = line
        return n_decode / (icpt + slope * n_decode), slope, max(icpt + slope, slope)

    def _token_price(self, source: str, i: int, cost: MtpCost) -> float:
        """P_i: the tokens drafted token i (from 0) of a source must be expected to bring to pay for its
        seconds at the step's rate (module docstring)."""
        m = cost.token(i) if source == "mtp" else 0.0
        if self._price is None:
            return m
        rate, slope, one = self._price
        return rate * (slope + m * one)

    def _reach(self, sp: SeqSpec, source: str, conf, match_len: int) -> list[float]:
        """R_i for each drafted token: per-depth acceptance (by source and match length) times the
        confidence ratio, the first depth blended with the sequence's own first-token rate."""
        acc = self.mtp_acceptance if source == "mtp" else self.acceptance
        out, R, prev = [], 1.0, 1.0
        for i, c in enumerate(conf):
            p = acc.rate(match_len, i)
            if i == 0:
                p = 0.5 * (p + sp.first_rate[source])
            R *= p * (c / prev) if prev > 0 else 0.0
            prev = c
            out.append(R)
        return out

    def _auto_widths(self, seqs, n_decode: int, line) -> dict:
        if line is None:                  # nothing timed yet: verify one token each to start measuring
            return {s: 1 for s in seqs}
        icpt, slope = line
        one = max(icpt + slope, slope)                          # seconds of a one-token target step
        E, T = float(n_decode), icpt + slope * n_decode        # expected tokens and seconds of the step
        mtp = self._mtp_cost() if self.mtp is not None else None
        options = []                                             # (R / seconds, R, seconds, seq, width)
        for seq in seqs:
            sp = seq.spec
            for i, R in enumerate(self._reach(sp, sp.source, sp.draft.conf, sp.draft.match_len)):
                dt = slope + (mtp.token(i) * one if sp.source == "mtp" else 0.0)
                options.append((R / dt, R, dt, seq, i + 1))
        widths = {}                       # per sequence R / seconds falls with depth: widths stay prefixes
        for rate, R, dt, seq, w in sorted(options, key=lambda o: (-o[0], -o[1], o[4])):
            if rate <= E / T:
                break
            widths[seq] = max(widths.get(seq, 0), w)
            E, T = E + R, T + dt
        for seq in seqs:                  # a sequence that stopped drafting gets a probe now and then
            if seq not in widths and seq.spec.idle >= PROBE_EVERY:
                widths[seq] = 1
        return widths

    def observe(self, seq, n_drafted: int, n_accepted: int) -> None:
        """The scheduler verified n_drafted tokens of seq's draft; the first n_accepted were accepted."""
        sp = seq.spec
        sp.drafted += n_drafted
        sp.accepted += n_accepted
        sp.steps += 1
        sp.first_rate[sp.source] += EMA * (float(n_accepted > 0) - sp.first_rate[sp.source])
        acc = self.mtp_acceptance if sp.source == "mtp" else self.acceptance
        acc.observe(sp.draft.match_len, n_drafted, n_accepted)
        t = self.totals
        t["drafted"] += n_drafted
        t["accepted"] += n_accepted
        t["steps"] += 1
        src = self.by_source[sp.source]
        src["drafted"] += n_drafted
        src["accepted"] += n_accepted
        self.outcomes.append((n_drafted, n_accepted))

    def pop_outcomes(self) -> list[tuple[int, int]]:
        out, self.outcomes = self.outcomes, []
        return out

    def observe_step(self, n_tokens: int, n_read: int, seconds: float) -> None:
        """The engine's measure of one step; steps that read prompt tokens do not enter the cost line."""
        if not n_read:
            self.cost.observe(n_tokens, seconds)
