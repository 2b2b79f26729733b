"""Choosing the next token as llama.cpp's default chain does: logit biases and repetition penalties over the last
tokens, then top-k, top-p and min-p on the adjusted logits, then temperature (0: greedy), reproducible with a seed.
A constraint (a JSON grammar, say) is checked on the pick first and masks the logits only when the pick breaks it,
as llama.cpp applies its grammars. Log-probabilities, when asked, are of the adjusted (biased, penalised, masked)
logits at temperature 1: the distribution the pick was made from before truncation.

torch is imported by the Sampler, not here: the CLI checks SamplingParams before the slow imports."""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from moestream.errors import MoestreamError

if TYPE_CHECKING:
    import torch

UNTIL_DONE = -1  # max_tokens: until an end-of-text token or a full context (llama.cpp's -n -1)
# float32's smallest normal number: logits divided by a temperature below it overflow, or divide by zero (a
# temperature below float32's subnormals rounds to 0), so such a temperature is taken as greedy
GREEDY_BELOW = 2.0**-126
BAN = -100.0  # a logit bias this low bans the token (OpenAI's meaning of -100); llama.cpp's -l ID-inf does too
MAX_LOGPROBS = 20  # alternatives a step reports at most, as OpenAI's top_logprobs


MASKED_LOGPROB = -9999.0  # a masked or banned token's logprob, as vLLM reports it: JSON has no -Infinity


class NoTokenLeft(MoestreamError):
    """The request's own limits (logit_bias bans, a response_format) leave no token to pick: the client's to fix."""


class Constraint(Protocol):
    """What a token may come next (runtime/json_constraint.py): checked per pick, a full mask only when needed."""

    def allows(self, token: int) -> bool: ...

    def mask(self, n_vocab: int) -> torch.Tensor: ...  # bool [n_vocab]: True where the token may come next

    def advance(self, token: int) -> None: ...


@dataclass(frozen=True)
class TokenLogprob:
    """One step's pick and its log-probability, with the most likely alternatives (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class SamplingParams:
    max_tokens: int = 64  # UNTIL_DONE: no limit but the end of text and the context
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # keep tokens at least this fraction of the top token's probability; 0 = off
    repeat_penalty: float = 1.0  # divide a positive logit (multiply a negative one) of a recent token; 1 = off
    repeat_last_n: int = 64  # how many of the last tokens (prompt included) the penalties look at; 0 = off
    presence_penalty: float = 0.0  # subtracted once from the logit of each recent token
    frequency_penalty: float = 0.0  # subtracted per occurrence among the recent tokens
    seed: int | None = None  # None (or llama.cpp's -1): a random seed
    stop_at_eos: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit; <= BAN: banned
    logprobs: int | None = None  # None: off; N: each pick's log-probability and the N most likely (<= 20)

    def __post_init__(self) -> None:
        if self.max_tokens < UNTIL_DONE:
            raise MoestreamError(
                f"-n {self.max_tokens}: give the number of tokens to generate, or -1 to generate until the end "
                "of the text or a full context"
            )
        floats = ("temp", self.temperature), ("top-p", self.top_p), ("min-p", self.min_p)
        floats += ("repeat-penalty", self.repeat_penalty), ("presence-penalty", self.presence_penalty)
        for name, value in (*floats, ("frequency-penalty", self.frequency_penalty)):
            if not math.isfinite(value):
                raise MoestreamError(f"--{name} {value}: must be a finite number")
        if self.seed == -1:  # llama.cpp's "random seed"
            self.seed = None
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise MoestreamError(f"--seed {self.seed}: must fit in 64 bits (-1: a random seed)")
        if self.temperature < 0:
            raise MoestreamError(f"--temp {self.temperature}: must be >= 0")
        if self.top_k < 0:
            raise MoestreamError(f"--top-k {self.top_k}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise MoestreamError(f"--top-p {self.top_p}: must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise MoestreamError(f"--min-p {self.min_p}: must be in [0, 1] (0: off)")
        if not 0 < self.repeat_penalty < math.inf or not math.isfinite(1 / self.repeat_penalty):
            raise MoestreamError(f"--repeat-penalty {self.repeat_penalty}: must be above 0 (1: off)")
        if self.repeat_last_n < 0:
            raise MoestreamError(f"--repeat-last-n {self.repeat_last_n}: must be >= 0 (0: off)")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise MoestreamError(f"--logit-bias {token}: a token id is a whole number >= 0")
            if math.isnan(bias) or bias == math.inf:
                raise MoestreamError(f"--logit-bias {token}{bias:+}: the bias must be a finite number (or -inf: a ban)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise MoestreamError(f"logprobs {self.logprobs}: must be from 0 to {MAX_LOGPROBS}")

    @property
    def limit(self) -> float:
        """The most tokens to generate (inf: until the end of text or the context)."""
        return math.inf if self.max_tokens == UNTIL_DONE else self.max_tokens

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one too small to divide float32 logits by (its answer is the top token anyway)."""
        return self.temperature < GREEDY_BELOW

    @property
    def penalises(self) -> bool:
        return self.repeat_last_n > 0 and (
            self.repeat_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
        )


