from collections.abc import Callable

import torch

BUILD: dict[str, str]

def torch_version() -> str: ...
def shim_op(name: str, tensors: list[torch.Tensor], scalars: list[float]) -> torch.Tensor: ...

class Engine:
    """Gemma 4 with a ring cache. Unsendable: only the thread that built it may call it."""

    def __init__(
        self, config_dict: dict[str, object], weights: dict[str, torch.Tensor], like: torch.Tensor
    ) -> None: ...
    def decode(
        self,
        ids: list[int],
        max_new: int,
        stop: list[int] = ...,
        read_every: int = ...,
        on_tokens: Callable[[list[int]], bool] | None = ...,
        return_logits: bool = ...,
    ) -> tuple[list[int], str, torch.Tensor | None]: ...
    @property
    def layout(self) -> dict[str, int]: ...
    @property
    def cache_bytes(self) -> int: ...
    @property
    def timers(self) -> dict[str, float]:
        """The last decode's read_s and decode_s."""
