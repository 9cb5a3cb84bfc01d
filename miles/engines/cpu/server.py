"""FastAPI app of the CPU engine: SGLang 0.5.23's native endpoints (OpenAI routes in `openai_routes`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from miles.contract.engine_args import DEFAULT_MAX_RUNNING_REQUESTS
from miles.engines.cpu import protocol as P
from miles.engines.cpu.engine import Engine
from miles.engines.cpu.generate import GenJob, build_output, run_job
from miles.engines.cpu.graphs import DecodeOptions
from miles.engines.cpu.memory import empty_device_cache
from miles.engines.cpu.sampling import SamplingSchemaError, make_generator, parse_sampling_params
from miles.engines.errors import EngineRefused
from miles.engines.sglang_client import DELTA_LOAD_FORMAT

log = logging.getLogger(__name__)
ENGINE_TP_SIZE = 1  # the CPU engine runs one model replica: SGLang's payload lists one entry per TP rank
OPEN_PATHS = frozenset({"/health", "/health_generate", "/ready", "/metrics"})
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def create_app(
    model_path: str,
    *,
    api_key: str | None = None,
    legacy_weight_api: bool = False,
    served_model_name: str | None = None,
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS,
    enable_memory_saver: bool = False,
    enable_weights_cpu_backup: bool = False,
    dtype: str = "auto",
    decode: DecodeOptions = DecodeOptions(),
) -> FastAPI:
    """The engine app; the model loads in the background after startup (/health is 503 until then)."""
    engine = Engine(
        model_path,
        served_model_name=served_model_name,
        legacy=legacy_weight_api,
        max_running_requests=max_running_requests,
        memory_saver=enable_memory_saver,
        weights_cpu_backup=enable_weights_cpu_backup,
        dtype=dtype,
        decode=decode,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(engine.load())
        loading.add_done_callback(lambda t: t.cancelled() or t.exception())  # error kept on engine
        yield
        loading.cancel()
        await engine.close()

    app = FastAPI(lifespan=lifespan)
    app.state.engine = engine
    _install_errors_and_auth(app, api_key)
    _add_status_routes(app, engine)
    _add_generate_route(app, engine)
    _add_control_routes(app, engine)
    _add_weight_routes(app, engine)
    from miles.engines.cpu.openai_routes import add_openai_routes

    add_openai_routes(app, engine)
    return app


def _install_errors_and_auth(app: FastAPI, api_key: str | None) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return P.openai_style_error(400, str(exc.errors()), "Bad Request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return P.openai_style_error(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineRefused)
    async def _refusal(request: Request, exc: EngineRefused) -> JSONResponse:
        return P.value_error(str(exc))

    if api_key:

        @app.middleware("http")
        async def _auth(request: Request, call_next: Any) -> Response:
            if (
                request.url.path not in OPEN_PATHS
                and request.headers.get("authorization") != f"Bearer {api_key}"
            ):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)


def _decode_path(engine: Engine) -> dict[str, Any]:
    """The runner's decode path (graphs.py) and how its steps ran; nothing before the model is loaded."""
    runner = engine.runner
    if runner is None:
        return {}
    return {"decode_mode": runner.decode_mode, "decode_counts": runner.decode_counts.as_dict()}


