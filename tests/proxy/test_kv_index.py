"""The KV-event index and the kv-aware policy as pure objects: frames in vLLM's encodings, blocks keyed on token
ids whatever the nodes' hashes, removals by the nodes' hashes, and the choice between cached prefix and load."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from vllm_etcd_proxy.fleet.records import Node, Role
from vllm_etcd_proxy.proxy.discovery.pool import NodeState
from vllm_etcd_proxy.proxy.kvcache.index import KvIndex
from vllm_etcd_proxy.proxy.kvcache.prompt.ids import KvPrompt, token_id_prompt
from vllm_etcd_proxy.proxy.kvcache.prompt.prefix_ids import SOFT_CUT
from vllm_etcd_proxy.proxy.kvcache.prompt.tokens import CHECKED_SPLITS, PromptTokens
from vllm_etcd_proxy.proxy.kvcache.wire import Cleared, Malformed, Removed, Stored, read_batch, read_seq
from vllm_etcd_proxy.proxy.routing.kv_aware import HEAD_TOKENS, KvAware, KvRouting
from vllm_etcd_proxy.sim import vocab

BS = 4
IDS = list(range(1, 13))  # three blocks
MAP_BATCH = [
    1.5,
    [
        {
            "type": "BlockStored",
            "block_hashes": [11, 12, 13],
            "parent_block_hash": None,
            "token_ids": IDS,
            "block_size": BS,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None, None, None],
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
            "a_future_field": {"x": 1},
        },
        {"type": "BlockRemoved", "block_hashes": [13], "medium": "GPU"},
        {"type": "SomethingNew", "x": 1},
    ],
    0,
]
ARRAY_BATCH = {
    "ts": 1.5,
    "events": [["BlockStored", [b"\x01" * 32, b"\x02" * 32], None, IDS[:8], BS, None, "GPU"], ["AllBlocksCleared"]],
}


def state(name: str) -> NodeState:
    return NodeState(node=Node(node_id=name, role=Role.MIXED, url=f"http://{name}", models=("m",)))


def stored(hashes: list[int], ids: list[int], parent: int | None = None) -> Stored:
    return Stored(hashes, parent, ids, BS, "")


def test_batches_are_read_in_both_encodings_with_int_or_bytes_hashes() -> None:
    batch = read_batch(7, msgspec.msgpack.encode(MAP_BATCH))
    assert batch.events == [Stored([11, 12, 13], None, IDS, BS, ""), Removed([13])] and batch.bad_events == 0
    older = read_batch(8, msgspec.msgpack.encode(ARRAY_BATCH))
    assert isinstance(older.events[1], Cleared)
    first = older.events[0]
    fold = 2**60 - 1  # hashes name blocks within a node in 60 bits
    assert isinstance(first, Stored) and first.hashes == [0x0101010101010101 & fold, 0x0202020202020202 & fold]
    assert read_seq((-1).to_bytes(8, "big", signed=True)) == -1


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode("x"),
        msgspec.msgpack.encode({"ts": "now", "events": []}),
    ],
)
def test_a_payload_that_is_no_batch_is_malformed(payload: bytes) -> None:
    with pytest.raises(Malformed):
        read_batch(0, payload)


def test_a_malformed_event_is_left_out_and_counted_the_rest_kept() -> None:
    events = [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2], "block_size": BS},
        {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"},
    ]
    batch = read_batch(0, msgspec.msgpack.encode([0.0, events, 0]))
    assert batch.events == [Removed([5])] and batch.bad_events == 1


def test_blocks_of_the_same_tokens_share_keys_whatever_each_nodes_hashes() -> None:
    index = KvIndex()
    index.apply("a", [stored([101, 102, 103], IDS)])
    index.apply("b", [stored([901, 902], IDS[:8])])
    keys = KvPrompt([*IDS, 99], "m").keys(BS)
    both = (1 << index.slot_of("a")) | (1 << index.slot_of("b"))
    assert index.depths(keys, both) == {index.slot_of("a"): 3, index.slot_of("b"): 2}
    index.apply("a", [Removed([102])])  # by a's own hash: its second block is gone, so only its first is a prefix
    assert index.depths(keys, both) == {index.slot_of("a"): 1, index.slot_of("b"): 2}
    index.apply("b", [Cleared()])
    assert index.depths(keys, both) == {index.slot_of("a"): 1}
    index.drop("a")
    assert index.depths(keys, both) == {} and len(index) == 0


def test_a_block_whose_parent_was_never_announced_is_an_orphan_and_children_chain_from_known_parents() -> None:
    index = KvIndex()
    index.apply("a", [stored([2], IDS[4:8], parent=1)])
    node = index.node("a")
    assert node is not None and node.orphans == 1 and not node.blocks
    index.apply("a", [stored([1], IDS[:4]), stored([2, 3], IDS[4:], parent=1)])
    assert index.depths(KvPrompt([*IDS, 0], "m").keys(BS), 1 << index.slot_of("a")) == {index.slot_of("a"): 3}


def test_adapters_and_block_sizes_have_keys_of_their_own() -> None:
    index = KvIndex()
    index.apply("a", [Stored([1, 2, 3], None, IDS, BS, "my-lora")])
    prompt = KvPrompt([*IDS, 0], "m")
    assert index.depths(prompt.keys(BS), 1) == {}
    assert index.depths(prompt.keys(BS, "my-lora"), 1) == {0: 3}
    assert index.depths(prompt.keys(2), 1) == {}


def stored_event(hashes: list[int], ids: list[int], lora: str | None, extra_keys: object) -> dict[str, object]:
    """A BlockStored as vLLM 0.32 publishes it (to_event_extra_keys: one entry per block, untagged keys)."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": ids,
        "block_size": BS,
        "lora_id": None if lora is None else 1,
        "medium": "GPU",
        "lora_name": lora,
        "extra_keys": extra_keys,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def index_of(*events: dict[str, object]) -> KvIndex:
    index = KvIndex()
    index.apply("a", read_batch(0, msgspec.msgpack.encode([1.0, list(events), 0])).events)
    return index


