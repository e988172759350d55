"""`cosyvoice-export speakers`: upstream's `spk2info.pt` speakers into the runtime's speaker registry.

Upstream's `CosyVoice.add_zero_shot_spk(prompt_text, prompt_wav, spk_id)` keeps the front end's model
input for a prompt (`frontend_zero_shot`, less the text to speak) under `spk_id`, and `save_spkinfo`
writes that dict with `torch.save` as `<model_dir>/spk2info.pt`. The runtime never imports torch, so
this command (the exporter has torch) reads the file once and adds each speaker to a registry folder
through `cosyvoice_runtime.speakers.SpeakerRegistry` (atomic files, the front-end fingerprint of the
bundle that will use them); `CosyVoice3` lists them as upstream lists the speakers of `spk2info.pt`, and
`cosyvoice-serve` serves them like speakers registered over HTTP.

A command of its own rather than a step of `cosyvoice-export all`: `spk2info.pt` changes whenever a
speaker is added upstream, independently of the weights, and its speakers belong in the speakers'
registry folder, not in the runtime bundle; as a step of `all` a new speaker would mean an export (and a
new manifest) to carry it, and the runtime would need a second, read-only speaker source.

An entry, as upstream's front end makes it for CosyVoice3, and what it becomes:

- `prompt_text` (1, L) int32: the transcript, its ids decoded with the bundle's tokenizer (special tokens
  such as `<|endofprompt|>` kept) and required to encode back to the same ids, so that the runtime's LLM
  prompt is upstream's (a transcript without `<|endofprompt|>` gets the system prompt in front, as every
  transcript the runtime is given);
- `llm_prompt_speech_token` (1, N) int32: the speech tokens (`flow_prompt_speech_token` must be equal);
- `prompt_speech_feat` (1, ratio * N, 80) float32: the prompt mel, already cut to the token alignment;
- `llm_embedding` (1, 192) float32: the x-vector (`flow_embedding` must be equal).

The `*_len` entries repeat the shapes and are not needed. Float tensors of any precision are read as float32
and must be finite; the ids must be the bundle's (text ids below the tokenizer's size, speech tokens below
the codebook's), so that nothing the registry serves fails or makes noise later.
"""

from __future__ import annotations

import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_runtime.bundle import ModelDims, RuntimeBundle
from cosyvoice_runtime.bundle_source import bundle_front, choose_bundle
from cosyvoice_runtime.frontend import PromptFeatures, TextTokenizer
from cosyvoice_runtime.speakers import SpeakerError, SpeakerRegistry, check_name, frontend_fingerprint

from .bundle.errors import BundleError
from .bundle.model_dir import ModelBundle
from .onnx.dims import model_dims

SPK2INFO = "spk2info.pt"
REQUIRED = ("prompt_text", "llm_prompt_speech_token", "flow_prompt_speech_token", "prompt_speech_feat",
            "llm_embedding", "flow_embedding")
"""The keys a zero-shot speaker's entry must have."""
ZIP_HEAD = b"PK\x03\x04"
"""How `torch.save`'s file begins: a zip archive."""
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C.to_bytes(10, "little")
"""What the first pickle of torch's legacy (not zip) format holds, after the pickle's protocol and framing
(`torch.serialization.MAGIC_NUMBER`, here so that a file is judged before torch loads)."""
TORCH_HEAD_BYTES = 32
"""The bytes of a file's beginning that show it is one of these."""


@dataclass(frozen=True)
class UpstreamSpeaker:
    """One speaker of `spk2info.pt`, as the speaker registry keeps it."""

    name: str
    prompt_text: str
    features: PromptFeatures


