"""Regenerate the message and gRPC modules from `cosyvoice.proto` (a developer's tool: needs grpcio-tools).

    python -m cosyvoice_serve.proto.generate

The generated modules are committed: installing the server then needs the grpcio and protobuf wheels only,
with no code generator and no build step (an editable install included). protoc sees the .proto under its
import path, `cosyvoice_serve/proto/`, so that the gRPC module imports the message module by that path.
The generated code refuses protobuf and grpcio runtimes older than the generator's; the `serve` extra's
lower bounds follow the `grpcio-tools` pinned in the `dev` extra, and change with it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

PROTO = Path(__file__).with_name("cosyvoice.proto")
IMPORT_PATH = "cosyvoice_serve/proto"
"""Where the .proto sits for protoc, and so the package the generated imports name."""
GENERATED = ("cosyvoice_pb2.py", "cosyvoice_pb2.pyi", "cosyvoice_pb2_grpc.py")


def generate(out: Path, *, descriptor_set: Path | None = None) -> list[Path]:
    """Write the generated modules into `out` (and the .proto's `FileDescriptorSet` to `descriptor_set`)."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory(prefix="cosyvoice-protoc-") as folder:
        args = ["protoc", f"-I{IMPORT_PATH}={PROTO.parent}",
                f"--python_out={folder}", f"--pyi_out={folder}", f"--grpc_python_out={folder}"]
        if descriptor_set is not None:
            args.append(f"--descriptor_set_out={descriptor_set}")
        if protoc.main([*args, f"{IMPORT_PATH}/{PROTO.name}"]) != 0:
            raise RuntimeError(f"protoc failed on {PROTO}")
        written = []
        for name in GENERATED:
            written.append(out / name)
            shutil.copyfile(Path(folder, IMPORT_PATH, name), out / name)
    return written


if __name__ == "__main__":
    for path in generate(PROTO.parent):
        print(path)
