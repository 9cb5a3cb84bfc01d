"""`SGLangApiClient`: the only way the runtime talks to an engine (SGLang 0.5.23 or our CPU engine).

One async method per endpoint the runtime uses. Requests go through the shared per-loop httpx client of
`miles.utils.http` (keep-alive expiry below every engine's keep-alive, see there).

Retry policy (and nothing else is retried): `pause_generation`, `continue_generation`, and
`update_weight_version(..., abort_all_requests=False)` are idempotent, so after a ReadError, WriteError or
RemoteProtocolError (the request may or may not have reached the engine) they are sent exactly once more.
Never retried: refused connections, timeouts, error statuses, and every non-idempotent call (group init,
weight updates, begin/end session, memory release/resume, LoRA load/unload, generate): resending a weight
bucket would join a broadcast nobody sends, and a resent resume fails (nothing is released any more).

Errors: an error status raises `EngineError` (`EngineRefused` for `success: false` bodies, also with status
200, and for a refused flush), carrying the engine's answer as `.body` and as an exception note. Transport
errors propagate as httpx exceptions with a note naming the endpoint.

Weight-update dialect (`weight_api`): "current" (SGLang >= 0.5.22) needs updates bracketed by
begin_weight_update/end_weight_update; "legacy" engines have no such endpoints, so those calls are no-ops.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from miles.engines.errors import EngineError, EngineRefused, EngineUnauthorized
from miles.utils.http import CONNECT_TIMEOUT_S, get_async_client

PauseMode = Literal["abort", "retract", "in_place"]
WeightApi = Literal["current", "legacy"]
RETRYABLE_TRANSPORT_ERRORS: tuple[type[Exception], ...] = (
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)
DEFAULT_GROUP_NAME = "weight_update_group"
# Our delta push (docs/weights.md "Delta push"): a load_format only our CPU engine knows. SGLang reads any
# load_format but "flattened_bucket" as one broadcast per named tensor, so the driver sends it only to
# engines that answered the digest action below, which SGLang refuses ("Unsupported action").
DELTA_LOAD_FORMAT = "miles_delta"
DIGEST_ACTION = "miles_digest"  # /weights_checker action: miles.utils.delta.digest of every tensor
LOAD_FORMATS = (None, "flattened_bucket", DELTA_LOAD_FORMAT)


def dtype_name(dtype: Any) -> str:
    """`torch.bfloat16` / "torch.bfloat16" / "bfloat16" -> "bfloat16" (SGLang does getattr(torch, name))."""
    import torch

    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"{dtype!r} is not a torch dtype (expected e.g. torch.bfloat16 or 'bfloat16')")
    return name


def _decode_body(response: httpx.Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text


def _message_of(body: Any) -> str:
    """The human message inside any of SGLang's error envelopes."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "error_message"):
            if body.get(key):
                return str(body[key])
    return str(body)


def _generate_payload(
    input_ids: list[int] | list[list[int]],
    sampling_params: dict[str, Any] | list[dict[str, Any]],
    return_logprob: bool,
    lora_path: str | None,
    rid: str | None,
    logprob_start_len: int | None,
    top_logprobs_num: int | None,
    token_ids_logprob: list[int] | None,
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": sampling_params,
        "return_logprob": return_logprob,
    }
    optional = {
        "lora_path": lora_path,
        "rid": rid,
        "logprob_start_len": logprob_start_len,
        "top_logprobs_num": top_logprobs_num or None,
        "token_ids_logprob": token_ids_logprob or None,
    }
    payload.update({k: v for k, v in optional.items() if v is not None})
    return payload


