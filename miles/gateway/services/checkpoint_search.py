"""search_checkpoints (tinker 0.39's CheckpointSearchRequest): which checkpoints match, newest first, one
page at a time. Pure: the caller hands in every checkpoint the caller may read.

- `owner`: `own` (the default) is the caller's checkpoints; `accessible` adds every published one;
  `user` keeps those of the listed owners (tenants, as training runs' `model_owner` names them) that the
  caller may read.
- `project_ids`: this job has no projects, so naming one is the published "project you cannot list" error.
- `user_metadata`: every pair must match exactly; `base_models`: any of them (an empty list matches none);
  `checkpoint_type`: training, sampler or external.
- Paging: newest first by (creation time, tinker path); `next_cursor` names the last checkpoint of the
  page, and the next page starts strictly after it, so checkpoints saved between pages never shift a page.
  The cursor's `last_checkpoint_uuid` is the checkpoint's tinker path (this job's checkpoint id).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from miles.state.records import CheckpointRecord

MAX_PAGE = 200


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OwnOwner(_Body):
    type: Literal["own"] = "own"


class AccessibleOwner(_Body):
    type: Literal["accessible"]


class UserOwner(_Body):
    type: Literal["user"]
    owner_urns: list[Annotated[str, Field(max_length=256)]] = Field(min_length=1, max_length=10)


class SearchCursor(_Body):
    last_created_at: AwareDatetime
    last_checkpoint_uuid: str = Field(max_length=4096)


class CheckpointSearch(_Body):
    """The request body; unknown fields are ignored, as on every Tinker route here."""

    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = Field(default_factory=dict)
    checkpoint_type: Literal["training", "sampler", "external"] | None = None
    owner: Annotated[OwnOwner | AccessibleOwner | UserOwner, Field(discriminator="type")] = OwnOwner()
    base_models: list[str] | None = None
    limit: int = Field(default=50, ge=1, le=MAX_PAGE)
    cursor: SearchCursor | None = None


def project_refusal(search: CheckpointSearch) -> str | None:
    """The 400's message when the search names a project (this job has none), else None."""
    if not search.project_ids:
        return None
    return (
        f"project {search.project_ids[0]!r} cannot be listed: this self-hosted job has no projects; "
        "omit project_ids to search every checkpoint you may read"
    )


def _created(record: CheckpointRecord) -> datetime:
    # microseconds, as the cursor carries it: a float's finer digits would never compare equal
    return datetime.fromtimestamp(record.created_at, tz=UTC)


def _order_key(record: CheckpointRecord) -> tuple[datetime, str]:
    return _created(record), record.tinker_path


def _owned_as_asked(record: CheckpointRecord, tenant: str, owner: Any) -> bool:
    if isinstance(owner, OwnOwner):
        return record.tenant == tenant
    if isinstance(owner, UserOwner):
        return record.tenant in owner.owner_urns
    return True  # accessible: everything the caller may read (the caller filtered that)


def matches(record: CheckpointRecord, tenant: str, search: CheckpointSearch) -> bool:
    metadata = record.user_metadata or {}
    return (
        _owned_as_asked(record, tenant, search.owner)
        and all(metadata.get(key) == value for key, value in search.user_metadata.items())
        and (search.checkpoint_type is None or record.checkpoint_type == search.checkpoint_type)
        and (search.base_models is None or record.base_model in search.base_models)
    )


def search_page(
    readable: Iterable[CheckpointRecord], tenant: str, search: CheckpointSearch
) -> tuple[list[CheckpointRecord], SearchCursor | None]:
    """(this page's checkpoints newest first, the cursor of the next page or None after the last)."""
    found = sorted((r for r in readable if matches(r, tenant, search)), key=_order_key, reverse=True)
    if search.cursor is not None:
        after = (search.cursor.last_created_at, search.cursor.last_checkpoint_uuid)
        found = [r for r in found if _order_key(r) < after]
    page = found[: search.limit]
    if len(found) <= search.limit:
        return page, None
    last = page[-1]
    return page, SearchCursor(last_created_at=_created(last), last_checkpoint_uuid=last.tinker_path)
