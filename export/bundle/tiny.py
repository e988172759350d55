"""`cosyvoice-export tiny-bundle`: a random-weight model directory in upstream's exact file format.

`tiny` keeps every interface dim of the real model (80 mels, 6561 speech tokens, 192-dim x-vectors,
24 kHz) and shrinks the hidden sizes, for tests. `full` has the released model's dims with random
weights: it costs what the real model costs, for benchmarks. Same seed, same bytes.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save
from tqdm import tqdm

from cosyvoice_runtime.atomic_files import new_sibling, siblings_made

from ..config import ModelConfig, full_size, tiny
from ..manifest import NETWORKS, build_network
from ..nets import flow as flow_net
from ..nets import hift as hift_net
from ..nets import llm as llm_net
from .errors import BundleError
from .layout import CAMPPLUS, PROMPT_TEXT, PROMPT_WAV, QWEN_DIR, QWEN_WEIGHTS, SPEECH_TOKENIZER, YAML
from .prompt_wav import PROMPT_TRANSCRIPT, write_prompt_wav
from .standin_onnx import write_standin_onnx
from .tokenizer_files import (
    load_cosyvoice3_tokenizer,
    qwen_vocab_size,
    write_qwen_config,
    write_tokenizer_files,
)
from .yaml_config import model_config_to_yaml

_INIT: dict[str, Callable[[torch.nn.Module, torch.Generator], None]] = {
    "llm": llm_net.init_random_,  # type: ignore[dict-item]
    "flow": flow_net.init_random_,  # type: ignore[dict-item]
    "hift": hift_net.init_random_,  # type: ignore[dict-item]
}
SIZES = ("tiny", "full")


def config_for_size(size: str, text_vocab_size: int | None = None) -> ModelConfig:
    """The model config of a `tiny` or `full` bundle.

    A tiny bundle's Qwen embedding is sized to its tokenizer; without `text_vocab_size` the size our
    tokenizer writer gives is used.
    """
    if size == "full":
        return full_size()
    if size == "tiny":
        return tiny(text_vocab_size if text_vocab_size is not None else _tiny_text_vocab_size())
    raise ValueError(f"unknown bundle size {size!r}; expected one of {', '.join(SIZES)}")


def _tiny_text_vocab_size() -> int:
    with tempfile.TemporaryDirectory() as d:
        write_tokenizer_files(Path(d))
        return qwen_vocab_size(load_cosyvoice3_tokenizer(Path(d)))


def _qwen_safetensors(llm_state: dict[str, torch.Tensor], path: Path, tied: bool) -> None:
    """The HF `model.safetensors` upstream's `Qwen2ForCausalLM.from_pretrained` reads (bf16, as released)."""
    prefix = "llm.model."
    tensors = {k.removeprefix(prefix): v.to(torch.bfloat16).contiguous()
               for k, v in llm_state.items() if k.startswith(prefix)}
    if tied:  # HF drops the tied head on save
        tensors.pop("lm_head.weight")
    # written as bytes: safetensors' save_file makes the file private (0o600), where the bundle's others get
    # 0o666 less the umask
    path.write_bytes(save(tensors, metadata={"format": "pt"}))


def _write(root: Path, size: str, seed: int, progress: bool) -> None:
    qwen_dir = root / QWEN_DIR
    steps = tqdm(total=3 + len(NETWORKS), desc=f"{size} bundle", unit="step", disable=not progress)

    steps.set_postfix_str("tokenizer")
    n_bpe = write_tokenizer_files(qwen_dir)
    cfg = config_for_size(size, qwen_vocab_size(load_cosyvoice3_tokenizer(qwen_dir)))
    write_qwen_config(cfg.llm.qwen, qwen_dir, endoftext_id=n_bpe)
    (root / YAML).write_text(model_config_to_yaml(cfg))
    steps.update()

    generator = torch.Generator().manual_seed(seed)
    for name in NETWORKS:
        steps.set_postfix_str(f"{name}.pt")
        with torch.random.fork_rng(devices=[]):  # pin the default inits without touching the caller's RNG
            torch.manual_seed(seed)
            net = build_network(cfg, name)
        _INIT[name](net, generator)
        state = net.state_dict()
        torch.save(state, root / f"{name}.pt")
        if name == "llm":
            _qwen_safetensors(state, root / QWEN_WEIGHTS, cfg.llm.qwen.tie_word_embeddings)
        del net, state
        steps.update()

    steps.set_postfix_str("campplus / speech tokenizer")
    write_standin_onnx(root, seed)
    steps.update()
    steps.set_postfix_str("prompt")
    (root / PROMPT_WAV).parent.mkdir(parents=True, exist_ok=True)
    write_prompt_wav(root / PROMPT_WAV, seed=0)
    (root / PROMPT_TEXT).write_text(PROMPT_TRANSCRIPT + "\n")
    steps.update()
    steps.close()


