"""TrainingService: model records, the ordered training operations, checkpoints and sampler publishing.

Every operation runs as a future in seq_id order per model (`Operations.submit_ordered`); its result is
the Tinker SDK's own response model, as JSON. A model record exists from the create request on, and a
create that fails removes it again; a checkpoint is allocated, written, then committed (or aborted when
the write fails); a sampler snapshot is published to the runtime only once committed. An unnamed sampler
save of a full fine-tuning model writes nothing: it is published as an ephemeral snapshot (the push).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tinker import types as tt

from miles.checkpoints.paths import CheckpointNotFound
from miles.contract.custom_loss import CUSTOM_LOSS
from miles.contract.losses import LOSS_NAMES
from miles.errors import UserError
from miles.gateway.errors import not_found
from miles.gateway.operations import Operation, Operations
from miles.gateway.services.base_models import BaseModels
from miles.gateway.services.custom_losses import CustomLosses
from miles.gateway.services.model_ids import variant_id
from miles.gateway.services.stability import with_recorded_logprobs
from miles.gateway.sessions import (
    Sessions,
    ephemeral_snapshot_id,
    inflight_target_id,
    model_id_for,
    sampler_id_for,
    session_of,
)
from miles.gateway.stages import StageClock
from miles.gateway.tinker import codec
from miles.gateway.tinker.responses import sdk_json
from miles.seam.requests import ForwardBackwardRequest, OptimStepRequest
from miles.seam.runtime import ModelCard, Runtime, SamplerTarget
from miles.state.futures import FutureRecord
from miles.state.records import ModelRecord, ModelRepository, SamplerRecord, SamplerRepository
from miles.types import AdamParams, LoraSpec

Write = Callable[[Path], Awaitable[None]]
# what copy_weights takes as ttl_seconds, as the hosted service documents it: 1 hour to 10 years
COPY_TTL_RANGE_S = (3600, 10 * 365 * 86400)


class TrainingService:
    def __init__(
        self,
        runtime: Runtime,
        base_models: BaseModels,
        models: ModelRepository,
        samplers: SamplerRepository,
        sessions: Sessions,
        checkpoints: Any,  # miles.checkpoints.manager.CheckpointManager
        ops: Operations,
        custom_losses: CustomLosses,
    ) -> None:
        self._runtime = runtime
        self._base_models = base_models
        self._models = models
        self._samplers = samplers
        self._sessions = sessions
        self._checkpoints = checkpoints
        self._ops = ops
        self._custom_losses = custom_losses

    # ----- records ---------------------------------------------------------------------------------------

    async def owned_model(self, tenant: str, model_id: str, *, touch: bool = False) -> ModelRecord:
        if touch:
            model = await self._models.touch_owned(tenant, model_id)
        else:
            model = await self._models.get_owned(tenant, model_id)
        if model is None:
            raise not_found(f"model {model_id!r}")
        if touch and model.copied_from is not None:
            raise UserError(
                f"training run {model_id} holds a copy of {model.copied_from} and cannot be trained or "
                "saved; load its checkpoint with create_training_client_from_state to train on"
            )
        return model

    async def account_refused(self, tenant: str, model_id: str, seq_id: int) -> bool:
        """A request at (model_id, seq_id) was refused before queueing: skip that seq_id in the model's
        order, so the SDK's next request does not wait for it. Only the model's owner can skip its seq_ids."""
        if await self._models.get_owned(tenant, model_id) is None:
            return False
        return self._ops.skip_refused(model_id, seq_id)

    async def _ordered(
        self,
        tenant: str,
        kind: str,
        model_id: str,
        seq_id: int | None,
        key: str | None,
        op: Operation,
        clock: StageClock | None = None,
    ) -> str:
        # A gateway restarted on a persistent store knows the model but has no queue: start at this seq_id.
        first_seq = 0 if self._ops.has_queue(model_id) or seq_id is None else seq_id
        return await self._ops.submit_ordered(
            tenant=tenant,
            kind=kind,
            model_id=model_id,
            seq_id=seq_id,
            idempotency_key=key,
            operation=op,
            first_seq=first_seq,
            clock=clock,
        )

    async def _submit_create(self, tenant: str, record: ModelRecord, key: str | None, op: Operation) -> str:
        """The model record now (so that later requests of the pipeline find it); gone if `op` fails."""
        model_id = record.model_id
        if await self._models.get_owned(tenant, model_id) is None:
            await self._models.save(record)

        async def guarded() -> Any:
            try:
                return await op()
            except BaseException:
                await self._models.delete(model_id)
                raise

        return await self._ops.submit_ordered(
            tenant=tenant,
            kind="CreateModel",
            model_id=model_id,
            seq_id=0,
            idempotency_key=key,
            operation=guarded,
        )

    # ----- models ----------------------------------------------------------------------------------------

    async def create_model(
        self,
        tenant: str,
        session_id: str,
        model_seq_id: int,
        base_model: str,
        lora: LoraSpec | None,
        user_metadata: dict[str, Any] | None,
        key: str | None,
    ) -> tuple[str, str]:
        """(request_id, model_id) of a new model of an active session; `lora` None: full fine-tuning."""
        card, context = self._base_models.resolve(base_model, for_training=True)
        _check_train_mode(card, lora)
        await self._sessions.require_active(tenant, session_id)
        model_id = model_id_for(session_id, model_seq_id)

        async def op() -> dict[str, Any]:
            await self._runtime.create_model(model_id, card.name, lora)
            return sdk_json(tt.CreateModelResponse(model_id=model_id))

        record = new_model_record(tenant, model_id, card.name, lora, user_metadata, context)
        request_id = await self._submit_create(tenant, record, key, op)
        return request_id, model_id

    async def create_from_checkpoint(
        self,
        tenant: str,
        session_id: str,
        model_seq_id: int,
        tinker_path: str,
        with_optimizer: bool,
        key: str | None,
    ) -> tuple[str, str]:
        """(request_id, model_id) of a new model loaded from a checkpoint (its base model and rank)."""
        await self._sessions.require_active(tenant, session_id)
        model_id = model_id_for(session_id, model_seq_id)
        try:
            _, info = await self._checkpoints.locate_readable(tenant, tinker_path)
        except CheckpointNotFound as exc:
            raise not_found(f"checkpoint {tinker_path!r}") from exc
        if info.base_model is None:
            raise UserError(f"checkpoint {tinker_path} does not record its base model")
        base_model: str = info.base_model
        lora = LoraSpec(rank=info.lora_rank) if info.is_lora and info.lora_rank else None

        async def op() -> dict[str, Any]:
            path = await self._weights_dir(tenant, tinker_path)
            await self._runtime.create_model(model_id, base_model, lora)
            with self._checkpoints.pinned(tinker_path):
                await self._runtime.load_state(model_id, path, with_optimizer)
            return sdk_json(tt.LoadWeightsResponse(path=tinker_path, model_id=model_id, type="load_weights"))

        request_id = await self._submit_create(
            tenant, new_model_record(tenant, model_id, base_model, lora, None), key, op
        )
        return request_id, model_id

    async def unload_model(self, tenant: str, model_id: str, key: str | None) -> str:
        await self.owned_model(tenant, model_id)

        async def op() -> dict[str, Any]:
            await self._runtime.release_model(model_id)
            await self._models.delete(model_id)
            return sdk_json(tt.UnloadModelResponse(model_id=model_id, type="unload_model"))

        return await self._ordered(tenant, "UnloadModel", model_id, None, key, op)

    async def copy_weights(
        self,
        tenant: str,
        source_path: str,
        *,
        session_id: str | None,
        model_seq_id: int | None,
        project_id: str | None,
        ttl_seconds: int | None,
        key: str | None,
    ) -> str:
        """The tinker path of a copy of a readable checkpoint in a new training run of the caller's (in
        `session_id` at `model_seq_id`, else in a session of its own), sharing the source's files. The same
        idempotency key answers the same copy."""
        if ttl_seconds is not None and not COPY_TTL_RANGE_S[0] <= ttl_seconds <= COPY_TTL_RANGE_S[1]:
            raise UserError(f"ttl_seconds must be between 3600 (1 hour) and 10 years, got {ttl_seconds}")
        try:
            source_dir, source = await self._checkpoints.locate_readable(tenant, source_path)
        except CheckpointNotFound as exc:
            raise not_found(f"checkpoint {source_path!r}") from exc
        if source.kind == "external_weights":
            raise UserError(
                f"{source_path} is an external weights export; copy a weights or sampler checkpoint"
            )
        model_id = await self._copy_destination(tenant, session_id, model_seq_id, key)
        lora = LoraSpec(rank=source.lora_rank) if source.is_lora and source.lora_rank else None
        metadata = {"project_id": project_id} if project_id else None
        record = new_model_record(tenant, model_id, source.base_model or "", lora, metadata)
        # created atomically: of two requests for one copy (a retry racing the first), one makes it
        if not await self._models.create(record.model_copy(update={"copied_from": source.tinker_path})):
            existing = await self._models.get_owned(tenant, model_id)
            if existing is not None and existing.copied_from == source.tinker_path:
                return f"tinker://{model_id}/{source.kind}/{source.name}"  # a retry of this copy
            raise UserError(f"training run {model_id} exists; copy into another model_seq_id")
        try:
            with self._checkpoints.pinned(source.tinker_path):
                info = await self._checkpoints.copy(
                    source_dir, source, tenant, model_id, ttl_seconds=ttl_seconds
                )
        except BaseException:
            await self._models.delete(model_id)
            raise
        return info.tinker_path

    async def _copy_destination(
        self, tenant: str, session_id: str | None, model_seq_id: int | None, key: str | None
    ) -> str:
        if session_id is not None or model_seq_id is not None:
            if session_id is None or model_seq_id is None:
                raise UserError("copy_weights takes session_id and model_seq_id together")
            await self._sessions.require_active(tenant, session_id)
            return model_id_for(session_id, model_seq_id)
        # no projects here: the copy gets a session id of its own, derived from the idempotency key
        seed = f"{tenant}\0{key}".encode() if key else uuid.uuid4().bytes
        return model_id_for(f"copy-{hashlib.sha256(seed).hexdigest()[:20]}", 0)

    # ----- training --------------------------------------------------------------------------------------

    async def forward_backward(
        self,
        tenant: str,
        call: codec.ForwardBackwardCall,
        key: str | None,
        clock: StageClock | None = None,
    ) -> str:
        """`clock`: the stage timings the route started (dispatch, compute and encode are marked here)."""
        clock = clock or StageClock()
        model = await self.owned_model(tenant, call.model_id, touch=True)

        async def own_future(request_id: str) -> FutureRecord | None:
            return await self._ops.futures.get_owned(tenant, request_id)

        async def op() -> bytes:
            if call.loss_fn not in (*LOSS_NAMES, CUSTOM_LOSS):
                raise UserError(
                    f"loss_fn {call.loss_fn!r} is not supported; use one of {', '.join(LOSS_NAMES)}, or "
                    f"{CUSTOM_LOSS!r} with a loss from create_custom_loss"
                )
            if not call.data:
                raise UserError("forward_backward needs at least one datum")
            check_context(model, call.data)  # in the queue, like every refusal here: the order goes on
            request: ForwardBackwardRequest = call
            if call.loss_fn == CUSTOM_LOSS:  # the trainer gets the stored program, never the loss id
                program = await self._custom_losses.program_for(tenant, model, call.loss_config)
                request = replace(call, loss_config={"program": program})
            if call.loss_fn == "stable_reinforce" and any(spans is not None for spans in call.loss_spans):
                data = await with_recorded_logprobs(call.data, call.loss_spans, own_future)
                request = replace(call, data=data)
            clock.mark("prepare")
            out = await self._runtime.forward_backward(request)
            clock.mark("dispatch")
            # the gateway waited for the slowest rank; each rank's own time goes to the session trace
            clock.ranks_ns = out.rank_compute_ns
            clock.split("dispatch", "compute", max(out.rank_compute_ns, default=out.compute_ns))
            encoded = codec.encode_forward_backward_output(out)
            clock.mark("encode")
            return encoded

        kind = "Forward" if call.forward_only else "ForwardBackward"
        return await self._ordered(tenant, kind, call.model_id, call.seq_id, key, op, clock)

    async def optim_step(
        self, tenant: str, model_id: str, seq_id: int | None, adam: AdamParams, key: str | None
    ) -> str:
        await self.owned_model(tenant, model_id, touch=True)

        async def op() -> dict[str, Any]:
            metrics = await self._runtime.optim_step(OptimStepRequest(model_id, adam))
            response = tt.OptimStepResponse(metrics={k: float(v) for k, v in (metrics or {}).items()})
            return sdk_json(response, type="optim_step")

        return await self._ordered(tenant, "OptimStep", model_id, seq_id, key, op)

    # ----- checkpoints -----------------------------------------------------------------------------------

    async def _write_checkpoint(self, handle: Any, write: Write, metadata: dict[str, Any]) -> str:
        """Write into the allocated directory, then commit it; abort it (and re-raise) if writing fails."""
        try:
            await write(handle.path)
        except BaseException:
            await self._checkpoints.abort(handle)
            raise
        await self._checkpoints.commit(handle, metadata)
        return handle.tinker_path

    async def save_weights(
        self,
        tenant: str,
        model_id: str,
        seq_id: int | None,
        name: str | None,
        *,
        overwrite: bool,
        ttl_seconds: int | None,
        key: str | None,
        user_metadata: dict[str, str] | None = None,
    ) -> str:
        model = await self.owned_model(tenant, model_id, touch=True)

        async def op() -> dict[str, Any]:
            handle = await self._checkpoints.allocate(
                tenant, model_id, "weights", name, overwrite=overwrite, ttl_seconds=ttl_seconds
            )

            async def write(path: Path) -> None:
                await self._runtime.save_state(model_id, path, True)

            metadata = _commit_metadata(model, True, user_metadata)
            path = await self._write_checkpoint(handle, write, metadata)
            return sdk_json(tt.SaveWeightsResponse(path=path, type="save_weights"))

        return await self._ordered(tenant, "SaveWeights", model_id, seq_id, key, op)

    async def save_for_sampler(
        self,
        tenant: str,
        model_id: str,
        seq_id: int | None,
        name: str | None,
        sampling_session_seq_id: int | None,
        key: str | None,
        kind: str = "snapshot",
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> str:
        """Save a sampler snapshot, publish it to the runtime; with a seq id, open a sampler on it.

        kind "inflight": the save also becomes its model's inflight target, and the opened sampler follows
        that target (this save, then every later inflight save of the model) instead of this snapshot.

        An unnamed save of a full fine-tuning model is ephemeral: the engines get the trainer's weights by
        the push, never from files, so nothing is written and no checkpoint is made; the sampler names the
        pushed weights by an id (`ephemeral_snapshot_id`), and the answer has no path. A LoRA model's
        engines load the adapter from its files, so its unnamed saves are written as before."""
        model = await self.owned_model(tenant, model_id, touch=True)
        if name is None and sampling_session_seq_id is None:
            raise UserError("save_weights_for_sampler needs a path (name) or a sampling_session_seq_id")
        if kind not in ("snapshot", "inflight"):
            raise UserError(f"save_weights_for_sampler kind must be 'snapshot' or 'inflight', got {kind!r}")
        inflight = kind == "inflight"
        clock = StageClock()  # the push (or adapter load) it made, for the session trace

        async def op() -> dict[str, Any]:
            path: str | None = None
            ephemeral: str | None = None
            if name is None and sampling_session_seq_id is not None and self._pushes_weights(model):
                ephemeral = ephemeral_snapshot_id(model.model_id, sampling_session_seq_id)
                await self._publish_ephemeral(model, ephemeral, clock)
            else:
                path = await self._save_snapshot(tenant, model, name, ttl_seconds, user_metadata, clock)
            if inflight:  # saves of one model run in seq_id order, so the target only moves forward
                pointer = _sampler_record(tenant, inflight_target_id(model.model_id), model, path, ephemeral)
                await self._samplers.save(pointer.model_copy(update={"inflight": True}))
            sampler_id = None
            if sampling_session_seq_id is not None:
                sampler_id = sampler_id_for(model.session_id, sampling_session_seq_id)
                record = _sampler_record(tenant, sampler_id, model, path, ephemeral)
                await self._samplers.save(record.model_copy(update={"inflight": inflight}))
            answer: dict[str, Any] = {} if path is None else {"path": path}
            if sampler_id is not None:
                answer["sampling_session_id"] = sampler_id
            response = tt.SaveWeightsForSamplerResponseInternal(type="save_weights_for_sampler", **answer)
            return sdk_json(response)

        return await self._ordered(tenant, "SaveWeightsForSampler", model_id, seq_id, key, op, clock)

    async def save_external(
        self,
        tenant: str,
        model_id: str,
        seq_id: int | None,
        name: str,
        *,
        ttl_seconds: int | None,
        key: str | None,
    ) -> str:
        """A merged HF safetensors export at tinker://model_id/external_weights/name (downloadable)."""
        model = await self.owned_model(tenant, model_id, touch=True)

        async def op() -> dict[str, Any]:
            handle = await self._checkpoints.allocate(
                tenant, model_id, "external_weights", name, ttl_seconds=ttl_seconds
            )

            async def write(path: Path) -> None:
                await self._runtime.save_external(model_id, path)

            path = await self._write_checkpoint(handle, write, _commit_metadata(model, False))
            size = (await self._checkpoints.info(tenant, path)).size_bytes
            response = tt.SaveWeightsExternalResponseInternal(
                path=path, size_bytes=size, type="save_weights_external"
            )
            return sdk_json(response)

        return await self._ordered(tenant, "SaveWeightsExternal", model_id, seq_id, key, op)

    async def _save_snapshot(
        self,
        tenant: str,
        model: ModelRecord,
        name: str | None,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
        clock: StageClock | None = None,
    ) -> str:
        handle = await self._checkpoints.allocate(
            tenant, model.model_id, "sampler_weights", name, ttl_seconds=ttl_seconds
        )
        metadata = _commit_metadata(model, False, user_metadata)
        try:
            written = await self._runtime.save_for_sampler(model.model_id, handle.path)
        except BaseException:
            await self._checkpoints.abort(handle)
            raise
        if written is None:
            await self._checkpoints.commit(handle, metadata)
        else:  # a full-weight snapshot taken, its files written behind: committed when they are whole
            self._checkpoints.commit_behind(handle, metadata, written)
        path = handle.tinker_path
        # engines load the committed, immutable directory (never the staging one the files were written to)
        snapshot = SamplerTarget(model.base_model, snapshot_path=handle.final_path, snapshot_id=path)
        timeline = await self._runtime.publish_sampler(model.model_id, snapshot)
        if clock is not None:
            clock.parts.extend(timeline or ())
        return path

    def _pushes_weights(self, model: ModelRecord) -> bool:
        """The runtime serves `model`'s sampler snapshots by pushing the trainer's weights (the job's
        model.train_mode is full), never reading their files."""
        card = self._base_models.cards().get(model.base_model)
        return card is not None and card.train_mode == "full"

    async def _publish_ephemeral(
        self, model: ModelRecord, snapshot_id: str, clock: StageClock | None = None
    ) -> None:
        """The trainer's weights to the engines under `snapshot_id`, with no files (full fine-tuning)."""
        target = SamplerTarget(model.base_model, snapshot_id=snapshot_id, ephemeral=True)
        timeline = await self._runtime.publish_sampler(model.model_id, target)
        if clock is not None:
            clock.parts.extend(timeline or ())

    async def _weights_dir(self, tenant: str, tinker_path: str) -> Path:
        try:
            path, info = await self._checkpoints.locate_readable(tenant, tinker_path)
        except CheckpointNotFound as exc:
            raise UserError(f"checkpoint {tinker_path!r} not found (or not yours and not published)") from exc
        if info.kind != "weights":
            what = "a sampler snapshot" if info.kind == "sampler_weights" else "an external weights export"
            raise UserError(f"{tinker_path} is {what}; load a tinker://.../weights/... checkpoint")
        return path

    async def load_weights(
        self, tenant: str, model_id: str, seq_id: int | None, tinker_path: str, with_optimizer: bool, key
    ) -> str:
        await self.owned_model(tenant, model_id, touch=True)

        async def op() -> dict[str, Any]:
            path = await self._weights_dir(tenant, tinker_path)
            with self._checkpoints.pinned(tinker_path):
                await self._runtime.load_state(model_id, path, with_optimizer)
            return sdk_json(tt.LoadWeightsResponse(path=tinker_path, model_id=model_id, type="load_weights"))

        return await self._ordered(tenant, "LoadWeights", model_id, seq_id, key, op)