async def _sse_events(response: httpx.Response) -> AsyncIterator[Any]:
    """The JSON payloads of a text/event-stream's `data:` lines, up to `data: [DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


@dataclass(frozen=True)
class SGLangApiClient:
    base_url: str
    api_key: str | None = None
    weight_api: WeightApi = "current"
    timeout_s: float = 1800.0  # per request; a group rendezvous legitimately blocks until every peer joins

    def __post_init__(self) -> None:
        if self.weight_api not in ("current", "legacy"):
            raise ValueError(f"weight_api must be 'current' or 'legacy', got {self.weight_api!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")

    # ----- transport -------------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _timeout(self, timeout_s: float | None) -> httpx.Timeout:
        total = self.timeout_s if timeout_s is None else timeout_s
        return httpx.Timeout(total, connect=min(CONNECT_TIMEOUT_S, total))

    async def _send_once(
        self, method: str, endpoint: str, payload: Any, params: dict[str, Any] | None, timeout_s: float | None
    ) -> httpx.Response:
        client = get_async_client(purpose="engine")
        url = self.base_url.rstrip("/") + endpoint
        try:
            return await client.request(
                method,
                url,
                json=payload,
                params=params,
                headers=self._headers(),
                timeout=self._timeout(timeout_s),
            )
        except httpx.TransportError as exc:
            exc.add_note(f"while calling {method} {url}")
            raise

    async def _call(
        self,
        method: str,
        endpoint: str,
        payload: Any = None,
        *,
        retry_once: bool = False,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """Send, optionally retry once on a reset, raise on failure statuses; return the decoded body."""
        try:
            response = await self._send_once(method, endpoint, payload, params, timeout_s)
        except RETRYABLE_TRANSPORT_ERRORS:
            if not retry_once:
                raise
            response = await self._send_once(method, endpoint, payload, params, timeout_s)
        return self._check(endpoint, response)

    def _check(self, endpoint: str, response: httpx.Response) -> Any:
        body = _decode_body(response)
        status = response.status_code
        refused = isinstance(body, dict) and body.get("success") is False
        if status in (401, 403):
            raise EngineUnauthorized(
                f"{endpoint}: engine at {self.base_url} rejected the API key ({status})",
                status_code=status,
                endpoint=endpoint,
                body=body,
            )
        if refused or status >= 400:
            cls = EngineRefused if refused else EngineError
            raise cls(
                f"{endpoint} failed on {self.base_url} ({status}): {_message_of(body)}",
                status_code=status,
                endpoint=endpoint,
                body=body,
            )
        return body

    # ----- status ----------------------------------------------------------------------------------------

    async def health(self, timeout_s: float | None = 20.0) -> bool:
        """True when GET /health answers 200; False for any other status or an unreachable engine."""
        try:
            response = await self._send_once("GET", "/health", None, None, timeout_s)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def alive(self, timeout_s: float | None = 20.0) -> bool:
        """True when the engine's HTTP process answers GET /model_info (200): a liveness probe that needs
        no GPU work, for an engine whose memory is released (its /health would try to generate)."""
        try:
            response = await self._send_once("GET", "/model_info", None, None, timeout_s)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def model_info(self) -> dict[str, Any]:
        return await self._call("GET", "/model_info")

    # ----- generation ------------------------------------------------------------------------------------

    async def generate(
        self,
        *,
        input_ids: list[int] | list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]],
        return_logprob: bool = False,
        lora_path: str | None = None,
        rid: str | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        token_ids_logprob: list[int] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """POST /generate. A dict; a list of dicts for a batch or `sampling_params["n"] > 1` (as SGLang
        answers: item-major, the n samples of an item next to each other)."""
        payload = _generate_payload(
            input_ids,
            sampling_params,
            return_logprob,
            lora_path,
            rid,
            logprob_start_len,
            top_logprobs_num,
            token_ids_logprob,
        )
        return await self._call("POST", "/generate", payload, timeout_s=timeout_s)

    async def generate_stream(
        self,
        *,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        return_logprob: bool = False,
        lora_path: str | None = None,
        rid: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """POST /generate with `stream: true`: each SSE `data:` event as it arrives (SGLang's default
        chunks are cumulative: full output_ids and meta_info so far), until `[DONE]`. An error the engine
        sends in-band (a chunk with "error") raises EngineError; closing the iterator early closes the
        connection, which SGLang treats as an abort."""
        payload = _generate_payload(
            input_ids, sampling_params, return_logprob, lora_path, rid, None, None, None
        )
        payload["stream"] = True
        client = get_async_client(purpose="engine")
        url = self.base_url.rstrip("/") + "/generate"
        request = client.build_request(
            "POST", url, json=payload, headers=self._headers(), timeout=self._timeout(timeout_s)
        )
        try:
            response = await client.send(request, stream=True)
        except httpx.TransportError as exc:
            exc.add_note(f"while calling POST {url} (stream)")
            raise
        try:
            if response.status_code >= 400:
                await response.aread()
                self._check("/generate", response)
            async for chunk in _sse_events(response):
                if isinstance(chunk, dict) and "error" in chunk:
                    raise EngineError(
                        f"/generate failed on {self.base_url} while streaming: {_message_of(chunk)}",
                        status_code=response.status_code,
                        endpoint="/generate",
                        body=chunk,
                    )
                yield chunk
        finally:
            await response.aclose()

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    # ----- pause / cache ---------------------------------------------------------------------------------

    async def pause_generation(self, mode: PauseMode = "abort") -> dict[str, Any]:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        return await self._call("POST", "/pause_generation", {"mode": mode}, retry_once=True)

    async def continue_generation(self) -> dict[str, Any]:
        return await self._call("POST", "/continue_generation", {}, retry_once=True)

    async def flush_cache(self, timeout_s: float = 0.0) -> None:
        """Flush the prefix cache; raises EngineRefused while requests run (SGLang answers 400 then)."""
        try:
            await self._call("POST", "/flush_cache", None, params={"timeout": timeout_s})
        except EngineRefused:
            raise
        except EngineError as exc:
            if exc.status_code != 400:
                raise
            raise EngineRefused(
                str(exc), status_code=exc.status_code, endpoint=exc.endpoint, body=exc.body
            ) from exc

    # ----- memory occupation (colocation) ----------------------------------------------------------------

    async def release_memory_occupation(self, tags: list[str] | None) -> None:
        """Give the engine's GPU memory back: `tags` among "weights", "kv_cache", "cuda_graph"; None or []
        = all. The engine must be idle (pause it first): else EngineError 400. Freed only on engines
        started with --enable-memory-saver. Not retried: a resend of a release that went through fails."""
        await self._call("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None) -> None:
        """Take the memory back; every tag named must be released (else EngineError 400). Not retried."""
        await self._call("POST", "/resume_memory_occupation", {"tags": tags})

    # ----- weight updates --------------------------------------------------------------------------------

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
    ) -> dict[str, Any]:
        """Blocks until every rank (trainer rank 0 too) has joined: run it concurrently with the trainer."""
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._call("POST", "/init_weights_update_group", payload)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> dict[str, Any]:
        return await self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def begin_weight_update(self) -> dict[str, Any] | None:
        if self.weight_api == "legacy":
            return None
        return await self._call("POST", "/begin_weight_update", {})

    async def end_weight_update(self) -> dict[str, Any] | None:
        if self.weight_api == "legacy":
            return None
        return await self._call("POST", "/end_weight_update", {})

    async def update_weights_from_distributed(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        group_name: str = DEFAULT_GROUP_NAME,
        flush_cache: bool = False,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """Receive one bucket; returns once the trainer's broadcast of it completed and weights loaded."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names, dtypes and shapes must have equal lengths, got {len(names)}, {len(dtypes)}, "
                f"{len(shapes)}"
            )
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
        payload: dict[str, Any] = {
            "names": list(names),
            "dtypes": [dtype_name(d) for d in dtypes],
            "shapes": [[int(x) for x in s] for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        return await self._call("POST", "/update_weights_from_distributed", payload)

    async def weights_checker(self, action: str = "checksum") -> dict[str, Any]:
        """SGLang's `/weights_checker`: `checksum` answers one checksum per tensor in `ranks[i].checksums`;
        `DIGEST_ACTION` (our CPU engine only; SGLang refuses it with 400) the same with our digest."""
        return await self._call("POST", "/weights_checker", {"action": action})

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        """Load one bucket from handles to the sender's memory (miles.utils.tensor_ipc
        .serialize_named_tensors: one payload per TP rank of the engine). Returns once the engine copied
        them: only then may the sender free or change those tensors."""
        payload: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "flush_cache": flush_cache,
        }
        if load_format is not None:
            payload["load_format"] = load_format
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return await self._call("POST", "/update_weights_from_tensor", payload)

    async def update_weight_version(
        self, new_version: str, abort_all_requests: bool = True
    ) -> dict[str, Any]:
        # Only without aborting is a resend harmless: a second abort could kill requests admitted in between.
        payload = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        return await self._call("POST", "/update_weight_version", payload, retry_once=not abort_all_requests)

    # ----- LoRA ------------------------------------------------------------------------------------------

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        payload = {"lora_name": lora_name, "lora_path": lora_path}
        return await self._call("POST", "/load_lora_adapter", payload)

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return await self._call("POST", "/unload_lora_adapter", {"lora_name": lora_name})
