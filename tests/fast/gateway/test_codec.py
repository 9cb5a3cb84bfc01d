"""The protobuf codec against the SDK's own encoder/decoder (tinker.proto.request_conv/response_conv)."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
import zstandard
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response
from tinker.types.forward_backward_input import ForwardBackwardInput
from tinker.types.forward_backward_request import ForwardBackwardRequest

from miles.errors import UserError
from miles.gateway.tinker import codec
from miles.types import ForwardBackwardOutput, SampledSequence, SampleOutput


def _request(loss_fn_config=None, forward_only=False, datums=None) -> ForwardBackwardRequest:
    datums = datums or [
        tinker.Datum(
            model_input=tinker.ModelInput(
                chunks=[tinker.EncodedTextChunk(tokens=[1, 2]), tinker.EncodedTextChunk(tokens=[3, 4, 5])]
            ),
            loss_fn_inputs={
                "target_tokens": tinker.TensorData(data=[2, 3, 4, 5, 6], dtype="int64", shape=[5]),
                "weights": tinker.TensorData(data=[0.0, 0.0, 1.0, 1.0, 0.5], dtype="float32", shape=[5]),
            },
        )
    ]
    return ForwardBackwardRequest(
        forward_backward_input=ForwardBackwardInput(
            data=datums, loss_fn="ppo", loss_fn_config=loss_fn_config
        ),
        model_id="s:train:0",
        seq_id=7,
    )


def test_decodes_sdk_request_with_concatenated_chunks_and_v2_config() -> None:
    req = _request(loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    body = forward_backward_request_to_proto(req).SerializeToString()
    call = codec.decode_forward_backward(body)
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 7, "ppo", False)
    assert call.loss_config == pytest.approx({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    (datum,) = call.data
    assert datum.model_input.tolist() == [1, 2, 3, 4, 5]
    assert datum.model_input.dtype == np.int64
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4, 5, 6]
    np.testing.assert_allclose(datum.loss_fn_inputs["weights"], [0, 0, 1, 1, 0.5])


def test_v2_config_wins_over_legacy_and_keeps_strings() -> None:
    msg = forward_backward_request_to_proto(_request())
    msg.loss_fn_config["eps"] = 1.0
    msg.loss_fn_config_v2["eps"].number = 2.0
    msg.loss_fn_config_v2["mode"].text = "token"
    assert codec.decode_forward_backward(msg.SerializeToString()).loss_config == {"eps": 2.0, "mode": "token"}
    legacy_only = forward_backward_request_to_proto(_request())
    legacy_only.loss_fn_config["eps"] = 1.5
    assert codec.decode_forward_backward(legacy_only.SerializeToString()).loss_config == {"eps": 1.5}


def test_sparse_csr_tensor_from_sdk_decodes_to_dense() -> None:
    dense = torch.tensor([[0.0, 1.5, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, 3.0]])
    sparse = dense.to_sparse_csr()
    td = tinker.TensorData(
        data=sparse.values().tolist(),
        dtype="float32",
        shape=[3, 3],
        sparse_crow_indices=sparse.crow_indices().tolist(),
        sparse_col_indices=sparse.col_indices().tolist(),
    )
    datum = tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"weights": td})
    body = forward_backward_request_to_proto(_request(datums=[datum])).SerializeToString()
    out = codec.decode_forward_backward(body).data[0].loss_fn_inputs["weights"]
    np.testing.assert_array_equal(out, dense.numpy())


def test_bad_sparse_indices_and_shapes_are_user_errors() -> None:
    msg = forward_backward_request_to_proto(_request())
    tensor = msg.data[0].loss_fn_inputs["weights"]
    tensor.ClearField("shape")
    tensor.shape.extend([4])
    with pytest.raises(UserError, match="shape"):
        codec.decode_forward_backward(msg.SerializeToString())
    bad = forward_backward_request_to_proto(_request())
    t = bad.data[0].loss_fn_inputs["weights"]
    t.ClearField("shape")
    t.shape.extend([2, 2])
    t.sparse_csr.values = np.array([1.0], dtype="<f4").tobytes()
    t.sparse_csr.crow_indices = np.array([0, 1, 1], dtype="<i8").tobytes()
    t.sparse_csr.col_indices = np.array([5], dtype="<i8").tobytes()
    with pytest.raises(UserError, match="sparse CSR"):
        codec.decode_forward_backward(bad.SerializeToString())
    with pytest.raises(UserError, match="not a ForwardBackwardRequest"):
        codec.decode_forward_backward(b"\xff\xff\xff")


def test_zstd_round_trip_and_unknown_encoding() -> None:
    body = forward_backward_request_to_proto(_request()).SerializeToString()
    packed = zstandard.ZstdCompressor().compress(body)
    assert codec.decompress(packed, "zstd") == body
    assert codec.decompress(body, None) == body
    with pytest.raises(UserError, match="Content-Encoding"):
        codec.decompress(body, "br")
    with pytest.raises(UserError, match="zstd"):
        codec.decompress(b"not zstd", "zstd")


def test_forward_backward_output_decodes_in_sdk_per_datum() -> None:
    out = ForwardBackwardOutput(
        logprobs=[np.array([-1.0, -2.0], np.float32), np.array([-3.0], np.float32)],
        elementwise_loss=[np.array([0.5, 0.25], np.float32), np.array([1.0], np.float32)],
        metrics={"loss:sum": 1.75},
    )
    sdk = deserialize_forward_backward_output(codec.encode_forward_backward_output(out))
    assert sdk.metrics == {"loss:sum": 1.75}
    assert [o["logprobs"].tolist() for o in sdk.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]
    assert sdk.loss_fn_outputs[1]["elementwise_loss"].shape == [1]
    with pytest.raises(ValueError, match="name:reduction"):
        codec.encode_forward_backward_output(
            ForwardBackwardOutput(logprobs=[], elementwise_loss=[], metrics={"loss:sum": 0.0, "bad": 1.0})
        )


def test_soft_target_logprobs_keep_their_k_column_shape_in_the_sdk() -> None:
    """(N, K) soft targets give (N, K) logprobs; the SDK rebuilds each datum's shape from trailing_shape."""
    first, second = np.arange(6, dtype=np.float32).reshape(3, 2) * -1, np.array([[-7.0, -8.0]], np.float32)
    out = ForwardBackwardOutput(
        logprobs=[first, second],
        elementwise_loss=[np.ones(3, np.float32), np.ones(1, np.float32)],
        metrics={"loss:sum": 4.0},
    )
    sdk = deserialize_forward_backward_output(codec.encode_forward_backward_output(out))
    assert sdk.loss_fn_outputs[0]["logprobs"].shape == [3, 2]
    np.testing.assert_array_equal(sdk.loss_fn_outputs[0]["logprobs"].to_numpy(), first)
    np.testing.assert_array_equal(sdk.loss_fn_outputs[1]["logprobs"].to_numpy(), second)
    assert sdk.loss_fn_outputs[1]["elementwise_loss"].shape == [1]


