"""routing/elastic.py as a pure function of the nodes' figures: run a request on one node or split it, where."""

from __future__ import annotations

from vllm_etcd_proxy.fleet.records import Node, Role
from vllm_etcd_proxy.proxy.discovery.pool import NodeState
from vllm_etcd_proxy.proxy.kvcache.index import KvIndex
from vllm_etcd_proxy.proxy.routing.elastic import Ask, Elastic, Plan
from vllm_etcd_proxy.proxy.routing.kv_aware import KvRouting


def nodes(count: int, role: Role = Role.BOTH, tag: str = "n") -> list[NodeState]:
    return [
        NodeState(node=Node(node_id=f"{tag}{i}:1", role=role, url=f"http://{tag}{i}:1", models=("m",)))
        for i in range(count)
    ]


def elastic() -> Elastic:
    return Elastic(KvRouting(KvIndex(), lambda name: False), split_min_tokens=256)


def ask(new_tokens: int | None = 2000, max_tokens: int | None = 100, model: str = "m") -> Ask:
    return Ask(prompt=None, new_tokens=new_tokens, max_tokens=max_tokens, model=model)


def plan(pool: list[NodeState], request: Ask | None = None, decider: Elastic | None = None) -> Plan:
    return (decider or elastic()).plan(request or ask(), pool, pool)


def test_a_long_new_prompt_is_split_between_two_nodes() -> None:
    chosen = plan(nodes(4))
    assert chosen.split and chosen.reason == "split"
    assert chosen.prefill[0] is not next(s for s in chosen.decode if s is not chosen.prefill[0])


def test_few_new_tokens_or_a_one_token_answer_run_on_one_node() -> None:
    pool = nodes(4)
    assert plan(pool, ask(new_tokens=100)) == Plan("few_new")  # the both policy picks the node
    one = plan(pool, ask(max_tokens=1))
    assert (one.reason, one.split) == ("one_token", False) and one.alone[0] is plan(pool).prefill[0]


def test_a_lone_node_runs_everything_itself() -> None:
    assert plan(nodes(1)).reason == "no_pair"


def test_an_unknown_prompt_size_is_split() -> None:
    chosen = plan(nodes(2), ask(new_tokens=None))
    assert chosen.split and chosen.reason == "unknown"


def test_the_prefill_avoids_nodes_that_generate_and_the_decode_nodes_that_compute_prompts() -> None:
    pool = nodes(4)
    first = plan(pool)
    prefill_node = first.prefill[0]
    decode_node = next(s for s in first.decode if s is not prefill_node)
    # This replica's legs: a prompt on the prefill node, answers generating on the decode node.
    prefill_node.in_flight = prefill_node.prefilling = 1
    decode_node.in_flight = 3
    after = plan(pool)
    assert after.prefill[0] is not decode_node  # would slow three answers
    assert after.decode[0] is decode_node  # decodes gather where answers are generated already
    assert after.decode[-1] is prefill_node  # never beside a prompt while another node will do


def test_prompts_queued_on_a_node_send_the_next_prompt_elsewhere() -> None:
    pool = nodes(3)
    busy = plan(pool).prefill[0]
    busy.node_running, busy.node_waiting = 1, 3  # another replica's prompts, as the node's /metrics says
    assert plan(pool).prefill[0] is not busy


def test_a_full_kv_cache_is_the_last_place_to_decode() -> None:
    pool = nodes(3)
    full = plan(pool).decode[0]
    full.kv_usage = 0.97
    assert plan(pool).decode[-1] is full


def test_the_same_figures_give_the_same_plan_on_every_replica() -> None:
    one, two = nodes(5), nodes(5)  # two replicas' views of the same fleet, in another order
    two.reverse()
    for view in (one, two):
        by_id = {s.node.node_id: s for s in view}
        by_id["n1:1"].node_running, by_id["n3:1"].node_waiting = 4, 2  # as scraped, alike
    mine, theirs = plan(one, decider=elastic()), plan(two, decider=elastic())
    assert [s.node.node_id for s in mine.prefill] == [s.node.node_id for s in theirs.prefill]
    assert [s.node.node_id for s in mine.decode] == [s.node.node_id for s in theirs.decode]


def test_each_model_has_its_own_order_of_nodes() -> None:
    pool = nodes(8)
    firsts = {plan(pool, ask(model=f"model-{i}")).prefill[0].node.node_id for i in range(12)}
    assert len(firsts) > 1  # not every model's prompts on the same node


def test_fixed_prefill_and_decode_nodes_beside_both_nodes_keep_their_side() -> None:
    prefill, decode, both = nodes(1, Role.PREFILL, "p"), nodes(1, Role.DECODE, "d"), nodes(1)
    chosen = elastic().plan(ask(), [*prefill, *both], [*decode, *both])
    assert chosen.split
    assert decode[0] not in chosen.prefill and prefill[0] not in chosen.decode


def test_decisions_are_counted_by_kind_and_reason() -> None:
    decider, pool = elastic(), nodes(3)
    plan(pool, decider=decider)
    plan(pool, ask(new_tokens=10), decider=decider)
    assert decider.decisions == {("split", "split"): 1, ("local", "few_new"): 1}
