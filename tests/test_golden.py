"""`cosyvoice-golden`: every golden case and graph passes on the CPU (bit for bit on the reference backend),
without torch; every graph spec and mode has a golden; a divergence is located; bad input gives one line
and exit status 2; `update` reproduces a stored expectation from the torch reference."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from cosyvoice_golden.cases import CASES_FILE, DATA_DIR, Cases, GoldenCase, load_cases
from cosyvoice_golden.cli import main
from cosyvoice_golden.run import CaseRun, Runtime, cpu_signature
from cosyvoice_golden.store import case_paths, graph_paths, read_case, read_graph, write_case
from cosyvoice_graphs import SPECS
from cosyvoice_graphs.bundle_layout import MODEL_YAML
from cosyvoice_runtime import bundle_source
from cosyvoice_runtime.bundle_source import CACHE_DIR_ENV
from cosyvoice_runtime.errors import RuntimeBundleError, SynthesisError
from cosyvoice_runtime.frontend import contains_chinese
from cosyvoice_runtime.synthesis import Mode

SHORT = "zero-shot-en-greedy"
STREAMED = "zero-shot-en-stream-greedy"


@pytest.fixture(scope="module")
def cases() -> Cases:
    return load_cases()


def _golden(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def _copy(folder: Path, *names: str) -> Path:
    """The package's cases file with the golden files of `names`, in `folder`; returns the cases file."""
    (folder / DATA_DIR).mkdir(parents=True)
    shutil.copy(CASES_FILE, folder / CASES_FILE.name)
    for name in names:
        for path in case_paths(CASES_FILE.parent / DATA_DIR, name):
            shutil.copy(path, folder / DATA_DIR / path.name)
    return folder / CASES_FILE.name


def _recorded_on_this_cpu(name: str) -> bool:
    """Whether case `name`'s golden was recorded on a CPU with this one's kernel-relevant features: only
    there can its bits be expected (the CPUs these tests run on vary)."""
    return read_case(CASES_FILE.parent / DATA_DIR, name).reference.get("cpu") == cpu_signature()