def test_a_cache_salt_keys_the_chain_as_vllm_keys_its_hashes() -> None:
    # vLLM mixes cache_salt into the request's first block only; chained, every later block differs too.
    index = index_of(stored_event([1, 2, 3], IDS, None, [["tenant-a"], None, None]))
    assert index.depths(KvPrompt([*IDS, 0], "m", salt="tenant-a").keys(BS), 1) == {0: 3}
    assert index.depths(KvPrompt([*IDS, 0], "m", salt="tenant-b").keys(BS), 1) == {}
    assert index.depths(KvPrompt([*IDS, 0], "m").keys(BS), 1) == {}
    unsalted = index_of(stored_event([1, 2, 3], IDS, None, [None, None, None]))
    assert unsalted.depths(KvPrompt([*IDS, 0], "m", salt="tenant-a").keys(BS), 1) == {}
    assert unsalted.depths(KvPrompt([*IDS, 0], "m").keys(BS), 1) == {0: 3}


def test_an_adapters_name_in_extra_keys_is_its_chain_and_its_salt_keys_it_further() -> None:
    # An adapter's blocks carry its name first in every entry, the salt after it on the first block.
    index = index_of(stored_event([1, 2, 3], IDS, "my-lora", [["my-lora", "s"], ["my-lora"], ["my-lora"]]))
    assert index.depths(KvPrompt([*IDS, 0], "m", salt="s").keys(BS, "my-lora"), 1) == {0: 3}
    assert index.depths(KvPrompt([*IDS, 0], "m").keys(BS, "my-lora"), 1) == {}
    assert index.depths(KvPrompt([*IDS, 0], "m", salt="s").keys(BS), 1) == {}


def test_blocks_keyed_by_media_are_matched_by_no_text_prompt_of_the_same_tokens() -> None:
    # A block holding an image's placeholder tokens: vLLM keys it by the media's hash and offset, which a
    # replica cannot compute, so no prompt of those tokens alone may look cached there (it gets affinity).
    index = index_of(stored_event([1, 2, 3], IDS, None, [None, [["9f2c", 0]], None]))
    assert index.depths(KvPrompt([*IDS, 0], "m").keys(BS), 1) == {0: 1}


@pytest.mark.parametrize("extra_keys", [[None], "salt", [["a"], 5, None], [[{"x": 1}], None, None]])
def test_extra_keys_that_are_not_one_entry_per_block_make_the_event_malformed(extra_keys: object) -> None:
    batch = read_batch(0, msgspec.msgpack.encode([1.0, [stored_event([1, 2, 3], IDS, None, extra_keys)], 0]))
    assert batch.events == [] and batch.bad_events == 1


