"""The machine's GPUs: the fake backend with injected faults, and NVML read through a stand-in
``pynvml`` that plays each fault a real driver reports."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pynvml  # its error classes and constants need no driver
import pytest

from live.fakes import HangingDevices
from workers.devices import (
    FakeDevices,
    GpuHealth,
    NvmlDevices,
    clear_faults,
    detect_devices,
    nvidia_gpus_present,
    inject_fault,
    nominal_memory_gb,
    short_gpu_type,
)

ROOT = Path(__file__).resolve().parents[1]

# -- the fake backend ---------------------------------------------------------------------------


def test_fake_devices_list_identical_gpus(tmp_path):
    devices = FakeDevices(2, gpu_type="H200", memory_gb=141, fault_file=tmp_path / "f.json")
    assert [(g.index, g.gpu_type, g.memory_gb) for g in devices.inventory()] == [
        (0, "H200", 141.0), (1, "H200", 141.0)]
    assert len({g.uuid for g in devices.inventory()}) == 2


def test_fake_faults_come_and_go_with_the_fault_file(tmp_path):
    faults = tmp_path / "faults" / "agent-c1-b0-r0-m0.json"
    devices = FakeDevices(3, fault_file=faults)
    assert all(h.healthy for h in devices.health())  # no file: all healthy

    inject_fault(faults, 1, "ecc_uncorrectable")
    inject_fault(faults, 1, "xid:79")
    inject_fault(faults, 1, "xid:79")  # twice is once
    inject_fault(faults, 2, "lost")
    assert devices.health() == [
        GpuHealth(index=0, healthy=True, faults=[]),
        GpuHealth(index=1, healthy=False, faults=["ecc_uncorrectable", "xid:79"]),
        GpuHealth(index=2, healthy=False, faults=["lost"]),
    ]

    clear_faults(faults, 1)
    assert [h.healthy for h in devices.health()] == [True, True, False]
    clear_faults(faults)
    assert all(h.healthy for h in devices.health())


def test_a_broken_fault_file_keeps_the_last_reading(tmp_path):
    faults = tmp_path / "f.json"
    devices = FakeDevices(1, fault_file=faults)
    inject_fault(faults, 0, "lost")
    assert not devices.health()[0].healthy
    faults.write_text("{not json")
    assert devices.health()[0].faults == ["lost"]


# -- names and sizes ----------------------------------------------------------------------------


@pytest.mark.parametrize("name, reported, expected", [
    ("an H100 drops vendor and variant", "NVIDIA H100 80GB HBM3", "H100"),
    ("an H200 is its model", "NVIDIA H200", "H200"),
    ("an A100 drops its form factor", "NVIDIA A100-SXM4-80GB", "A100"),
    ("an old Tesla drops the brand", "Tesla V100-SXM2-32GB", "V100"),
    ("a GeForce keeps its number", "NVIDIA GeForce RTX 4090", "RTX4090"),
])
def test_short_gpu_type(name, reported, expected):
    assert short_gpu_type(reported) == expected


@pytest.mark.parametrize("name, gpu_type, mib, expected", [
    ("an H100 80GB reports its marketed size", "H100", 81559, 80.0),
    ("an H200 reports its marketed size", "H200", 143771, 141.0),
    ("an A100 40GB is not the common SKU: its GiB", "A100", 40960, 40.0),
    ("an unknown type reports its GiB", "X9", 24564, 24.0),
])
def test_nominal_memory(name, gpu_type, mib, expected):
    assert nominal_memory_gb(gpu_type, mib * 2**20) == expected


# -- NVML through a stand-in --------------------------------------------------------------------

HW_THERMAL = pynvml.nvmlClocksEventReasonHwThermalSlowdown
SW_THERMAL = pynvml.nvmlClocksEventReasonSwThermalSlowdown
POWER_BRAKE = pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
SW_POWER_CAP = pynvml.nvmlClocksEventReasonSwPowerCap
HW_SLOWDOWN = pynvml.nvmlClocksEventReasonHwSlowdown
XID = pynvml.nvmlEventTypeXidCriticalError
NOT_SUPPORTED = pynvml.NVMLError_NotSupported()


@dataclass
class Gpu:
    name: str = "NVIDIA H100 80GB HBM3"
    mib: int = 81559
    ecc: int | Exception = 0
    reasons: int | Exception = 0
    events: int | Exception = XID  # supported event types
    lost: bool = False
    lost_at_start: bool = False
    mig: tuple[int, int] | Exception = (0, 0)  # MIG mode (current, pending)
    handle_fails: int = 0  # how many asks for its handle fail first (a transient driver error)


@dataclass
class FakeNvml:
    """Stands in for the pynvml module: the functions NvmlDevices calls, over ``gpus``.
    Handles are GPU indices; pending XIDs are (index, code) pairs."""

    gpus: list[Gpu]
    pending: list[tuple[int, int]] = field(default_factory=list)
    registered: list[int] = field(default_factory=list)
    event_sets: bool = True
    new_reason_names: bool = True
    init_error: Exception | None = None

    def __getattr__(self, name):  # constants and error classes: the real module's
        return getattr(pynvml, name)

    def _gpu(self, handle):
        gpu = self.gpus[handle]
        if gpu.lost:
            raise pynvml.NVMLError_GpuIsLost()
        return gpu

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        if self.gpus[i].lost_at_start:
            raise pynvml.NVMLError_GpuIsLost()
        if self.gpus[i].handle_fails:
            self.gpus[i].handle_fails -= 1
            raise pynvml.NVMLError_Unknown()
        return i

    def nvmlDeviceGetIndex(self, handle):
        return handle

    def nvmlDeviceGetName(self, h):
        return self._gpu(h).name

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h:04d}"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=self._gpu(h).mib * 2**20)

    def nvmlDeviceGetMigMode(self, h):
        return list(_answer(self._gpu(h).mig))

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        assert (error_type, counter_type) == (
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return _answer(self._gpu(h).ecc)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        if not self.new_reason_names:
            raise pynvml.NVMLError_FunctionNotFound()
        return _answer(self._gpu(h).reasons)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return _answer(self._gpu(h).reasons)

    def nvmlEventSetCreate(self):
        if not self.event_sets:
            raise pynvml.NVMLError_NotSupported()
        return "event-set"

    def nvmlEventSetFree(self, event_set):
        pass

    def nvmlDeviceGetSupportedEventTypes(self, h):
        return _answer(self._gpu(h).events)

    def nvmlDeviceRegisterEvents(self, h, event_types, event_set):
        assert event_types == XID and event_set == "event-set"
        self.registered.append(h)

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        assert timeout_ms == 0  # a poll must never block the heartbeat
        # Only GPUs registered on the set deliver their events.
        waiting = [e for e in self.pending if e[0] in self.registered]
        if not waiting:
            raise pynvml.NVMLError_Timeout()
        self.pending.remove(waiting[0])
        index, code = waiting[0]
        return SimpleNamespace(device=index, eventType=XID, eventData=code)


def _answer(value):
    if isinstance(value, Exception):
        raise value
    return value


def test_nvml_inventory_reads_type_memory_and_uuid():
    devices = NvmlDevices(FakeNvml([Gpu(), Gpu(name="NVIDIA H200", mib=143771)]))
    assert [(g.index, g.gpu_type, g.memory_gb, g.uuid) for g in devices.inventory()] == [
        (0, "H100", 80.0, "GPU-0000"), (1, "H200", 141.0, "GPU-0001")]
    assert NvmlDevices(FakeNvml([Gpu()]), gpu_type="H100-SXM").inventory()[0].gpu_type == "H100-SXM"


@pytest.mark.parametrize("name, gpu, xids, polls, faults", [
    ("a quiet GPU is healthy", Gpu(), [], 1, []),
    ("uncorrectable ECC errors make a GPU unhealthy", Gpu(ecc=2), [], 1, ["ecc_uncorrectable"]),
    ("ECC counters not supported are skipped", Gpu(ecc=NOT_SUPPORTED), [], 1, []),
    ("sustained HW thermal slowdown is a thermal throttle",
     Gpu(reasons=HW_THERMAL | HW_SLOWDOWN), [], 3, ["thermal_throttle"]),
    ("sustained SW thermal slowdown is a thermal throttle too",
     Gpu(reasons=SW_THERMAL), [], 3, ["thermal_throttle"]),
    ("a throttle seen on fewer polls than needed is not yet a fault",
     Gpu(reasons=HW_THERMAL), [], 2, []),
    ("a sustained HW power brake is a power throttle",
     Gpu(reasons=POWER_BRAKE | HW_SLOWDOWN), [], 3, ["power_throttle"]),
    ("SW power capping is what busy GPUs do, not a fault", Gpu(reasons=SW_POWER_CAP), [], 3, []),
    ("throttle reasons not supported are skipped", Gpu(reasons=NOT_SUPPORTED), [], 3, []),
    ("a critical XID makes a GPU unhealthy", Gpu(), [(0, 79)], 1, ["xid:79"]),
    ("a critical XID sticks after later quiet polls", Gpu(), [(0, 48)], 4, ["xid:48"]),
    ("a GSP timeout (Hopper) makes a GPU unhealthy", Gpu(), [(0, 119)], 1, ["xid:119"]),
    ("an unrecovered ECC error makes a GPU unhealthy", Gpu(), [(0, 140)], 1, ["xid:140"]),
    ("an application XID is the job's fault, not the GPU's", Gpu(), [(0, 13)], 1, []),
    ("an XID on another GPU leaves this one alone", Gpu(), [(1, 79)], 1, []),
    ("a GPU that falls off the bus is lost", Gpu(lost=True), [], 1, ["lost"]),
    ("a GPU lost before the agent started is lost", Gpu(lost_at_start=True), [], 1, ["lost"]),
    ("a GPU that cannot report XIDs is still checked otherwise",
     Gpu(events=0, ecc=1), [(0, 79)], 1, ["ecc_uncorrectable"]),
    ("a GPU in MIG mode takes no work: a job would get one of its instances", Gpu(mig=(1, 1)), [], 1,
     ["mig_enabled"]),
    ("MIG mode pending until the GPU is reset is not MIG mode yet", Gpu(mig=(0, 1)), [], 1, []),
    ("a GPU without MIG is checked otherwise", Gpu(mig=NOT_SUPPORTED, ecc=1), [], 1, ["ecc_uncorrectable"]),
    ("faults add up", Gpu(ecc=1, reasons=POWER_BRAKE | HW_THERMAL), [(0, 94)], 3,
     ["ecc_uncorrectable", "power_throttle", "thermal_throttle", "xid:94"]),
    ("readings the driver fails heartbeat after heartbeat are no healthy readings",
     Gpu(ecc=pynvml.NVMLError_Unknown()), [], 3, ["nvml_error"]),
    ("a GPU that needs a reset to answer is no healthy one either",
     Gpu(reasons=pynvml.NVMLError_ResetRequired(), mig=pynvml.NVMLError_ResetRequired()), [], 3, ["nvml_error"]),
    ("one failed reading alone does not move a job", Gpu(ecc=pynvml.NVMLError_Unknown()), [], 2, []),
    ("a reading refused for want of a privilege is skipped, as one not supported",
     Gpu(ecc=pynvml.NVMLError_NoPermission()), [], 1, []),
])
def test_nvml_health(name, gpu, xids, polls, faults):
    nvml = FakeNvml([gpu, Gpu()])
    now = [0.0]
    devices = NvmlDevices(nvml, throttle_after=3, clock=lambda: now[0])
    nvml.pending.extend(xids)
    for _ in range(polls):
        health = devices.health()
        now[0] += 2.0  # a heartbeat
    assert health[0] == GpuHealth(index=0, healthy=not faults, faults=faults)


def test_a_gpu_unhealthy_for_failing_readings_is_healthy_again_at_its_first_whole_reading():
    now = [0.0]
    nvml = FakeNvml([Gpu(ecc=pynvml.NVMLError_Unknown())])
    devices = NvmlDevices(nvml, throttle_after=2, clock=lambda: now[0])
    assert devices.health()[0].healthy
    now[0] += 2.0
    assert devices.health()[0].faults == ["nvml_error"]
    nvml.gpus[0].ecc = 0
    now[0] += 2.0
    assert devices.health()[0].healthy


def test_throttled_readings_moments_apart_do_not_add_up_to_a_trip():
    """Between heartbeats the agent reads health again when a job fails (is its GPU to blame?):
    before, three such readings in a second held a GPU in a passing slowdown out for 10 minutes."""
    now = [0.0]
    nvml = FakeNvml([Gpu(reasons=SW_THERMAL)])
    devices = NvmlDevices(nvml, throttle_after=3, clock=lambda: now[0])
    assert [devices.health()[0].healthy for _ in range(5)] == [True] * 5
    now[0] += 2.0
    assert devices.health()[0].healthy  # the second heartbeat's reading
    now[0] += 2.0
    assert devices.health()[0].faults == ["thermal_throttle"]  # the third


def test_a_gpu_whose_handle_comes_late_has_its_xids_watched_from_then():
    """Before, only GPUs with a handle at the start were registered: an XID 79 on a GPU whose
    handle came a poll later was never seen (and with no handle at the start, none were)."""
    nvml = FakeNvml([Gpu(handle_fails=1), Gpu(handle_fails=1)])
    devices = NvmlDevices(nvml)
    assert nvml.registered == [] and [h.faults for h in devices.health()] == [[], []]
    assert nvml.registered == [0, 1]
    nvml.pending.append((1, 79))
    assert [h.faults for h in devices.health()] == [[], ["xid:79"]]


@pytest.mark.parametrize("name, boot_then, boot_now, sticks", [
    ("an agent restarted in the same boot still reports the GPU's XID", "boot-1", "boot-1", True),
    ("after a reboot (which resets the GPUs) the XID is forgotten", "boot-1", "boot-2", False),
    ("where the boot cannot be known nothing is carried over", None, None, False),
])
def test_a_critical_xid_outlives_an_agent_restart_until_the_machine_reboots(tmp_path, name, boot_then, boot_now,
                                                                          sticks):
    record = tmp_path / "faults" / "agent-m0-xids.json"
    nvml = FakeNvml([Gpu(), Gpu()])
    first = NvmlDevices(nvml, xid_file=record, boot_id=lambda: boot_then)
    nvml.pending.append((1, 79))
    assert first.health()[1].faults == ["xid:79"]
    again = NvmlDevices(FakeNvml([Gpu(), Gpu()]), xid_file=record, boot_id=lambda: boot_now)
    assert again.health()[1] == GpuHealth(index=1, healthy=not sticks, faults=["xid:79"] if sticks else [])
    assert again.health()[0].healthy


def test_an_unreadable_xid_record_is_ignored(tmp_path):
    record = tmp_path / "xids.json"
    record.write_text("{not json")
    assert NvmlDevices(FakeNvml([Gpu()]), xid_file=record, boot_id=lambda: "b").health()[0].healthy


def test_a_throttle_that_never_tripped_stops_counting_when_it_stops():
    nvml = FakeNvml([Gpu(reasons=HW_THERMAL)])
    devices = NvmlDevices(nvml, throttle_after=3)
    assert [devices.health()[0].healthy for _ in range(2)] == [True, True]
    nvml.gpus[0].reasons = 0
    assert devices.health()[0].healthy
    nvml.gpus[0].reasons = HW_THERMAL
    assert devices.health()[0].healthy  # the streak started over


def test_a_throttle_that_tripped_counts_for_a_cool_down_doubled_at_each_trip_and_forgiven_after_a_day():
    """A GPU that overheats under load cools at once when idle: without a cool-down it would be
    given job after job, each moved off it minutes later."""
    now = [0.0]
    nvml = FakeNvml([Gpu(reasons=HW_THERMAL)])
    devices = NvmlDevices(nvml, throttle_after=2, throttle_cool_down=600, clock=lambda: now[0])

    def healthy_at(t, reasons=None):
        now[0] = t
        if reasons is not None:
            nvml.gpus[0].reasons = reasons
        return devices.health()[0].healthy

    assert [healthy_at(0), healthy_at(2)] == [True, False]  # tripped
    assert healthy_at(4, reasons=0) is False and healthy_at(600) is False  # cooling down
    assert healthy_at(603) is True  # 10 min after the last throttled reading
    assert [healthy_at(700, HW_THERMAL), healthy_at(702)] == [True, False]  # the second trip
    assert healthy_at(704, reasons=0) is False and healthy_at(1900) is False  # 20 min now
    assert healthy_at(1903) is True
    assert [healthy_at(1903 + 90000, HW_THERMAL), healthy_at(1905 + 90000)] == [True, False]  # a day on: 10 min again
    assert healthy_at(1905 + 90000 + 601, reasons=0) is True


def test_a_gpu_that_is_lost_later_stays_lost():
    nvml = FakeNvml([Gpu()])
    devices = NvmlDevices(nvml)
    assert devices.health()[0].healthy
    nvml.gpus[0].lost = True
    assert devices.health()[0].faults == ["lost"]
    nvml.gpus[0].lost = False  # a lost GPU needs a reset, which restarts the agent
    assert devices.health()[0].faults == ["lost"]


class BindingsBeforeMig(FakeNvml):
    """pynvml from before MIG: neither the mode query nor its constants."""

    nvmlDeviceGetMigMode = None

    def __getattr__(self, name):
        if "mig" in name.lower():
            raise AttributeError(name)
        return super().__getattr__(name)


def test_bindings_from_before_mig_read_every_gpu_as_without_it():
    assert NvmlDevices(BindingsBeforeMig([Gpu(mig=(1, 1))])).health() == [GpuHealth(index=0, healthy=True)]


def test_old_drivers_read_the_throttle_reasons_under_their_old_name():
    nvml = FakeNvml([Gpu(reasons=POWER_BRAKE)], new_reason_names=False)
    devices = NvmlDevices(nvml, throttle_after=1)
    assert devices.health()[0].faults == ["power_throttle"]


def test_without_event_sets_xids_are_not_watched_and_the_rest_works():
    nvml = FakeNvml([Gpu(ecc=1)], event_sets=False)
    devices = NvmlDevices(nvml)
    nvml.pending.append((0, 79))
    assert devices.health()[0].faults == ["ecc_uncorrectable"]
    assert nvml.pending == [(0, 79)]  # never polled


def test_xid_events_are_registered_only_where_supported():
    nvml = FakeNvml([Gpu(), Gpu(events=0), Gpu(events=NOT_SUPPORTED)])
    NvmlDevices(nvml)
    assert nvml.registered == [0, 2]  # "not supported" to ask: try registering anyway


# -- choosing a backend -------------------------------------------------------------------------


@pytest.mark.parametrize("name, nvml, fake, expected", [
    ("NVML with GPUs is used", FakeNvml([Gpu()]), None, "nvml"),
    ("NVML finding no GPUs falls back to the fake", FakeNvml([]), None, "fake"),
    ("NVML that cannot load falls back to the fake",
     FakeNvml([Gpu()], init_error=pynvml.NVMLError_LibraryNotFound()), None, "fake"),
    ("asking for the fake never touches NVML", FakeNvml([Gpu()]), True, "fake"),
])
def test_detect_devices(monkeypatch, tmp_path, name, nvml, fake, expected):
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr("workers.devices.nvidia_gpus_present", lambda: False)
    devices = detect_devices(fake, count=4, gpu_type=None, fault_file=tmp_path / "f.json")
    assert devices.kind == expected
    if expected == "fake":
        assert [g.gpu_type for g in devices.inventory()] == ["H100"] * 4


@pytest.mark.parametrize("name, nvml", [
    ("an NVML that cannot start", FakeNvml([Gpu()], init_error=pynvml.NVMLError_DriverNotLoaded())),
    ("an NVML that finds none of them", FakeNvml([])),
])
def test_a_machine_with_nvidia_gpus_never_falls_back_to_fake_ones(monkeypatch, name, nvml):
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr("workers.devices.nvidia_gpus_present", lambda: True)
    with pytest.raises(RuntimeError, match="NVML"):
        detect_devices(None, count=4)


def test_the_kernels_nvidia_devices_are_seen_without_nvml(tmp_path):
    dev, proc = tmp_path / "dev", tmp_path / "proc"
    dev.mkdir()
    (dev / "nvidiactl").touch()  # the control node alone is no GPU
    assert not nvidia_gpus_present(dev, proc)
    (dev / "nvidia0").touch()
    assert nvidia_gpus_present(dev, proc)


def pci_device(bus, name, vendor, klass):
    device = bus / name
    device.mkdir(parents=True)
    (device / "vendor").write_text(vendor + "\n")
    (device / "class").write_text(klass + "\n")


@pytest.mark.parametrize("vendor, klass, shows_gpus", [
    ("0x10de", "0x030200", True),   # an NVIDIA 3D controller (H100, A100)
    ("0x10de", "0x030000", True),   # an NVIDIA VGA controller
    ("0x10de", "0x068000", False),  # an NVIDIA bridge (NVSwitch)
    ("0x10de", "0x040300", False),  # an NVIDIA audio function
    ("0x1002", "0x030000", False),  # another vendor's display controller
])
def test_a_machine_whose_nvidia_driver_is_not_loaded_still_shows_its_gpus_on_the_pci_bus(
        tmp_path, vendor, klass, shows_gpus):
    dev, proc, pci = tmp_path / "dev", tmp_path / "proc", tmp_path / "pci"
    dev.mkdir()
    pci_device(pci, "0000:00:00.0", "0x8086", "0x060000")
    pci_device(pci, "0000:17:00.0", vendor, klass)
    assert nvidia_gpus_present(dev, proc, pci) is shows_gpus


def test_detect_devices_without_fallback_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([]))
    with pytest.raises(RuntimeError, match="no GPUs"):
        detect_devices(False, count=4)


# -- what the agent reports ---------------------------------------------------------------------


def test_a_hung_health_check_never_stops_the_heartbeats():
    from workers.agent import HealthReader

    devices = HangingDevices()
    # Timeouts wide enough for a loaded 2-core CI machine (0.1 s once missed the first answer):
    # the three stale readings take 1.5 s of the 2.5 s a last reading stands for.
    reader = HealthReader(devices, timeout=0.5, stale_for=2.5)

    async def scenario():
        first = await reader.read()
        stale = [await reader.read() for _ in range(3)]  # hung: the last reading, one call at a time
        await asyncio.sleep(1.0)
        late = await reader.read()
        devices.release.set()
        await asyncio.sleep(0.2)
        return first, stale, late, await reader.read()

    first, stale, late, recovered = asyncio.run(scenario())
    assert all(h.healthy for h in first) and stale == [first] * 3 and devices.calls == 2
    assert [h.faults for h in late] == [["nvml_error"]] * 2
    assert recovered == first and devices.calls == 2  # the hung call's own answer, once it came


class ReadsThenWaits(FakeDevices):
    """Fake GPUs whose health call reads the fault file, then takes 0.3 s more to answer."""

    def __init__(self, fault_file: Path):
        super().__init__(2, fault_file=fault_file)
        self.calls = 0

    def health(self):
        self.calls += 1
        readings = super().health()
        time.sleep(0.3)
        return readings


def test_a_fresh_reading_is_one_asked_after_it_is_wanted_not_the_one_in_flight(tmp_path):
    """Asked as a job dies: a reading a heartbeat asked for before the death may not show the
    fault the job died of, and the job would be failed as its own fault."""
    from workers.agent import HealthReader

    devices = ReadsThenWaits(tmp_path / "faults.json")
    reader = HealthReader(devices, timeout=5)

    async def scenario():
        in_flight = asyncio.create_task(reader.read())  # a heartbeat's, asked before the fault
        await asyncio.sleep(0.1)
        inject_fault(tmp_path / "faults.json", 0, "xid:79")  # the GPU fails; the job dies of it
        fresh = await reader.read_fresh()
        return await in_flight, fresh

    before, fresh = asyncio.run(scenario())
    assert [h.faults for h in before] == [[], []]
    assert [h.faults for h in fresh] == [["xid:79"], []] and devices.calls == 2


def test_a_fresh_reading_that_does_not_come_is_none():
    from workers.agent import HealthReader

    devices = HangingDevices()
    reader = HealthReader(devices, timeout=0.3)

    async def scenario():
        first = await reader.read()
        return first, await reader.read_fresh(), await reader.read()

    first, fresh, stale = asyncio.run(scenario())
    devices.release.set()
    assert fresh is None and stale == first and devices.calls == 2  # one call in flight, not two


NEVER_ANSWERS = """
import asyncio, sys, threading
from workers.agent import HealthReader
from workers.devices import FakeDevices