def read_spk2info(path: Path, tokenizer: TextTokenizer, dims: ModelDims) -> list[UpstreamSpeaker]:
    """Every speaker of upstream's `spk2info.pt` at `path`, checked; `BundleError` (one line naming the file,
    the speaker and the key) for anything that is not a CosyVoice3 zero-shot speaker."""
    data = _load(path)
    if not isinstance(data, dict) or not data:
        raise BundleError(f"{path}: not upstream's spk2info (a non-empty dict of speaker id -> front-end "
                          f"inputs), got {type(data).__name__}")
    names: dict[str, str] = {}
    for spk_id in data:
        name = _name(f"{path}: speaker {spk_id!r}", spk_id)
        if name in names:  # the registry keeps one of them, yet both would be counted as added
            raise BundleError(f"{path}: speakers {names[name]!r} and {spk_id!r} are both named {name!r} "
                              "(names are stripped); rename one")
        names[name] = spk_id
    return [_speaker(f"{path}: speaker {spk_id!r}", name, data[spk_id], tokenizer, dims)
            for name, spk_id in names.items()]


def convert_spk2info(spk2info: Path, out: Path, model: Path | None) -> list[UpstreamSpeaker]:
    """Add the speakers of `spk2info` to the registry in `out` for the bundle `cosyvoice-serve --model
    model` serves (the same default), replacing speakers of the same names; returns them.

    Every speaker is checked before the first is written, and before a model bundle is exported (minutes);
    a file that is no torch file is refused before the bundle is looked at and torch loads."""
    check_torch_file(spk2info)
    front = bundle_front(model)
    # a model bundle's export copies its tokenizer files and records the model constants its yaml gives
    dims = front.dims or model_dims(ModelBundle.open(front.root).config)
    speakers = read_spk2info(spk2info, TextTokenizer(front.tokenizer_dir, skip_special_tokens=False), dims)
    bundle = RuntimeBundle.open(choose_bundle(model).path)
    registry = SpeakerRegistry(out, frontend_fingerprint(bundle))
    for added, speaker in enumerate(speakers):
        try:
            registry.add(speaker.name, speaker.prompt_text, speaker.features)
        except OSError as e:  # each speaker is written whole or not at all, so those before it stay
            raise BundleError(f"{out}: cannot write in the folder ({e.strerror or e}); {added} of "
                              f"{len(speakers)} speakers added") from None
    return speakers


def check_torch_file(path: Path) -> bytes:
    """The beginning of `path`, a `BundleError` where it shows no file `torch.save` wrote."""
    try:
        with path.open("rb") as file:
            head = file.read(TORCH_HEAD_BYTES)
    except FileNotFoundError:
        raise BundleError(f"{path}: no such file") from None
    except OSError as e:
        raise BundleError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not head:
        raise BundleError(f"{path}: empty file; expected upstream's spk2info.pt")
    if not head.startswith(ZIP_HEAD) and LEGACY_MAGIC not in head:
        raise BundleError(f"{path}: not a torch file (neither torch.save's zip archive nor its legacy "
                          "pickle); expected upstream's spk2info.pt")
    return head


def _load(path: Path) -> object:
    """The object `torch.load` reads from `path`, tensors only (nothing in the file is run)."""
    head = check_torch_file(path)
    import torch

    try:
        with warnings.catch_warnings():
            # a legacy file's pickle protocol draws a warning about torch's default, not about the file
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's unpickling and zip errors have no common type
        if head.startswith(ZIP_HEAD) and not zipfile.is_zipfile(path):  # torch says only "Invalid argument"
            reason = "its zip archive is cut short or damaged"
        else:  # torch's advice around the reason is about its own defaults
            reason = " ".join(str(e).split("WeightsUnpickler error:")[-1].split())[:200]
        raise BundleError(f"{path}: a torch file that cannot be read as speakers ({reason})") from None


def _name(where: str, spk_id: object) -> str:
    if not isinstance(spk_id, str):  # upstream's add_zero_shot_spk takes a str
        raise BundleError(f"{where}: the speaker id is {type(spk_id).__name__}, not str")
    try:
        return check_name(spk_id)
    except SpeakerError as e:
        raise BundleError(f"{where}: {e}") from None


