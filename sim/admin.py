"""vLLM's node-admin routes: sleep mode, LoRA adapters, the prefix cache, the profiler.

A router must never send these to a node it picked by load balancing; the simulator serves them as vLLM 0.32 does
and records each call, so a test can prove which ones reached a node.

- Only with ``VLLM_SERVER_DEV_MODE=1`` (vLLM's development endpoints; else 404 as any unknown route):
  ``POST /sleep?level=0|1|2&mode=abort|wait|keep`` -> ``{"status": "sleeping", "level": N}`` (422 in FastAPI's
  shape for another value; level 1 by default, mode abort; see sleepmode.py for what each does);
  ``POST /wake_up[?tags=...]`` -> ``{"status": "awake"|"sleeping", "tags": [...]|null}`` (--wake-time,
  --wake-fail; 500 when the shared --gpu has no room); ``GET /is_sleeping`` -> ``{"is_sleeping": bool}``;
  ``POST /reset_prefix_cache`` -> ``{"success": bool}``.
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``/v1/unload_lora_adapter`` ``{"lora_name"}``
  (only with VLLM_ALLOW_RUNTIME_LORA_UPDATING true, else 404 as any unknown route): 200 with vLLM's plain-text
  success line, or its 400/404 errors (400 "has already been loaded" for a name it has). ``lora_load_time`` and
  ``lora_load_fail`` (knobs) slow a load down or make it fail; ``lora_loads`` counts those that succeeded.
- ``POST /start_profile``, ``/stop_profile``: 200, empty.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from vllm_etcd_proxy.sim.errors import ApiError
from vllm_etcd_proxy.sim.record import Record
from vllm_etcd_proxy.sim.recording import engine_of, json_body, new_record, raw_body


async def _admin(request: Request) -> Record:
    record = new_record(request)
    await raw_body(request, record)
    return record


def _done(request: Request, record: Record) -> None:
    record.status, record.state = 200, "done"
    engine_of(request).log(record)


def _ok(request: Request, record: Record) -> Response:
    _done(request, record)
    return Response(status_code=200)


_MODES = ("abort", "wait", "keep")


def _invalid_query(name: str, value: str, kind: str, message: str, ctx: dict[str, Any] | None = None) -> Response:
    """FastAPI's 422 for a query parameter its validation refused, as vLLM's routes answer it."""
    problem: dict[str, Any] = {"type": kind, "loc": ["query", name], "msg": message, "input": value}
    if ctx is not None:
        problem["ctx"] = ctx
    return JSONResponse({"detail": [problem]}, status_code=422)


def _sleep_args(request: Request) -> tuple[int, str] | Response:
    """``level`` (0-2, default 1) and ``mode`` (default abort) of POST /sleep, or vLLM's 422."""
    text, mode = request.query_params.get("level", "1"), request.query_params.get("mode", "abort")
    try:
        level = int(text)
    except ValueError:
        return _invalid_query(
            "level", text, "int_parsing", "Input should be a valid integer, unable to parse string as an integer"
        )
    if not 0 <= level <= 2:
        bound = ("greater_than_equal", "greater than or equal to 0", "ge", 0)
        if level > 2:
            bound = ("less_than_equal", "less than or equal to 2", "le", 2)
        return _invalid_query("level", text, bound[0], f"Input should be {bound[1]}", {bound[2]: bound[3]})
    if mode not in _MODES:
        expected = "'abort', 'wait' or 'keep'"
        return _invalid_query("mode", mode, "literal_error", f"Input should be {expected}", {"expected": expected})
    return level, mode


async def sleep(request: Request) -> Response:
    """``POST /sleep?level=0|1|2&mode=abort|wait|keep``: answers once asleep (a ``wait`` sleep once the running
    generations finished), ``{"status": "sleeping", "level": N}``."""
    record = await _admin(request)
    args = _sleep_args(request)
    record.detail = {"level": request.query_params.get("level", "1"), "mode": request.query_params.get("mode")}
    if isinstance(args, Response):
        engine_of(request).reject(record, 422)
        return args
    level, mode = args
    await engine_of(request).sleep(level, mode)
    _done(request, record)
    return JSONResponse({"status": "sleeping", "level": level})


