"""Generate the Python gRPC stubs from protos/ into specdec/v1/.

The stubs are committed. `python scripts/gen_protos.py --check` regenerates them
into a temporary folder and fails when they differ from the committed ones (CI runs it).

Post-processing (deterministic, part of the generation): grpcio-tools stamps the
gencode with a protobuf runtime-version check and a grpcio version check. Both are
removed so that the stubs import on images with an older protobuf/grpcio and no
grpcio-tools (the GPU image). The messages use only the descriptor builder API,
present since protobuf 3.20.
"""
from __future__ import annotations

import argparse
import difflib
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_PACKAGE = ROOT / "specdec" / "v1"
PROTOS = sorted(p.relative_to(PROTO_DIR).as_posix() for p in (PROTO_DIR / "specdec" / "v1").glob("*.proto"))


def _strip_version_checks(path: Path) -> None:
    """Drop the runtime-version guards that grpcio-tools writes into the gencode."""
    out: list[str] = []
    skipping = False
    for line in path.read_text().splitlines(keepends=True):
        if skipping:
            # a guard block ends at the first line back at column 0 that is not its closing
            if line.strip() == ")" or line.startswith((" ", "\t")) or line.startswith("except ImportError"):
                continue
            skipping = False
        if line.startswith("from google.protobuf import runtime_version"):
            continue
        if line.startswith(("_runtime_version.ValidateProtobufRuntimeVersion(", "try:", "if _version_not_supported:")):
            skipping = True
            continue
        if line.startswith(("GRPC_GENERATED_VERSION", "GRPC_VERSION", "_version_not_supported")):
            continue
        out.append(line)
    text = re.sub(r"\n{3,}", "\n\n\n", "".join(out))
    path.write_text(text)


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc  # only needed to regenerate

    args = ["protoc", f"-I{PROTO_DIR}", f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", *PROTOS]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    files = sorted((out_root / "specdec" / "v1").glob("*_pb2*.py*"))
    for f in files:
        _strip_version_checks(f)
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed stubs differ from a fresh generation")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        if a.check:
            bad = 0
            for f in files:
                committed = OUT_PACKAGE / f.name
                old = committed.read_text() if committed.exists() else ""
                if old != f.read_text():
                    bad += 1
                    sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), f.read_text().splitlines(True), str(committed), "regenerated"))
            print("stubs up to date" if not bad else f"{bad} stub file(s) differ: run python scripts/gen_protos.py")
            return 1 if bad else 0
        OUT_PACKAGE.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copy(f, OUT_PACKAGE / f.name)
        (OUT_PACKAGE / "__init__.py").write_text('"""Generated gRPC stubs (see scripts/gen_protos.py)."""\n')
        print("\n".join(str((OUT_PACKAGE / f.name).relative_to(ROOT)) for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
