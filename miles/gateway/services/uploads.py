"""External weights uploads (tinker 0.39/0.40's RestClient.external_weights_upload_start / _finish): a
LoRA adapter trained elsewhere becomes a checkpoint this job samples from.

1. start: the caller names the base model and the LoRA config; the answer is an upload id and a signed PUT
   URL per file of PEFT's format (adapter_config.json, adapter_model.safetensors: what this job's sampler
   snapshots of LoRA runs hold). SDK 0.39 gets each URL as a string, 0.40 as `{url, headers}`.
2. PUT: the signature is the credential (no API key), as on the download links. Each file streams to the
   upload's area on the checkpoint filesystem, at most `max_file_bytes`; a file may be sent again.
3. finish: the files are checked against the base (lora_layout: the config's rank and targets, every
   tensor's name, shape and dtype against the base's own weight shapes). A refusal names what is wrong and
   leaves the upload open to PUT a corrected file and finish again. Accepted files move into a sampler
   checkpoint `tinker://upload-<id>:train:0/sampler_weights/adapter` of a new training run of the caller's
   (which, like a copy, is never trained); `create_sampling_client(model_path=...)` and the OpenAI routes
   load it. A retried finish answers the same path.

Uploads live in this gateway's memory for their URLs' lifetime: an expired one is swept at the next start,
and a restarted gateway removes what an earlier one left (`.uploads` is scratch).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version
from safetensors import safe_open

from miles.checkpoints.manager import CheckpointManager
from miles.contract.lora_layout import (
    ADAPTER_FILES,
    adapter_layout,
    config_problems,
    lora_targets,
    tensor_problems,
)
from miles.errors import Category, UserError
from miles.gateway.errors import ApiError, bad_request, not_found
from miles.gateway.services import signed_urls
from miles.gateway.services.base_models import BaseModels
from miles.gateway.services.training import new_model_record
from miles.gateway.sessions import model_id_for
from miles.seam.runtime import ModelCard
from miles.state.records import ModelRepository
from miles.types import LoraSpec

PUT_PREFIX = "/api/v1/external_weights_uploads"
DEFAULT_URL_TTL_S = 3600.0
DEFAULT_MAX_FILE_BYTES = 16 * 2**30
URLS_WITH_HEADERS = Version("0.40")  # tinker 0.40's ExternalWeightsUploadURL {url, headers}
PUT_HEADERS = {"Content-Type": "application/octet-stream"}
CHECKPOINT_NAME = "adapter"
MAX_OPEN_UPLOADS = 16  # per tenant: each holds a directory and a record until it is finished or expires


class UploadState(StrEnum):
    OPEN = "open"  # files may be PUT; finish may be asked
    FINISHING = "finishing"  # the files are being checked and committed
    DONE = "done"  # committed: a retried finish answers the same path
    EXPIRED = "expired"


UPLOAD_TRANSITIONS: dict[UploadState, frozenset[UploadState]] = {
    UploadState.OPEN: frozenset({UploadState.FINISHING, UploadState.EXPIRED}),
    UploadState.FINISHING: frozenset({UploadState.OPEN, UploadState.DONE}),  # OPEN: refused, fix and retry
    UploadState.DONE: frozenset(),
    UploadState.EXPIRED: frozenset(),
}


@dataclass(frozen=True)
class LoraDeclaration:
    """The upload's lora_config: what the files must be."""

    rank: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    @property
    def targets(self) -> list[str]:
        return lora_targets(
            train_attn=self.train_attn, train_mlp=self.train_mlp, train_unembed=self.train_unembed
        )


@dataclass
class Upload:
    upload_id: str
    tenant: str
    card: ModelCard
    lora: LoraDeclaration
    project_id: str | None
    expires: int
    area: Path
    state: UploadState = UploadState.OPEN
    tinker_path: str | None = None

    def move(self, to: UploadState) -> None:
        if to not in UPLOAD_TRANSITIONS[self.state]:
            raise RuntimeError(f"upload {self.upload_id}: {self.state} -> {to} is not allowed")
        self.state = to


def urls_carry_headers(sdk_version: str | None) -> bool:
    """Whether the SDK that asked reads each URL as `{url, headers}` (0.40 on) rather than a string."""
    try:
        return sdk_version is not None and Version(sdk_version.strip()) >= URLS_WITH_HEADERS
    except InvalidVersion:
        return False


