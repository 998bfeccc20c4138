"""decodebench's Rust engine: Gemma 4 in Rust over ATen, built against the installed torch.

``import torch`` first loads libtorch, so the extension's libraries resolve; a module built for
another torch refuses to load (the C++ ABI differs between releases).
"""

import torch

from ._native import BUILD, Engine, shim_op, torch_version

if BUILD["torch"] != torch.__version__:
    raise ImportError(
        f"decodebench_rs was built against torch {BUILD['torch']} but torch {torch.__version__} is installed; "
        "rebuild it with `make setup`"
    )

__all__ = ["BUILD", "Engine", "shim_op", "torch_version"]