def _add_status_routes(app: FastAPI, engine: Engine) -> None:
    @app.get("/health")
    @app.get("/health_generate")
    @app.get("/ready")
    async def health() -> Response:
        return Response(status_code=200 if engine.ready else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "served_model_name": engine.served_model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "load_format": "auto",
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {
            "model_path": engine.model_path,
            "served_model_name": engine.served_model_name,
            "engine": "miles-cpu",
            "device": str(engine.runner.device) if engine.runner else None,
            "weight_api": "legacy" if engine.legacy else "current",
            "version": "0.5.23-compatible",
            "internal_states": [
                {
                    "paused": engine.pause_mode,
                    "weight_version": engine.weight_version,
                    "offload_tags": sorted(engine.memory.released),  # SGLang's name: the released tags
                    **engine.scheduler.snapshot(),  # batch sizes and forward counts of the step scheduler
                    **_decode_path(engine),
                    "tensor_loads": engine.tensor_loads.as_dict(),
                }
            ],
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": engine.served_model_name, "object": "model", "created": 0, "owned_by": "sglang"}
        return {"object": "list", "data": [card]}


# ----- /generate -------------------------------------------------------------------------------------------


async def _read_json(request: Request) -> Any:
    raw = await request.body()
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": str(exc)}]) from exc


def _as_batch(body: dict[str, Any], engine: Engine) -> tuple[list[list[int]], bool]:
    """The prompts as token ids, and whether the request was a batch."""
    given = [k for k in ("text", "input_ids", "input_embeds") if body.get(k) is not None]
    if len(given) != 1:
        raise ValueError("Either text, input_ids or input_embeds should be provided.")
    if given[0] == "input_embeds":
        raise ValueError("input_embeds is not supported by the CPU engine; send text or input_ids")
    tok = engine.model().tokenizer
    if "text" in given:
        texts = body["text"]
        batch = isinstance(texts, list)
        return [tok.encode(t) for t in (texts if batch else [texts])], batch
    ids = body["input_ids"]
    if not isinstance(ids, list) or not ids:
        raise ValueError("input_ids must be a non-empty list of token ids (or a list of such lists)")
    batch = isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    vocab = engine.model().model.config.vocab_size
    for prompt in prompts:
        if not prompt or any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"input_ids must be non-empty lists of integers in [0, {vocab})")
    return prompts, batch


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for a batch of {count}")
        return value
    return [value] * count


def _token_ids_per_item(value: Any, count: int, vocab: int) -> list[list[int] | None]:
    """SGLang's normalisation: empty/absent = none; a flat list applies to every item; a list of lists is per
    item."""
    if not value:
        return [None] * count
    if not isinstance(value, list):
        raise ValueError("token_ids_logprob must be a list of token ids (or one list per batch item)")
    per_item = value if isinstance(value[0], list) else [value] * count
    if len(per_item) != count:
        raise ValueError(f"token_ids_logprob has {len(per_item)} entries for a batch of {count}")
    for ids in per_item:
        if ids is not None and any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"token_ids_logprob must hold integers in [0, {vocab})")
    return [list(ids) if ids else None for ids in per_item]


def build_jobs(body: dict[str, Any], engine: Engine) -> tuple[list[GenJob], bool]:
    """Validate a /generate body into jobs (one per sequence); True when the answer must be a list."""
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, (dict, list)):
        raise SamplingSchemaError("sampling_params must be an object (or a list of objects for a batch)")
    prompts, batch = _as_batch(body, engine)
    configs = [parse_sampling_params(s) for s in _per_item(sampling, len(prompts), "sampling_params")]
    rids = _per_item(body.get("rid"), len(prompts), "rid")
    adapters = _per_item(body.get("lora_path"), len(prompts), "lora_path")
    runner = engine.model()
    starts = [
        -1 if v is None else int(v)
        for v in _per_item(body.get("logprob_start_len"), len(prompts), "logprob_start_len")
    ]
    tops = [int(v or 0) for v in _per_item(body.get("top_logprobs_num"), len(prompts), "top_logprobs_num")]
    id_lists = _token_ids_per_item(
        body.get("token_ids_logprob"), len(prompts), runner.model.config.vocab_size
    )
    jobs: list[GenJob] = []
    for prompt, cfg, rid, adapter, start_len, top, ids in zip(
        prompts, configs, rids, adapters, starts, tops, id_lists, strict=True
    ):
        if adapter is not None and adapter not in runner.adapters:
            raise ValueError(f"LoRA adapter {adapter!r} is not loaded; loaded: {sorted(runner.adapters)}")
        base_rid = rid or engine.new_rid()
        gen = make_generator(cfg.seed, runner.device)
        for i in range(cfg.n):
            jobs.append(
                GenJob(
                    rid=base_rid if cfg.n == 1 else f"{base_rid}_{i}",
                    prompt_ids=list(prompt),
                    cfg=cfg,
                    gen=gen,
                    adapter=adapter,
                    return_logprob=bool(body.get("return_logprob", False)),
                    logprob_start_len=start_len,
                    return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
                    top_logprobs_num=top,
                    token_ids_logprob=ids,
                )
            )
    return jobs, batch or len(jobs) > 1


async def run_to_end(engine: Engine, job: GenJob) -> dict[str, Any]:
    final = None
    async for state in run_job(engine, job):
        final = state
    assert final is not None
    return build_output(engine, job, final)