def _speaker(where: str, name: str, entry: object, tokenizer: TextTokenizer, dims: ModelDims
             ) -> UpstreamSpeaker:
    if not isinstance(entry, dict):
        raise BundleError(f"{where}: not a dict of front-end inputs ({type(entry).__name__})")
    missing = [key for key in REQUIRED if key not in entry]
    if missing:
        sft = " (an sft speaker: only an x-vector, no prompt to clone)" if "embedding" in entry else ""
        raise BundleError(f"{where}: lacks {', '.join(missing)}{sft}; only zero-shot speakers "
                          "(add_zero_shot_spk) can be served")
    arrays = {key: _array(where, key, entry[key]) for key in REQUIRED}
    text_ids, tokens = arrays["prompt_text"], arrays["llm_prompt_speech_token"]
    mel, embedding = arrays["prompt_speech_feat"], arrays["llm_embedding"]
    n = tokens.shape[-1] if tokens.ndim else 0  # a scalar is refused by its shape, not by an IndexError
    _shape(where, "prompt_text", text_ids, (1, text_ids.shape[-1] if text_ids.ndim else 0), integer=True)
    _shape(where, "llm_prompt_speech_token", tokens, (1, n), integer=True)
    _shape(where, "prompt_speech_feat", mel, (1, dims.token_mel_ratio * n, dims.mel_bins))
    _shape(where, "llm_embedding", embedding, (1, dims.spk_embed_dim))
    _ids(where, "prompt_text", text_ids, len(tokenizer), "tokenizer")
    _ids(where, "llm_prompt_speech_token", tokens, dims.speech_token_size, "speech codebook")
    _finite(where, "prompt_speech_feat", mel)
    _finite(where, "llm_embedding", embedding)
    for key, same_as in (("flow_prompt_speech_token", tokens), ("flow_embedding", embedding)):
        if not np.array_equal(arrays[key], same_as):  # zero-shot speakers prompt the LLM and the flow alike
            raise BundleError(f"{where}: {key} differs from its llm_ counterpart; not a zero-shot speaker")
    ids = text_ids[0].tolist()
    transcript = tokenizer.decode(ids)
    if tokenizer.encode(transcript) != ids:
        raise BundleError(f"{where}: prompt_text does not decode to a text that encodes back to its ids "
                          "(made with another tokenizer than the bundle's?)")
    features = PromptFeatures(speech_tokens=tokens.astype(np.int64), mel=mel.astype(np.float32),
                              embedding=embedding.astype(np.float32))
    return UpstreamSpeaker(name, transcript, features)


def _array(where: str, key: str, value: Any) -> np.ndarray:
    import torch

    if not isinstance(value, torch.Tensor):
        raise BundleError(f"{where}: {key} is not a tensor ({type(value).__name__})")
    value = value.detach().cpu()
    try:  # numpy has no bfloat16, and the registry keeps float32 whatever upstream stored
        return (value.float() if value.is_floating_point() else value).numpy()
    except TypeError:  # a dtype numpy lacks (complex32, ...)
        raise BundleError(f"{where}: {key} is {value.dtype}, neither an integer nor a float type") from None


def _shape(where: str, key: str, array: np.ndarray, shape: tuple[int, ...], integer: bool = False) -> None:
    kind_ok = np.issubdtype(array.dtype, np.integer) if integer else np.issubdtype(array.dtype, np.floating)
    if array.shape != shape or not kind_ok or 0 in shape:
        raise BundleError(f"{where}: {key} is {array.dtype} {tuple(array.shape)}, expected "
                          f"{'integer' if integer else 'float'} {shape}")


def _ids(where: str, key: str, array: np.ndarray, size: int, vocabulary: str) -> None:
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= size:
        raise BundleError(f"{where}: {key} has ids from {low} to {high}; the bundle's {vocabulary} has 0 to "
                          f"{size - 1}")


def _finite(where: str, key: str, array: np.ndarray) -> None:
    bad = int(np.count_nonzero(~np.isfinite(array)))
    if bad:
        raise BundleError(f"{where}: {key} has {bad} NaN or infinite values of {array.size}")
