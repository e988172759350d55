"""`ModelConfig` <-> a bundle's `cosyvoice3.yaml` (+ `CosyVoice-BlankEN/config.json`).

The reader takes every hyperparameter the yaml and the Qwen config carry; values upstream hard-codes in
Python stay `ModelConfig` defaults, and the writer refuses a config that changes one of them (no yaml could
carry it). The writer follows the layout of upstream's `examples/libritts/cosyvoice3/conf/cosyvoice3.yaml`
so upstream's `CosyVoice3` can load our bundles; training-only entries are left out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from cosyvoice_runtime.text_stream import MIX_RATIO
from cosyvoice_runtime.token2wav import CFG_RATE

from ..config import (
    CFMConfig,
    DiTConfig,
    F0PredictorConfig,
    FlowConfig,
    HiFTConfig,
    LLMConfig,
    MelConfig,
    ModelConfig,
    Qwen2Config,
    RASConfig,
)
from .errors import BundleError
from .hyperyaml import Tagged, key_name, load_hyperyaml

# The classes upstream's `get_model_type` accepts for a CosyVoice3 bundle, and the ones nested in them.
LLM_CLASS = "cosyvoice.llm.llm.CosyVoice3LM"
FLOW_CLASS = "cosyvoice.flow.flow.CausalMaskedDiffWithDiT"
HIFT_CLASS = "cosyvoice.hifigan.generator.CausalHiFTGenerator"
QWEN_ENCODER_CLASS = "cosyvoice.llm.llm.Qwen2Encoder"
RAS_FUNCTION = "cosyvoice.utils.common.ras_sampling"
PRE_LOOKAHEAD_CLASS = "cosyvoice.transformer.upsample_encoder.PreLookaheadLayer"
CFM_CLASS = "cosyvoice.flow.flow_matching.CausalConditionalCFM"
CFM_PARAMS_CLASS = "omegaconf.DictConfig"
DIT_CLASS = "cosyvoice.flow.DiT.dit.DiT"
F0_CLASS = "cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor"
MEL_FUNCTION = "matcha.utils.audio.mel_spectrogram"
TOKENIZER_FUNCTION = "cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer"

QWEN_PRETRAIN_KEY = "qwen_pretrain_path"
SEED = 1986

# Fields upstream fixes in Python, not in the yaml: (label for messages, getter, field names).
_HARD_CODED: tuple[tuple[str, Any, tuple[str, ...]], ...] = (
    ("llm", lambda c: c.llm, ("extra_speech_ids",)),
    ("flow.dit", lambda c: c.flow.dit, ("conv_pos_kernel", "conv_pos_groups", "time_embed_dim")),
    ("flow.cfm", lambda c: c.flow.cfm, ("n_timesteps", "noise_frames")),
    ("hift", lambda c: c.hift, ("noise_seconds",)),
)


# --- reading -------------------------------------------------------------------------------------------


def _describe(value: Any) -> str:
    text = repr(value)
    return (text if len(text) <= 60 else text[:57] + "...") + f" ({type(value).__name__})"


@dataclass(frozen=True)
class _Block:
    """A mapping of the document plus the key path that reached it, so errors can name the key."""

    source: Path
    path: tuple[str, ...]
    values: Mapping[str, Any]

    def _name(self, key: str) -> str:
        return key_name((*self.path, key))

    def error(self, key: str, message: str) -> BundleError:
        return BundleError(f"{self.source}: key '{self._name(key)}' {message}")

    def get(self, key: str) -> Any:
        if key not in self.values:
            raise self.error(key, "is missing")
        return self.values[key]

    def _typed(self, key: str, ok: bool, what: str) -> None:
        if not ok:
            raise self.error(key, f"must be {what}, got {_describe(self.values[key])}")

    def integer(self, key: str) -> int:
        value = self.get(key)
        self._typed(key, type(value) is int, "an integer")
        return value

    def number(self, key: str) -> float:
        value = self.get(key)
        self._typed(key, type(value) in (int, float), "a number")
        return float(value)

    def optional_number(self, key: str) -> float | None:
        return None if self.get(key) is None else self.number(key)

    def flag(self, key: str) -> bool:
        value = self.get(key)
        self._typed(key, type(value) is bool, "true or false")
        return value

    def text(self, key: str) -> str:
        value = self.get(key)
        self._typed(key, type(value) is str, "a string")
        return value

    def integers(self, key: str) -> tuple[int, ...]:
        value = self.get(key)
        self._typed(key, isinstance(value, list | tuple) and all(type(v) is int for v in value),
                    "a list of integers")
        return tuple(value)

    def integer_lists(self, key: str) -> tuple[tuple[int, ...], ...]:
        value = self.get(key)
        self._typed(key, isinstance(value, list | tuple) and all(
            isinstance(row, list | tuple) and all(type(v) is int for v in row) for row in value),
            "a list of lists of integers")
        return tuple(tuple(row) for row in value)

    def mapping(self, key: str) -> _Block:
        value = self.get(key)
        self._typed(key, isinstance(value, dict), "a mapping")
        return _Block(self.source, (*self.path, key), value)

    def call(self, key: str, kind: str, target: str) -> _Block:
        """The arguments of `key: !kind:target`, checking the tag."""
        expected = f"!{kind}:{target}"
        if key not in self.values:
            raise self.error(key, f"is missing (expected {expected})")
        value = self.values[key]
        if not isinstance(value, Tagged):
            raise self.error(key, f"must be {expected}, got {_describe(value)}")
        if not value.is_call(kind, target):
            raise self.error(key, f"is {value.tag}, expected {expected}")
        if not isinstance(value.args, dict):
            raise self.error(key, f"must have named arguments, got {_describe(value.args)}")
        return _Block(self.source, (*self.path, key), value.args)


def _read_qwen_config(path: Path) -> Qwen2Config:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path}: cannot read Qwen2 config ({e.__class__.__name__}: {e})") from None
    if not isinstance(data, dict):
        raise BundleError(f"{path}: expected a JSON object, got {type(data).__name__}")
    try:
        return Qwen2Config.from_dict(data)
    except KeyError as e:
        raise BundleError(f"{path}: {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise BundleError(f"{path}: a Qwen2 hyperparameter has the wrong type ({e})") from None


def _as_released(block: _Block, key: str, found: object, applied: object) -> None:
    """Refuse a yaml value that differs from the released model's where the runtime applies that one: its
    bundles do not carry the setting, so an export would silently not honour another."""
    if found != applied:
        raise block.error(key, f"is {found!r}; the runtime applies the released model's {applied!r} (its "
                               "bundles do not carry this setting), so an export would not honour it")


def model_config_from_yaml(yaml_path: Path, qwen_config_path: Path) -> ModelConfig:
    """Read a bundle's `cosyvoice3.yaml` and `CosyVoice-BlankEN/config.json` into a `ModelConfig`.

    Checks that `llm`, `flow` and `hift` are the CosyVoice3 classes; any missing entry, missing field or
    value of the wrong type raises a `BundleError` naming the file and the key.
    """
    yaml_path, qwen_config_path = Path(yaml_path), Path(qwen_config_path)
    qwen = _read_qwen_config(qwen_config_path)
    # The same override upstream's CosyVoice3 passes; it only fills path strings we do not use.
    doc = load_hyperyaml(yaml_path, overrides={QWEN_PRETRAIN_KEY: str(qwen_config_path.parent)})
    top = _Block(yaml_path, (), doc)

    llm = top.call("llm", "new", LLM_CLASS)
    llm.call("llm", "new", QWEN_ENCODER_CLASS)  # only checked: its one argument is the BlankEN path
    ras = llm.call("sampling", "name", RAS_FUNCTION)
    llm_input_size = llm.integer("llm_input_size")
    if llm_input_size != qwen.hidden_size:
        raise llm.error("llm_input_size", f"is {llm_input_size} but {qwen_config_path} has hidden_size "
                                          f"{qwen.hidden_size}; they must match")
    llm_cfg = LLMConfig(
        qwen=qwen, llm_input_size=llm_input_size, llm_output_size=llm.integer("llm_output_size"),
        speech_token_size=llm.integer("speech_token_size"),
        sampling=RASConfig(top_p=ras.number("top_p"), top_k=ras.integer("top_k"),
                           win_size=ras.integer("win_size"), tau_r=ras.number("tau_r")),
    )
    for key in ("top_p", "top_k", "win_size", "tau_r"):
        _as_released(ras, key, getattr(llm_cfg.sampling, key), getattr(RASConfig(), key))
    _as_released(llm, "mix_ratio", llm.integers("mix_ratio"), MIX_RATIO)

    flow = top.call("flow", "new", FLOW_CLASS)
    pll = flow.call("pre_lookahead_layer", "new", PRE_LOOKAHEAD_CLASS)
    decoder = flow.call("decoder", "new", CFM_CLASS)
    cfm = decoder.call("cfm_params", "new", CFM_PARAMS_CLASS).mapping("content")
    dit = decoder.call("estimator", "new", DIT_CLASS)
    flow_cfg = FlowConfig(
        input_size=flow.integer("input_size"), output_size=flow.integer("output_size"),
        spk_embed_dim=flow.integer("spk_embed_dim"), vocab_size=flow.integer("vocab_size"),
        token_mel_ratio=flow.integer("token_mel_ratio"), pre_lookahead_len=flow.integer("pre_lookahead_len"),
        pre_lookahead_channels=pll.integer("channels"),
        dit=DiTConfig(
            dim=dit.integer("dim"), depth=dit.integer("depth"), heads=dit.integer("heads"),
            dim_head=dit.integer("dim_head"),
            ff_mult=dit.integer("ff_mult"), mel_dim=dit.integer("mel_dim"), mu_dim=dit.integer("mu_dim"),
            spk_dim=dit.integer("spk_dim"), out_channels=dit.integer("out_channels"),
            static_chunk_size=dit.integer("static_chunk_size"),
        ),
        cfm=CFMConfig(inference_cfg_rate=cfm.number("inference_cfg_rate"),
                      t_scheduler=cfm.text("t_scheduler")),
    )

    _as_released(cfm, "inference_cfg_rate", flow_cfg.cfm.inference_cfg_rate, CFG_RATE)
    _as_released(cfm, "t_scheduler", flow_cfg.cfm.t_scheduler, "cosine")  # the runtime's ode_time_grid

    hift = top.call("hift", "new", HIFT_CLASS)
    istft = hift.mapping("istft_params")
    f0 = hift.call("f0_predictor", "new", F0_CLASS)
    hift_cfg = HiFTConfig(
        in_channels=hift.integer("in_channels"), base_channels=hift.integer("base_channels"),
        nb_harmonics=hift.integer("nb_harmonics"), sampling_rate=hift.integer("sampling_rate"),
        nsf_alpha=hift.number("nsf_alpha"), nsf_sigma=hift.number("nsf_sigma"),
        nsf_voiced_threshold=hift.number("nsf_voiced_threshold"),
        upsample_rates=hift.integers("upsample_rates"),
        upsample_kernel_sizes=hift.integers("upsample_kernel_sizes"),
        istft_n_fft=istft.integer("n_fft"), istft_hop_len=istft.integer("hop_len"),
        resblock_kernel_sizes=hift.integers("resblock_kernel_sizes"),
        resblock_dilation_sizes=hift.integer_lists("resblock_dilation_sizes"),
        source_resblock_kernel_sizes=hift.integers("source_resblock_kernel_sizes"),
        source_resblock_dilation_sizes=hift.integer_lists("source_resblock_dilation_sizes"),
        lrelu_slope=hift.number("lrelu_slope"), audio_limit=hift.number("audio_limit"),
        conv_pre_look_right=hift.integer("conv_pre_look_right"),
        f0=F0PredictorConfig(num_class=f0.integer("num_class"), in_channels=f0.integer("in_channels"),
                             cond_channels=f0.integer("cond_channels")),
    )

    mel = top.call("feat_extractor", "name", MEL_FUNCTION)
    mel_cfg = MelConfig(
        n_fft=mel.integer("n_fft"), num_mels=mel.integer("num_mels"),
        sampling_rate=mel.integer("sampling_rate"),
        hop_size=mel.integer("hop_size"), win_size=mel.integer("win_size"), fmin=mel.number("fmin"),
        fmax=mel.optional_number("fmax"), center=mel.flag("center"),
    )

    return ModelConfig(
        sample_rate=top.integer("sample_rate"), token_frame_rate=top.integer("token_frame_rate"),
        token_mel_ratio=top.integer("token_mel_ratio"), chunk_size=top.integer("chunk_size"),
        llm=llm_cfg, flow=flow_cfg, hift=hift_cfg, feat=mel_cfg,
    )


# --- writing -------------------------------------------------------------------------------------------


def _y(value: Any) -> str:
    """A YAML flow scalar/sequence in the file's style: `True`, `null`, `'cosine'`, `[8, 5, 3]`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_y(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to the yaml")


