"""Stand-ins for a bundle's `campplus.onnx` and `speech_tokenizer_v3.onnx`, built with `onnx.helper`.

Our test bundles cannot ship the real third-party models, so these small graphs keep upstream's I/O
contract (as `CosyVoiceFrontEnd._extract_spk_embedding` and `_extract_speech_token` call them) with
deterministic random weights:

- `campplus.onnx`: input `input` float32 (B, T, 80) Kaldi fbank -> float32 (B, 192) speaker embedding.
  Frame-wise `tanh` projection, mean over time, linear projection: the nonlinearity matters because the
  frontend subtracts the per-utterance mean from the fbank, so a plain time average would be constant.
- `speech_tokenizer_v3.onnx`: inputs `feats` float32 (1, 128, T) whisper log-mel and `feats_length` int32
  (1,) -> int32 (1, N) tokens in [0, 6561), N = ceil(ceil(T / 2) / 2), from two stride-2 convolutions
  (kernel 3, padding 1) and an argmax over a 6561-way projection. `feats_length` is accepted and unused
  (batch 1 has no padding to mask).

The input names are the ones third-party tooling reports for the real files; the real output names are
unknown (no source we could check names them), so ours (`embedding`, `indices`) are placeholders and
consumers must address outputs by position, as upstream does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .layout import CAMPPLUS, SPEECH_TOKENIZER

OPSET = 17
IR_VERSION = 8  # the lowest IR that carries opset 17, so older onnxruntime releases load the files too

FBANK_BINS = 80
SPEAKER_DIM = 192
WHISPER_MELS = 128
SPEECH_CODEBOOK = 6561

_CAMPPLUS_HIDDEN = 128
_TOKENIZER_CHANNELS = 64


def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...], fan_in: int) -> onnx.TensorProto:
    """Gaussian float32 weights scaled by 1/sqrt(fan_in), so activations stay of order one."""
    return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32), name)


def _model(graph: onnx.GraphProto, role: str, seed: int) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="cosyvoice_export.bundle.standin_onnx")
    model.ir_version = IR_VERSION
    model.doc_string = f"Stand-in for upstream's {role} with random weights; address outputs by position."
    helper.set_model_props(model, {"stand_in": "true", "seed": str(seed)})
    onnx.checker.check_model(model, full_check=True)
    return model


def campplus_standin(seed: int = 0) -> onnx.ModelProto:
    """The `campplus.onnx` stand-in: (B, T, 80) float32 -> (B, 192) float32."""
    rng = np.random.default_rng([seed, 1])
    nodes = [
        helper.make_node("MatMul", ["input", "w_frame"], ["frame_proj"]),  # (B, T, H)
        helper.make_node("Add", ["frame_proj", "b_frame"], ["frame_pre"]),
        helper.make_node("Tanh", ["frame_pre"], ["frame_act"]),
        helper.make_node("ReduceMean", ["frame_act"], ["pooled"], axes=[1], keepdims=0),  # (B, H)
        helper.make_node("MatMul", ["pooled", "w_out"], ["out_proj"]),
        helper.make_node("Add", ["out_proj", "b_out"], ["embedding"]),  # (B, 192)
    ]
    graph = helper.make_graph(
        nodes, "campplus_standin",
        inputs=[helper.make_tensor_value_info("input", TensorProto.FLOAT, ["B", "T", FBANK_BINS])],
        outputs=[helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["B", SPEAKER_DIM])],
        initializer=[
            _init(rng, "w_frame", (FBANK_BINS, _CAMPPLUS_HIDDEN), FBANK_BINS),
            _init(rng, "b_frame", (_CAMPPLUS_HIDDEN,), FBANK_BINS),
            _init(rng, "w_out", (_CAMPPLUS_HIDDEN, SPEAKER_DIM), _CAMPPLUS_HIDDEN),
            _init(rng, "b_out", (SPEAKER_DIM,), _CAMPPLUS_HIDDEN),
        ],
    )
    return _model(graph, CAMPPLUS, seed)


def speech_tokenizer_standin(seed: int = 0) -> onnx.ModelProto:
    """The `speech_tokenizer_v3.onnx` stand-in: (1, 128, T) float32 + (1,) int32 -> (1, ceil(T/4)) int32."""
    rng = np.random.default_rng([seed, 2])
    c = _TOKENIZER_CHANNELS
    def conv(inputs: list[str], output: str) -> onnx.NodeProto:
        return helper.make_node("Conv", inputs, [output], kernel_shape=[3], strides=[2], pads=[1, 1])

    nodes = [
        conv(["feats", "w_conv1", "b_conv1"], "conv1"),  # (1, C, ceil(T/2))
        helper.make_node("Tanh", ["conv1"], ["act1"]),
        conv(["act1", "w_conv2", "b_conv2"], "conv2"),  # (1, C, N)
        helper.make_node("Tanh", ["conv2"], ["act2"]),
        helper.make_node("Transpose", ["act2"], ["frames"], perm=[0, 2, 1]),  # (1, N, C)
        helper.make_node("MatMul", ["frames", "w_codebook"], ["logits"]),  # (1, N, 6561)
        helper.make_node("ArgMax", ["logits"], ["indices_i64"], axis=2, keepdims=0),
        helper.make_node("Cast", ["indices_i64"], ["indices"], to=TensorProto.INT32),  # (1, N)
    ]
    graph = helper.make_graph(
        nodes, "speech_tokenizer_v3_standin",
        inputs=[
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, WHISPER_MELS, "T"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
        ],
        outputs=[helper.make_tensor_value_info("indices", TensorProto.INT32, [1, "N"])],
        initializer=[
            _init(rng, "w_conv1", (c, WHISPER_MELS, 3), WHISPER_MELS * 3),
            _init(rng, "b_conv1", (c,), WHISPER_MELS * 3),
            _init(rng, "w_conv2", (c, c, 3), c * 3),
            _init(rng, "b_conv2", (c,), c * 3),
            _init(rng, "w_codebook", (c, SPEECH_CODEBOOK), c),
        ],
    )
    return _model(graph, SPEECH_TOKENIZER, seed)


def write_standin_onnx(model_dir: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write both stand-ins into `model_dir`; returns (campplus path, speech tokenizer path)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    campplus, tokenizer = model_dir / CAMPPLUS, model_dir / SPEECH_TOKENIZER
    onnx.save(campplus_standin(seed), str(campplus))
    onnx.save(speech_tokenizer_standin(seed), str(tokenizer))
    return campplus, tokenizer
