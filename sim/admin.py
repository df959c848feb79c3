"""vLLM's node-admin routes: sleep mode, LoRA adapters, the prefix cache, the profiler.

A router must never send these to a node it picked by load balancing; the simulator serves them as vLLM does and
records each call, so a test can prove which ones reached a node.

- ``POST /sleep?level=1&mode=abort`` (200, empty): generation holds until woken (vLLM pauses its scheduler:
  "requests are still accepted but not processed"), the prefix cache is dropped; /health stays 200, /v1/models
  and /tokenize still answer. ``mode=abort`` (vLLM's default) ends the requests already in the engine at their
  next step with finish_reason "abort" (state "aborted" in their records); ``wait`` and ``keep`` let them finish.
- ``POST /wake_up`` (200, empty), ``GET /is_sleeping`` -> ``{"is_sleeping": bool}``.
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``/v1/unload_lora_adapter`` ``{"lora_name"}``
  (only with VLLM_ALLOW_RUNTIME_LORA_UPDATING true, else 404 as any unknown route): 200 with vLLM's plain-text
  success line, or its 400/404 errors (400 "has already been loaded" for a name it has). ``lora_load_time`` and
  ``lora_load_fail`` (knobs) slow a load down or make it fail; ``lora_loads`` counts those that succeeded.
- ``POST /reset_prefix_cache``, ``/start_profile``, ``/stop_profile``: 200, empty.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from vllm_etcd_proxy.sim.errors import ApiError, bad_request
from vllm_etcd_proxy.sim.record import Record
from vllm_etcd_proxy.sim.recording import engine_of, json_body, new_record, raw_body


async def _admin(request: Request) -> Record:
    record = new_record(request)
    await raw_body(request, record)
    return record


def _ok(request: Request, record: Record) -> Response:
    record.status, record.state = 200, "done"
    engine_of(request).log(record)
    return Response(status_code=200)


async def sleep(request: Request) -> Response:
    record = await _admin(request)
    level, mode = request.query_params.get("level", "1"), request.query_params.get("mode", "abort")
    record.detail = {"level": level, "mode": mode}
    if level not in ("1", "2") or mode not in ("abort", "wait", "keep"):
        engine_of(request).reject(record, 400)
        raise bad_request(f"Invalid sleep level {level} or mode {mode}: expected 1 or 2, abort, wait or keep", "level")
    engine_of(request).sleep(int(level), mode)
    return _ok(request, record)


async def wake_up(request: Request) -> Response:
    record = await _admin(request)
    engine_of(request).wake_up()
    return _ok(request, record)


async def is_sleeping(request: Request) -> Response:
    return JSONResponse({"is_sleeping": engine_of(request).is_sleeping})


async def reset_prefix_cache(request: Request) -> Response:
    record = await _admin(request)
    engine_of(request).cache.clear()
    return _ok(request, record)


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


ROUTES = [
    Route("/sleep", sleep, methods=["POST"]),
    Route("/wake_up", wake_up, methods=["POST"]),
    Route("/is_sleeping", is_sleeping, methods=["GET"]),
    Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
    Route("/start_profile", profile, methods=["POST"]),
    Route("/stop_profile", profile, methods=["POST"]),
]
LORA_ROUTES = [
    Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
]
"""Served only with VLLM_ALLOW_RUNTIME_LORA_UPDATING true, as in vLLM."""
