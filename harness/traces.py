"""Request traces in Mooncake's format (one JSON line a request: ``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids``, one id per 512-token prompt block, equal ids a reusable prefix):
what share of the input tokens a prefix cache can serve, and prompts that replay the trace.

- ``ideal_hit_share``: an unbounded cache (every block ever computed stays).
- ``lru_hit_share``: a cache of ``capacity`` blocks, least recently used out first: what a tier
  of that size serves, for sizing tiers before a replay measures them.
- ``thin``: a lighter trace that keeps its sharing (whole prefix trees kept or dropped);
- ``replay_prompts``: token ids that keep the trace's sharing at a smaller block (``block_tokens``
  per hash id, the same tokens for the same id), so a tiny model on a CPU can play it.

    python -m harness.traces benchmarks/data/mooncake/conversation_trace_20min.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path) -> list[TraceRequest]:
    requests = []
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            requests.append(
                TraceRequest(r["timestamp"], r["input_length"], r["output_length"], tuple(r["hash_ids"]))
            )
    return requests


def _cached_tokens(request: TraceRequest, blocks: int) -> int:
    return min(blocks * TRACE_BLOCK_TOKENS, request.input_length)


def ideal_hit_share(requests: Iterable[TraceRequest]) -> float:
    """Input tokens an unbounded prefix cache serves / all input tokens."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        prefix = next((i for i, h in enumerate(r.hash_ids) if h not in seen), len(r.hash_ids))
        hit += _cached_tokens(r, prefix)
        total += r.input_length
        seen.update(r.hash_ids)
    return hit / total if total else 0.0


def lru_hit_share(requests: Iterable[TraceRequest], capacity: int) -> float:
    """The same with at most ``capacity`` blocks kept, least recently used evicted first."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in requests:
        prefix = next((i for i, h in enumerate(r.hash_ids) if h not in cache), len(r.hash_ids))
        hit += _cached_tokens(r, prefix)
        total += r.input_length
        for h in r.hash_ids:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hit / total if total else 0.0


def thin(
    requests: Sequence[TraceRequest], keep: int, seed: int = 0, common: float = 0.05
) -> list[TraceRequest]:
    """A random ``1 / keep`` of the prefix trees: each request's tree is named by its first block
    that fewer than ``common`` of the requests hold (leading blocks most hold, a shared system
    prompt, name none); whole trees are kept or dropped, so what kept requests share stays."""
    holders: dict[int, int] = {}
    for r in requests:
        for h in set(r.hash_ids):
            holders[h] = holders.get(h, 0) + 1
    bound = common * len(requests)

    def tree(r: TraceRequest) -> int:
        return next((h for h in r.hash_ids if holders[h] < bound), r.hash_ids[-1] if r.hash_ids else -1)

    trees = sorted({tree(r) for r in requests})
    kept = set(random.Random(seed).sample(trees, max(1, len(trees) // keep)))
    return [r for r in requests if tree(r) in kept]


def replay_prompts(
    requests: Sequence[TraceRequest], block_tokens: int, vocab: range, seed: int = 0
) -> list[list[int]]:
    """One prompt per request: each hash id becomes the same ``block_tokens`` token ids (drawn
    from ``vocab`` by the id), the prompt cut to its input length scaled by ``block_tokens / 512``."""
    blocks: dict[int, list[int]] = {}
    prompts = []
    for r in requests:
        ids: list[int] = []
        for h in r.hash_ids:
            if h not in blocks:
                rng = random.Random(f"{seed}/{h}")
                blocks[h] = [rng.randrange(vocab.start, vocab.stop) for _ in range(block_tokens)]
            ids += blocks[h]
        length = max(1, -(-r.input_length * block_tokens // TRACE_BLOCK_TOKENS))
        prompts.append(ids[:length])
    return prompts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", type=Path)
    parser.add_argument("--lru-blocks", type=int, nargs="*", default=[1000, 4000, 16000])
    args = parser.parse_args(argv)
    requests = load_trace(args.trace)
    minutes = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 60_000 if requests else 0.0
    tokens = sum(r.input_length for r in requests)
    print(f"{len(requests)} requests over {minutes:.1f} min, {tokens:,} input tokens")
    print(f"ideal (unbounded) prefix-cache share: {ideal_hit_share(requests):.1%}")
    for capacity in args.lru_blocks:
        share = lru_hit_share(requests, capacity)
        print(f"LRU of {capacity:,} blocks ({capacity * TRACE_BLOCK_TOKENS:,} tokens): {share:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