def test_token_id_prompts_are_read_and_text_is_left_to_a_tokenizer() -> None:
    assert token_id_prompt("m", {"prompt": [1, 2, 3]}, "completion") == [1, 2, 3]
    assert token_id_prompt("m", {"prompt": [[1, 2]]}, "completion") == [1, 2]
    assert token_id_prompt("m", {"token_ids": [4, 5]}, "generate") == [4, 5]
    for body, kind in (
        ({"prompt": "text"}, "completion"),
        ({"prompt": [1, True]}, "completion"),
        ({"messages": []}, "chat"),
        ({"prompt": [[1], [2]]}, "completion"),
    ):
        assert token_id_prompt("m", body, kind) is None


def policy(index: KvIndex, tracked: set[str] | None = None) -> tuple[KvAware, KvRouting]:
    routing = KvRouting(index, lambda name: tracked is None or name in tracked)
    return KvAware(routing), routing


def test_the_longest_cached_prefix_wins_until_its_node_is_overloaded() -> None:
    index = KvIndex()
    nodes = [state(n) for n in ("a", "b", "c")]
    index.apply(nodes[1].entry_key, [stored([1, 2, 3], IDS)])
    index.apply(nodes[2].entry_key, [stored([7], IDS[:4])])
    choose, routing = policy(index)
    prompt = KvPrompt([*IDS, 5], "m")
    assert choose.choose(nodes, key="k", prompt=prompt) is nodes[1]
    nodes[1].in_flight = 4  # not above 1.5 x the mean (4/3) + 2: still b
    assert choose.choose(nodes, key="k", prompt=KvPrompt([*IDS, 6], "m")) is nodes[1]
    nodes[1].in_flight = 5  # overloaded; c holds a third of the prompt, too little to draw it: by load
    assert choose.choose(nodes, key="k", prompt=KvPrompt([*IDS, 7], "m")) in (nodes[0], nodes[2])
    assert routing.decisions == {"cached_prefix": 2, "load": 1}


def test_new_prompts_spread_evenly_alike_on_every_replica() -> None:
    nodes = [state(n) for n in ("a", "b", "c", "d")]
    first, _ = policy(KvIndex())
    second, _ = policy(KvIndex())
    picks = []
    for i in range(200):
        prompt = KvPrompt([1000 + i] * 9, "m")
        one = first.choose(nodes, key=f"prefix:{i}", prompt=prompt)
        assert one is not None and second.choose(nodes, key=f"prefix:{i}", prompt=prompt) is one
        picks.append(one.node.node_id)
    assert [picks.count(n) for n in "abcd"] == [50] * 4  # each replica counts the conversations it began


def test_a_new_conversation_goes_where_the_events_show_fewest_then_by_load() -> None:
    nodes = [state(n) for n in ("a", "b", "c")]
    replicas = [KvIndex(), KvIndex()]
    begun = {"a": 3, "b": 1, "c": 2}  # conversations: stores from the root, or forks off a shared block
    for index in replicas:
        for node in nodes:
            name = node.node.node_id
            index.apply(node.entry_key, [stored([100, 200], IDS[:8])])  # a preamble's block, then its own
            index.apply(node.entry_key, [stored([200 + t], [t] * 4, parent=100) for t in range(1, begun[name])])
            index.apply(node.entry_key, [stored([250], [7] * 4, parent=201)] if name == "a" else [])  # a next turn
    choosers = [policy(index)[0] for index in replicas]
    picked = [c.choose(nodes, key="new", prompt=KvPrompt([9] * 9, "m")) for c in choosers]
    assert picked == [nodes[1], nodes[1]]  # b serves one conversation: fewest, on both replicas
    # The first replica counts its own placement at once; its next new conversation goes to c (2) ahead of b (2)
    # only by load: b is busier.
    nodes[1].in_flight = 1
    assert choosers[0].choose(nodes, key="next", prompt=KvPrompt([8] * 9, "m")) is nodes[2]


def test_a_decision_counts_until_the_nodes_next_events_and_untracked_nodes_keep_content_affinity() -> None:
    index = KvIndex()
    nodes = [state(n) for n in ("a", "b")]
    for i, node in enumerate(nodes):
        index.apply(node.entry_key, [stored([60 + i], [8 + i] * BS)])
    choose, routing = policy(index)
    placed = choose.choose(nodes, key="k", prompt=KvPrompt([*IDS, 1], "m"))
    assert placed is not None and routing.decisions["load"] == 1
    assert choose.choose(nodes, key="other", prompt=KvPrompt([*IDS, 2], "m")) is placed  # not announced yet
    index.apply(placed.entry_key, [stored([50], [9, 9, 9, 9])])  # its events say it holds something else
    choose.choose(nodes, key="other", prompt=KvPrompt([*IDS, 3], "m"))
    assert routing.decisions == {"load": 2, "cached_prefix": 1}
    untracked, routing = policy(KvIndex(), tracked=set())
    untracked.choose(nodes, key="k", prompt=KvPrompt(IDS, "m"))
    untracked.choose(nodes, key="k", prompt=None)
    assert routing.decisions == {"fallback": 2}


