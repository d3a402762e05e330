"""Logits rows → next tokens, one batched pass over a step's rows: greedy rows take the argmax; sampled rows
are scaled by their temperature, cut to their top-k and top-p, and drawn by an exponential race whose noise
comes from a counter-based hash of (the request's seed, the token's index, the vocabulary id). No generator
object and no tensor operation per row: a step of 256 sampled rows costs the same few kernels as one. A
request draws the same tokens alone, in any batch, after preemption or a restart."""

from __future__ import annotations

from operator import attrgetter

import torch

from batching.grammar import allowed_tokens
from batching.host_to_device import device_tensor
from batching.sequence import Sequence
from batching.token_counts import TokenCounts

_plain = attrgetter("plain")
_MASK64 = (1 << 63) - 1
_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed 64-bit integer (torch has no uint64 math)
_MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB


def token_seed(seed: int, index: int) -> int:
    """A 63-bit seed for output token `index` of a request seeded with `seed` (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK64


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """keys: [R] int64 (token_seed of each row); returns [R, V] float64 Exp(1) noise, element (r, v) a pure
    function of (keys[r], v): splitmix64 of key + v * golden ratio, its top 53 bits a uniform in (0, 1)."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    z = keys[:, None] + ids[None, :] * _GOLDEN  # [R, V], wrapping int64 arithmetic
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    u = (_shr(z, 11).to(torch.float64) + 0.5) * 2.0**-53  # (0, 1), never 0
    return -torch.log(u)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits: [N, V]; each row's argmax [N] (int64; the first of equal maxima, a NaN before all, as torch's).
    On the CPU in float32/float64 with many rows by numpy: torch's CPU argmax over [256, 259] took 169 us on one
    thread (~4 ms on two, its threads woken for it), numpy's 21 us; inside an engine step, 140 against 64 us.
    For a few rows the conversions cost more than they save (one row: 16 against 28 us in a step). bfloat16 and
    float16 rows are widened to float32 first (exact: the same order, the same ties): torch's CPU argmax over
    bfloat16 [64, 8192] took 854 us on two threads, the widening and numpy's 180-200."""
    if len(logits) >= NUMPY_ARGMAX_ROWS and logits.device.type == "cpu":
        if logits.dtype in _WIDENED:
            logits = logits.float()
        if logits.dtype in _NUMPY_FLOATS:
            return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


NUMPY_ARGMAX_ROWS = 16
_NUMPY_FLOATS = (torch.float32, torch.float64)
_WIDENED = (torch.bfloat16, torch.float16)