class UploadService:
    def __init__(
        self,
        checkpoints: CheckpointManager,
        models: ModelRepository,
        base_models: BaseModels,
        *,
        url_ttl_s: float = DEFAULT_URL_TTL_S,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._checkpoints = checkpoints
        self._models = models
        self._base_models = base_models
        self._url_ttl_s = url_ttl_s
        self.max_file_bytes = max_file_bytes
        self._clock = clock
        self._key = secrets.token_bytes(32)  # links are valid for this gateway's life only
        self._uploads: dict[str, Upload] = {}
        shutil.rmtree(checkpoints.root / ".uploads", ignore_errors=True)  # an earlier gateway's

    # ----- start -----------------------------------------------------------------------------------------

    def start(
        self,
        tenant: str,
        base_model: str,
        lora: LoraDeclaration,
        project_id: str | None,
        base_url: str,
        sdk_version: str | None,
    ) -> dict[str, Any]:
        """The SDK's ExternalWeightsUploadStartResponse: the upload id and a signed PUT URL per file."""
        card = self._base_models.card(base_model)
        if not card.sampleable:
            raise bad_request(f"base_model {base_model!r} is not served for sampling here")
        if card.max_lora_rank is not None and lora.rank > card.max_lora_rank:
            raise bad_request(
                f"lora_config.rank {lora.rank} is above what the engines serve ({card.max_lora_rank})"
            )
        if not lora.targets:
            raise bad_request("lora_config needs at least one of train_attn, train_mlp, train_unembed")
        self._sweep()
        open_uploads = sum(u.tenant == tenant and u.state is UploadState.OPEN for u in self._uploads.values())
        if open_uploads >= MAX_OPEN_UPLOADS:
            raise ApiError(
                Category.CAPACITY,
                f"{open_uploads} uploads of yours are open (at most {MAX_OPEN_UPLOADS}): finish them, or "
                "start again once their URLs expire",
            )
        upload_id = secrets.token_hex(16)
        expires = int(self._clock() + self._url_ttl_s)
        area = self._checkpoints.upload_area(upload_id)
        self._uploads[upload_id] = Upload(upload_id, tenant, card, lora, project_id, expires, area)
        prefix = base_url.rstrip("/") + PUT_PREFIX
        signed = {
            name: signed_urls.signed_path(prefix, f"{upload_id}/{name}", self._key, expires)
            for name in ADAPTER_FILES
        }
        with_headers = urls_carry_headers(sdk_version)
        urls = {n: {"url": u, "headers": PUT_HEADERS} if with_headers else u for n, u in signed.items()}
        when = datetime.fromtimestamp(expires, tz=UTC).isoformat()
        return {"upload_id": upload_id, "urls": urls, "expires": when}

    def _sweep(self) -> None:
        now = self._clock()
        for upload in [u for u in self._uploads.values() if u.expires <= now]:
            if upload.state is UploadState.OPEN:
                upload.move(UploadState.EXPIRED)
            if upload.state is not UploadState.FINISHING:
                shutil.rmtree(upload.area, ignore_errors=True)
                del self._uploads[upload.upload_id]

    # ----- PUT -------------------------------------------------------------------------------------------

    async def receive(self, address: str, expires: int, signature: str, body: AsyncIterator[bytes]) -> None:
        """One file of an open upload, from a signed URL; a bad or expired link is a 404, as downloads."""
        if not signed_urls.is_valid(self._key, address, expires, signature, self._clock()):
            raise not_found("upload link (invalid or expired; start a new upload)")
        upload_id, _, name = address.partition("/")
        upload = self._uploads.get(upload_id)
        if upload is None or name not in ADAPTER_FILES:
            raise not_found("upload link")
        _check_open(upload)
        partial = upload.area / f".{name}.{secrets.token_hex(4)}.part"  # concurrent PUTs: the last one wins
        size = 0
        try:
            with partial.open("wb") as out:
                async for chunk in body:
                    size += len(chunk)
                    if size > self.max_file_bytes:
                        raise ApiError(
                            Category.TOO_LARGE,
                            f"{name} is over the {self.max_file_bytes} bytes an upload file may hold",
                        )
                    await asyncio.to_thread(out.write, chunk)
            _check_open(upload)  # no await from here on: a finish begun meanwhile checks what it commits
            partial.replace(upload.area / name)
        finally:
            partial.unlink(missing_ok=True)

    # ----- finish ----------------------------------------------------------------------------------------

    async def finish(self, tenant: str, upload_id: str) -> dict[str, Any]:
        """The SDK's ExternalWeightsUploadFinishResponse: the checked adapter as a sampler checkpoint."""
        upload = self._uploads.get(upload_id)
        if upload is None or upload.tenant != tenant:
            raise not_found(f"upload {upload_id!r}")
        if upload.state is UploadState.DONE:
            return {"tinker_path": upload.tinker_path}
        if upload.state is UploadState.FINISHING:
            raise ApiError(Category.USER, f"upload {upload_id} is being finished by another request")
        if upload.expires <= self._clock():
            raise bad_request(f"upload {upload_id} expired; start a new upload")
        upload.move(UploadState.FINISHING)
        try:
            problems = await asyncio.to_thread(check_adapter, upload)
            if problems:
                raise bad_request(
                    "the uploaded adapter does not fit "
                    f"{upload.card.name} with rank {upload.lora.rank}: {'; '.join(problems)}. PUT the "
                    "corrected file to its URL again and finish the upload again"
                )
            upload.tinker_path = await self._commit(upload)
        except BaseException:
            upload.move(UploadState.OPEN)
            raise
        upload.move(UploadState.DONE)
        shutil.rmtree(upload.area, ignore_errors=True)
        return {"tinker_path": upload.tinker_path}

    async def _commit(self, upload: Upload) -> str:
        model_id = model_id_for(f"upload-{upload.upload_id[:20]}", 0)
        metadata = {"project_id": upload.project_id} if upload.project_id else None
        lora = LoraSpec(rank=upload.lora.rank)
        record = new_model_record(upload.tenant, model_id, upload.card.name, lora, metadata)
        copied_from = f"external weights upload {upload.upload_id}"
        if not await self._models.create(record.model_copy(update={"copied_from": copied_from})):
            raise UserError(f"training run {model_id} exists already")
        try:
            info = await self._checkpoints.commit_files(
                upload.tenant,
                model_id,
                "sampler_weights",
                CHECKPOINT_NAME,
                upload.area,
                {"base_model": upload.card.name, "is_lora": True, "lora_rank": upload.lora.rank},
            )
        except BaseException:
            await self._models.delete(model_id)
            raise
        return info.tinker_path


def _check_open(upload: Upload) -> None:
    if upload.state is not UploadState.OPEN:
        raise ApiError(
            Category.USER, f"upload {upload.upload_id} is {upload.state}; its files can no longer change"
        )


def check_adapter(upload: Upload) -> list[str]:
    """What is wrong with the upload's files for its base and LoRA config (empty: nothing)."""
    missing = [name for name in ADAPTER_FILES if not (upload.area / name).is_file()]
    if missing:
        return [f"{', '.join(missing)} not uploaded (PUT each file of the start answer's urls)"]
    try:
        config = json.loads((upload.area / "adapter_config.json").read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return [f"adapter_config.json is not JSON: {exc}"]
    problems = config_problems(config, upload.lora.rank, upload.lora.targets)
    try:
        found = _tensor_shapes(upload.area / "adapter_model.safetensors")
    except Exception as exc:  # safetensors refuses a malformed file with one of several error types
        return [*problems, f"adapter_model.safetensors is not a safetensors file: {exc}"]
    expected = adapter_layout(
        base_weight_shapes(upload.card.tokenizer_path), upload.lora.rank, upload.lora.targets
    )
    return problems + tensor_problems(found, expected)


def _tensor_shapes(path: Path) -> dict[str, tuple[str, list[int]]]:
    with safe_open(str(path), framework="numpy") as handle:
        return {
            name: (handle.get_slice(name).get_dtype(), handle.get_slice(name).get_shape())
            for name in handle.keys()  # noqa: SIM118 (a safe_open handle is not a dict)
        }


@lru_cache(maxsize=8)
def base_weight_shapes(model_dir: str | None) -> Mapping[str, list[int]]:
    """Every weight's shape in the base model's safetensors files (headers only, read once)."""
    if model_dir is None:
        raise UserError("this base model's weights are not on the gateway's filesystem to check against")
    shapes: dict[str, list[int]] = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        shapes.update({name: shape for name, (_, shape) in _tensor_shapes(shard).items()})
    if not shapes:
        raise UserError(f"no safetensors weights in {model_dir} to check an uploaded adapter against")
    return shapes
