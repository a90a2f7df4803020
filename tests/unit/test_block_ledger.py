"""The agent's per-request ledger over the allocator: blocks come back together, exactly once,
and only the request's current owner (or a reclaim of a dead owner) gives them back."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_agent.blocks import PROMPT_GRANT_KEEP_S, BlockLedger, NotOwnerError
from gpu_agent.leases import Leases
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.kv_slab import KVSlabPool
from tandem.engine.errors import InvalidRequestError, OutOfBlocksError
from tandem.protocol import ModelKVLoad


def test_allocate_extend_release_by_request_id() -> None:
    ledger = BlockLedger(BlockAllocator(num_blocks=8, block_size=4))
    a = ledger.allocate("a", list(range(7)), num_extra_tokens=1, owner="p")  # 8 tokens -> 2 blocks
    assert a.block_ids == (0, 1)
    assert ledger.extend("a", 9) == [2]
    assert ledger.blocks_of("a") == [0, 1, 2]
    assert ledger.release("a") == 3
    assert ledger.release("a") == 0  # idempotent
    assert ledger.allocator.num_free_blocks == 8


def test_extra_tokens_may_need_a_block_of_their_own() -> None:
    ledger = BlockLedger(BlockAllocator(num_blocks=8, block_size=4))
    assert ledger.allocate("a", list(range(8)), num_extra_tokens=1, owner="p").block_ids == (0, 1, 2)


def test_refused_allocation_leaves_nothing_behind() -> None:
    ledger = BlockLedger(BlockAllocator(num_blocks=2, block_size=4))
    with pytest.raises(OutOfBlocksError):
        ledger.allocate("a", list(range(8)), num_extra_tokens=1, owner="p")  # prompt fits, the extra token not
    assert ledger.allocator.num_free_blocks == 2 and ledger.num_requests == 0


def test_release_publishes_written_tokens_for_reuse() -> None:
    ledger = BlockLedger(BlockAllocator(num_blocks=8, block_size=4))
    prompt = list(range(10))
    ledger.allocate("a", prompt, owner="p")
    ledger.release("a", prompt)
    b = ledger.allocate("b", prompt + [42], owner="p")
    assert b.num_cached_tokens == 8


def test_unknown_and_duplicate_requests_are_errors() -> None:
    ledger = BlockLedger(BlockAllocator(num_blocks=8, block_size=4))
    ledger.allocate("a", [1, 2], owner="p")
    with pytest.raises(InvalidRequestError, match="already holds"):
        ledger.allocate("a", [1, 2], owner="p")
    with pytest.raises(InvalidRequestError, match="holds no blocks"):
        ledger.extend("zzz", 5)


def test_only_the_owner_releases_extends_or_publishes() -> None:
    ledger = BlockLedger(BlockAllocator(num_blocks=8, block_size=4))
    ledger.allocate("a", list(range(5)), owner="prefill-1")
    assert ledger.claim("decode-1", ["a", "gone"]) == (["gone"], {"a": [0, 1]}, [])
    assert ledger.release("a", owner="prefill-1") == 0  # a late release of the former holder
    with pytest.raises(NotOwnerError):
        ledger.extend("a", 12, owner="prefill-1")
    with pytest.raises(NotOwnerError):
        ledger.publish("a", list(range(4)), owner="prefill-1")
    assert ledger.extend("a", 12, owner="decode-1") == [2]
    assert ledger.reclaim("prefill-1") == (0, 0)
    assert ledger.reclaim("decode-1") == (1, 3)
    assert ledger.allocator.num_free_blocks == 8 and ledger.release("a") == 0
    with pytest.raises(InvalidRequestError, match="owner"):
        ledger.allocate("b", [1], owner="")


_OPS = st.lists(st.tuples(st.sampled_from(["allocate", "extend", "claim", "claim_from_dead", "release", "reclaim"]),
                          st.integers(0, 5), st.integers(0, 2), st.integers(1, 30)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(_OPS)
def test_random_ownership_histories_never_lose_or_double_free_a_block(ops: list[tuple[str, int, int, int]]) -> None:
    """Blocks held + blocks free = the pool after any history of allocations, claims, releases
    (by owners and by others) and reclaims; each request's blocks return exactly once."""
    ledger = BlockLedger(BlockAllocator(num_blocks=24, block_size=4))
    owners = ["prefill", "decode-old", "decode-new"]
    held: dict[str, str] = {}  # the model: request -> owner
    freed = 0  # blocks given back, which prefill's wait for blocks reads as the pool's progress
    for op, r, o, n in ops:
        rid, owner = f"r{r}", owners[o]
        before = {k: len(ledger.blocks_of(k) or []) for k in held}
        if op == "allocate":
            try:
                ledger.allocate(rid, list(range(n)), owner=owner)
                assert rid not in held
                held[rid] = owner
            except OutOfBlocksError:
                pass
            except InvalidRequestError:
                assert rid in held
        elif op == "extend" and rid in held:
            try:
                ledger.extend(rid, n + 4 * len(ledger.blocks_of(rid) or []), owner=owner)
                assert held[rid] == owner
            except NotOwnerError:
                assert held[rid] != owner
            except OutOfBlocksError:
                pass
        elif op == "claim":
            missing, _, kept = ledger.claim(owner, [rid])
            assert (missing == [rid]) == (rid not in held) and kept == []
            if rid in held:
                held[rid] = owner
        elif op == "claim_from_dead":  # "decode-new" is the one live service besides the claimer
            missing, blocks, kept = ledger.claim(owner, [rid], may_take_from=lambda holder: holder != "decode-new")
            assert (missing == [rid]) == (rid not in held)
            taken = rid in held and (held[rid] == owner or held[rid] != "decode-new")
            assert (kept == [rid]) == (rid in held and not taken) and (rid in blocks) == taken
            if taken:
                held[rid] = owner
        elif op == "release":
            released = ledger.release(rid, owner=owner)
            if held.get(rid) == owner:
                assert released > 0
                del held[rid]
            else:
                assert released == 0
        elif op == "reclaim":
            mine = sorted(k for k, v in held.items() if v == owner)
            assert sorted(ledger.owned_by(owner)) == mine
            assert ledger.reclaim(owner)[0] == len(mine)
            for k in mine:
                del held[k]
        freed += sum(n for k, n in before.items() if k not in held)
        assert ledger.num_blocks_freed == freed
        in_use = [b for k in held for b in ledger.blocks_of(k) or []]
        assert len(in_use) == len(set(in_use))
        assert ledger.allocator.num_free_blocks + len(in_use) == 24
        assert {k: ledger.owner_of(k) for k in held} == held
    for owner in owners:
        ledger.reclaim(owner)
    assert ledger.allocator.num_free_blocks == 24 and ledger.num_requests == 0


