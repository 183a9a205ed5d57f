"""Which blocks a bounded KV policy keeps (core/kv/policy.py parses it), block-granular.

For a request under ``streaming:sinks=S,window=W`` with blocks of B tokens, let
head = ceil(S / B) (the sink blocks), recent = ceil((S + W) / B) - head. The queries of a
step whose last query lies in block ``last`` see exactly the tokens of blocks
[0, head) and [max(head, last - recent + 1), last]: the S sinks and the rest of their
blocks, then the newest ``recent`` blocks, the one being written included (so the
recent part holds between (recent - 1) * B + 1 and recent * B tokens). The request never
holds more than ceil((S + W) / B) blocks, a constant once its context passes them.

Positions are cache positions: a token's rotary position is its index among the held
tokens. Keys are rotated once, when written, at that position; dropping a block moves
every later held block B positions down, so those keys are re-rotated then (their one
rotation by -B per block dropped before them: engine/layers/rotary.py ``shift``). The
window's keys each move at most ``recent`` times before they are dropped themselves, so
rounding stays bounded; the sinks never move. The alternative, storing keys unrotated and
rotating every key at every read, costs a rotation of the whole kept cache per layer per
step instead of a rotation of the window once per B tokens (bench/kv_policy_rotation.py).

Because a drop changes positions, the queries of one step must agree on the kept set:
``chunk_limit`` ends a prefill chunk where it would change (at the budget, then at each
block boundary), and a bounded request does not speculate.

``h2o:heavy=H,recent=R`` keeps tokens, not blocks (engine/kv_cache/h2o.py): its table
is its cache's slots, budget = H + R of them in budget_blocks blocks, never a hole.
After a step fills the last slot, one token per layer and KV head is evicted and the
rest compacted, so ``kept_tokens`` = min(computed, budget - 1) and the next token goes
into the last slot; past the budget a chunk is one token (each one evicts).
"""
from __future__ import annotations

from core.errors import FieldError
from core.kv.policy import KVPolicy, parse_kv_policy


def live_bounds(policy: KVPolicy, block_size: int, num_computed: int,
                num_new_tokens: int) -> tuple[int, int]:
    """(head, first) for the queries num_computed .. num_computed + n - 1 (one at least):
    table entries [0, head) and [first, ...) are held, those between dropped (h2o drops
    no table entry: its table is its compacted slots)."""
    if policy.scored:
        return 0, 0
    head = policy.sink_blocks(block_size)
    last = (num_computed + max(num_new_tokens, 1) - 1) // block_size
    return head, max(head, last - policy.recent_blocks(block_size) + 1)


def chunk_limit(policy: KVPolicy, block_size: int, num_computed: int,
                num_new_tokens: int) -> int:
    """The most of num_new_tokens whose queries all see the same kept blocks: up to the
    budget's last block while nothing was dropped, then to the end of the current block
    (h2o: up to the budget, then one token a step, as each one evicts)."""
    if policy.scored:
        return min(num_new_tokens, max(1, policy.budget - num_computed))
    full = policy.budget_blocks(block_size) * block_size
    if num_computed < full:
        return min(num_new_tokens, full - num_computed)
    return min(num_new_tokens, block_size - num_computed % block_size)


def dropped_tokens(table: list[int], null: int, block_size: int) -> int:
    """Positions a bounded request's cache lost: its dropped entries, B tokens each."""
    return sum(1 for b in table if b == null) * block_size


def kept_tokens(policy: KVPolicy | None, num_computed: int) -> int:
    """The tokens a request's cache holds after num_computed were computed: every one,
    except under h2o (the budget less the slot the next token fills). Streaming's are
    counted by its table (``dropped_tokens``)."""
    if policy is None or not policy.scored:
        return num_computed
    return min(num_computed, policy.budget - 1)


def cache_view(policy: KVPolicy | None, table: list[int], null: int, block_size: int,
               num_computed: int) -> tuple[list[int], int]:
    """(the block table attention reads, how many positions it lost): a bounded request's
    held blocks, compact (positions within its cache); any other's table unchanged."""
    if policy is None:
        return table, 0
    if policy.scored:
        return table, num_computed - kept_tokens(policy, num_computed)
    return [b for b in table if b != null], dropped_tokens(table, null, block_size)


def request_policy(asked: str | None, server: KVPolicy | None, allowed: bool,
                   block_size: int, max_model_len: int) -> KVPolicy | None:
    """The policy a request runs under: the server's (--kv-policy) unless it asks for
    one (``kv_policy``), which needs --allow-request-kv-policy unless it is the server's.
    FieldError naming kv_policy for a refused or malformed one."""
    if not asked:
        return server
    policy = parse_kv_policy(asked, "kv_policy")
    if policy != server and not allowed:
        raise FieldError("kv_policy", f"kv_policy: this server runs --kv-policy "
                                      f"{server.spec() if server else 'full'} and takes no "
                                      f"other per request (its --allow-request-kv-policy "
                                      f"is off)")
    if policy is not None:
        policy.check(block_size, max_model_len, "kv_policy")
    return policy


def check_scores(runner: object, field: str) -> None:
    """FieldError naming ``field`` when the runner gives no attention scores (h2o evicts
    by them): its attention backend does not (engine/attention/base.py)."""
    backend = getattr(runner, "backend", None)
    if backend is None or not backend.gives_scores:
        name = getattr(backend, "name", "of this runner")
        raise FieldError(field, f"{field}: h2o needs attention scores, which --attention-backend "
                                f"{name} does not give; use --attention-backend sdpa or naive")