def _check_train_mode(card: ModelCard, lora: LoraSpec | None) -> None:
    """The preset decides how a job trains (model.train_mode); the client's request must match it."""
    if card.train_mode == "full" and lora is not None:
        raise UserError(
            f"this job fully fine-tunes {card.name} (preset model.train_mode: full); create the training "
            "client with rank=0 to train the whole model, or use a job whose train_mode is lora"
        )
    cap = card.max_lora_rank
    if lora is not None and cap is not None and lora.rank > cap:
        raise UserError(
            f"LoRA rank {lora.rank} is above this job's maximum {cap} for {card.name} (preset "
            f"model.lora_rank, the rank the engines are started for); use a rank <= {cap}"
        )
    if card.train_mode != "full" and lora is None:
        raise UserError(
            f"this job trains LoRA adapters on {card.name} (preset model.train_mode: {card.train_mode}); "
            "rank=0 (full fine-tuning) needs a job whose train_mode is full: pass a rank >= 1"
        )


def new_model_record(
    tenant: str,
    model_id: str,
    base_model: str,
    lora: LoraSpec | None,
    user_metadata: dict[str, Any] | None,
    max_context: int | None = None,
) -> ModelRecord:
    now = time.time()
    return ModelRecord(
        model_id=model_id,
        tenant=tenant,
        session_id=session_of(model_id),
        base_model=base_model,
        is_lora=lora is not None,
        lora_rank=None if lora is None else lora.rank,
        train_mode="lora" if lora is not None else "full",
        created_at=now,
        last_request_time=now,
        user_metadata=user_metadata or {},
        max_context=max_context,
    )


