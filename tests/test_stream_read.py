"""``decodebench_read.stream`` (engines/cpu_kernels.py, ``reads``): the streaming read a CPU roofline divides by beside
torch's reductions. It must read every byte: its XOR of the tensor's 64-bit words (the last partial word zero-padded)
equals numpy's over sizes that split into the threads' blocks, leave a partial line or a partial word, and are empty;
a tensor it cannot read front to back is refused by name; it is offered for this CPU only, never for an accelerator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decodebench.device import Device, resolve_device
from engines import cpu_kernels

SIZES = [0, 1, 7, 63, 64, 65, 4096 + 9, 64 * 1024 * 3 + 1, 2**22 + 13]  # bytes: the block of 64 KiB the threads share


@pytest.fixture(scope="module", autouse=True)
def _runs_here():
    reason = cpu_kernels.missing()
    if reason:
        pytest.skip(f"decodebench_read.stream: {reason}")


def numpy_xor(data: np.ndarray) -> int:
    """The XOR of ``data``'s bytes as 64-bit little-endian words, the last one zero-padded, as a signed int64."""
    padded = np.zeros(-(-data.size // 8) * 8, np.uint8)
    padded[: data.size] = data
    folded = np.bitwise_xor.reduce(padded.view("<u8")) if padded.size else np.uint64(0)
    return int(np.uint64(folded).view(np.int64))


@pytest.mark.parametrize("size", SIZES)
def test_it_reads_every_byte(size):
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
    assert int(torch.ops.decodebench_read.stream(data)) == numpy_xor(data.numpy())
    if size >= 64:  # one flipped bit anywhere changes it: the last byte, and one in the middle of a thread's block
        for where in (size - 1, size // 2):
            changed = data.clone()
            changed[where] ^= 1
            assert int(torch.ops.decodebench_read.stream(changed)) != int(torch.ops.decodebench_read.stream(data))


def test_any_dtype_is_read_as_its_bytes():
    x = torch.randn(1000, 3, dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    assert int(torch.ops.decodebench_read.stream(x)) == numpy_xor(x.numpy().view(np.uint8).reshape(-1))


def test_a_tensor_not_laid_out_front_to_back_is_refused_by_name():
    with pytest.raises(RuntimeError, match="x: a contiguous tensor"):
        torch.ops.decodebench_read.stream(torch.zeros(64, 64).t())


def test_it_is_offered_for_this_cpu_and_never_for_an_accelerator():
    assert list(cpu_kernels.reads(resolve_device("cpu"))) == [cpu_kernels.STREAM_READ]
    accelerator = Device("cuda", torch.device("cpu"), "a GPU")  # its memory is not what the library reads
    assert cpu_kernels.reads(accelerator) == {}