def test_conversations_are_counted_from_the_shape_of_the_stores() -> None:
    index = KvIndex()
    name = state("a").entry_key
    index.apply(name, [stored([1, 2], IDS[:8])], now=0.0)  # a first request: preamble block 1, its own block 2
    index.apply(name, [stored([3], IDS[:4], parent=2)], now=1.0)  # its answer fills a block: the same one
    index.apply(name, [stored([4, 5], IDS[:8], parent=1)], now=2.0)  # another forks off the preamble
    index.apply(name, [stored([4, 5], IDS[:8], parent=1)], now=2.5)  # replayed: nothing new
    convs = index.node(name).conversations  # type: ignore[union-attr]
    assert (convs.active(3.0), convs.begun) == (2, 2)
    index.apply(name, [stored([6], IDS[:4], parent=3)], now=50.0)  # the first one's next turn
    assert convs.active(62.5) == 1  # the second said nothing for a minute: it ended
    index.apply(name, [Removed([6])], now=63.0)  # evicted: still placed here lately (busy caches evict more)
    assert convs.active(63.0) == 1
    index.apply(name, [stored([7], IDS[:4])], now=64.0)
    index.apply(name, [Cleared()], now=65.0)
    assert convs.active(65.0) == 0 and convs.begun == 3


def test_a_preamble_several_nodes_hold_does_not_keep_new_conversations_off_the_others() -> None:
    index = KvIndex()
    nodes = [state(n) for n in ("a", "b", "c")]
    preamble = list(range(1, 9))  # two blocks, the larger part of every new conversation's prompt
    for node, tip in ((nodes[0], 20), (nodes[1], 30)):  # a and b each serve one conversation after it
        index.apply(node.entry_key, [stored([10, 11, tip], [*preamble, tip, tip, tip, tip])])
    choose, routing = policy(index)
    picked = choose.choose(nodes, key="new", prompt=KvPrompt([*preamble, 7, 7, 7], "m"))
    assert picked is nodes[2] and routing.decisions == {"load": 1}  # c serves none: its prefill is worth it
    # With conversations even, the nodes holding the preamble come first.
    index.apply(nodes[2].entry_key, [stored([40], [9, 9, 9, 9])])
    again = choose.choose(nodes, key="new2", prompt=KvPrompt([*preamble, 6, 6, 6], "m"))
    assert again in (nodes[0], nodes[1])


def test_a_document_one_conversation_began_with_draws_its_next_turns_but_not_new_conversations() -> None:
    index = KvIndex()
    nodes = [state(n) for n in ("a", "b", "c")]
    document = list(range(1, 13))  # three blocks: most of any prompt below
    index.apply(nodes[0].entry_key, [stored([10, 11, 12, 13], [*document, 5, 5, 5, 5])])  # a's conversation
    choose, routing = policy(index)
    turn = KvPrompt([*document, 5, 5, 5, 5, 6, 6], "m")  # its next turn: goes on from the chain's last block
    assert choose.choose(nodes, key="conv", prompt=turn) is nodes[0]
    index.apply(nodes[0].entry_key, [stored([14, 15], [6, 6, 7, 7, 7, 7, 7, 7], parent=13)])  # its answer
    other = KvPrompt([*document, 8, 8, 8], "m")  # another conversation on the same document, a short question
    placed = choose.choose(nodes, key="other", prompt=other)
    assert placed in (nodes[1], nodes[2]) and routing.decisions == {"cached_prefix": 1, "load": 1}
    # Its next turn, sent at once, follows it there before that node's events say anything.
    assert choose.choose(nodes, key="other", prompt=KvPrompt([*document, 8, 8, 8, 8, 9, 9], "m")) is placed