def _ref_or(value: Any, key: str, top_value: Any) -> str:
    """`!ref <key>` where the value equals the top-level one it stands for (upstream's style), else it."""
    return f"!ref <{key}>" if value == top_value else _y(value)


def _check_hard_coded(cfg: ModelConfig) -> None:
    for label, get, names in _HARD_CODED:
        part = get(cfg)
        defaults = {f.name: f.default for f in fields(part)}
        for name in names:
            if getattr(part, name) != defaults[name]:
                raise ValueError(f"{label}.{name} = {getattr(part, name)!r}: upstream hard-codes "
                                 f"{defaults[name]!r} in Python, so no cosyvoice3.yaml can carry this value")


def model_config_to_yaml(cfg: ModelConfig) -> str:
    """A `cosyvoice3.yaml` for `cfg`, with upstream's top-level keys, order, tags and nesting.

    `qwen_pretrain_path` stays `''` as upstream ships it (the loader overrides it). Raises `ValueError`
    when `cfg` changes a value upstream hard-codes in Python.
    """
    _check_hard_coded(cfg)
    llm, flow, dit, hift, feat = cfg.llm, cfg.flow, cfg.flow.dit, cfg.hift, cfg.feat
    ras = llm.sampling
    chunk_frames = cfg.chunk_size * cfg.token_mel_ratio
    static_chunk = ("!ref <chunk_size> * <token_mel_ratio>" if dit.static_chunk_size == chunk_frames
                    else _y(dit.static_chunk_size))
    return f"""\
# HyperPyYAML runs these four while loading: every RNG starts from the same seed.
__set_seed1: !apply:random.seed [{SEED}]
__set_seed2: !apply:numpy.random.seed [{SEED}]
__set_seed3: !apply:torch.manual_seed [{SEED}]
__set_seed4: !apply:torch.cuda.manual_seed_all [{SEED}]

# fixed params
sample_rate: {_y(cfg.sample_rate)}
llm_input_size: {_y(llm.llm_input_size)}
llm_output_size: {_y(llm.llm_output_size)}
spk_embed_dim: {_y(flow.spk_embed_dim)}
{QWEN_PRETRAIN_KEY}: ''
token_frame_rate: {_y(cfg.token_frame_rate)}
token_mel_ratio: {_y(cfg.token_mel_ratio)}

# streaming: tokens per chunk, and how many past chunks the flow decoder sees (-1: all)
chunk_size: {_y(cfg.chunk_size)}
num_decoding_left_chunks: -1

# model params: the three networks, built in this order (the vocoder's noise depends on it)
llm: !new:{LLM_CLASS}
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: {_y(llm.speech_token_size)}
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:{QWEN_ENCODER_CLASS}
        pretrain_path: !ref <{QWEN_PRETRAIN_KEY}>
    sampling: !name:{RAS_FUNCTION}
        top_p: {_y(ras.top_p)}
        top_k: {_y(ras.top_k)}
        win_size: {_y(ras.win_size)}
        tau_r: {_y(ras.tau_r)}

flow: !new:{FLOW_CLASS}
    input_size: {_y(flow.input_size)}
    output_size: {_y(flow.output_size)}
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {_y(flow.vocab_size)}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: {_ref_or(flow.token_mel_ratio, "token_mel_ratio", cfg.token_mel_ratio)}
    pre_lookahead_len: {_y(flow.pre_lookahead_len)}
    pre_lookahead_layer: !new:{PRE_LOOKAHEAD_CLASS}
        in_channels: {_y(flow.input_size)}
        channels: {_y(flow.pre_lookahead_channels)}
        pre_lookahead_len: {_y(flow.pre_lookahead_len)}
    decoder: !new:{CFM_CLASS}
        in_channels: {_y(3 * flow.output_size)}
        n_spks: 1
        spk_emb_dim: {_y(dit.spk_dim)}
        cfm_params: !new:{CFM_PARAMS_CLASS}
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: {_y(flow.cfm.t_scheduler)}
                training_cfg_rate: 0.2
                inference_cfg_rate: {_y(flow.cfm.inference_cfg_rate)}
                reg_loss_type: 'l1'
        estimator: !new:{DIT_CLASS}
            dim: {_y(dit.dim)}
            depth: {_y(dit.depth)}
            heads: {_y(dit.heads)}
            dim_head: {_y(dit.dim_head)}
            ff_mult: {_y(dit.ff_mult)}
            mel_dim: {_y(dit.mel_dim)}
            mu_dim: {_y(dit.mu_dim)}
            spk_dim: {_y(dit.spk_dim)}
            out_channels: {_y(dit.out_channels)}
            static_chunk_size: {static_chunk}
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:{HIFT_CLASS}
    in_channels: {_y(hift.in_channels)}
    base_channels: {_y(hift.base_channels)}
    nb_harmonics: {_y(hift.nb_harmonics)}
    sampling_rate: {_ref_or(hift.sampling_rate, "sample_rate", cfg.sample_rate)}
    nsf_alpha: {_y(hift.nsf_alpha)}
    nsf_sigma: {_y(hift.nsf_sigma)}
    nsf_voiced_threshold: {_y(hift.nsf_voiced_threshold)}
    upsample_rates: {_y(hift.upsample_rates)}
    upsample_kernel_sizes: {_y(hift.upsample_kernel_sizes)}
    istft_params:
        n_fft: {_y(hift.istft_n_fft)}
        hop_len: {_y(hift.istft_hop_len)}
    resblock_kernel_sizes: {_y(hift.resblock_kernel_sizes)}
    resblock_dilation_sizes: {_y(hift.resblock_dilation_sizes)}
    source_resblock_kernel_sizes: {_y(hift.source_resblock_kernel_sizes)}
    source_resblock_dilation_sizes: {_y(hift.source_resblock_dilation_sizes)}
    lrelu_slope: {_y(hift.lrelu_slope)}
    audio_limit: {_y(hift.audio_limit)}
    conv_pre_look_right: {_y(hift.conv_pre_look_right)}
    f0_predictor: !new:{F0_CLASS}
        num_class: {_y(hift.f0.num_class)}
        in_channels: {_y(hift.f0.in_channels)}
        cond_channels: {_y(hift.f0.cond_channels)}

# front end: text tokenizer and the prompt-mel extractor
get_tokenizer: !name:{TOKENIZER_FUNCTION}
    token_path: !ref <{QWEN_PRETRAIN_KEY}>
    skip_special_tokens: True
    version: cosyvoice3
allowed_special: 'all'
feat_extractor: !name:{MEL_FUNCTION}
    n_fft: {_y(feat.n_fft)}
    num_mels: {_y(feat.num_mels)}
    sampling_rate: {_ref_or(feat.sampling_rate, "sample_rate", cfg.sample_rate)}
    hop_size: {_y(feat.hop_size)}
    win_size: {_y(feat.win_size)}
    fmin: {_y(feat.fmin)}
    fmax: {_y(feat.fmax)}
    center: {_y(feat.center)}
"""