class Sampler:
    """Picks each next token of one sequence; it remembers the prompt and its picks for the penalties."""

    def __init__(self, params: SamplingParams, prompt: list[int] = (), constraint: Constraint | None = None):
        import torch

        self.params = params
        self.constraint = constraint
        self.recent: deque[int] = deque(prompt, maxlen=params.repeat_last_n)
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        bias = params.logit_bias
        self._bias_ids = torch.tensor(list(bias), dtype=torch.long)
        self._bias = torch.tensor([-math.inf if b <= BAN else b for b in bias.values()], dtype=torch.float32)
        self.last: TokenLogprob | None = None  # the last pick's log-probabilities, when params.logprobs is set

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick a token from logits [V] (on any device; sampled on the CPU for reproducibility)."""
        import torch

        logits = logits.float().cpu()  # sync: one token per step must reach the host anyway
        if not math.isfinite(float(logits.max())):  # NaN or +inf anywhere: every pick was token 0, said nowhere
            raise MoestreamError(
                "the model's logits hold NaN or infinity: its weights do (a damaged or badly converted file) or "
                "float16 overflowed; try --dtype bfloat16 or float32, or convert the model again"
            )
        if len(self._bias_ids):
            if int(self._bias_ids.max()) >= len(logits):
                raise MoestreamError(
                    f"logit_bias names token {int(self._bias_ids.max())}; the model has {len(logits)} tokens"
                )
            logits = logits.index_add(0, self._bias_ids, self._bias)
        if self.params.penalises and self.recent:
            logits = self._penalised(logits)
        token, masked = self._pick(logits), False
        if self.constraint is not None and not self.constraint.allows(token):
            logits, masked = self._masked(logits), True
            token = self._pick(logits)
        if self.params.logprobs is not None:  # of the logits the constraint leaves, whichever way the pick went
            if self.constraint is not None and not masked:
                logits = self._masked(logits)
            self.last = self._logprob(torch.log_softmax(logits, dim=-1), token)
        if self.constraint is not None:
            self.constraint.advance(token)
        if self.recent.maxlen:
            self.recent.append(token)
        return token

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        allowed = self.constraint.mask(len(logits))
        if not bool(allowed.any()):
            raise NoTokenLeft("no token of the vocabulary can continue the constrained output (response_format)")
        return logits.masked_fill(~allowed, -math.inf)

    def _logprob(self, logprobs: torch.Tensor, token: int) -> TokenLogprob:
        import torch

        logprobs = logprobs.clamp_min(MASKED_LOGPROB)
        top = torch.topk(logprobs, min(self.params.logprobs, len(logprobs)))
        pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        return TokenLogprob(token, float(logprobs[token]), pairs)

    def _pick(self, logits: torch.Tensor) -> int:
        import torch

        p = self.params
        if logits.max() == -math.inf:
            raise NoTokenLeft("every token is banned (logit_bias, or a constraint with -inf biases); ban fewer")
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits - logits.max()
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1:
            sorted_logits, idx = torch.sort(logits, descending=True)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            drop[0] = False  # the most likely token, even for a top_p below float32's smallest number
            logits = logits.index_fill(0, idx[drop], float("-inf"))
        if p.min_p > 0:  # the top logit is 0 here: keep p_i >= min_p * p_max
            logits = logits.masked_fill(logits < math.log(p.min_p), float("-inf"))
        logits = (logits - logits.max()) / p.temperature  # from the top down: a tiny temperature gives -inf, not inf
        return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=self.generator))

    def _penalised(self, logits: torch.Tensor) -> torch.Tensor:
        import torch

        p = self.params
        counts = Counter(self.recent)
        ids = torch.tensor(list(counts), dtype=torch.long)
        n = torch.tensor(list(counts.values()), dtype=logits.dtype)
        seen = logits[ids]
        seen = torch.where(seen > 0, seen / p.repeat_penalty, seen * p.repeat_penalty)
        seen = seen - n * p.frequency_penalty - p.presence_penalty
        logits = logits.clone()  # a penalty past float32's range: +inf the largest logit, nan (inf - inf) a ban
        logits[ids] = seen.nan_to_num(nan=-math.inf, posinf=torch.finfo(logits.dtype).max, neginf=-math.inf)
        return logits
