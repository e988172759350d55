"""`cosyvoice-export check-bundle`: is a model directory complete, readable and of the right shapes?"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import onnx

from cosyvoice_runtime.errors import FrontendError
from cosyvoice_runtime.frontend import read_prompt_audio

from ..manifest import NETWORKS
from .checkpoint import read_pickled_dict
from .errors import BundleError
from .layout import CAMPPLUS, LLM_VARIANTS, PROMPT_WAV, SPEECH_TOKENIZER, SPK2INFO, YAML
from .model_dir import ModelBundle
from .tokenizer_files import TOKENIZER_FILES, load_cosyvoice3_tokenizer

EOP_TOKEN = "<|endofprompt|>"


def _onnx_io(path: Path) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    if not path.is_file():
        raise BundleError(f"{path}: file not found")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError and friends with no common base
        raise BundleError(f"{path}: not a readable ONNX model ({type(e).__name__})") from None
    return list(model.graph.input), list(model.graph.output)


def _rank(v: onnx.ValueInfoProto) -> int:
    return len(v.type.tensor_type.shape.dim)


def _dim_fits(v: onnx.ValueInfoProto, i: int, size: int) -> bool:
    """Dim `i` is `size` or left symbolic (a real export may not pin it)."""
    d = v.type.tensor_type.shape.dim[i]
    return not d.HasField("dim_value") or d.dim_value == size


def check_campplus(path: Path, mel_bins: int = 80) -> str:
    """Upstream feeds input 0 a float32 (1, T, 80) fbank and flattens output 0 to 192 values."""
    inputs, outputs = _onnx_io(path)
    if len(inputs) != 1 or _rank(inputs[0]) != 3 or not _dim_fits(inputs[0], 2, mel_bins):
        found = ", ".join(f"{i.name} rank {_rank(i)}" for i in inputs)
        raise BundleError(f"{path}: expected one input of shape (B, T, {mel_bins}), found {found}")
    if inputs[0].type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
        raise BundleError(f"{path}: input {inputs[0].name} must be float32")
    if not outputs:
        raise BundleError(f"{path}: has no outputs; expected a speaker embedding")
    return f"input {inputs[0].name}, output {outputs[0].name}"


def check_speech_tokenizer(path: Path, n_mels: int = 128) -> str:
    """Upstream feeds input 0 float32 (1, 128, T) log-mels and input 1 an int32 length."""
    inputs, outputs = _onnx_io(path)
    if len(inputs) != 2:
        raise BundleError(f"{path}: expected 2 inputs (features, length), found {len(inputs)}")
    feats, length = inputs
    if _rank(feats) != 3 or not _dim_fits(feats, 1, n_mels):
        raise BundleError(f"{path}: input {feats.name} must have shape (1, {n_mels}, T)")
    if length.type.tensor_type.elem_type != onnx.TensorProto.INT32:
        raise BundleError(f"{path}: input {length.name} must be int32")
    if not outputs:
        raise BundleError(f"{path}: has no outputs; expected speech token ids")
    return f"inputs {feats.name}, {length.name}, output {outputs[0].name}"


def check_prompt_wav(path: Path) -> str:
    """The demo prompt as the runtime reads it (`read_prompt_audio`): a recording it refuses would be copied
    into every runtime bundle and fail there at the first synthesis."""
    try:
        audio = read_prompt_audio(path)
    except FrontendError as e:
        raise BundleError(str(e)) from None
    return f"{audio.samples.shape[0] / audio.sample_rate:.2f} s at {audio.sample_rate} Hz"


def check_bundle(root: Path, report: Callable[[str], None] = print,
                 llm_checkpoints: Sequence[str] = LLM_VARIANTS["base"]) -> ModelBundle:
    """Check every file of the model directory at `root`; raise `BundleError` on the first problem.

    `report` receives one line per file that passed. `llm_checkpoints` are the files checked against the
    LLM's keys (a value of `LLM_VARIANTS`: `llm.pt`, `llm.rl.pt` or both).
    """
    bundle = ModelBundle.open(root)
    cfg = bundle.config
    report(f"ok  {YAML}: llm {cfg.llm.qwen.num_hidden_layers} layers x {cfg.llm.qwen.hidden_size}, "
           f"DiT {cfg.flow.dit.depth} x {cfg.flow.dit.dim}, HiFT {cfg.hift.base_channels} channels")

    for name in TOKENIZER_FILES:
        if not (bundle.qwen_dir / name).is_file():
            raise BundleError(f"{bundle.qwen_dir / name}: file not found")
    tok = load_cosyvoice3_tokenizer(bundle.qwen_dir)
    if len(tok) > cfg.llm.qwen.vocab_size:
        raise BundleError(f"{bundle.qwen_dir}: tokenizer has {len(tok)} ids but config.json vocab_size is "
                          f"{cfg.llm.qwen.vocab_size}")
    report(f"ok  {bundle.qwen_dir.name}/: {len(tok)} text ids, {EOP_TOKEN} = {tok.token_id(EOP_TOKEN)}")
    if (root / PROMPT_WAV).exists():
        report(f"ok  {PROMPT_WAV}: {check_prompt_wav(root / PROMPT_WAV)}")

    for name in NETWORKS:
        for path in ([root / f for f in llm_checkpoints] if name == "llm" else [bundle.checkpoint(name)]):
            state = bundle.read_checked_state(name, path)
            dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values()})
            values = sum(t.numel() for t in state.values())
            report(f"ok  {path.name}: {len(state)} tensors, {values:,} values, {'/'.join(dtypes)}")

    report(f"ok  {CAMPPLUS}: {check_campplus(root / CAMPPLUS, cfg.feat.num_mels)}")
    report(f"ok  {SPEECH_TOKENIZER}: {check_speech_tokenizer(root / SPEECH_TOKENIZER)}")
    if (root / SPK2INFO).exists():
        speakers = read_pickled_dict(root / SPK2INFO)
        report(f"ok  {SPK2INFO}: {len(speakers)} speakers")
    return bundle