def _add_generate_route(app: FastAPI, engine: Engine) -> None:
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        body = await _read_json(request)
        if not isinstance(body, dict):
            return JSONResponse({"error": "the request body must be a JSON object"}, status_code=400)
        await engine.wait_loaded()
        try:
            jobs, as_list = build_jobs(body, engine)
        except SamplingSchemaError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        except ValueError as exc:
            return P.value_error(str(exc))
        if body.get("stream"):
            if len(jobs) != 1:
                return P.value_error("streaming supports one sequence per request on the CPU engine")
            return StreamingResponse(_stream(engine, jobs[0]), media_type="text/event-stream")
        outputs = await asyncio.gather(*(run_to_end(engine, job) for job in jobs))
        return JSONResponse(outputs if as_list else outputs[0])


async def _stream(engine: Engine, job: GenJob) -> AsyncIterator[str]:
    """Cumulative chunks (SGLang's default), one per new token, then [DONE]."""
    sent = (-1, None)
    async for state in run_job(engine, job):
        key = (len(state.output_ids), json.dumps(state.finish_reason))
        if key != sent:
            sent = key
            yield f"data: {json.dumps(build_output(engine, job, state))}\n\n"
    yield "data: [DONE]\n\n"


# ----- pause / abort / cache / adapters --------------------------------------------------------------------


def _add_control_routes(app: FastAPI, engine: Engine) -> None:
    @app.post("/pause_generation")
    async def pause_generation(req: P.PauseReq) -> dict[str, str]:
        await engine.pause(req.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(req: P.ContinueReq) -> dict[str, str]:
        await engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort_request(req: P.AbortReq) -> Response:
        await engine.abort(req.rid, req.abort_all)
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = 0.0) -> Response:
        deadline = time.monotonic() + max(timeout, 0.0)
        while (refusal := engine.flush_refusal()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if refusal:
            return PlainTextResponse(refusal, status_code=400)
        return PlainTextResponse(FLUSHED)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(req: P.ReleaseMemoryReq) -> JSONResponse:
        await engine.release_memory(req.tags)  # EngineRefused: 400 {"error": {"message"}}, as SGLang
        return JSONResponse(None)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(req: P.ResumeMemoryReq) -> JSONResponse:
        await engine.resume_memory(req.tags)
        return JSONResponse(None)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(req: P.LoadLoraReq) -> JSONResponse:
        return await _lora_answer(engine, engine.load_adapter(req.lora_name, req.lora_path))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: P.UnloadLoraReq) -> JSONResponse:
        return await _lora_answer(engine, engine.unload_adapter(req.lora_name))


async def _lora_answer(engine: Engine, operation: Any) -> JSONResponse:
    try:
        await operation
    except EngineRefused as exc:
        body = {"success": False, "error_message": str(exc), "loaded_adapters": engine.loaded_adapters()}
        return JSONResponse(body, status_code=400)
    return JSONResponse({"success": True, "error_message": None, "loaded_adapters": engine.loaded_adapters()})


# ----- weight updates --------------------------------------------------------------------------------------