def test_dense_two_dimensional_soft_targets_decode_with_their_shape() -> None:
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={
            "target_tokens": np.array([[3, 4, 5], [6, 7, 8]], np.int64),
            "weights": np.array([[0.5, -0.25, 0.0], [1.0, 0.0, 0.0]], np.float32),
        },
    )
    body = forward_backward_request_to_proto(_request(datums=[datum])).SerializeToString()
    inputs = codec.decode_forward_backward(body).data[0].loss_fn_inputs
    assert inputs["target_tokens"].shape == (2, 3) and inputs["target_tokens"].dtype == np.int64
    np.testing.assert_array_equal(inputs["weights"], [[0.5, -0.25, 0.0], [1.0, 0.0, 0.0]])


def test_sample_output_decodes_with_nan_first_prompt_logprob() -> None:
    out = SampleOutput(
        sequences=[
            SampledSequence(tokens=[5, 6], logprobs=[-0.5, -0.25], stop_reason="stop"),
            SampledSequence(tokens=[7], logprobs=[-1.5], stop_reason="length"),
        ],
        prompt_logprobs=[None, -3.0, -2.0],
    )
    sdk = deserialize_sample_response(codec.encode_sample_output(out))
    assert [s.tokens for s in sdk.sequences] == [[5, 6], [7]]
    assert [s.stop_reason for s in sdk.sequences] == ["stop", "length"]
    assert sdk.sequences[0].logprobs == [-0.5, -0.25]
    assert sdk.prompt_logprobs[0] is None
    assert sdk.prompt_logprobs[1:] == [-3.0, -2.0]
