"""KV slab pool (FineServe section 5): exact slab and block ids, carving and returning slabs,
LCM sizing, exhaustion, prefix hits across slab reuse, and a state machine over random histories."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from tandem.engine.errors import OutOfBlocksError
from tandem.engine.kv_slab import KVSlabPool, SlabState, kv_block_bytes, slab_bytes_for

# Model "a": 4 KiB blocks, "b": 6 KiB blocks -> LCM 12 KiB: a slab holds 3 of a's or 2 of b's.
A_BYTES, B_BYTES, SLAB = 4096, 6144, 12288


def _pool(num_slabs: int = 4, tail: int = 100) -> KVSlabPool:
    return KVSlabPool(SLAB * num_slabs + tail, {"a": A_BYTES, "b": B_BYTES})


def test_lcm_sizing_and_blocks_per_slab() -> None:
    pool = _pool()
    assert pool.slab_bytes == SLAB and pool.num_slabs == 4 and pool.unused_tail_bytes == 100
    assert pool.blocks_per_slab("a") == 3 and pool.blocks_per_slab("b") == 2
    assert KVSlabPool(SLAB * 8, {"a": A_BYTES, "b": B_BYTES}, slab_multiple=2).slab_bytes == 2 * SLAB
    # Llama-3.1-8B, 16-token blocks: fp16 KV 2 MiB; int8 KV with an fp16 scale per token and
    # KV head 1 MiB + 16 KiB = 2^14 x 65 bytes; their LCM is 2^21 x 65 bytes.
    fp16 = kv_block_bytes(32, 8, 128, 16, 2)
    int8 = kv_block_bytes(32, 8, 128, 16, 1, scale_bytes_per_token=32 * 2 * 8 * 2)
    assert fp16 == 2 << 20 and int8 == (1 << 20) + (16 << 10)
    assert slab_bytes_for([fp16, int8]) == (2 << 20) * 65
    assert slab_bytes_for([fp16, kv_block_bytes(32, 8, 128, 16, 1)]) == 2 << 20
    with pytest.raises(ValueError, match="holds no slab"):
        KVSlabPool(SLAB - 1, {"a": A_BYTES, "b": B_BYTES})
    with pytest.raises(ValueError, match="whole number of bytes"):
        kv_block_bytes(1, 1, 1, 1, 0.25)


def test_exact_slab_and_block_ids_on_a_crafted_sequence() -> None:
    pool = _pool()
    a, b = pool.view("a", block_size=4), pool.view("b", block_size=4)
    assert a.num_free_blocks == 12 and b.num_free_blocks == 8

    a1 = a.allocate(list(range(10)))  # 3 blocks: slab 0 formatted to a
    assert a1.block_ids == (0, 1, 2)
    assert pool.state(0) is SlabState.FULL and pool.owner(0) == "a"
    b1 = b.allocate(list(range(5)))  # 2 blocks: slab 1 formatted to b, ids 1*2+0, 1*2+1
    assert b1.block_ids == (2, 3)
    assert pool.owner(1) == "b" and pool.state(1) is SlabState.FULL
    a2 = a.allocate([7, 7])  # 1 block of slab 2 (a's blocks 6, 7, 8)
    assert a2.block_ids == (6,) and pool.state(2) is SlabState.PARTIAL
    assert a.num_free_blocks == 2 + 1 * 3 and b.num_free_blocks == 1 * 2

    a.free(a1.block_ids)  # slab 0 is empty: back to the free list's tail, after slab 3
    assert pool.state(0) is SlabState.FREE and pool.owner(0) is None and pool.num_free_slabs == 2
    b2 = b.allocate(list(range(100, 109)))  # 3 blocks: slab 3 (ids 6, 7), then slab 0 (id 0)
    assert b2.block_ids == (6, 7, 0)
    assert pool.owner(0) == "b" and pool.state(0) is SlabState.PARTIAL
    # b's block 0 now covers the bytes a's block 0 had; a holds nothing there any more.
    assert pool.locate("b", 0).offset_bytes == 0 and pool.locate("b", 7).offset_bytes == 3 * SLAB + B_BYTES
    assert pool.locate("a", 6).offset_bytes == 2 * SLAB
    a3 = a.allocate([1, 2, 3, 4, 5])  # first fit: a's open slab 2 (ids 7, 8), never b's slab 0
    assert a3.block_ids == (7, 8) and pool.state(2) is SlabState.FULL
    assert a.num_free_blocks == 0 and b.num_free_blocks == 1
    pool.check()


def test_extend_fills_the_models_open_slab_first() -> None:
    pool = _pool()
    a = pool.view("a", block_size=4)
    blocks = list(a.allocate([1, 2, 3]).block_ids)  # slab 0, block 0
    blocks += a.extend(blocks, 13)  # 3 more blocks: 1, 2 of slab 0, then 3 of slab 1
    assert blocks == [0, 1, 2, 3]
    assert a.extend(blocks, 16) == []
    assert a.num_slabs_held == 2 and a.num_used_blocks == 4


def test_freeing_the_last_block_returns_the_slab() -> None:
    pool = _pool()
    b = pool.view("b", block_size=4)
    x = b.allocate([1] * 8)  # slab 0: ids 0, 1
    y = b.allocate([2] * 3)  # slab 1: id 2
    b.free(x.block_ids[1:])
    assert pool.state(0) is SlabState.PARTIAL and pool.num_held_blocks(0) == 1
    b.free(x.block_ids[:1])
    assert pool.state(0) is SlabState.FREE and b.num_slabs_held == 1
    b.free(y.block_ids)
    assert pool.num_free_slabs == 4 and b.num_free_blocks == 8 and b.num_used_blocks == 0
    with pytest.raises(ValueError, match="freed more times"):
        b.free(y.block_ids)
    pool.check()


def test_exhaustion_raises_a_clear_error_and_changes_nothing() -> None:
    pool = _pool(num_slabs=2)
    a, b = pool.view("a", 4), pool.view("b", 4)
    a.allocate([1] * 4)  # slab 0 for a: 2 of its blocks still free, but only for a
    b.allocate([2] * 8)  # slab 1 for b, full
    assert not b.can_allocate([3] * 4)
    with pytest.raises(OutOfBlocksError, match=r"KV slab pool exhausted for model 'b'.*0 of 2 slabs free"):
        b.allocate([3] * 4)
    with pytest.raises(OutOfBlocksError, match="model 'a'"):
        a.extend([0], 16)
    assert a.num_free_blocks == 2 and pool.num_free_slabs == 0
    pool.check()


def test_a_freed_slab_keeps_its_prefix_until_another_model_carves_it() -> None:
    pool = _pool(num_slabs=2)
    a, b = pool.view("a", 4), pool.view("b", 4)
    prompt = list(range(1, 10))  # 2 full blocks + 1
    first = a.allocate(prompt)
    assert first.block_ids == (0, 1, 2)
    assert a.publish(first.block_ids, prompt) == 2
    a.free(first.block_ids)
    assert pool.num_free_slabs == 2
    # A prefix hit takes slab 0 back from the free list (still in a's format).
    again = a.allocate(prompt)
    assert again.num_cached_tokens == 8 and again.block_ids[:2] == (0, 1)
    assert pool.owner(0) == "a" and pool.num_free_slabs == 1
    a.free(again.block_ids)
    # Free list is now [1, 0]; b takes slab 1, then slab 0, which drops a's cached blocks.
    b.allocate([5] * 16)
    assert pool.owner(0) == "b" and a.match_prefix(prompt) == []
    pool.check()


def test_views_are_one_per_model_and_unknown_models_are_refused() -> None:
    pool = _pool()
    assert pool.view("a", 4) is pool.view("a", 4)
    with pytest.raises(ValueError, match="already has a view"):
        pool.view("a", 8)
    with pytest.raises(KeyError, match="not in this slab pool"):
        pool.view("c", 4)
    with pytest.raises(ValueError, match="outside"):
        pool.locate("a", 12)


# ---------------------------------------------------------------------------- state machine
class SlabMachine(RuleBasedStateMachine):
    """Random allocate / extend / share / publish / free histories of 2-3 models."""

    requests = Bundle("requests")

    @initialize(
        sizes=st.lists(st.sampled_from([1024, 1536, 2048, 3072, 4096]), min_size=2, max_size=3),
        num_slabs=st.integers(1, 6),
        multiple=st.integers(1, 2),
    )
    def make_pool(self, sizes: list[int], num_slabs: int, multiple: int) -> None:
        block_bytes = {f"m{i}": size for i, size in enumerate(sizes)}
        slab = slab_bytes_for(sizes, multiple)
        self.pool = KVSlabPool(slab * num_slabs, block_bytes, slab_multiple=multiple)
        self.views = {m: self.pool.view(m, block_size=2) for m in block_bytes}
        self.held: dict[int, tuple[str, list[int], list[int]]] = {}
        self.next_key = 0

    @rule(target=requests, model=st.integers(0, 2), num_tokens=st.integers(1, 9), prefix=st.booleans())
    def allocate(self, model: int, num_tokens: int, prefix: bool) -> int | None:
        name = f"m{model % len(self.views)}"
        view = self.views[name]
        # Shared prompts make prefix hits likely, including on blocks of FREE slabs.
        tokens = list(range(num_tokens)) if prefix else [self.next_key * 100 + i for i in range(num_tokens)]
        if not view.can_allocate(tokens):
            with pytest.raises(OutOfBlocksError):
                view.allocate(tokens)
            return None
        alloc = view.allocate(tokens)
        key = self.next_key
        self.next_key += 1
        self.held[key] = (name, list(alloc.block_ids), tokens)
        return key

    @rule(key=requests, more=st.integers(1, 6))
    def extend(self, key: int | None, more: int) -> None:
        if key not in self.held:
            return
        name, blocks, tokens = self.held[key]
        view = self.views[name]
        num_tokens = len(tokens) + more
        if view.can_extend(blocks, num_tokens):
            blocks += view.extend(blocks, num_tokens)
            tokens += [self.next_key * 100 + 50 + i for i in range(more)]

    @rule(key=requests)
    def publish(self, key: int | None) -> None:
        if key in self.held:
            name, blocks, tokens = self.held[key]
            self.views[name].publish(blocks, tokens)

    @rule(key=consumes(requests))
    def free(self, key: int | None) -> None:
        if key in self.held:
            name, blocks, _ = self.held.pop(key)
            self.views[name].free(blocks)

    @invariant()
    def pool_is_consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check()
        usage = self.pool.usage()
        for name, view in self.views.items():
            held = sorted({b for m, blocks, _ in self.held.values() if m == name for b in blocks})
            assert view.num_used_blocks == len(held) == usage.held_blocks[name]
            bps = self.pool.blocks_per_slab(name)
            for b in held:  # every held block is in a slab of its own model's format
                assert self.pool.owner(b // bps) == name
            assert view.num_free_blocks == usage.stranded_blocks[name] + usage.num_free_slabs * bps
        assert usage.num_free_slabs + usage.num_partial_slabs + usage.num_full_slabs == self.pool.num_slabs

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for name, blocks, _ in self.held.values():
            self.views[name].free(blocks)
        self.pool.check()
        assert self.pool.num_free_slabs == self.pool.num_slabs
        assert all(v.num_used_blocks == 0 and v.num_slabs_held == 0 for v in self.views.values())


SlabMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSlabMachine = SlabMachine.TestCase
