"""Upstream's model directory (`cosyvoice3.yaml`, `llm.pt`, ..., `CosyVoice-BlankEN/`) as one object."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cosyvoice_graphs.bundle_layout import MANIFEST
from cosyvoice_runtime.bundle import file_sha256

from ..config import ModelConfig
from .errors import BundleError
from .layout import LLM_CHECKPOINTS, QWEN_DIR, YAML
from .yaml_config import model_config_from_yaml

if TYPE_CHECKING:
    import torch
    from torch import nn

    from cosyvoice_runtime.bundle import RuntimeBundle


@dataclass(frozen=True)
class ModelBundle:
    """A CosyVoice3 model directory whose yaml and Qwen config have been read."""

    root: Path
    config: ModelConfig
    llm_checkpoint: str = LLM_CHECKPOINTS["base"]
    """The file the LLM's weights are read from: `llm.pt`, or another of `LLM_CHECKPOINTS` (same keys)."""

    @classmethod
    def open(cls, root: Path | str, llm_checkpoint: str = LLM_CHECKPOINTS["base"]) -> ModelBundle:
        """Read the hyperparameters of the bundle at `root` (no weights are loaded); its LLM is read from
        `llm_checkpoint`."""
        root = Path(root)
        if not root.is_dir():
            found = "not a directory" if root.exists() else "does not exist"
            raise BundleError(f"{root}: {found}; expected a CosyVoice3 model directory")
        if (root / MANIFEST).is_file() and not (root / QWEN_DIR).is_dir():
            raise BundleError(f"{root}: a runtime bundle (already exported: run it with `cosyvoice-run "
                              f"--model {root}` or cosyvoice-serve); this command reads a model directory "
                              f"({YAML}, llm.pt, {QWEN_DIR}/, ...)")
        yaml_path = root / YAML
        qwen_config = root / QWEN_DIR / "config.json"
        for p in (yaml_path, qwen_config):
            if not p.is_file():
                raise BundleError(f"{p}: file not found")
        return cls(root, model_config_from_yaml(yaml_path, qwen_config), llm_checkpoint)

    @classmethod
    def open_exported_from(cls, root: Path | str, bundle: RuntimeBundle) -> ModelBundle:
        """The model directory at `root` as `open` reads it, LLM checkpoint and all, when it is the model the
        runtime bundle `bundle` was exported from: every source file its manifest names has its sha256
        here. Otherwise `BundleError`, naming the first file that differs, before any weights are read."""
        root = Path(root)
        for name, entry in bundle.manifest.sources.items():
            path = root / name
            try:
                sha = file_sha256(path)
            except OSError as e:
                raise BundleError(f"{path}: unreadable ({e.strerror}); --model-dir must be the model "
                                  f"{bundle.root} was exported from") from None
            if sha != entry.sha256:
                raise BundleError(f"{path} is not the {name} {bundle.root} was exported from (sha256 "
                                  "differs); --model-dir must be that model")
        return cls.open(root, bundle.manifest.llm_checkpoint)

    @property
    def qwen_dir(self) -> Path:
        return self.root / QWEN_DIR

    def checkpoint_file(self, name: str) -> str:
        """The checkpoint of network `name` (`llm`, `flow`, `hift`), relative to the root."""
        return self.llm_checkpoint if name == "llm" else f"{name}.pt"

    def checkpoint(self, name: str) -> Path:
        return self.root / self.checkpoint_file(name)

    def read_checked_state(self, name: str, path: Path | None = None) -> dict[str, torch.Tensor]:
        """The state dict of network `name`'s checkpoint (or of `path`) in our key layout, checked key for
        key against our network `name`."""
        # torch loads with the weights, not with this module: opening a model directory takes none, so
        # the commands refuse a wrong one at once
        from ..manifest import expected_entries
        from ..nets.hift import normalize_hift_state_dict
        from .checkpoint import check_state_dict, read_state_dict

        path = path or self.checkpoint(name)
        state = read_state_dict(path)
        if name == "hift":
            state = normalize_hift_state_dict(state)
        check_state_dict(path, state, expected_entries(self.config, name))
        return state

    def load_network(self, name: str) -> nn.Module:
        """Build network `name` (`llm`, `flow`, `hift`) and load its checkpoint strictly, in eval mode."""
        from ..manifest import build_network
        from .checkpoint import to_float32

        state = to_float32(self.read_checked_state(name))
        net = build_network(self.config, name, random_init=False)  # every weight is loaded next
        net.load_state_dict(state, strict=True)
        return net.eval()
