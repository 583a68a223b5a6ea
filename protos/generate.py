"""Regenerate the Python code of every `.proto` in this folder.

    python -m pdserve.protos.generate            # rewrite the *_pb2*.py files
    python -m pdserve.protos.generate --check    # exit 1 if they are stale (CI)

Imports in the generated gRPC module are rewritten to the package path, since protoc
writes `import kv_transfer_pb2` as if the folder were on sys.path.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency, pinned in pyproject.toml

    protos = sorted(HERE.glob("*.proto"))
    for proto in protos:
        args = [
            "protoc",
            f"-I{HERE}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto.name}")
    outputs = sorted(out_dir.glob("*_pb2*.py*"))
    for path in outputs:
        text = re.sub(
            r"^import (\w+_pb2) as",
            r"from pdserve.protos import \1 as",
            path.read_text(),
            flags=re.M,
        )
        path.write_text(text)
    return outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        if args.check:
            stale = [p.name for p in fresh if not _same(HERE / p.name, p)]
            if stale:
                print(f"stale generated code: {stale}; run: python -m pdserve.protos.generate")
                return 1
            print("generated protobuf code is current")
            return 0
        for path in fresh:
            (HERE / path.name).write_bytes(path.read_bytes())
            print(f"wrote protos/{path.name}")
    return 0


def _same(committed: Path, fresh: Path) -> bool:
    return committed.exists() and committed.read_bytes() == fresh.read_bytes()


if __name__ == "__main__":
    sys.exit(main())