def _one_error_line(result: Result, message: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output


# --- coverage -----------------------------------------------------------------------------------------


def test_every_graph_spec_and_mode_has_a_golden(cases: Cases) -> None:
    assert set(cases.graphs) == set(SPECS), "a registered graph spec has no golden bundle in cases.toml"
    for graph in SPECS:
        assert all(p.is_file() for p in graph_paths(cases.data_dir, graph)), graph
    for case in cases.cases.values():
        assert all(p.is_file() for p in case_paths(cases.data_dir, case.name)), case.name
    all_cases = list(cases.cases.values())
    for mode in Mode:
        assert {c.stream for c in all_cases if c.mode is mode} == {False, True}, f"{mode}: offline, streamed"
    assert {c.sampling for c in all_cases} == {"greedy", "ras"}
    assert {contains_chinese(c.text) for c in all_cases} == {True, False}
    assert any(c.speed != 1.0 for c in all_cases)
    assert any(len(read_case(cases.data_dir, c.name).segments) > 1 for c in all_cases), "a long text"


# --- the check ----------------------------------------------------------------------------------------


def test_check_passes_every_case_bit_for_bit(cases: Cases) -> None:
    result = _golden("check")
    print(result.output)
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == len(cases.cases) + len(cases.graphs) + 1
    for name in cases.cases:
        line = next(line for line in lines if line.split()[1] == name)
        judged = "cpu · exact:" if _recorded_on_this_cpu(name) else "cpu · tolerance (recorded on another CPU"
        assert line.startswith("✓") and judged in line, line
    assert all(any(line.startswith(f"✓ graph {g} ") for line in lines) for g in cases.graphs)


def test_check_runs_without_torch() -> None:
    script = textwrap.dedent(f"""
        import sys
        sys.modules.update(dict.fromkeys(("torch", "cosyvoice_export", "transformers"), None))  # unimportable
        from cosyvoice_golden.cli import main
        main(["check", "--case", {SHORT!r}, "--graph", "hift_f0"])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "2 of 2 passed" in proc.stdout


def test_other_threads_are_judged_by_tolerance() -> None:
    result = _golden("check", "--case", SHORT, "--threads", "2")
    assert result.exit_code == 0, result.output
    assert "cpu · tolerance (2 threads, the reference has 1)" in result.output


def test_a_divergence_names_the_chunk_and_sample(tmp_path: Path) -> None:
    cases_file = _copy(tmp_path, STREAMED)
    data = tmp_path / DATA_DIR
    golden = read_case(data, STREAMED)
    assert len(golden.segments[0].chunks) >= 3
    chunk = golden.segments[0].chunks[1]
    audio = golden.audio.copy()
    audio[chunk.sample_range[0] + 1234] += 0.5  # the torch reference "moved" there
    write_case(data, replace(golden, audio=audio))
    result = _golden("check", "--cases", str(cases_file), "--case", STREAMED)
    assert result.exit_code == 1, result.output
    line = result.output.splitlines()[0]
    assert line.startswith(f"✗ {STREAMED}") and "max_abs" in line, line
    assert f"diverges at segment 0 chunk 1, sample {chunk.sample_range[0] + 1234}" in line, line

    if not _recorded_on_this_cpu(STREAMED):
        return  # hashes are compared only on the recording CPU's kind
    # a changed hash on the reference backend: located where the output leaves its recorded distance
    last = golden.segments[0].chunks[2]
    chunks = (*golden.segments[0].chunks[:2], replace(last, pcm16_sha256="0" * 64, reference_max_abs=0.0))
    write_case(data, replace(golden, segments=(replace(golden.segments[0], chunks=chunks),)))
    result = _golden("check", "--cases", str(cases_file), "--case", STREAMED)
    assert result.exit_code == 1, result.output
    line = result.output.splitlines()[0]
    assert "PCM16 sha256 differs; diverges at segment 0 chunk 2, sample" in line, line


def test_a_mel_bound_judges_the_generated_mel(tmp_path: Path) -> None:
    """The torch reference's mel is stored; a case's mel SNR bound is checked against the runtime's mel."""
    cases_file = _copy(tmp_path, SHORT)
    text = cases_file.read_text(encoding="utf-8")
    entry = f'name = "{SHORT}"\n'
    for bound, passes in ((60.0, True), (300.0, False)):
        own = f'{entry}tolerance = {{ cpu = {{ mel_snr_db = {bound} }} }}\n'
        cases_file.write_text(text.replace(entry, own), encoding="utf-8")
        result = _golden("check", "--cases", str(cases_file), "--case", SHORT)
        line = result.output.splitlines()[0]
        assert (result.exit_code == 0) == passes, result.output
        snr = float(line.split("mel snr ")[1].split()[0])
        assert 60 < snr < 300, line  # the runtime's mel within float32 rounding of torch's
        if not passes:
            assert f"mel snr {snr:.1f} < 300 dB" in line, line


# --- bad input ----------------------------------------------------------------------------------------


def test_unknown_case_or_graph() -> None:
    _one_error_line(_golden("check", "--case", "no-such-case"), "unknown case 'no-such-case'")
    _one_error_line(_golden("check", "--graph", "no-such-graph"), "unknown graph 'no-such-graph'")


@pytest.mark.torch
def test_update_of_an_unknown_case() -> None:
    _one_error_line(_golden("update", "--case", "no-such-case"), "unknown case 'no-such-case'")


def test_missing_golden_file(tmp_path: Path) -> None:
    """The remedy is the update of this check's cases file and model, not of the package's cases."""
    cases_file = _copy(tmp_path / "none")
    _one_error_line(_golden("check", "--cases", str(cases_file), "--case", SHORT),
                    f"{SHORT}.json: missing; record it with `cosyvoice-golden update --cases {cases_file} "
                    f"--case {SHORT}`")
    cases_file = _copy(tmp_path / "json-only", SHORT)
    (cases_file.parent / DATA_DIR / f"{SHORT}.npz").unlink()
    _one_error_line(_golden("check", "--cases", str(cases_file), "--case", SHORT), f"{SHORT}.npz: missing")


def test_a_damaged_npz_is_named(tmp_path: Path) -> None:
    cases_file = _copy(tmp_path, SHORT)
    npz = cases_file.parent / DATA_DIR / f"{SHORT}.npz"
    npz.write_bytes(npz.read_bytes()[:100])
    result = _golden("check", "--cases", str(cases_file), "--case", SHORT)
    _one_error_line(result, f"{npz}: sha256 is not the one {SHORT}.json records; the pair is damaged")
    assert "not a golden case file" not in result.output


@pytest.mark.parametrize(("old", "new", "message"), [
    ('name = "zero-shot-en-greedy"', 'name = "../escaped"',
     "name '../escaped' must be letters, digits, '.', '_' and '-'"),
    ('name = "zero-shot-en-greedy"', 'name = "zero-shot-en-greedy"\nspeed = 0.0',
     "speed is 0.0, expected a finite number above 0"),
    ('name = "zero-shot-en-greedy"', 'name = "zero-shot-en-greedy"\nmax_tokens = -3',
     "max_tokens is -3, expected at least 1"),
    ('name = "zero-shot-en-greedy"', 'name = "zero-shot-en-greedy"\nseed = -1', "seed is -1, expected 0 to"),
    ("threads = 1", "threads = 0", "reference.threads is 0, expected at least 1"),
    ("cpu = { max_abs = 3e-2,", "cpu = { max_abs = -3e-2,", "max_abs is -0.03, expected a finite number"),
    ("format_version = 1", "format_version = 1\nbogus = 3", "unknown key 'bogus'; a cases file holds "),
    ('name = "zero-shot-en-greedy"',
     'name = "zero-shot-en-greedy"\ntolerance = { cpu = { snr_db = -1e999 } }',
     "tolerance.cpu: snr_db is -inf, expected a finite number"),
])
def test_a_cases_field_out_of_range_is_one_line(tmp_path: Path, old: str, new: str, message: str) -> None:
    """Refused as the cases file is read, before any synthesis (a name with a path would also have written
    its goldens outside the data folder)."""
    cases_file = _copy(tmp_path, SHORT)
    text = cases_file.read_text()
    assert text.count(old) == 1, old
    cases_file.write_text(text.replace(old, new))
    for command in ("check", "update"):
        _one_error_line(_golden(command, "--cases", str(cases_file), "--case", SHORT), message)


def test_a_cases_own_tolerance_overrides_the_bounds_it_names(tmp_path: Path) -> None:
    cases_file = _copy(tmp_path, SHORT)
    text = cases_file.read_text()
    old = f'name = "{SHORT}"'
    cases_file.write_text(text.replace(old, f"{old}\ntolerance = {{ cpu = {{ snr_db = 50.0 }} }}", 1))
    bounds = load_cases(cases_file).cases[SHORT].tolerance["cpu"]  # the rest of [tolerance]'s cpu bounds
    assert (bounds.snr_db, bounds.max_abs, bounds.l1, bounds.mel_snr_db) == (50.0, 3e-2, 2e-3, None)
    result = _golden("check", "--cases", str(cases_file), "--case", SHORT)
    assert result.exit_code == 0, result.output


def test_a_case_named_twice_is_judged_once() -> None:
    result = _golden("check", "--case", SHORT, "--case", SHORT, "--graph", "hift_f0", "--graph", "hift_f0")
    assert result.exit_code == 0 and "2 of 2 passed" in result.output, result.output


@pytest.mark.torch
def test_update_refuses_a_data_folder_it_cannot_write_before_torch(tmp_path: Path) -> None:
    cases_file = _copy(tmp_path / "cases", SHORT)
    shutil.rmtree(cases_file.parent / DATA_DIR)
    (cases_file.parent / DATA_DIR).write_text("")
    result = _golden("update", "--cases", str(cases_file), "--case", SHORT)
    _one_error_line(result, f"the cases' data folder {cases_file.parent / DATA_DIR}: is a file, not a folder")


def test_openvino_is_judged_by_its_bounds() -> None:
    pytest.importorskip("openvino", reason="the openvino extra is not installed")
    result = _golden("check", "--case", SHORT, "--provider", "openvino")
    assert result.exit_code == 0, result.output
    assert "1 of 1 passed (openvino" in result.output


def test_golden_from_another_model(tmp_path: Path) -> None:
    cases_file = _copy(tmp_path, SHORT)
    path = case_paths(tmp_path / DATA_DIR, SHORT)[0]
    data = json.loads(path.read_text())
    data["bundle"]["sources"]["llm.pt"] = "0" * 64
    path.write_text(json.dumps(data))
    _one_error_line(_golden("check", "--cases", str(cases_file), "--case", SHORT),
                    "was recorded from another model than")


@pytest.mark.torch
def test_update_sees_a_graph_golden_of_other_model_constants() -> None:
    """A graph golden whose bundle's model constants differ is rewritten by `update` (not "unchanged"),
    or `check` would refuse it as from another model."""
    from cosyvoice_golden.update import graph_changes

    old = read_graph(CASES_FILE.parent / DATA_DIR, "hift_f0")
    moved = replace(old, bundle={**old.bundle, "model": {**old.bundle["model"], "mel_bins": 81}})
    assert graph_changes(old, old) == "unchanged"
    assert graph_changes(moved, old) == "changed: model"


def test_stale_golden(tmp_path: Path) -> None:
    cases_file = _copy(tmp_path, SHORT)
    text = cases_file.read_text()
    cases_file.write_text(text.replace('text = "Hello there, how are you today?"', 'text = "Hello there."'))
    _one_error_line(_golden("check", "--cases", str(cases_file), "--case", SHORT),
                    "is stale: text changed since it was recorded")


def test_precision_bounds_must_name_a_reduced_precision(tmp_path: Path) -> None:
    cases_file = _copy(tmp_path, SHORT)
    text = cases_file.read_text()
    assert "\nfp16 = { max_abs" in text
    cases_file.write_text(text.replace("\nfp16 = { max_abs", "\nfp8 = { max_abs"))
    _one_error_line(_golden("check", "--cases", str(cases_file), "--case", SHORT),
                    "precision_tolerance: 'fp8' is not one of fp16, int8, int4, bf16")


def test_a_precision_other_than_the_bundles_is_refused() -> None:
    """--precision judges a bundle of that precision by tolerance; on a bundle of another (the demo bundle is
    fp32) it is one line before anything runs, for cases and graphs alike."""
    for selection in (["--case", SHORT], ["--graph", "hift_f0"]):
        result = _golden("check", *selection, "--precision", "int8")
        _one_error_line(result, "was exported with --precision fp32 (its manifest); give --precision fp32")
        assert result.output.startswith("error: --precision int8: ")


def test_a_model_bundle_of_another_model_is_refused_before_its_export(
        tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--model` on a model bundle exports it (minutes) before the goldens are held against its manifest: one
    whose source files are not those the goldens were recorded from is refused before that, by its yaml
    (hashed first, the smallest), where the model they were recorded from goes on to its export."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))

    def export(*_: object, **__: object) -> None:
        raise RuntimeBundleError("the export is not run here")

    monkeypatch.setattr(bundle_source, "_export", export)
    result = _golden("check", "--case", SHORT, "--graph", "hift_f0", "--model", str(tiny_bundle))
    _one_error_line(result, "the export is not run here")
    other = shutil.copytree(tiny_bundle, tmp_path / "other")
    with open(other / MODEL_YAML, "a", encoding="utf-8") as yaml:
        yaml.write("# another model\n")
    result = _golden("check", "--case", SHORT, "--model", str(other))
    golden = case_paths(CASES_FILE.parent / DATA_DIR, SHORT)[0]
    _one_error_line(result, f"{golden} was recorded from another model than {other}: sources {MODEL_YAML} ")
    assert not (tmp_path / "cache").exists()


def test_a_bundle_whose_graphs_are_all_fp32_is_judged_as_fp32(tmp_path: Path) -> None:
    """A list that names graphs in fp32 (`--precision decode=fp32` writes one) makes an fp32 bundle: its cases
    are judged by their own bounds, with no --precision to give."""
    from cosyvoice_runtime.demo import DEMO_BUNDLE

    bundle = shutil.copytree(DEMO_BUNDLE, tmp_path / "bundle")
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["precision"] = "llm=fp32"
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    result = _golden("check", "--case", SHORT, "--model", str(bundle))
    assert result.exit_code == 0, result.output
    assert "1 of 1 passed" in result.output


def _failing_synthesis(monkeypatch: pytest.MonkeyPatch, name: str, message: str) -> None:
    """Case `name`'s synthesis on the runtime raises the runtime's `SynthesisError` with `message`."""
    real = Runtime.run

    def run(self: Runtime, case: GoldenCase) -> CaseRun:
        if case.name == name:
            raise SynthesisError(message)
        return real(self, case)

    monkeypatch.setattr(Runtime, "run", run)


def test_a_synthesis_failing_in_a_case_is_that_cases_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case's ✗ line names it and the error; the other cases and graphs are still judged, the summary
    printed, and the exit status is a failure's (1), not bad input's."""
    message = "the LLM sampled stop id 6627 after the text, which upstream's bistream refuses"
    _failing_synthesis(monkeypatch, SHORT, message)
    result = _golden("check", "--case", SHORT, "--case", STREAMED, "--graph", "hift_f0")
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert lines[0].startswith(f"✗ {SHORT}") and lines[0].endswith(f"cpu: synthesis failed — {message}")
    assert lines[1].startswith(f"✓ {STREAMED}") and lines[2].startswith("✓ graph hift_f0")
    assert lines[3].startswith("2 of 3 passed")


# --- update -------------------------------------------------------------------------------------------


@pytest.mark.torch
def test_a_synthesis_failing_in_update_names_the_case(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """An update cannot record a failing case: it stops, in one line naming the case, writing nothing."""
    from cosyvoice_golden import update

    message = "3304 mel frames (prompt included) exceed the flow noise table's 3000"
    _failing_synthesis(monkeypatch, SHORT, message)
    cases_file = _copy(tmp_path, SHORT)
    before = {p: p.read_bytes() for p in (tmp_path / DATA_DIR).iterdir()}
    _one_error_line(_golden("update", "--cases", str(cases_file), "--case", SHORT),
                    f"error: case {SHORT}: {message}")

    def refused(*args: object) -> None:  # upstream's refusal, which the torch reference mirrors
        raise ValueError("should not get token 6562")

    monkeypatch.setattr(update, "reference_segments", refused)
    _one_error_line(_golden("update", "--cases", str(cases_file), "--case", SHORT),
                    f"error: case {SHORT}: the torch reference failed: should not get token 6562")
    assert {p: p.read_bytes() for p in (tmp_path / DATA_DIR).iterdir()} == before


@pytest.mark.torch
def test_update_reproduces_the_stored_expectation(tmp_path: Path) -> None:
    """The demo model rebuilt from its recipe, the torch reference, the runtime on the reference backend:
    the stored golden, unchanged and not rewritten."""
    if not _recorded_on_this_cpu(SHORT):
        pytest.skip(f"{SHORT}'s golden was recorded on another CPU kind (this is {cpu_signature()}): "
                    f"its bits cannot be reproduced here")
    cases_file = _copy(tmp_path, SHORT)
    before = {p: p.read_bytes() for p in case_paths(tmp_path / DATA_DIR, SHORT)}
    result = _golden("update", "--cases", str(cases_file), "--case", SHORT)
    print(result.output)
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[0].startswith(f"✓ {SHORT}")
    assert result.output.strip().endswith("unchanged")
    assert {p: p.read_bytes() for p in before} == before