async def wake_up(request: Request) -> Response:
    """``POST /wake_up[?tags=weights&tags=kv_cache|scheduling]``: ``{"status": "awake"|"sleeping", "tags"}``,
    "sleeping" while some memory still sleeps (a partial wake)."""
    record = await _admin(request)
    tags = request.query_params.getlist("tags") or None
    record.detail = {"tags": tags}
    engine = engine_of(request)
    try:
        awake = await engine.wake_up(tags)
    except ApiError as exc:
        engine.reject(record, exc.status)
        raise
    _done(request, record)
    return JSONResponse({"status": "awake" if awake else "sleeping", "tags": tags})


async def is_sleeping(request: Request) -> Response:
    return JSONResponse({"is_sleeping": engine_of(request).is_sleeping})


async def reset_prefix_cache(request: Request) -> Response:
    """``{"success": bool}``: false while running requests hold cached blocks (vLLM's answer then), nothing
    dropped."""
    record = await _admin(request)
    engine = engine_of(request)
    success = not engine.slots.running
    if success:
        engine.cache.clear()
    _done(request, record)
    return JSONResponse({"success": success})


async def profile(request: Request) -> Response:
    return _ok(request, await _admin(request))


def _invalid(message: str) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message, type="InvalidUserInput")


def _already(name: str) -> ApiError:
    return _invalid(
        f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
        "set 'load_inplace' to True."
    )


async def load_lora_adapter(request: Request) -> Response:
    engine, record = engine_of(request), new_record(request)
    try:
        body = await json_body(request, record)
        name, path = (body.get("lora_name"), body.get("lora_path")) if isinstance(body, dict) else (None, None)
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        if name in engine.loras and not body.get("load_inplace"):
            raise _already(name)
        if not engine.settings.enable_lora:
            raise ApiError(HTTPStatus.BAD_REQUEST, "LoRA is not enabled on this server (--enable-lora).")
        await asyncio.sleep(engine.knobs.lora_load_time)
        if (failing := engine.knobs.lora_load_fail) == HTTPStatus.NOT_FOUND:
            raise ApiError(failing, f"Loading lora {name} failed: No adapter found for {path}", type="NotFoundError")
        if failing:
            raise ApiError(failing, f"vllm-sim: injected failure loading lora {name}")
        if name in engine.loras and not body.get("load_inplace"):
            raise _already(name)  # loaded by a concurrent call meanwhile
    except ApiError as exc:
        engine.reject(record, exc.status)
        raise
    engine.loras[name] = path
    engine.counters["lora_loads"] += 1
    record.status, record.state = 200, "done"
    engine.log(record)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    engine, record = engine_of(request), new_record(request)
    try:
        body = await json_body(request, record)
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        if name not in engine.loras:
            raise ApiError(HTTPStatus.NOT_FOUND, f"The lora adapter '{name}' cannot be found.")
    except ApiError as exc:
        engine.reject(record, exc.status)
        raise
    del engine.loras[name]
    record.status, record.state = 200, "done"
    engine.log(record)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


DEV_ROUTES = [
    Route("/sleep", sleep, methods=["POST"]),
    Route("/wake_up", wake_up, methods=["POST"]),
    Route("/is_sleeping", is_sleeping, methods=["GET"]),
    Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
]
"""Served only with VLLM_SERVER_DEV_MODE=1, as in vLLM (its "development endpoints")."""
ROUTES = [
    Route("/start_profile", profile, methods=["POST"]),
    Route("/stop_profile", profile, methods=["POST"]),
]
"""Always served (vLLM serves them only with --profiler-config)."""
LORA_ROUTES = [
    Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
]
"""Served only with VLLM_ALLOW_RUNTIME_LORA_UPDATING true, as in vLLM."""