WRITTEN = frozenset({YAML, QWEN_DIR, *(f"{name}.pt" for name in NETWORKS), CAMPPLUS, SPEECH_TOKENIZER,
                     PROMPT_WAV.split("/")[0], PROMPT_TEXT.split("/")[0]})
"""What `write_bundle` puts at the top of a bundle."""


def check_replaceable(out: Path) -> None:
    """Raise `BundleError` unless `out` is an empty folder or a model bundle holding nothing but what
    `write_bundle` writes: --force must never delete a folder of someone else's files."""
    if not out.is_dir():
        raise BundleError(f"{out}: is a file; --force replaces only a model bundle tiny-bundle wrote")
    names = {p.name for p in out.iterdir()}
    foreign = sorted(names - WRITTEN)
    if names and (foreign or YAML not in names):
        found = f"it holds {foreign[0]}" if foreign else f"no {YAML}"
        raise BundleError(f"{out}: not a model bundle tiny-bundle wrote ({found}); --force replaces only "
                          "such a bundle: choose another OUT, or remove it yourself")


def write_bundle(out: Path, *, size: str = "tiny", seed: int = 0, force: bool = False, progress: bool = False
                 ) -> Path:
    """Write a random-weight bundle to `out`, atomically: into a sibling temp dir, then renamed; first
    removing the temp dirs of writes into `out` that were killed.

    Raises `FileExistsError` if `out` exists and `force` is not set, and `BundleError` if `force` would
    replace something this function does not write (`check_replaceable`) or `out` holds the working
    folder.
    """
    out = Path(out)
    if size not in SIZES:
        raise ValueError(f"unknown bundle size {size!r}; expected one of {', '.join(SIZES)}")
    target = Path(os.path.abspath(out))
    if not target.name or Path.cwd().is_relative_to(target):
        raise BundleError(f"{out}: is the working folder or holds it; name a folder of the bundle's own")
    if out.exists() and not force:
        raise FileExistsError(f"{out}: already exists; pass --force to replace it")
    if out.exists():
        check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(out, progress)
    with _working_folder(out) as tmp:
        try:
            _write(tmp, size, seed, progress)
            if out.exists() and not force:  # written meanwhile, by another process: theirs stays
                raise FileExistsError(f"{out}: already exists (written while this one was); pass --force to "
                                      "replace it")
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


PARTIAL = ".partial"
CLAIM = ".claim"


@contextmanager
def _working_folder(out: Path) -> Iterator[Path]:
    """A new folder beside `out` (`.NAME.<random>.partial`) to write the bundle in, locked (flock) while
    the block runs. The kernel drops the lock of a process that dies, so a folder of that name which no one
    holds was left by a write that was killed (`_remove_abandoned`). It is made under another name and
    renamed once locked: a writer's folder is never unlocked under the name looked for."""
    claim = new_sibling(out, CLAIM, directory=True)
    fd = os.open(claim, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        tmp = claim.with_name(claim.name.removesuffix(CLAIM) + PARTIAL)
        os.rename(claim, tmp)
        yield tmp
    finally:
        os.close(fd)


def _remove_abandoned(out: Path, progress: bool) -> None:
    """Delete the working folders beside `out` that no writer holds: a write killed outright (kill -9,
    the out-of-memory killer) cannot remove its own, and a full bundle's is up to 4.2 GB."""
    for folder in siblings_made(out, PARTIAL):
        if folder.is_symlink() or not folder.is_dir():
            continue
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:  # removed meanwhile by another writer
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a writer at work
            continue
        else:
            if progress:
                print(f"removing {folder}: an unfinished bundle of a write that was killed", file=sys.stderr,
                      flush=True)
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)
