"""The index's packed maps (kvcache/blocks.py) answer as dicts would, whatever the order of stores
and removals, including hashes that crowd the same slots and runs that wrap around the table's end."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_etcd_proxy.proxy.kvcache.blocks import SPLIT_AT, BlockMap, Holders

# Small hashes share their home slots (and the runs reach the end of the table and wrap); large ones spread.
HASHES = st.integers(0, 40) | st.integers(0, (1 << 60) - 1) | st.sampled_from([15, 31, 47, 63, 1 << 40, (1 << 40) + 15])
CHANGES = st.lists(
    st.tuples(st.sampled_from(["add", "pop", "clear"]), HASHES, st.integers(0, (1 << 60) - 1)), max_size=400
)


@settings(max_examples=300, deadline=None)
@given(CHANGES)
def test_block_map_answers_as_a_dict_after_any_changes(changes: list[tuple[str, int, int]]) -> None:
    packed, model = BlockMap(), dict[int, int]()
    for op, engine_hash, key in changes:
        if op == "add":
            assert packed.add(engine_hash, key) is (engine_hash not in model)
            model.setdefault(engine_hash, key)
        elif op == "pop":
            assert packed.pop(engine_hash) == model.pop(engine_hash, None)
        elif len(changes) % 7 == 0:  # now and then, not in every run: clearing hides what came before
            packed.clear()
            model.clear()
        assert len(packed) == len(model)
    for engine_hash, key in model.items():
        assert engine_hash in packed and packed.get(engine_hash) == key
    assert sorted(packed.values()) == sorted(model.values())
    assert all(packed.get(h) is None and h not in packed for h in range(41) if h not in model)


def test_a_hash_is_kept_to_sixty_bits_as_the_wire_folds_it() -> None:
    packed = BlockMap()
    assert packed.add((1 << 64) - 1, 7)
    assert packed.get((1 << 60) - 1) == 7 and packed.pop((1 << 64) - 1) == 7 and not packed


KEYS = st.integers(0, 40) | st.integers(0, (1 << 48) - 1) | st.sampled_from([16, 24, 36, 1 << 40, (1 << 40) + 16])
HOLDER_CHANGES = st.lists(st.tuples(st.sampled_from(["add", "release"]), KEYS, st.integers(0, 70)), max_size=400)


@settings(max_examples=300, deadline=None)
@given(HOLDER_CHANGES)
def test_holders_answer_as_a_dict_of_bit_masks_after_any_changes(changes: list[tuple[str, int, int]]) -> None:
    # Slots up to 70 (more than one word of bits), keys crowding their home slots and wrapping: each key's
    # holders are the slots that added it and did not release it since, one holder or several.
    packed, model = Holders(), dict[int, int]()
    for op, key, slot in changes:
        if op == "add":
            packed.add(key, slot)
            model[key] = model.get(key, 0) | 1 << slot
        else:
            packed.release(key, slot)
            if model.get(key, 0) & ~(1 << slot):
                model[key] &= ~(1 << slot)
            else:
                model.pop(key, None)
        assert len(packed) == len(model)
    for key, mask in model.items():
        assert packed.mask(key) == mask
    assert all(packed.mask(k) == 0 for k in range(41) if k not in model)
    assert set(packed.shared) == {k for k, m in model.items() if m & (m - 1)}


def test_maps_split_into_shards_past_their_threshold_and_answer_alike() -> None:
    # Enough entries to split both maps into shards, then removals of half: every answer still a dict's.
    rng = random.Random(5)
    count = 3 * SPLIT_AT
    hashes, keys = [rng.getrandbits(64) for _ in range(count)], [rng.getrandbits(48) for _ in range(count)]
    blocks, holders = BlockMap(), Holders()
    for engine_hash, key in zip(hashes, keys, strict=True):
        assert blocks.add(engine_hash, key)
        holders.add(key, 3)
    for engine_hash, key in zip(hashes[::2], keys[::2], strict=True):
        assert blocks.pop(engine_hash) == key
        holders.release(key, 3)
    assert len(blocks) == len(holders) == count // 2
    assert all(blocks.get(h) == k for h, k in zip(hashes[1::2], keys[1::2], strict=True))
    assert all(blocks.get(h) is None for h in hashes[::2])
    assert all(holders.mask(k) == 1 << 3 for k in keys[1::2]) and not any(holders.mask(k) for k in keys[::2])
    assert sorted(blocks.values()) == sorted(keys[1::2])