class Hung(FakeDevices):
    def health(self):
        threading.Event().wait()  # an NVML call that never returns

async def serve():
    reader = HealthReader(Hung(2), timeout=0.2, stale_for=0)
    print([h.faults for h in await reader.read()], flush=True)
    return 0

sys.exit(asyncio.run(serve()))
"""


def test_an_agent_whose_health_check_never_answers_still_exits_when_it_is_done():
    """Before, the call ran on asyncio's default executor, whose threads asyncio.run and the
    interpreter wait for at their end: a stopped agent never exited while NVML hung."""
    done = subprocess.run([sys.executable, "-c", NEVER_ANSWERS], capture_output=True, text=True, timeout=30,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[['nvml_error'], ['nvml_error']]"


def test_the_heartbeat_reports_each_gpu_and_the_running_allocations(tmp_path):
    from workers.agent import heartbeat_payload

    devices = FakeDevices(2, gpu_type="H200", memory_gb=141, fault_file=tmp_path / "f.json")
    inject_fault(tmp_path / "f.json", 1, "ecc_uncorrectable")
    assert heartbeat_payload(123, devices.inventory(), devices.health(), [9, 4], accepting_work=False) == {
        "pid": 123,
        "gpus": [
            {"index": 0, "gpu_type": "H200", "memory_gb": 141.0, "healthy": True, "faults": []},
            {"index": 1, "gpu_type": "H200", "memory_gb": 141.0, "healthy": False,
             "faults": ["ecc_uncorrectable"]},
        ],
        "running_allocations": [4, 9],
        "accepting_work": False,
    }


@pytest.mark.parametrize("name, api_url, expected", [
    ("the machine id's slashes stay path segments", "http://127.0.0.1:8080",
     "http://127.0.0.1:8080/machines/c1/b0/r0/m0/heartbeat"),
    ("a trailing slash on the API URL is not doubled", "http://api:80/",
     "http://api:80/machines/c1/b0/r0/m0/heartbeat"),
])
def test_heartbeat_url(name, api_url, expected):
    from workers.agent import heartbeat_url

    assert heartbeat_url(api_url, "c1/b0/r0/m0") == expected


def test_the_agent_command_explains_itself():
    import subprocess

    out = subprocess.run([sys.executable, "-m", "workers.agent", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--machine-id" in out and "--fake-devices" in out


@pytest.mark.parametrize("fault, kills", [
    ("xid:79", True), ("xid:48", True), ("xid:94", True), ("ecc_uncorrectable", True), ("lost", True),
    ("nvml_error", True), ("xid:63", False), ("xid:92", False), ("thermal_throttle", False),
    ("power_throttle", False), ("mig_enabled", False),
])
def test_which_faults_can_have_killed_a_job_on_the_gpu(fault, kills):
    from workers.devices import kills_processes

    assert kills_processes(fault) is kills


def test_a_gpu_that_has_tripped_its_throttle_thousands_of_times_is_held_a_day_not_an_overflow():
    now = [0.0]
    nvml = FakeNvml([Gpu(reasons=HW_THERMAL)])
    devices = NvmlDevices(nvml, throttle_after=1, throttle_cool_down=600, clock=lambda: now[0])
    devices.trips[(0, "thermal_throttle")] = 5000
    assert devices.health()[0].faults == ["thermal_throttle"]
    assert devices.throttled_until[(0, "thermal_throttle")] == 86400.0
