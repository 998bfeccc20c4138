"""Device selection rules and memory readings (the TPU and CUDA branches are exercised by the rules)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from decodebench.config import HardwareConfig
from decodebench.device import DeviceUnavailable, resolve_device, select_kind
from tests.conftest import make_cfg


@pytest.mark.parametrize(
    ("requested", "tpu", "cuda", "expected"),
    [
        ("auto", True, True, "tpu"),
        ("auto", False, True, "cuda"),
        ("auto", False, False, "cpu"),
        ("cpu", True, True, "cpu"),
        ("cuda", False, True, "cuda"),
        ("tpu", True, False, "tpu"),
    ],
)
def test_selection_rule(requested, tpu, cuda, expected):
    assert select_kind(requested, has_tpu=tpu, has_cuda=cuda) == expected


@pytest.mark.parametrize(("requested", "message"), [("tpu", "no TPU"), ("cuda", "cuda.is_available")])
def test_absent_device_fails_clearly(requested, message):
    with pytest.raises(DeviceUnavailable, match=message):
        select_kind(requested, has_tpu=False, has_cuda=False)


@pytest.mark.parametrize(
    ("override", "valid"),
    [
        ("device.kind=gpu", "auto, tpu, cuda, cpu"),
        ("dtype=float64", "bfloat16, float16, float32"),
        ("engine=static engine.mode=fast", "eager, fuse"),
        ("model.tables=int8", "bf16, int4"),
        ("model.source=s3", "synthetic, hub"),
    ],
)
def test_a_value_outside_its_enum_is_refused_when_composed(override, valid):
    with pytest.raises(ConfigCompositionException) as caught:
        make_cfg(*override.split())
    bad = override.split()[-1].split("=")[1]
    assert f"Invalid value '{bad}', expected one of [{valid}]" in str(caught.value.__cause__)


def test_cpu_memory_readings_name_their_counter():
    device = resolve_device("cpu")
    device.reset_peak()
    now = device.memory_now()
    assert now.bytes > 0 and "VmRSS" in now.counter
    block = bytearray(64 * 2**20)  # 64 MiB touched: the peak must see it
    block[::4096] = b"\x01" * len(block[::4096])
    peak = device.peak_memory()["rss"]
    assert "VmHWM" in peak.counter and peak.bytes >= now.bytes + 60 * 2**20
    del block


def test_bandwidth_is_measured_once_per_host_and_sweep(tmp_path):
    from decodebench import hardware

    device = resolve_device("cpu")
    first = hardware.bandwidth(device, tmp_path, "s1")
    again = hardware.bandwidth(device, tmp_path, "s1")
    assert again["value"] == first["value"] and again["file"] == first["file"]
    assert len(first["samples"]) == hardware.BANDWIDTH_COPIES and first["value"] == max(first["samples"])
    assert isinstance(first["contention"]["contended"], bool) and isinstance(first["contended_tries"], list)
    assert hardware.bandwidth(device, tmp_path, "s2")["file"] != first["file"]


# (contended per try, read kept GB/s, tries listed, the kept one contended): quiet at once, at the third, never
BUSY_TRIES = [((False,), 10.0, 0, False), ((True, True, False), 30.0, 2, False), ((True,) * 4, 30.0, 2, True)]


@pytest.mark.parametrize(("busy", "kept", "tries", "still_busy"), BUSY_TRIES)
def test_a_sweep_read_taken_while_the_machine_was_busy_is_taken_again(monkeypatch, busy, kept, tries, still_busy):
    """The sweep's read is measured again while other processes kept the cores busy, three times in all by default;
    the last try is kept with its contention, the ones before it listed with theirs."""
    from decodebench import hardware

    reads_taken, watched = iter([10.0, 20.0, 30.0, 40.0]), iter(busy)

    class Watch:
        def measure(self) -> dict:
            return {"contended": next(watched), "other_cores": 1.0}

    monkeypatch.setattr(hardware, "Contention", Watch)
    monkeypatch.setattr(hardware, "measure_bandwidth", lambda device, repeats, reads: {"value": next(reads_taken)})
    monkeypatch.setattr(hardware, "BANDWIDTH_PAUSE_S", 0.0)
    monkeypatch.delenv(hardware.READ_TRIES, raising=False)  # the default (the tests' conftest sets 1)
    read = hardware.uncontended_read(resolve_device("cpu"))
    assert read["value"] == kept and len(read["contended_tries"]) == tries
    assert [t["value"] for t in read["contended_tries"]] == [10.0, 20.0][:tries]
    assert all(t["contention"]["contended"] for t in read["contended_tries"])
    assert read["contention"]["contended"] is still_busy


@pytest.mark.parametrize("tries", ["0", "two", "-1", ""])
def test_a_read_tries_setting_that_is_no_count_is_refused_by_name(monkeypatch, tries):
    from decodebench import hardware

    monkeypatch.setenv(hardware.READ_TRIES, tries)
    with pytest.raises(ValueError, match=f"DECODEBENCH_READ_TRIES={tries!r}: the times a contended sweep read"):
        hardware.uncontended_read(resolve_device("cpu"))


def test_the_roofline_divides_by_a_streaming_read_with_the_copy_beside_it(tmp_path):
    from decodebench import hardware

    device = resolve_device("cpu")
    first = hardware.bandwidth(device, tmp_path, "s1")
    assert first["method"].startswith("the best of torch sum float32, sum int64, amax uint8 over")
    assert "bytes read / seconds" in first["method"]
    reductions = first["reductions"]
    assert sorted(reductions) == ["amax uint8", "sum float32", "sum int64"]
    assert [len(samples) for samples in reductions.values()] == [hardware.BANDWIDTH_COPIES] * 3
    assert first["samples"] == [max(each) for each in zip(*reductions.values(), strict=True)], "each repeat's best"
    copy = first["copy"]
    assert copy["method"].startswith("torch copy_") and copy["value"] == max(copy["samples"])
    assert len(copy["samples"]) == len(first["samples"]) == hardware.BANDWIDTH_COPIES
    older = {k: v for k, v in json.loads(Path(first["file"]).read_text()).items() if k != "copy"}
    Path(first["file"]).write_text(json.dumps(older | {"value": 1.0e6}))  # a file measured before the read was
    assert hardware.bandwidth(device, tmp_path, "s1")["value"] != 1.0e6, "measured again, read and copy"


def test_a_callers_read_is_taken_beside_torchs_and_a_sweep_file_without_it_is_measured_again(tmp_path):
    """``reads`` (the project's stream read, where its kernels run): taken every repeat after torch's reductions, its
    samples kept by name and in each repeat's best, named in the method; a sweep's file taken before it was offered
    is measured again, one that holds it reused."""
    import torch

    from decodebench import hardware

    device, seen = resolve_device("cpu"), []

    def fast(x):  # a read that reports every pass: it is given the whole buffer
        seen.append(x.nbytes)
        return x.view(torch.uint8).amax()

    without = hardware.bandwidth(device, tmp_path, "s1")
    assert "a read" not in without["reductions"]
    first = hardware.bandwidth(device, tmp_path, "s1", {"a read": fast})
    assert first["file"] == without["file"] and first["samples"] != without["samples"], "measured again, with it"
    assert list(first["reductions"]) == ["sum float32", "sum int64", "amax uint8", "a read"]
    assert seen == [first["bytes"]] * hardware.BANDWIDTH_COPIES
    assert first["samples"] == [max(each) for each in zip(*first["reductions"].values(), strict=True)]
    assert first["method"].startswith("the best of torch sum float32, sum int64, amax uint8 and a read over ")
    assert hardware.bandwidth(device, tmp_path, "s1", {"a read": fast})["samples"] == first["samples"], "reused"
    assert hardware.bandwidth(device, tmp_path, "s1")["samples"] == first["samples"], "holds more than asked: reused"
    now = hardware.read_now(device, {"a read": fast})
    assert len(now["reductions"]["a read"]) == hardware.CELL_READS and "copy" not in now


def test_the_bf16_matmul_rate_is_measured_beside_the_bandwidth_and_added_to_an_older_file(tmp_path):
    from decodebench import hardware

    device = resolve_device("cpu")
    first = hardware.bandwidth(device, tmp_path, "s1")
    matmul = first["matmul"]
    assert matmul["unit"] == "GFLOP/s" and matmul["value"] == max(matmul["samples"]) and len(matmul["samples"]) == 10
    assert "torch mm of bf16 [512, 1536] x [1536, 6144]" in matmul["method"]
    older = {k: v for k, v in json.loads(Path(first["file"]).read_text()).items() if k != "matmul"}
    Path(first["file"]).write_text(json.dumps(older | {"value": 1.0e6}))  # a sweep's file from before the matmul
    again = hardware.bandwidth(device, tmp_path, "s1")
    assert again["value"] == 1.0e6, "the sweep's read figure kept: every cell divides by the same bandwidth"
    assert again["matmul"]["samples"] != matmul["samples"] and "matmul" in json.loads(Path(first["file"]).read_text())
    block = hardware.resolve(HardwareConfig(name="cpu"), device, tmp_path, "s1")
    assert block["peak_bf16_tflops"] == again["matmul"]["value"] / 1e3 and block["peak_source"] == "measured"
    assert block["matmul_measurement"]["samples"] == again["matmul"]["samples"]
    bandwidth_given = hardware.resolve(HardwareConfig(name="x", memory_bandwidth_gb_s=800.0), device, tmp_path, "s1")
    assert "bandwidth_measurement" not in bandwidth_given, "a measured read it does not use is not recorded as its own"
    assert bandwidth_given["memory_bandwidth_gb_s"] == 800.0 and "matmul_measurement" in bandwidth_given
    facts = hardware.resolve(HardwareConfig(name="x", memory_bandwidth_gb_s=800.0, peak_bf16_tflops=197.0), device,
                             tmp_path, "s1")  # fmt: skip
    assert (facts["peak_bf16_tflops"], facts["peak_source"], "bandwidth_measurement" in facts) == (
        197.0, "facts file", False)  # fmt: skip


def test_a_bandwidth_file_from_another_host_or_device_is_never_reused(tmp_path, monkeypatch):
    from decodebench import hardware
    from decodebench.device import Device

    device = resolve_device("cpu")
    first = hardware.bandwidth(device, tmp_path, "s1")
    other = Device(kind="cpu", name="another cpu", torch_device=device.torch_device)
    assert hardware.bandwidth(other, tmp_path, "s1")["file"] != first["file"], "another device, another file"
    forged = json.loads(Path(first["file"]).read_text()) | {"host": "elsewhere", "value": 1.0e6}
    Path(first["file"]).write_text(json.dumps(forged))  # a copied cache that says it came from another host
    again = hardware.bandwidth(device, tmp_path, "s1")
    assert again["host"] == socket.gethostname() and again["value"] != 1.0e6, "measured again, not reused"
    monkeypatch.setattr(hardware.socket, "gethostname", lambda: "second-host")
    assert hardware.bandwidth(device, tmp_path, "s1")["file"] != first["file"], "another host, another file"


def test_an_accelerator_reads_with_its_float32_sum_alone(monkeypatch):
    """The other reductions are a CPU's (a dtype view of an accelerator's memory is not assumed of every backend)."""
    import torch

    from decodebench.device import Device, measure_bandwidth

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)  # a CUDA device's timer boundary, on the host
    read = measure_bandwidth(Device("cuda", torch.device("cpu"), "a GPU"), nbytes=2**20, repeats=2, copy=False)
    assert list(read["reductions"]) == ["sum float32"]
    assert read["method"].startswith("the best of torch sum float32 over")
    assert read["samples"] == read["reductions"]["sum float32"]


def test_a_read_offered_for_a_jax_accelerators_memory_is_refused_by_name():
    import torch

    from decodebench.device import JaxDevice, measure_bandwidth

    tpu = JaxDevice("tpu", torch.device("cpu"), "a TPU")  # refused before JAX is asked for anything
    with pytest.raises(ValueError, match="reads a read: a JAX tpu's memory is not a torch tensor"):
        measure_bandwidth(tpu, nbytes=2**20, repeats=1, copy=False, reads={"a read": torch.sum})


def test_a_cpu_reads_four_times_its_largest_cache_at_least(tmp_path, monkeypatch):
    """sysfs's sizes as it writes them (``2048K``, a bare number of bytes): the largest data cache, times four, where it
    exceeds 256 MiB; 256 MiB where sysfs lists nothing or on another device; ``DECODEBENCH_READ_BYTES`` before both,
    a bad one refused by name."""
    from decodebench import device

    monkeypatch.delenv(device.READ_BYTES, raising=False)
    for index, (kind, level, size) in enumerate((("Instruction", 1, "1G"), ("Data", 1, "48K"), ("Unified", 2, "2048K"),
                                                 ("Unified", 3, "491520K"))):  # fmt: skip
        for name, value in (("type", kind), ("level", level), ("size", size)):
            (tmp_path / f"index{index}").mkdir(exist_ok=True)
            (tmp_path / f"index{index}" / name).write_text(f"{value}\n")
    assert device.cache_bytes(caches=tmp_path) == 480 * 2**20  # the largest data cache
    assert device.cache_bytes(2, tmp_path) == 2 * 2**20
    assert device.read_bytes("cpu", tmp_path) == 4 * 480 * 2**20
    assert device.read_bytes("cuda", tmp_path) == 256 * 2**20  # an accelerator's memory: not the host's caches
    (tmp_path / "index3" / "size").write_text("33554432")  # 32 MiB, in bytes: four of them are under 256 MiB
    assert device.read_bytes("cpu", tmp_path) == 256 * 2**20
    assert device.read_bytes("cpu", tmp_path / "none") == 256 * 2**20
    monkeypatch.setenv(device.READ_BYTES, str(2**21))
    assert device.read_bytes("cpu", tmp_path) == 2**21
    monkeypatch.setenv(device.READ_BYTES, "1e9")
    with pytest.raises(ValueError, match="DECODEBENCH_READ_BYTES='1e9': the bytes a streaming read covers"):
        device.read_bytes("cpu", tmp_path)


def test_the_read_records_the_bytes_it_covered(monkeypatch):
    from decodebench import device

    monkeypatch.setenv(device.READ_BYTES, str(2**21))
    read = device.measure_bandwidth(resolve_device("cpu"), repeats=1, copy=False)
    assert read["bytes"] == 2**21 and "over 2097152 B" in read["method"]