def _add_weight_routes(app: FastAPI, engine: Engine) -> None:
    @app.post("/init_weights_update_group")
    async def init_group(req: P.InitGroupReq) -> JSONResponse:
        try:
            await engine.init_group(**req.model_dump())
        except EngineRefused as exc:
            return P.success_body(False, str(exc))
        except Exception as exc:  # rendezvous failures (timeout, refused store) are the caller's to see
            log.exception("init_weights_update_group failed")
            return P.success_body(False, f"Failed to initialize custom process group: {exc}")
        return P.success_body(True, "Succeeded to initialize custom process group.")

    @app.post("/destroy_weights_update_group")
    async def destroy_group(req: P.DestroyGroupReq) -> JSONResponse:
        try:
            engine.destroy_group(req.group_name)
        except EngineRefused as exc:
            return P.success_body(False, str(exc))
        return P.success_body(True, "Succeeded to destroy custom process group.")

    if not engine.legacy:  # older SGLang builds have no session endpoints at all (404)

        @app.post("/begin_weight_update")
        async def begin(req: P.BeginWeightUpdateReq) -> JSONResponse:
            try:
                engine.begin_session()
            except EngineRefused as exc:
                return P.success_body(False, str(exc))
            return P.success_body(True, "Success")

        @app.post("/end_weight_update")
        async def end(req: P.EndWeightUpdateReq) -> JSONResponse:
            try:
                engine.end_session()
            except EngineRefused as exc:
                return P.success_body(False, str(exc))
            return P.success_body(True, "Success")

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(req: P.UpdateFromDistributedReq) -> JSONResponse:
        try:
            message = await _update_from_distributed(engine, req)
        except EngineRefused as exc:
            return P.success_body(False, str(exc))
        except Exception as exc:  # the broadcast broke (trainer left the group, timeout): answer, like SGLang
            log.exception("update_weights_from_distributed failed")
            return P.success_body(
                False,
                f"Failed to update weights: {exc}. The weights may be partially updated; push them again.",
            )
        return P.success_body(message.startswith("Succeeded"), message)

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def weights_checker(req: P.CheckWeightsReq | None = None) -> JSONResponse:
        req = req or P.CheckWeightsReq()
        try:
            checksums = await engine.checksums(req.action, req.skip_tensor_list or [])
        except EngineRefused as exc:
            return P.success_body(False, str(exc))
        return P.success_body(True, "Success.", **P.checksum_body(checksums))

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(req: P.UpdateFromTensorReq) -> JSONResponse:
        try:
            success, message = await _update_from_tensor(engine, req)
        except EngineRefused as exc:
            return P.success_body(False, str(exc))
        except Exception as exc:  # a copy that failed midway: answer, as SGLang's runner does
            log.exception("update_weights_from_tensor failed")
            return P.success_body(
                False, f"Failed to update weights: {exc}. The weights may be partially updated; push again."
            )
        return P.success_body(success, message)

    @app.post("/update_weight_version")
    async def update_weight_version(req: P.UpdateWeightVersionReq) -> JSONResponse:
        await engine.set_version(req.new_version, req.abort_all_requests)
        return P.success_body(
            True, f"Weight version updated to {req.new_version}", new_version=req.new_version
        )


async def _update_from_distributed(engine: Engine, req: P.UpdateFromDistributedReq) -> str:
    engine.check_session()
    engine.memory.require_weights()
    if not len(req.names) == len(req.dtypes) == len(req.shapes):
        raise EngineRefused("names, dtypes and shapes must have the same length")
    async with engine.exclusive_weights():
        if req.abort_all_requests:
            await engine.abort(abort_all=True)
        if req.load_format == DELTA_LOAD_FORMAT:
            await engine.receive_delta(req.group_name, req.names, req.dtypes, req.shapes)
        else:
            named = await engine.receive_bucket(
                req.group_name, req.names, req.dtypes, req.shapes, req.load_format == "flattened_bucket"
            )
            await engine.load_received(named)
    message = "Succeeded to update parameter online."
    if req.weight_version is not None:
        engine.change_version(req.weight_version)
        message += f" Weight version updated to {req.weight_version}."
    if req.flush_cache and (refusal := engine.flush_refusal()):
        return f"Weights were updated, but the cache was not flushed: {refusal}"
    return message


async def _update_from_tensor(engine: Engine, req: P.UpdateFromTensorReq) -> tuple[bool, str]:
    """Checks first (session, resident weights, payload), then as SGLang: abort, the writer gate (at once
    when paused), load, version, flush. The tensors are copied in (never adopted: they are the sender's)."""
    engine.check_session("update_weights_from_tensor")
    engine.memory.require_weights()
    if len(req.serialized_named_tensors) != ENGINE_TP_SIZE:
        raise EngineRefused(
            f"serialized_named_tensors has {len(req.serialized_named_tensors)} entries; it needs one per "
            f"tensor-parallel rank, and this engine has {ENGINE_TP_SIZE}"
        )
    if req.abort_all_requests:
        await engine.abort(abort_all=True)
    async with engine.exclusive_weights():
        await engine.load_tensor_payload(
            req.serialized_named_tensors[0], flattened=req.load_format == "flattened_bucket"
        )
    message = "Success"
    if req.weight_version is not None:
        engine.change_version(req.weight_version)
        message += f" Weight version updated to {req.weight_version}."
    if req.torch_empty_cache:
        empty_device_cache(engine.model().device)
    if req.flush_cache and (refusal := engine.flush_refusal()):
        return False, f"Weights were updated, but the cache was not flushed: {refusal}"
    return True, message
