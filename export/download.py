"""`cosyvoice-export download`: the Fun-CosyVoice3-0.5B release, fetched into a model directory.

Only the files our exporter and runtime read are fetched: not the training-time batch speech tokenizer,
not upstream's TensorRT source ONNX, and not `CosyVoice-BlankEN/model.safetensors` (upstream's yaml builds
the Qwen2 backbone from it and `llm.pt` then overwrites every weight; we read `llm.pt` alone). Downloads go
through each hub's own client, which resumes an interrupted file and skips files already present; a file
appears under its name only once it is complete. A release the Hugging Face cache holds (at the commit the
hub names, or at the revision asked for where the hub cannot be reached) is placed from there instead.
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from cosyvoice_runtime.atomic_files import TMP, atomic_path, siblings_made

from .bundle.layout import CAMPPLUS, LLM_VARIANTS, QWEN_DIR, QWEN_WEIGHTS, SPEECH_TOKENIZER, YAML
from .bundle.tokenizer_files import TOKENIZER_FILES

REPO_ID = "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
"""The release's repository, under the same id on Hugging Face and on ModelScope."""
DEFAULT_DIR = Path("pretrained_models/Fun-CosyVoice3-0.5B")
"""Where upstream's README puts it."""
SOURCES = ("huggingface", "modelscope")
QWEN_FILES = ("config.json", *TOKENIZER_FILES)
"""What we read of `CosyVoice-BlankEN/`: the Qwen2 config and the tokenizer."""
MODELSCOPE_URL = f"https://www.modelscope.cn/models/{REPO_ID}"
TOKEN_HINT = "set HF_TOKEN to a token that can read it, or run `huggingface-cli login`"

T = TypeVar("T")


class DownloadError(Exception):
    """The release could not be fetched; the message is one line that says why and what to do."""


def required_files(llm: str) -> list[str]:
    """The files, relative to the model directory, that a download for `llm` (a key of `LLM_VARIANTS`)
    must leave there."""
    return [YAML, *LLM_VARIANTS[llm], "flow.pt", "hift.pt", CAMPPLUS, SPEECH_TOKENIZER,
            *(f"{QWEN_DIR}/{name}" for name in QWEN_FILES)]


def file_patterns(llm: str) -> tuple[list[str], list[str]]:
    """The hubs' `allow_patterns` and `ignore_patterns` for `llm`: the required files, the rest of
    `CosyVoice-BlankEN/` but its weights, and `asset/` if the release has one."""
    allow = [YAML, *LLM_VARIANTS[llm], "flow.pt", "hift.pt", CAMPPLUS, SPEECH_TOKENIZER, f"{QWEN_DIR}/*",
             "asset/*"]
    return allow, [QWEN_WEIGHTS]


def missing_files(model_dir: Path, llm: str) -> list[str]:
    """The required files for `llm` that `model_dir` lacks."""
    return [name for name in required_files(llm) if not (model_dir / name).is_file()]


def by_hand(model_dir: Path, llm: str, url: str) -> str:
    """How to place the files without this command, in one sentence."""
    top = [name for name in required_files(llm) if not name.startswith(f"{QWEN_DIR}/")]
    check = "" if llm == "base" else f" --llm {llm}"
    return (f"to place the files by hand, copy {', '.join(top)} and {QWEN_DIR}/ ({', '.join(QWEN_FILES)}) "
            f"from {url} into {model_dir}, then run `cosyvoice-export check-bundle {model_dir}{check}`")