class Chats:
    """Chats as a replica reads them for routing (pieces reused, read as far as asked), the ids a node would
    announce for them (tokenized whole), and the ids the replica has tokenized since it was made."""

    def __init__(self, tokenizer: Path) -> None:
        self.registry = CollectorRegistry()
        self._replica = PromptTokens({"m": str(tokenizer)}, lambda model: [], self.registry)
        self._node = PromptTokens({"m": str(tokenizer)}, lambda model: [], CollectorRegistry(), cache_tokens=0)
        for side in (self._replica, self._node):
            side.start()
            side._loads[str(tokenizer)].result(timeout=30)  # loaded in its own thread
        for i in range(CHECKED_SPLITS):  # a model's first chats are also tokenized whole, as a check
            self._replica.prompt_ids("m", {"messages": [{"role": "user", "content": f"hello {i}"}]}, "chat")
        self._before = self._tokenized()

    def _tokenized(self) -> float:
        return self.registry.get_sample_value("vllm_proxy_prompt_ids_total", {"source": "tokenized"}) or 0.0

    def tokenized(self) -> float:
        return self._tokenized() - self._before

    def read(self, messages: list[dict[str, str]]) -> KvPrompt:
        ids = self._replica.ids("m", {"messages": messages}, "chat")
        assert ids is not None
        return KvPrompt(ids, "m")

    def announce(self, index: KvIndex, node: NodeState, messages: list[dict[str, str]], first_hash: int) -> None:
        """The node stores the chat's full blocks (a BlockStored of them all, hashes from ``first_hash``)."""
        ids = self._node.prompt_ids("m", {"messages": messages}, "chat")
        assert ids is not None
        blocks = len(ids) // BS
        index.apply(node.entry_key, [stored(list(range(first_hash, first_hash + blocks)), list(ids[: blocks * BS]))])


def words(count: int) -> str:
    return " ".join(vocab.WORDS[i % len(vocab.WORDS)] for i in range(count))  # a token per word


def test_a_long_prompt_no_node_holds_is_tokenized_only_as_far_as_its_first_blocks(tmp_path: Path) -> None:
    chats = Chats(vocab.write(tmp_path))
    index = KvIndex()
    nodes = [state(n) for n in ("a", "b")]
    for i, node in enumerate(nodes):  # each holds a block of something else
        index.apply(node.entry_key, [stored([60 + i], [8 + i] * BS)])
    choose, routing = policy(index)
    first = [{"role": "user", "content": words(20_000)}]
    prompt = chats.read(first)
    uncached = routing.uncached(prompt, nodes, upto=256)  # as for --pd-min-prompt-tokens 256, before the choice
    placed = choose.choose(nodes, key="doc", prompt=prompt)
    assert uncached is not None and uncached >= 256 and placed is not None and routing.decisions == {"load": 1}
    assert chats.tokenized() < HEAD_TOKENS + SOFT_CUT  # of 20,000 tokens: nothing after the first block can be a hit
    # The node it went to announces the prompt's blocks: the next turn is read whole, and follows it there.
    chats.announce(index, placed, first, 1000)
    turn = [*first, {"role": "assistant", "content": "yes"}, {"role": "user", "content": "and then"}]
    assert choose.choose(nodes, key="doc", prompt=chats.read(turn)) is placed
    assert routing.decisions == {"load": 1, "cached_prefix": 1} and chats.tokenized() > 20_000  # the rest, now


def test_a_long_new_document_after_a_cached_preamble_is_read_only_past_it(tmp_path: Path) -> None:
    # A RAG request or a tool's output: a system preamble some node holds, then 20,000 tokens no node can hold.
    chats = Chats(vocab.write(tmp_path))
    index = KvIndex()
    nodes = [state(n) for n in ("a", "b")]
    system = {"role": "system", "content": words(600)}
    chats.announce(index, nodes[0], [system, {"role": "user", "content": "hello"}], 1000)
    choose, routing = policy(index)
    assert chats.read([system, {"role": "user", "content": "warm"}]).ids  # the replica has read the preamble before
    warm = chats.tokenized()
    document = [system, {"role": "user", "content": words(20_000)}]
    placed = choose.choose(nodes, key="rag", prompt=chats.read(document))
    # The preamble is the smaller part: a new conversation, placed by load; the document is read for its first
    # blocks past the preamble only.
    assert placed is not None and routing.decisions == {"load": 1}
    assert chats.tokenized() - warm < SOFT_CUT // 4
    # Once the node it went to announces the document, the next turn finds it there and reads all of it.
    chats.announce(index, placed, document, 5000)
    turn = [*document, {"role": "assistant", "content": "yes"}, {"role": "user", "content": "and then"}]
    assert choose.choose(nodes, key="rag", prompt=chats.read(turn)) is placed
    assert routing.decisions == {"load": 1, "cached_prefix": 1} and chats.tokenized() - warm > 20_000