def check_context(model: ModelRecord, data: Any) -> None:
    """A model created as `<base>:peft:<context>` trains on sequences of at most that many tokens."""
    limit = model.max_context
    if limit is None:
        return
    for index, datum in enumerate(data):
        if len(datum.model_input) > limit:
            raise UserError(
                f"datum {index} has {len(datum.model_input)} input tokens; model {model.model_id} was "
                f"created as {variant_id(model.base_model, limit)}, which takes at most {limit}"
            )


def _sampler_record(
    tenant: str, sampler_id: str, model: ModelRecord, path: str | None, ephemeral: str | None
) -> SamplerRecord:
    """A sampler on a saved snapshot (`path`), or on an ephemeral one (`ephemeral`, its id)."""
    return SamplerRecord(
        sampling_session_id=sampler_id,
        tenant=tenant,
        base_model=model.base_model,
        created_at=time.time(),
        session_id=model.session_id,
        model_id=model.model_id,
        model_path=path,
        ephemeral_snapshot=ephemeral,
    )


def _commit_metadata(
    model: ModelRecord, has_optimizer: bool, user_metadata: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "has_optimizer": has_optimizer,
        "base_model": model.base_model,
        "is_lora": model.is_lora,
        "lora_rank": model.lora_rank,
        "user_metadata": user_metadata or None,
    }
