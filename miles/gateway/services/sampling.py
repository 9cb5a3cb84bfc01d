"""SamplingService: where a sample runs (target resolution) and the limits every sample obeys.

Both APIs sample through here: Tinker's `asample` as a future (`submit`), OpenAI's completions inline
(`sample_now`). Either way at most `max_concurrent_samples` runtime samples run at once on each sampling
lane (the runtime's engines for the target: a catalog instance; one lane for a job of one model), and a
prompt must fit the base model's context.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from miles.checkpoints.paths import CheckpointNotFound
from miles.errors import Category, UpstreamError
from miles.gateway.errors import ApiError, bad_request, not_found
from miles.gateway.operations import Operations
from miles.gateway.sample_slots import SampleSlots
from miles.gateway.services.base_models import BaseModels
from miles.gateway.services.model_ids import variant_id
from miles.gateway.sessions import (
    Sessions,
    inflight_target_id,
    is_ephemeral_snapshot_id,
    sampler_id_for,
    session_of,
)
from miles.gateway.settings import GatewaySettings
from miles.gateway.stages import StageClock
from miles.gateway.traces import Traced
from miles.seam.runtime import Runtime, SamplerTarget, report_sampling_timeout, sampling_lane_of
from miles.state.claims import DedupClaims
from miles.state.records import SamplerRecord, SamplerRepository
from miles.types import LogprobSpec, SampleChunk, SampleOutput, SamplingParams

Encode = Callable[[SampleOutput], bytes]


class SamplingService:
    def __init__(
        self,
        runtime: Runtime,
        base_models: BaseModels,
        checkpoints: Any,  # miles.checkpoints.manager.CheckpointManager
        samplers: SamplerRepository,
        sessions: Sessions,
        ops: Operations,
        settings: GatewaySettings,
    ) -> None:
        self._runtime = runtime
        self._base_models = base_models
        self._checkpoints = checkpoints
        self._samplers = samplers
        self._sessions = sessions
        self._ops = ops
        self.slots = SampleSlots(settings.max_concurrent_samples)

    # ----- where to sample -------------------------------------------------------------------------------

    async def resolve_target(
        self, tenant: str, *, base_model: str | None, model_path: str | None
    ) -> SamplerTarget:
        """A sampler snapshot the caller owns or that is published (404 otherwise), or a sampleable base
        model."""
        if model_path:
            return await self._snapshot_target(tenant, model_path)
        if not base_model:
            raise bad_request("give base_model or model_path")
        card, context = self._base_models.resolve(base_model)
        if not card.sampleable:
            raise bad_request(f"base_model {base_model!r} is not served for sampling")
        return SamplerTarget(base_model=card.name, max_context=context)

    async def _snapshot_target(self, tenant: str, model_path: str) -> SamplerTarget:
        if is_ephemeral_snapshot_id(model_path):
            raise ApiError(
                Category.NOT_FOUND,
                f"sampler weights {model_path!r} were not saved to disk: the unnamed save "
                "(save_weights_and_get_sampling_client) of a full fine-tuning model writes no snapshot, "
                "and only the sampling client it returned samples those weights; save with a name "
                "(save_weights_for_sampler(name)) to keep a snapshot you can open by path",
            )
        try:
            # no files needed: a full-weight snapshot still being written behind its save is served by
            # the engines already (a LoRA snapshot is never written behind: they load its files)
            path, info = await self._checkpoints.locate_readable(tenant, model_path, files=False)
        except CheckpointNotFound as exc:
            raise not_found(f"sampler weights {model_path!r}") from exc
        if info.kind != "sampler_weights":
            raise bad_request(
                f"{model_path} is a training checkpoint; sample from a .../sampler_weights/... path"
            )
        if info.base_model is None:
            raise bad_request(f"{model_path} does not record its base model")
        return SamplerTarget(base_model=info.base_model, snapshot_path=path, snapshot_id=model_path)

    async def owned_sampler(self, tenant: str, sampler_id: str) -> SamplerRecord:
        sampler = await self._samplers.get_owned(tenant, sampler_id)
        if sampler is None:
            raise not_found(f"sampler {sampler_id!r}")
        return sampler

    async def target_of_sampler(self, tenant: str, sampler_id: str) -> SamplerTarget:
        record = await self.owned_sampler(tenant, sampler_id)
        source = record
        if record.inflight and record.model_id is not None:
            # an inflight sampler follows its model's latest inflight save, never an older one
            latest = await self._samplers.get_owned(tenant, inflight_target_id(record.model_id))
            source = latest if latest is not None else record
        if source.ephemeral_snapshot is not None:  # an unnamed full-weight save: nothing to locate
            return SamplerTarget(record.base_model, snapshot_id=source.ephemeral_snapshot, ephemeral=True)
        return await self.resolve_target(tenant, base_model=record.base_model, model_path=source.model_path)

    async def open_sampler(
        self,
        tenant: str,
        session_id: str,
        sampling_session_seq_id: int,
        *,
        base_model: str | None,
        model_path: str | None,
    ) -> str:
        """A sampling session of an active session: its target must resolve now. Its id."""
        await self._sessions.require_active(tenant, session_id)
        target = await self.resolve_target(tenant, base_model=base_model, model_path=model_path)
        sampler_id = sampler_id_for(session_id, sampling_session_seq_id)
        record = SamplerRecord(
            sampling_session_id=sampler_id,
            tenant=tenant,
            base_model=variant_id(target.base_model, target.max_context),  # resolved again on each use
            created_at=time.time(),
            session_id=session_id,
            model_path=model_path,
        )
        await self._samplers.save(record)
        return sampler_id

    # ----- limits and sampling ---------------------------------------------------------------------------

    def check_prompt(self, target: SamplerTarget, prompt: list[int], max_tokens: int | None = None) -> None:
        if not prompt:
            raise bad_request("the prompt is empty")
        card = self._base_models.cards().get(target.base_model)
        if card is not None and len(prompt) >= card.max_context:
            raise bad_request(
                f"prompt has {len(prompt)} tokens; {target.base_model} takes fewer than {card.max_context}"
            )
        limit = target.max_context
        if limit is not None and len(prompt) + (max_tokens or 0) > limit:
            raise bad_request(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens or 0}) exceed the context of "
                f"{variant_id(target.base_model, limit)}; shorten them or use a longer variant"
            )

    def _slot_for(self, target: SamplerTarget) -> contextlib.AbstractAsyncContextManager[None]:
        """One of the `max_concurrent_samples` slots of the lane (the engines) `target` samples on."""
        return self.slots.lane(sampling_lane_of(self._runtime, target))

    async def _sample(
        self, target: SamplerTarget, prompt: list[int], params: SamplingParams, n: int, logprobs: LogprobSpec
    ) -> SampleOutput:
        with self._checkpoints.pinned(_checkpoint_of(target)):
            out = await self._runtime.sample(target, prompt, params, n, logprobs)
        if len(out.sequences) != n:
            raise UpstreamError(f"the runtime returned {len(out.sequences)} samples for {n} requested")
        return out

    async def sample_now(
        self, target: SamplerTarget, prompt: list[int], params: SamplingParams, n: int
    ) -> SampleOutput:
        """Sample inline (OpenAI), after waiting for one of the `max_concurrent_samples` slots."""
        self.check_prompt(target, prompt, params.max_tokens)
        async with self._slot_for(target):
            return await self._sample(target, prompt, params, n, LogprobSpec())

    async def stream_now(
        self, target: SamplerTarget, prompt: list[int], params: SamplingParams, n: int
    ) -> AsyncGenerator[SampleChunk, None]:
        """Stream inline (OpenAI): holds one of the `max_concurrent_samples` slots until the stream ends
        or the caller closes it (which closes the runtime's stream, aborting the generations)."""
        self.check_prompt(target, prompt, params.max_tokens)
        async with self._slot_for(target):
            with self._checkpoints.pinned(_checkpoint_of(target)):
                stream = self._runtime.stream_sample(target, prompt, params, n)
                try:
                    async for chunk in stream:
                        yield chunk
                finally:
                    await stream.aclose()

    async def submit(
        self,
        tenant: str,
        target: SamplerTarget,
        prompt: list[int],
        params: SamplingParams,
        *,
        num_samples: int,
        logprobs: LogprobSpec,
        dedup: tuple[str, int] | None,
        idempotency_key: str | None,
        encode: Encode,
    ) -> str:
        """Sample as a future (Tinker): its request id. `dedup`: (sampling_session_id, seq_id)."""
        self.check_prompt(target, prompt, params.max_tokens)

        clock = StageClock()  # the engine's generation, for the session trace

        async def op() -> bytes:
            out = await self._sample(target, prompt, params, num_samples, logprobs)
            clock.parts.extend(out.timeline)
            return encode(out)

        # the lane is fixed when the sample is admitted: a sample cut at the execution timeout reports the
        # engines it hung on (a catalog job quarantines that instance), not wherever the target points later
        lane = sampling_lane_of(self._runtime, target)
        request_id, _ = await self._ops.submit_concurrent(
            tenant=tenant,
            kind="Sample",
            model_id=None,
            dedup=None if dedup is None else DedupClaims.sample_key(*dedup),
            idempotency_key=idempotency_key,
            operation=op,
            slots=self.slots.lane(lane),
            on_timeout=lambda cause: report_sampling_timeout(self._runtime, lane, cause),
            traced=None if dedup is None else Traced(session_of(dedup[0]), dedup[0]),
            clock=clock,
        )
        return request_id


def _checkpoint_of(target: SamplerTarget) -> str | None:
    """The checkpoint a sample reads (pinned against the TTL sweep meanwhile); an ephemeral snapshot is
    none."""
    return None if target.ephemeral else target.snapshot_id