def download(model_dir: Path, *, source: str = "huggingface", revision: str | None = None,
             llm: str = "base", warn: Callable[[str], None] = print) -> Path:
    """Fetch the release's files for `llm` (a key of `LLM_VARIANTS`) from `source` into `model_dir`.

    `revision` is a branch, tag or commit (default: the hub's default branch). Where the hub cannot be
    reached but `model_dir` already holds every required file, `warn` is told so and nothing is fetched;
    where files are placed from the Hugging Face cache, `warn` is told that too.
    Raises `DownloadError` when the files are not all there afterwards; returns `model_dir`.
    """
    if llm not in LLM_VARIANTS:
        raise ValueError(f"unknown llm {llm!r}; expected one of {', '.join(LLM_VARIANTS)}")
    model_dir = Path(model_dir)
    if source == "huggingface":
        url = _fetch_huggingface(model_dir, revision, llm, warn)
    elif source == "modelscope":
        url = MODELSCOPE_URL
        _fetch_modelscope(model_dir, revision, llm)
    else:
        raise ValueError(f"unknown source {source!r}; expected one of {', '.join(SOURCES)}")
    missing = missing_files(model_dir, llm)
    if missing:
        raise DownloadError(f"{model_dir / missing[0]}: not there after the download; "
                            f"{by_hand(model_dir, llm, url)}")
    return model_dir


