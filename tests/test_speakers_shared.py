"""A speaker registry folder shared by several processes (server replicas): each sees the others' changes,
their writes merge, and `tidy` never takes a file another writer is registering."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np

from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.speakers import LOCK, REGISTRY, SpeakerRegistry


def features(seed: int) -> PromptFeatures:
    rng = np.random.default_rng(seed)
    return PromptFeatures(rng.integers(0, 100, (1, 4)), rng.standard_normal((1, 8, 80)).astype(np.float32),
                          rng.standard_normal((1, 192)).astype(np.float32))


def test_a_registry_sees_another_registrys_changes(tmp_path: Path) -> None:
    one, two = SpeakerRegistry(tmp_path, "fp"), SpeakerRegistry(tmp_path, "fp")
    one.add("alice", "hello", features(0))
    assert two.names() == ["alice"]
    alice = two.get("alice")
    assert alice is not None and np.array_equal(alice.features.mel, features(0).mel)
    two.add("bob", "hi", features(1))  # merged into the registry one wrote, not over it
    assert one.names() == two.names() == SpeakerRegistry(tmp_path, "fp").names() == ["alice", "bob"]
    assert two.get("alice") is alice  # an unchanged entry's features are not read again
    one.add("alice", "hello again", features(2))
    replaced = two.get("alice")
    assert replaced is not None and replaced.prompt_text == "hello again"
    assert np.array_equal(replaced.features.mel, features(2).mel)
    assert two.remove("bob") and one.names() == ["alice"] and not one.remove("bob")
    assert len(list(tmp_path.glob("*.npz"))) == 1  # replaced and removed features are gone


def test_writers_in_several_processes_lose_nothing(tmp_path: Path) -> None:
    writer = textwrap.dedent("""
        import sys
        from pathlib import Path
        import numpy as np
        from cosyvoice_runtime.frontend import PromptFeatures
        from cosyvoice_runtime.speakers import SpeakerRegistry
        registry = SpeakerRegistry(Path(sys.argv[1]), "fp")
        features = PromptFeatures(np.zeros((1, 4), np.int64), np.zeros((1, 8, 80), np.float32),
                                  np.zeros((1, 192), np.float32))
        for i in range(10):
            registry.add(f"{sys.argv[2]}-{i}", "text", features)
        registry.tidy()
    """)
    writers = [subprocess.Popen([sys.executable, "-c", writer, str(tmp_path), f"w{w}"]) for w in range(4)]
    assert [w.wait(60) for w in writers] == [0] * 4
    names = SpeakerRegistry(tmp_path, "fp").names()
    assert names == sorted(f"w{w}-{i}" for w in range(4) for i in range(10))
    assert len(list(tmp_path.glob("*.npz"))) == len(names)


def test_tidy_waits_for_a_writer_between_its_two_writes(tmp_path: Path) -> None:
    registry = SpeakerRegistry(tmp_path, "fp")
    registry.add("alice", "hello", features(0))
    with (tmp_path / LOCK).open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process, holding the lock: its features file is written
        pending = features(1)
        np.savez(tmp_path / "pending.npz", speech_tokens=pending.speech_tokens, mel=pending.mel,
                 embedding=pending.embedding)
        failed: list[BaseException] = []

        def tidy_up() -> None:
            try:
                SpeakerRegistry(tmp_path, "fp").tidy()
            except BaseException as e:
                failed.append(e)

        tidy = threading.Thread(target=tidy_up)
        tidy.start()
        tidy.join(0.3)
        assert tidy.is_alive()  # waits for the lock
        registry_file = tmp_path / REGISTRY
        registry_file.write_text(registry_file.read_text().replace('"speakers": {',
                                 '"speakers": {"pending": {"file": "pending.npz", "prompt_text": "x", '
                                 '"frontend": "fp"},'))
    tidy.join(10)
    assert not tidy.is_alive() and not failed
    assert (tmp_path / "pending.npz").exists()  # registered by then: kept
    assert SpeakerRegistry(tmp_path, "fp").names() == ["alice", "pending"]


def test_an_unreadable_features_file_leaves_its_speaker_out(tmp_path: Path) -> None:
    SpeakerRegistry(tmp_path, "fp").add("alice", "hello", features(0))
    for npz in tmp_path.glob("*.npz"):
        npz.write_bytes(b"")  # truncated
    assert SpeakerRegistry(tmp_path, "fp").names() == []