def test_a_lease_that_ends_reclaims_after_its_grace_unless_the_service_comes_back() -> None:
    async def body() -> None:
        ledger = BlockLedger(BlockAllocator(num_blocks=16, block_size=4))
        leases = Leases(ledger, lambda sid: sid.startswith("decode"), grace_s=0.05, decode_grace_s=0.2)
        for sid in ("prefill-1", "decode-1", "decode-2"):
            leases.opened(sid)
            ledger.allocate(f"{sid}-req", list(range(6)), owner=sid)
        leases.closed("prefill-1")
        leases.closed("decode-1")
        leases.closed("decode-2")
        leases.opened("decode-2")  # a reconnect within the grace: nothing happens
        await asyncio.sleep(0.1)
        assert ledger.owned_by("prefill-1") == [] and leases.num_reclaimed_requests == 1
        assert ledger.owned_by("decode-1") == ["decode-1-req"]  # its successor has time to claim
        ledger.claim("decode-2", ["decode-1-req"])
        await asyncio.sleep(0.2)
        assert leases.num_reclaimed_requests == 1  # claimed: not the dead one's any more
        assert sorted(ledger.owned_by("decode-2")) == ["decode-1-req", "decode-2-req"]
        leases.closed("decode-2")
        await asyncio.sleep(0.3)
        assert ledger.num_requests == 0 and ledger.allocator.num_free_blocks == 16
        assert leases.num_reclaimed_requests == 3 and leases.num_reclaimed_blocks == 6

    asyncio.run(body())


