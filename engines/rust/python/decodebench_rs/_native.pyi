from collections.abc import Callable

import torch

BUILD: dict[str, str]

def torch_version() -> str: ...
def shim_op(name: str, tensors: list[torch.Tensor], scalars: list[float]) -> torch.Tensor: ...

class Engine:
    """Gemma 4 with a ring cache. Unsendable: only the thread that built it may call it."""

    def __init__(
        self,
        config_dict: dict[str, object],
        weights: dict[str, torch.Tensor],
        like: torch.Tensor,
        linears: dict[str, tuple[object, ...]] | None = ...,
        tables: dict[str, tuple[object, ...]] | None = ...,
    ) -> None: ...
    def decode(
        self,
        ids: list[int],
        max_new: int,
        stop: list[int] = ...,
        read_every: int = ...,
        on_tokens: Callable[[list[int]], bool] | None = ...,
        return_logits: bool = ...,
        last_rows: int = ...,
    ) -> tuple[list[int], str, torch.Tensor | None]: ...
    @property
    def layout(self) -> dict[str, int]: ...
    @property
    def cache_bytes(self) -> int: ...
    @property
    def read_rows(self) -> list[int]:
        """The rows each piece of the last prompt was read as."""
    @property
    def timers(self) -> dict[str, float]:
        """The last decode's read_s and decode_s."""
