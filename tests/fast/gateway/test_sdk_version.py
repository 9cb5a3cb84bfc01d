"""The tinker SDK version window (miles/gateway/sdk_version.py): the rules on plain data, then through the
gateway with the real SDK: an old SDK is refused with a 400 naming the version to install, an SDK other
than the tested one is served with the hosted service's deprecation headers, which the SDK logs."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
import tinker

from miles.gateway.sdk_version import MINIMUM, TESTED, sdk_verdict
from tests.fast.gateway.runtime_double import DoubleRuntime, double_app
from tests.fast.local_gateway import local_gateway

KEY = "tml-sdk-version-0001"


def test_the_window_refuses_pre_protobuf_sdks_and_notes_other_minors() -> None:
    assert sdk_verdict(None) == sdk_verdict(str(TESTED)) == sdk_verdict(f"{TESTED.major}.{TESTED.minor}.7")
    assert sdk_verdict(str(TESTED)).note is None and sdk_verdict(str(TESTED)).refusal is None
    old = sdk_verdict("0.24.9")
    assert old.refusal is not None and f">= {MINIMUM}" in old.refusal and f"tinker=={TESTED}" in old.refusal
    assert "older than this gateway's" in (sdk_verdict(str(MINIMUM)).note or "")
    assert "newer than this gateway's" in (sdk_verdict("0.40.1").note or "")
    assert "unreadable" in (sdk_verdict("not-a-version").note or "")


async def test_through_the_app_an_old_sdk_gets_400_and_another_minor_a_deprecation_note(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    app = double_app(tmp_path, DoubleRuntime(tokenizer_path=str(tiny_model_dir)), {KEY: "alpha"})
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        body = {"tags": []}
        r = await client.post(
            "/api/v1/create_session",
            json=body,
            headers={"X-API-Key": KEY, "X-Stainless-Package-Version": "0.20.0"},
        )
        assert r.status_code == 400 and f"tinker=={TESTED}" in r.json()["detail"]
        r = await client.post(
            "/api/v1/create_session",
            json=body,
            headers={"X-API-Key": KEY, "X-Stainless-Package-Version": "0.36.2"},
        )
        assert r.status_code == 200 and r.headers["x-deprecation-level"] == "warning"
        assert "older than this gateway's" in r.headers["x-deprecation-note"]
        r = await client.post(
            "/api/v1/create_session",
            json=body,
            headers={"X-API-Key": KEY, "X-Stainless-Package-Version": str(TESTED)},
        )
        assert r.status_code == 200 and "x-deprecation-note" not in r.headers
        r = await client.get(
            "/v1/models", headers={"Authorization": f"Bearer {KEY}", "X-Stainless-Package-Version": "0.1"}
        )
        assert r.status_code == 200, "the OpenAI routes are not the SDK's"
    await app.state.gateway.ops.close()


def test_the_real_sdk_logs_the_note_of_a_gateway_that_tests_another_minor(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from packaging.version import Version

    from miles.gateway import sdk_version

    monkeypatch.setattr(sdk_version, "TESTED", Version("0.39.0"))  # as if this gateway were newer
    runtime = DoubleRuntime(tokenizer_path=str(tiny_model_dir))
    with local_gateway(runtime, tmp_path / "ckpt", KEY) as url, caplog.at_level(logging.WARNING):
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        assert service.get_server_capabilities().supported_models
    assert any(
        "Deprecation notice" in r.getMessage() and "older than" in r.getMessage() for r in caplog.records
    )
