"""Generate the Python stubs for protos/*.proto (run by `make proto`).

protoc names a generated module after the .proto path, and the descriptor file name must
stay "grpc_service.proto" so it is identical to the one tritonclient registers (see the
header of grpc_service.proto). The stubs therefore come out with top-level imports
(`import model_config_pb2`); this script turns those into package-relative ones.
"""

import re
import sys
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent
PROTOS = ["model_config.proto", "grpc_service.proto", "routing.proto", "usage.proto"]


def main() -> int:
    args = [
        "protoc",
        f"-I{HERE}",
        f"--python_out={HERE}",
        f"--pyi_out={HERE}",
        f"--grpc_python_out={HERE}",
        *(str(HERE / p) for p in PROTOS),
    ]
    if protoc.main(args) != 0:
        return 1
    for path in HERE.glob("*_pb2*.py*"):
        text = path.read_text()
        fixed = re.sub(r"^import (\w+_pb2) as ", r"from . import \1 as ", text, flags=re.M)
        fixed = re.sub(r"^from (\w+_pb2) import ", r"from .\1 import ", fixed, flags=re.M)
        path.write_text(fixed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