def test_a_refused_readmission_goes_ahead_of_new_prompts_until_it_fits_or_its_hold_ends() -> None:
    ledger = BlockLedger(BlockAllocator(num_blocks=8, block_size=4))
    ledger.allocate("running", list(range(20)), owner="d")  # 5 blocks, 3 free
    with pytest.raises(OutOfBlocksError):  # needs 4 (15 tokens + 1)
        ledger.allocate("back", [7] * 15, num_extra_tokens=1, owner="d", readmit=True, now_s=10.0)
    assert ledger.held_for_readmission(10.5) == 4
    with pytest.raises(OutOfBlocksError, match="held back for 1 preempted"):
        ledger.allocate("new", [1], owner="p", now_s=10.5)  # 1 block would fit, but not beside the hold
    assert ledger.num_requests == 1
    ledger.release("running")
    ledger.allocate("new", [1], owner="p", now_s=10.6)  # 8 free: room for the hold and the prompt
    assert ledger.allocate("back", [7] * 15, num_extra_tokens=1, owner="d", readmit=True, now_s=10.7).block_ids
    assert ledger.held_for_readmission(10.7) == 0  # granted: the hold is gone
    with pytest.raises(OutOfBlocksError):  # needs 5, 3 free: held until 21.0 unless it asks again
        ledger.allocate("late", list(range(20)), owner="d", readmit=True, now_s=20.0)
    with pytest.raises(OutOfBlocksError):
        ledger.allocate("new2", [2], owner="p", now_s=20.9)
    ledger.allocate("new2", [2], owner="p", now_s=21.0)  # it stopped asking (cancelled): the hold ended
    assert ledger.held_for_readmission(21.0) == 0


@given(ops=st.lists(st.tuples(st.sampled_from(["new", "readmit", "release", "wait"]), st.integers(1, 40),
                              st.floats(0.0, 1.5)), max_size=40))
