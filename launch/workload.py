"""Seeded multi-turn streams and the per-rank serving state they build up.

`--bs` request slots each run a stream of conversations: a shared system prompt (one of a few,
so conversations share prefixes), then turns of (user prompt, generated tokens). A conversation
ends when its history passes `MAX_CONTEXT` tokens and the slot starts a new one. Everything that
is drawn (prompts, turn lengths, sampling parameters) comes from generators seeded by
(seed, slot, conversation, turn), so every rank draws the same; everything that is *generated*
comes from the verify step's commits, so a rank that commits other tokens drifts from the others
exactly as a real server's scheduler state would.

Per-rank state: each slot's committed history (its length is the request's seq len) and an
incremental hash of it (the synthetic model's context), and a prefix cache: a set of block keys
(a hash chain over `cache_block` token ids). Each step the blocks that were matched in the cache
(at a conversation or turn start) or newly inserted (as commits complete a block) are queued;
the next step's state collective issues one broadcast per queued block, so its number of
collectives depends on this rank's state (see state_collective.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import xxhash

from tpguard.launch.model import extend_history_hash, mix64_int

MAX_CONTEXT = 192  # tokens; a longer history ends the conversation
SYSTEM_PROMPTS = 4
SYSTEM_PROMPT_LEN = 24
USER_PROMPT_LEN = (6, 20)  # inclusive range
TURN_TOKENS = (8, 32)  # tokens generated per turn, inclusive range

# --mixed-params menu (SGLang-style: top_k 0 = off, top_p 1 = off, min_p 0 = off)
MIXED_TEMPERATURES = (0.6, 0.8, 1.0, 1.2)
MIXED_TOP_P = (0.8, 0.9, 0.95, 1.0)
MIXED_TOP_K = (0, 20, 50, 200)
MIXED_MIN_P = (0.0, 0.0, 0.05, 0.1)


@dataclass
class SamplingParams:
    temperature: float
    top_p: float
    top_k: int
    min_p: float


@dataclass
class Request:
    slot: int
    conversation: int = 0
    turn: int = 0
    history: list[int] = field(default_factory=list)
    history_hash: int = 0
    turn_left: int = 0
    chain: list[int] = field(default_factory=list)  # prefix-cache keys of the history's leading full blocks
    params: SamplingParams | None = None


class PrefixCache:
    """Per-rank cache of token blocks, keyed by a hash chain over their token ids."""

    def __init__(self, block: int):
        self.block = block
        self.keys: set[int] = set()

    def key(self, prev: int, tokens: list[int]) -> int:
        return xxhash.xxh64_intdigest(np.asarray(tokens, dtype=np.int64).tobytes(), seed=prev & ((1 << 64) - 1))


@dataclass
class StepInputs:
    seq_lens: np.ndarray  # int64 [bs]
    history_hash: np.ndarray  # uint64 [bs]
    last_tokens: np.ndarray  # int64 [bs]
    temperature: np.ndarray  # float32 [bs]
    top_p: np.ndarray  # float32 [bs]
    top_k: np.ndarray  # int64 [bs] (0: off)
    min_p: np.ndarray  # float32 [bs]


class Workload:
    def __init__(self, bs: int, vocab: int, seed: int, cache_block: int, params: SamplingParams,
                 mixed_params: bool = False):
        self.bs, self.vocab, self.seed = bs, vocab, seed
        self.base_params = params
        self.mixed_params = mixed_params
        self.cache = PrefixCache(cache_block)
        self.pending_blocks: list[np.ndarray] = []  # blocks for the next step's state collective
        self.digest = xxhash.xxh64(seed=0)  # of every commit, in order
        self.committed_tokens = 0
        self.conversations_started = 0
        self.system_prompts = [self._rng(7777, k).integers(0, vocab, SYSTEM_PROMPT_LEN).tolist()
                               for k in range(SYSTEM_PROMPTS)]
        self.requests = [Request(slot=i) for i in range(bs)]
        for r in self.requests:
            self._start_conversation(r)

    # --- seeded draws --------------------------------------------------------------------------

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed & 0xFFFFFFFF, *[k & 0xFFFFFFFF for k in key]])

    def _params(self, r: Request) -> SamplingParams:
        if not self.mixed_params:
            return self.base_params
        g = self._rng(4242, r.slot, r.conversation)
        return SamplingParams(float(g.choice(MIXED_TEMPERATURES)), float(g.choice(MIXED_TOP_P)),
                              int(min(g.choice(MIXED_TOP_K), self.vocab - 1)), float(g.choice(MIXED_MIN_P)))

    def _start_conversation(self, r: Request) -> None:
        g = self._rng(1, r.slot, r.conversation)
        sys_prompt = self.system_prompts[int(g.integers(0, SYSTEM_PROMPTS))]
        r.history, r.history_hash, r.chain, r.turn = [], 0, [], 0
        r.params = self._params(r)
        self.conversations_started += 1
        self._append(r, sys_prompt)
        self._start_turn(r, match=True)

    def _start_turn(self, r: Request, match: bool) -> None:
        g = self._rng(2, r.slot, r.conversation, r.turn)
        prompt = g.integers(0, self.vocab, int(g.integers(USER_PROMPT_LEN[0], USER_PROMPT_LEN[1] + 1))).tolist()
        r.turn_left = int(g.integers(TURN_TOKENS[0], TURN_TOKENS[1] + 1))
        self._append(r, prompt)
        self._cache_blocks(r, match=match)

    # --- state ---------------------------------------------------------------------------------

    def _append(self, r: Request, tokens: list[int]) -> None:
        h = r.history_hash
        for t in tokens:
            h = extend_history_hash(h, t)
        r.history_hash = h
        r.history.extend(int(t) for t in tokens)

    def _cache_blocks(self, r: Request, match: bool) -> None:
        """Walk the history's full blocks not yet in `r.chain`: count cache hits (when matching a new
        prompt) and insert misses; each is queued for one broadcast in the next state collective."""
        b = self.cache.block
        full = len(r.history) // b
        matching = match
        while len(r.chain) < full:
            k = len(r.chain)
            tokens = r.history[k * b:(k + 1) * b]
            key = self.cache.key(r.chain[-1] if r.chain else mix64_int(b), tokens)
            hit = key in self.cache.keys
            matching = matching and hit
            if not hit:
                self.cache.keys.add(key)
            if matching or not hit:  # a matched prefix block, or a newly inserted one
                self.pending_blocks.append(np.asarray(tokens, dtype=np.int64))
            r.chain.append(key)

    def inputs(self) -> StepInputs:
        rs = self.requests
        p = [r.params for r in rs]
        return StepInputs(
            seq_lens=np.array([len(r.history) for r in rs], dtype=np.int64),
            history_hash=np.array([r.history_hash for r in rs], dtype=np.uint64),
            last_tokens=np.array([r.history[-1] for r in rs], dtype=np.int64),
            temperature=np.array([x.temperature for x in p], dtype=np.float32),
            top_p=np.array([x.top_p for x in p], dtype=np.float32),
            top_k=np.array([x.top_k for x in p], dtype=np.int64),
            min_p=np.array([x.min_p for x in p], dtype=np.float32),
        )

    def take_blocks(self) -> list[np.ndarray]:
        blocks, self.pending_blocks = self.pending_blocks, []
        return blocks

    def commit(self, out_tokens: np.ndarray, commit_lens: np.ndarray) -> None:
        """Append each request's committed tokens; end turns and conversations; update the cache."""
        spec = out_tokens.shape[1]
        for r in self.requests:
            n = int(min(max(int(commit_lens[r.slot]), 0), spec))
            tokens = out_tokens[r.slot, :n].tolist()
            self.digest.update(np.asarray([r.slot, n, *tokens], dtype=np.int64).tobytes())
            self.committed_tokens += n
            self._append(r, tokens)
            r.turn_left -= n
            if r.turn_left > 0:
                self._cache_blocks(r, match=False)
            elif len(r.history) >= MAX_CONTEXT:
                r.conversation += 1
                self._start_conversation(r)
            else:
                self._cache_blocks(r, match=False)
                r.turn += 1
                self._start_turn(r, match=True)

    def output_fingerprint(self) -> int:
        """64-bit digest of every commit so far (slot, length, tokens), in order."""
        return self.digest.intdigest()
