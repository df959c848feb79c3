"""The background workers' timetable: due order, a capped rate, urgent first with a reserved share for the rest."""

from __future__ import annotations

import asyncio
import time

import pytest

from vllm_etcd_proxy.proxy.discovery.schedule import Schedule


async def take(schedule: Schedule, count: int) -> list[str]:
    return [await schedule.next() for _ in range(count)]


async def test_keys_come_out_in_due_order() -> None:
    schedule, now = Schedule(1000.0), time.monotonic()
    for key, due in (("c", 0.3), ("a", 0.1), ("b", 0.2)):
        schedule.put(key, now - 1.0 + due)
    assert await take(schedule, 3) == ["a", "b", "c"]
    assert len(schedule) == 0


async def test_turns_are_paced_at_the_rate_once_the_saved_second_is_spent() -> None:
    rate = 100.0
    schedule, now = Schedule(rate), time.monotonic()
    for i in range(150):
        schedule.put(f"n{i}", now)
    started = time.monotonic()
    await take(schedule, 150)
    # Up to a second's worth (100 turns) at once, then 50 more at 10 ms apart.
    assert time.monotonic() - started >= 0.45


async def test_urgent_keys_go_first_but_routine_ones_keep_their_share() -> None:
    schedule, now = Schedule(10_000.0), time.monotonic()
    for i in range(100):
        schedule.put(f"routine{i}", now - 1)
        schedule.put(f"urgent{i}", now - 1, urgent=True)
    taken = await take(schedule, 50)
    routine = sum(key.startswith("routine") for key in taken)
    assert 5 <= routine <= 15, taken
    # With nothing urgent left, routine keys get every turn.
    rest = await take(schedule, 150)
    assert sum(key.startswith("routine") for key in rest) == 100 - routine


async def test_a_rescheduled_key_comes_out_once_at_its_new_time() -> None:
    schedule = Schedule(1000.0)
    now = time.monotonic()
    schedule.put("a", now)
    schedule.put("a", now + 0.05)
    assert schedule.due_at("a") == pytest.approx(now + 0.05)
    assert await schedule.next() == "a"
    assert time.monotonic() >= now + 0.05
    assert "a" not in schedule and len(schedule) == 0


async def test_a_dropped_key_never_comes_out() -> None:
    schedule, now = Schedule(1000.0), time.monotonic()
    schedule.put("gone", now)
    schedule.put("kept", now + 0.01)
    schedule.drop("gone")
    assert await schedule.next() == "kept"


async def test_a_put_wakes_a_worker_waiting_on_an_empty_schedule() -> None:
    schedule = Schedule(1000.0)
    waiting = asyncio.create_task(schedule.next())
    await asyncio.sleep(0)  # let it start waiting
    schedule.put("new", time.monotonic())
    assert await asyncio.wait_for(waiting, 1.0) == "new"


async def test_many_reschedules_of_few_keys_keep_the_heap_small() -> None:
    schedule, now = Schedule(1000.0), time.monotonic()
    for i in range(10_000):
        schedule.put(f"n{i % 10}", now + i)
    assert len(schedule) == 10
    assert len(schedule._queues[1]) <= 2 * 10 + 64 + 1


async def test_routine_turns_have_their_own_lower_ceiling() -> None:
    schedule, now = Schedule(10_000.0, routine_rate=100.0), time.monotonic()
    for i in range(150):
        schedule.put(f"routine{i}", now)
    started = time.monotonic()
    await take(schedule, 150)
    assert time.monotonic() - started >= 0.45  # 100 saved up, then 50 at 10 ms apart
    schedule.put("urgent", time.monotonic(), urgent=True)
    schedule.put("routine", time.monotonic())
    assert await asyncio.wait_for(schedule.next(), 0.005) == "urgent"  # the routine ceiling does not hold it


async def test_nodes_on_trial_come_after_routine_ones_but_keep_a_tenth_of_the_turns() -> None:
    schedule, now = Schedule(10_000.0), time.monotonic()
    for i in range(100):
        schedule.put(f"trial{i}", now - 1, trial=True)
        schedule.put(f"routine{i}", now - 1)
    taken = await take(schedule, 50)
    trial = sum(key.startswith("trial") for key in taken)
    assert 3 <= trial <= 8, taken