@settings(max_examples=200, deadline=None)
def test_new_prompts_never_take_what_standing_readmissions_need(ops: list[tuple[str, int, float]]) -> None:
    """Against a model of the holds: a new prompt is granted only if the pool has room for it and
    every standing hold; a readmission is refused only for want of blocks, and then holds what
    it needs for READMIT_HOLD_S; a granted one holds nothing. Every block comes back."""
    from gpu_agent.blocks import READMIT_HOLD_S

    ledger = BlockLedger(BlockAllocator(num_blocks=12, block_size=4))
    holds: dict[str, tuple[int, float]] = {}
    now, live, n = 0.0, [], 0
    for kind, tokens, dt in ops:
        now += dt
        holds = {r: h for r, h in holds.items() if h[1] > now}
        if kind == "wait":
            continue
        if kind == "release":
            if live:
                ledger.release(live.pop(tokens % len(live)))
            continue
        rid = f"{kind}-{tokens % 3}" if kind == "readmit" else f"new-{n}"
        n += 1
        if rid in live:
            continue
        need = -(-(tokens + 1) // 4)
        free = ledger.allocator.num_free_blocks
        held = sum(h[0] for r, h in holds.items())
        try:
            ledger.allocate(rid, list(range(1000 * n, 1000 * n + tokens)), num_extra_tokens=1, owner="s",
                            readmit=kind == "readmit", now_s=now)
        except OutOfBlocksError:
            if kind == "readmit":
                assert need > free
                holds[rid] = (need, now + READMIT_HOLD_S)
            else:
                assert need > free or (held and free < held + need)
        else:
            assert need <= free and (kind == "readmit" or not held or free >= held + need)
            holds.pop(rid, None)
            live.append(rid)
        assert ledger.held_for_readmission(now) == sum(h[0] for h in holds.values())
    for rid in live:
        ledger.release(rid)
    assert ledger.allocator.num_free_blocks == 12


def test_in_a_slab_pool_new_prompts_of_one_model_leave_the_slabs_another_models_readmission_waits_for() -> None:
    """Two models on one slab pool (4 slabs; a slab holds 2 blocks of model a, 4 of model b): a
    refused readmission of a holds the free slabs it needs against b's new prompts too, while b
    may still fill the free blocks of its own slabs; the hold ends when a is granted or stops
    asking."""
    pool = KVSlabPool(16, {"a": 2, "b": 1}, slab_multiple=2)
    a, b = BlockLedger(pool.view("a", 4)), BlockLedger(pool.view("b", 4))
    a.peers, b.peers = [b], [a]
    a.allocate("a1", list(range(16)), owner="da")  # 4 blocks: 2 slabs
    a.allocate("a2", list(range(8)), owner="da")  # 1 slab
    b.allocate("b1", list(range(8)), owner="db")  # 2 of the last slab's 4 blocks
    assert pool.num_free_slabs == 0
    a.release("a2")  # preempted: its slab is free again
    with pytest.raises(OutOfBlocksError):  # 4 blocks: 2 slabs, 1 free
        a.allocate("a2", list(range(16)), owner="da", readmit=True, now_s=5.0)
    assert a.slabs_held_back(5.1) == 2 and b.slabs_held_back(5.1) == 0
    # Admission's figures, in each model's blocks: a has 1 free slab (2 blocks) and holds 4 back
    # for its readmission; b has 2 free blocks in its slab and the free slab's 4, and a's hold
    # keeps 2 slabs (8 of b's blocks) back from it.
    assert a.kv_load(5.1) == ModelKVLoad(4, free_blocks=2, held_back_blocks=4, prompt_blocks_granted=6,
                                         granted_prompts=("a1",))  # a2 gave its blocks back
    assert b.kv_load(5.1) == ModelKVLoad(4, free_blocks=6, held_back_blocks=8, prompt_blocks_granted=2,
                                         granted_prompts=("b1",))
    with pytest.raises(OutOfBlocksError, match="held back for preempted requests of other models"):
        b.allocate("b2", list(range(12)), owner="pb", now_s=5.1)  # 3 blocks: would open a new slab
    b.allocate("b3", list(range(8)), owner="pb", now_s=5.2)  # fits in b's own slab: no slab taken
    a.release("a1")  # two more slabs free: room for the hold
    assert a.allocate("a2", list(range(16)), owner="da", readmit=True, now_s=5.3).block_ids
    assert a.slabs_held_back(5.3) == 0
    with pytest.raises(OutOfBlocksError):  # a refused again (needs 2 slabs, 1 free): held until 7.0
        a.allocate("a3", list(range(16)), owner="da", readmit=True, now_s=6.0)
    with pytest.raises(OutOfBlocksError, match="other models"):
        b.allocate("b2", list(range(4)), owner="pb", now_s=6.9)
    b.allocate("b2", list(range(4)), owner="pb", now_s=7.0)  # a stopped asking: the hold ended
    for ledger in (a, b):
        for owner in ("da", "db", "pb"):
            ledger.reclaim(owner)
    pool.check()
    assert pool.num_free_slabs == 4


@given(ops=st.lists(st.tuples(st.sampled_from(["new", "readmit", "release", "wait"]), st.sampled_from("ab"),
                              st.integers(1, 40), st.floats(0.0, 1.5)), max_size=40))
@settings(max_examples=200, deadline=None)
def test_a_new_prompt_in_a_slab_pool_never_takes_a_slab_another_models_hold_needs(
        ops: list[tuple[str, str, int, float]]) -> None:
    """Random histories of two models on one slab pool: whenever a new prompt of one model is
    granted a fresh slab, the free slabs left still cover every standing hold of the other; a new
    prompt that the model's admission figures (``kv_load``: free blocks less those held back,
    the other model's holds included) say fits is granted; every block and slab comes back."""
    pool = KVSlabPool(48, {"a": 2, "b": 1}, slab_multiple=2)  # 12 slabs: 2 blocks of a or 4 of b each
    ledgers = {"a": BlockLedger(pool.view("a", 4)), "b": BlockLedger(pool.view("b", 4))}
    ledgers["a"].peers, ledgers["b"].peers = [ledgers["b"]], [ledgers["a"]]
    now, held, ids = 0.0, {"a": [], "b": []}, iter(range(10**6))  # type: dict[str, list[str]]
    for op, model, n, dt in ops:
        ledger, other = ledgers[model], ledgers["b" if model == "a" else "a"]
        if op in ("new", "readmit"):
            rid = f"{model}{next(ids)}"
            slabs_before = pool.num_free_slabs
            kv = ledger.kv_load(now)
            assert kv.block_size == 4 and kv.free_blocks == ledger.allocator.num_free_blocks
            fits = kv.free_blocks - kv.held_back_blocks >= ledger.allocator.num_blocks_for(n)
            try:
                ledger.allocate(rid, list(range(n)), owner=model, readmit=op == "readmit", now_s=now)
            except OutOfBlocksError:
                assert not (op == "new" and fits), (kv, n)
                continue
            held[model].append(rid)
            if op == "new" and pool.num_free_slabs < slabs_before:
                assert other.slabs_held_back(now) <= pool.num_free_slabs
        elif op == "release" and held[model]:
            ledger.release(held[model].pop(n % len(held[model])))
        elif op == "wait":
            now += dt
    for model, ledger in ledgers.items():
        ledger.reclaim(model)
    pool.check()
    assert pool.num_free_slabs == 12


@given(ops=st.lists(st.tuples(st.sampled_from(["new", "readmit", "release", "reclaim", "wait"]),
                              st.integers(1, 12), st.floats(0.0, 20.0)), max_size=60),
       kept=st.integers(1, 6))
@settings(max_examples=200, deadline=None)
def test_the_report_names_the_new_prompts_given_blocks_lately_that_still_hold_them(
        ops: list[tuple[str, int, float]], kept: int) -> None:
    """``kv_load().granted_prompts`` (the router leaves those prompts out of the ones still
    waiting for blocks) is, on random histories, every new prompt (not a readmission) granted
    within PROMPT_GRANT_KEEP_S that holds its blocks still, the most recent first, at most
    PROMPT_GRANTS_KEPT of them; refused prompts are never named."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("gpu_agent.blocks.PROMPT_GRANTS_KEPT", kept)
        _check_grant_history(ops, kept)


def _check_grant_history(ops: list[tuple[str, int, float]], kept: int) -> None:
    ledger = BlockLedger(BlockAllocator(num_blocks=16, block_size=4))
    now, ids = 0.0, iter(range(10**6))
    grants: list[tuple[str, float]] = []  # the model: (id, granted at), oldest first
    owners: dict[str, str] = {}
    for op, n, dt in ops:
        if op in ("new", "readmit"):
            rid = f"r{next(ids)}"
            owner = f"svc{n % 2}"
            try:
                ledger.allocate(rid, list(range(n * 3)), owner=owner, readmit=op == "readmit", now_s=now)
            except OutOfBlocksError:
                continue
            owners[rid] = owner
            if op == "new":
                grants.append((rid, now))
        elif op == "release" and owners:
            rid = sorted(owners)[n % len(owners)]
            ledger.release(rid)
            del owners[rid]
        elif op == "reclaim":
            for rid in ledger.owned_by(f"svc{n % 2}"):
                del owners[rid]
            ledger.reclaim(f"svc{n % 2}")
        elif op == "wait":
            now += dt
        live = [rid for rid, at in grants if rid in owners and at > now - PROMPT_GRANT_KEEP_S]
        assert ledger.kv_load(now).granted_prompts == tuple(reversed(live[-kept:]))