def apply_penalties(
    logits: torch.Tensor, seqs: list[Sequence], seen: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """logits: [P, V] of rows with penalties; seen: [P, V] bool, the tokens of each row's prompt and output;
    counts: [P, V], each token's occurrences in its output (token_counts.py). The penalized logits
    (batching/sampling_params.py), in one pass."""
    dev = logits.device
    counts = counts.to(logits.dtype)

    def column(name: str) -> torch.Tensor:  # [P, 1]: each row's value of a parameter
        return device_tensor([getattr(s.params, name) for s in seqs], dev, logits.dtype)[:, None]

    repetition, presence, frequency = (
        column(n) for n in ("repetition_penalty", "presence_penalty", "frequency_penalty")
    )
    x = torch.where(seen, torch.where(logits < 0, logits * repetition, logits / repetition), logits)
    return x - frequency * counts - presence * (counts > 0)


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [N, V] of all rows; a copy with each row's logit_bias added (one scatter for every row's)."""
    rows = [r for r, s in enumerate(seqs) for _ in s.params.logit_bias]
    ids = [t for s in seqs for t in s.params.logit_bias]
    bias = [b for s in seqs for b in s.params.logit_bias.values()]
    dev = logits.device
    index = (device_tensor(rows, dev), device_tensor(ids, dev))
    return logits.index_put(index, device_tensor(bias, dev, logits.dtype), accumulate=True)


def hold_back_stops(logits: torch.Tensor, rows: list[int], stops: list[list[int]]) -> torch.Tensor:
    """logits: [N, V]; a copy where each row of `rows` cannot draw its stop tokens (`stops`: the end of
    sequence unless ignored, and stop_token_ids): min_tokens not reached yet (vLLM's MinTokensLogitsProcessor,
    transformers' MinNewTokensLengthLogitsProcessor)."""
    dev = logits.device
    at = device_tensor([r for r, ids in zip(rows, stops, strict=True) for _ in ids], dev)
    ids = device_tensor([t for s in stops for t in s], dev)
    return logits.index_put((at, ids), logits.new_full((), float("-inf")))


def apply_grammars(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [C, V] of rows with a grammar (structured output); the tokens their grammars forbid set to
    -inf, from one bitmask of all rows (grammar.allowed_tokens) unpacked on the logits' device."""
    vocab = logits.shape[-1]
    packed = torch.from_numpy(allowed_tokens([s.grammar for s in seqs if s.grammar is not None], vocab)).to(
        logits.device
    )
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((packed[:, :, None] >> bits) & 1).view(len(seqs), -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))


class Sampler:
    def __init__(self, eos_token_ids: set[int] | frozenset[int] = frozenset()):
        self.eos_token_ids = sorted(eos_token_ids)  # held back with stop_token_ids before min_tokens
        self.token_counts = TokenCounts()  # penalized sequences' seen tokens and output counts, on the device
        # the last step's rows when all were plain (a sequence's params do not change)
        self._plain_seqs: list[Sequence] = []

    def forget(self, seq: Sequence) -> None:
        """`seq` ended: its counts go."""
        self.token_counts.forget(seq)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [N, V], one row per sequence that gets a new token this step."""
        return self.sample(logits, seqs).tolist()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The tokens [N] (int64, on the logits' device; nothing waits for the device) of `__call__`."""
        if seqs == self._plain_seqs or all(map(_plain, seqs)):  # the common step: greedy rows only
            self._plain_seqs = list(seqs)  # (a copy: the caller may change its list)
            return argmax(logits)
        if any(s.params.logit_bias for s in seqs):  # a copy, as below: before everything else
            logits = apply_logit_bias(logits, seqs)
        early = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens]
        if early:
            stops = [self._stop_ids(seqs[i]) for i in early]
            if any(stops):
                logits = hold_back_stops(logits, early, stops)
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if constrained:  # a copy, as for penalties
            index = device_tensor(constrained, logits.device)
            masked = apply_grammars(logits.index_select(0, index), [seqs[i] for i in constrained])
            logits = logits.index_copy(0, index, masked)
        penalized = [i for i, s in enumerate(seqs) if s.params.penalized]
        if penalized:  # a copy: log probabilities are the model's (engine.py takes them from `logits`)
            at = device_tensor(penalized, logits.device)
            counted = [seqs[i] for i in penalized]
            rows, seen, counts = self.token_counts.gather(counted, logits.shape[-1], logits.device)
            changed = apply_penalties(logits.index_select(0, at), counted, seen, counts)
            logits = logits.index_copy(0, at, changed)
        tokens = argmax(logits)  # greedy rows done here
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            rows_sampled = [seqs[i] for i in sampled]
            index = device_tensor(sampled, logits.device)
            tokens = tokens.index_copy(0, index, self._sample(logits.index_select(0, index), rows_sampled))
        if penalized:  # this step's tokens join the counts on the device
            self.token_counts.add(counted, rows, tokens.index_select(0, at))
        return tokens

    def _stop_ids(self, seq: Sequence) -> list[int]:
        p = seq.params
        vocab = self.eos_token_ids if not p.ignore_eos else []
        return [*vocab, *p.stop_token_ids]

    @staticmethod
    def _sample(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits: [R, V] of sampled rows; their tokens [R]."""
        dev, vocab = logits.device, logits.shape[-1]
        temperature = device_tensor([s.params.temperature for s in seqs], dev, torch.float32)
        x = logits.float() / temperature[:, None]  # [R, V]
        top_k = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        if min(top_k) < vocab or min(top_p) < 1.0:
            sorted_x, order = torch.sort(x, dim=-1, descending=True)  # [R, V]
            ranks = torch.arange(vocab, device=dev)
            k = device_tensor(top_k, dev)
            sorted_x = sorted_x.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
            p = device_tensor(top_p, dev, torch.float32)
            probs = torch.softmax(sorted_x, dim=-1)
            # keep the smallest set reaching top_p (rows with top_p 1 keep all)
            drop = (probs.cumsum(dim=-1) - probs >= p[:, None]) & (p < 1.0)[:, None]
            x = torch.empty_like(x).scatter_(1, order, sorted_x.masked_fill(drop, float("-inf")))
        probs = torch.softmax(x, dim=-1).double()
        min_p = [s.params.min_p for s in seqs]
        if max(min_p) > 0.0:  # drop what is less likely than min_p times the row's most likely token
            floor = device_tensor(min_p, dev, torch.float64)[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        # exponential race (equivalent to sampling from probs), with noise from (seed, token index) only
        keys = device_tensor([token_seed(s.sample_seed, s.num_output_tokens) for s in seqs], dev, torch.int64)
        return argmax(probs / exponential_noise(keys, vocab))
