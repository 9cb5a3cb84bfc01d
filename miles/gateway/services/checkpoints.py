"""CheckpointService: what the REST API does with checkpoints beyond saving them (TrainingService saves).

- Publishing: a published checkpoint is readable (load, sample, weights_info, download) by every tenant
  of this job's gateway; only its owner publishes, unpublishes, deletes or sets its TTL. An unpublished
  checkpoint of another tenant answers exactly as a missing one (404).
- The user's checkpoints across training runs, newest first, paged; search_checkpoints
  (checkpoint_search.py) over every checkpoint the caller may read.
- External weights downloads: signed URLs, one per file, valid for `url_ttl_s`; the download route
  checks the signature and serves the file from the checkpoint directory.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from miles.checkpoints.manager import CheckpointInfo, CheckpointManager
from miles.checkpoints.paths import CheckpointNotFound, parse_checkpoint_id
from miles.gateway.errors import bad_request, not_found
from miles.gateway.services import signed_urls
from miles.gateway.services.checkpoint_search import CheckpointSearch, project_refusal, search_page
from miles.gateway.services.storage import filesystem_usage, usage_item

DOWNLOAD_PREFIX = "/api/v1/external_weights"
DEFAULT_URL_TTL_S = 3600.0


class CheckpointService:
    def __init__(
        self,
        checkpoints: CheckpointManager,
        *,
        url_ttl_s: float = DEFAULT_URL_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._checkpoints = checkpoints
        self._url_ttl_s = url_ttl_s
        self._clock = clock
        # Links are valid for this gateway's life only: a restarted gateway signs new ones.
        self._key = secrets.token_bytes(32)

    # ----- publishing ------------------------------------------------------------------------------------

    async def set_public(
        self, tenant: str, model_id: str, checkpoint_id: str, public: bool
    ) -> CheckpointInfo:
        try:
            return await self._checkpoints.set_public(tenant, model_id, checkpoint_id, public)
        except CheckpointNotFound as exc:
            raise not_found(f"checkpoint {checkpoint_id!r} of training run {model_id!r}") from exc

    async def readable(self, tenant: str, tinker_path: str) -> tuple[Path, CheckpointInfo]:
        """The caller's checkpoint or a published one, else 404."""
        try:
            return await self._checkpoints.locate_readable(tenant, tinker_path)
        except CheckpointNotFound as exc:
            raise not_found(f"checkpoint {tinker_path!r}") from exc

    # ----- listing ---------------------------------------------------------------------------------------

    async def user_checkpoints(self, tenant: str, limit: int, offset: int) -> dict[str, Any]:
        """The SDK's CheckpointsListResponse: the caller's checkpoints of every run, newest first."""
        records = await self._checkpoints.list(tenant)
        newest_first = sorted(records, key=lambda r: (r.created_at, r.tinker_path), reverse=True)
        page = newest_first[offset : offset + limit]
        return {
            "checkpoints": [r.to_tinker() for r in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(records)},
        }

    async def search(self, tenant: str, search: CheckpointSearch) -> dict[str, Any]:
        """The SDK's CheckpointSearchResponse: one page of matches, newest first."""
        refusal = project_refusal(search)
        if refusal is not None:
            raise bad_request(refusal)
        page, cursor = search_page(await self._checkpoints.list_readable(tenant), tenant, search)
        return {
            "checkpoints": [r.to_tinker() for r in page],
            "next_cursor": None if cursor is None else cursor.model_dump(mode="json"),
        }

    async def storage_usage(self, tenant: str, project_id: str | None) -> dict[str, Any]:
        """The SDK's CurrentCheckpointStorageUsageResponse for the caller, and (beyond the SDK's fields, for
        raw HTTP) the checkpoint filesystem's size and free space. Checkpoints here belong to no project:
        a project filter matches none."""
        records = [] if project_id else await self._checkpoints.list(tenant)
        usage = await asyncio.to_thread(filesystem_usage, self._checkpoints.root)
        return {
            "data": [{**usage_item(records), "project_id": None}] if records else [],
            "effective_rate_usd_per_gigabyte_month": None,
            "filesystem": {
                "total_bytes": usage.total_bytes,
                "free_bytes": usage.free_bytes,
                "used_fraction": round(usage.used_fraction, 4),
            },
        }

    # ----- external weights downloads --------------------------------------------------------------------

    async def external_urls(self, tenant: str, model_id: str, checkpoint_id: str, base_url: str) -> dict:
        """The SDK's ExternalWeightsUrlsResponse: a signed URL per file of a readable export."""
        try:
            address = parse_checkpoint_id(model_id, checkpoint_id)
        except CheckpointNotFound as exc:
            raise not_found(f"checkpoint {checkpoint_id!r} of training run {model_id!r}") from exc
        if address.kind != "external_weights":
            raise bad_request(
                f"{address.uri} is not an external weights export; download URLs exist for "
                "tinker://.../external_weights/... paths (save_weights_external)"
            )
        directory, _ = await self.readable(tenant, address.uri)
        expires = int(self._clock() + self._url_ttl_s)
        prefix = base_url.rstrip("/") + DOWNLOAD_PREFIX
        urls = {
            name: signed_urls.signed_path(prefix, f"{address.index_key}/{name}", self._key, expires)
            for name in sorted(self._checkpoints.files_of(directory))
        }
        return {"urls": urls, "expires": datetime.fromtimestamp(expires, tz=UTC).isoformat()}

    async def download(self, address: str, expires: int, signature: str) -> Path:
        """The file a signed URL names (`model_id/external_weights/name/file`), or 404: a bad or expired
        signature and a file that is gone answer alike, so a link reveals nothing once it is invalid."""
        if not signed_urls.is_valid(self._key, address, expires, signature, self._clock()):
            raise not_found("download link (invalid or expired; ask get_external_weights_urls for a new one)")
        parts = address.split("/", 3)
        if len(parts) != 4 or parts[1] != "external_weights":
            raise not_found("download link")
        model_id, kind, name, file = parts
        try:
            directory, _ = await self._checkpoints.locate_indexed(f"tinker://{model_id}/{kind}/{name}")
        except CheckpointNotFound as exc:
            raise not_found(f"external weights tinker://{model_id}/{kind}/{name}") from exc
        path = self._checkpoints.files_of(directory).get(file)
        if path is None:
            raise not_found(f"file {file!r} of tinker://{model_id}/{kind}/{name}")
        return path