def _fetch_huggingface(model_dir: Path, revision: str | None, llm: str, warn: Callable[[str], None]) -> str:
    """Download with `huggingface_hub`, whose endpoint is $HF_ENDPOINT; returns the repository's URL."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from requests import RequestException

    endpoint = constants.ENDPOINT
    url = f"{endpoint}/{REPO_ID}"
    revision = revision or constants.DEFAULT_REVISION
    # The listing is asked for first, by us: snapshot_download answers an unreachable hub by returning
    # whatever the local folder holds, which must not pass for a finished download.
    try:
        info = HfApi().model_info(REPO_ID, revision=revision)
    except OfflineModeIsEnabled:
        unreachable = "offline mode is on (HF_HUB_OFFLINE)"
    except RevisionNotFoundError:
        raise DownloadError(f"{REPO_ID}: no revision {revision!r} at {endpoint}") from None
    except GatedRepoError:
        raise DownloadError(f"{REPO_ID} is gated at {endpoint}: accept its terms at {url}, then "
                            f"{TOKEN_HINT}") from None
    except RepositoryNotFoundError:  # the hub answers a private repository so too, without a token
        raise DownloadError(f"{REPO_ID}: no such repository at {endpoint} (or none that this token, or no "
                            f"token, may read: {TOKEN_HINT}); {by_hand(model_dir, llm, url)}") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        token = f" ({TOKEN_HINT})" if status in (401, 403) else ""
        unreachable = f"{endpoint} answered {str(e).splitlines()[0]}{token}"
    except OSError as e:  # requests' connection errors and timeouts
        unreachable = f"cannot reach {endpoint} ({type(e).__name__})"
    else:
        if info.siblings is not None:
            listed = {sibling.rfilename for sibling in info.siblings}
            absent = [name for name in required_files(llm) if name not in listed]
            if absent:
                raise DownloadError(f"{REPO_ID}@{revision}: the repository has no {absent[0]}")
        cached = _cached_release(info.sha, llm) if info.sha and missing_files(model_dir, llm) else None
        if cached is not None:  # an earlier download of this very commit: not a second 3.4 GB
            warn(f"placing the release's files from the Hugging Face cache ({cached}) in {model_dir}")
            _place(cached, model_dir, llm)
            return url
        allow, ignore = file_patterns(llm)
        try:
            # the commit, not the branch: files already fetched from it are skipped without a request
            _quietly(lambda: snapshot_download(REPO_ID, revision=info.sha, local_dir=model_dir,
                                               allow_patterns=allow, ignore_patterns=ignore))
        except (LocalEntryNotFoundError, RequestException) as e:  # the network's, or the hub's
            raise DownloadError(f"the download from {endpoint} stopped ({type(e).__name__}); run the same "
                                f"command again to resume it, or {by_hand(model_dir, llm, url)}") from None
        except OSError as e:  # this machine's: a full disk, a folder that cannot be written
            raise DownloadError(f"{e.filename or model_dir}: cannot be written ({e.strerror or e})") from None
        return url

    missing = missing_files(model_dir, llm)
    cached = _cached_release(revision, llm) if missing else None
    if cached is not None:
        warn(f"warning: {unreachable}; placing the release's files from the Hugging Face cache ({cached}) "
             f"in {model_dir}")
        _place(cached, model_dir, llm)
    elif missing:
        raise DownloadError(f"{unreachable}, and {model_dir} does not hold the release yet (nor does the "
                            f"Hugging Face cache); {by_hand(model_dir, llm, url)}")
    else:
        warn(f"warning: {unreachable}; checking the files already in {model_dir}")
    return url


def _cached_release(revision: str, llm: str) -> Path | None:
    """The release at `revision` (a branch, tag or commit) in the Hugging Face cache ($HF_HUB_CACHE), where
    a download without a folder of its own (`hf download`, upstream's `snapshot_download` without
    `local_dir`) left every file a download for `llm` must; else None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(REPO_ID, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        return None
    return None if missing_files(folder, llm) else folder


PLACE_LOCK = Path(".cache") / "cosyvoice-place.lock"
"""Held in the model folder while files are placed there from the Hugging Face cache (`.cache` is where
`snapshot_download` keeps its own records of a download into a folder)."""


def _place(cached: Path, model_dir: Path, llm: str) -> None:
    """The files of the cached release a download for `llm` fetches (`file_patterns`) that `model_dir` lacks,
    from the cache: each a hard link to the cache's file where both are on one filesystem (no second copy of
    3.4 GB), else a copy, and each complete or not there at all. One placement into `model_dir` at a time
    (`PLACE_LOCK`), so that the temporary copies it finds were left by one killed outright, and removed."""
    from filelock import FileLock
    from huggingface_hub.utils import filter_repo_objects

    allow, ignore = file_patterns(llm)
    present = (path.relative_to(cached).as_posix() for path in sorted(cached.rglob("*")) if path.is_file())
    names = list(filter_repo_objects(present, allow_patterns=allow, ignore_patterns=ignore))
    try:
        (model_dir / PLACE_LOCK).parent.mkdir(parents=True, exist_ok=True)
        with FileLock(model_dir / PLACE_LOCK):
            for name in names:
                target = model_dir / name
                for abandoned in siblings_made(target, TMP):  # a copy of GBs, hidden by its leading dot
                    abandoned.unlink(missing_ok=True)
                if not target.is_file():  # the cache's names link to its blobs
                    _place_file((cached / name).resolve(), target)
    except OSError as e:
        raise DownloadError(f"{e.filename or model_dir}: cannot be written ({e.strerror or e})") from None


def _place_file(source: Path, target: Path) -> None:
    """`target` made a hard link to `source`, or a copy of it where no link can be made."""
    with atomic_path(target) as tmp:
        tmp.unlink()
        try:
            os.link(source, tmp)
        except OSError:  # another filesystem, or one without hard links
            shutil.copyfile(source, tmp)


def _quietly(fetch: Callable[[], T]) -> T:
    """`fetch()` with the hub client's retry logs and warnings left out (the command says in one line what
    stopped it), in a thread of its own: Ctrl-C then reaches the command at once, where the client's pool
    would first finish every file in flight (their partial files stay, for the next run to resume)."""
    from huggingface_hub.utils import logging

    logging.set_verbosity_error()
    done: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning, module="huggingface_hub")
            try:
                done.append(fetch())
            except BaseException as e:  # handed to the caller's thread as it is
                failed.append(e)

    thread = threading.Thread(target=run, name="hub-download", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return done[0]


def _fetch_modelscope(model_dir: Path, revision: str | None, llm: str) -> None:
    """Download with the `modelscope` package, where it is installed."""
    try:
        from modelscope.hub.snapshot_download import snapshot_download
    except ImportError:
        raise DownloadError("--source modelscope needs the modelscope package: pip install modelscope"
                            ) from None
    allow, ignore = file_patterns(llm)
    try:
        snapshot_download(REPO_ID, revision=revision, local_dir=str(model_dir), allow_patterns=allow,
                          ignore_patterns=ignore)
    except Exception as e:  # modelscope's errors share no base class across its releases
        reason = str(e).splitlines()[0] if str(e) else ""
        raise DownloadError(f"could not download {REPO_ID} from ModelScope ({type(e).__name__}: {reason}); "
                            f"{by_hand(model_dir, llm, MODELSCOPE_URL)}") from None
