"""The GPUs of one machine, as its agent sees them: what they are and whether they can be used.

Two backends answer the same two questions (``inventory()`` and ``health()``):

- ``NvmlDevices`` asks the driver through NVML (``pynvml``, from the nvidia-ml-py package).
- ``FakeDevices`` has no hardware: the dev stack and tests run agents with it, and inject faults by
  writing a small JSON file that ``gpusched dev fault gpu`` edits.

A GPU is healthy exactly when its list of faults is empty. The fault words:

| fault             | meaning                                                 | lasts             |
|-------------------|---------------------------------------------------------|-------------------|
| ecc_uncorrectable | uncorrectable (double-bit) ECC errors, volatile counter | to driver reload  |
| thermal_throttle  | HW or SW thermal slowdown, sustained over several polls | a cool-down after |
| power_throttle    | HW power brake (the power supply asked), sustained      | a cool-down after |
| xid:<code>        | a critical XID event (see ``CRITICAL_XIDS``)            | to machine reboot |
| lost              | the GPU fell off the bus (NVML_ERROR_GPU_IS_LOST)       | to agent restart  |
| nvml_error        | NVML will not hand out the GPU, or its checks crashed   | while it lasts    |

The fake backend reports whatever words its fault file holds.

Choices worth knowing:
- SW power capping is the driver holding the GPU under its power limit, which any busy GPU does;
  it is not a fault and is not reported.
- Throttling is a state, not an event: it counts only after ``throttle_after`` consecutive polls
  (one poll per agent heartbeat) so that a brief spike does not make the scheduler move a job,
  and once it has counted it keeps counting for a cool-down after it stops (``THROTTLE_COOL_DOWN``,
  doubled at each trip), so that a GPU that overheats under load is not given job after job.
- XID faults stick until the machine reboots (recorded with the boot id in ``xid_file``, so an
  agent restart does not clear them: the GPU still needs its reset); lost faults stick until the
  agent restarts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Protocol

from pydantic import BaseModel

from activities.run_processes import boot_id as this_boot

log = logging.getLogger("gpusched.devices")

ECC_UNCORRECTABLE = "ecc_uncorrectable"
THERMAL_THROTTLE = "thermal_throttle"
POWER_THROTTLE = "power_throttle"
LOST = "lost"
NVML_ERROR = "nvml_error"
# In MIG mode a GPU runs processes only in its MIG instances, and CUDA_VISIBLE_DEVICES=<index>
# does not give a job the whole GPU (at most one instance). Until instances are scheduled as
# GPUs of their own, such a GPU takes no work, with this fault saying why.
MIG_ENABLED = "mig_enabled"


def xid_fault(code: int) -> str:
    return f"xid:{code}"


# Faults that keep a GPU from new work but kill no process on it: throttling slows it down; XID
# 63 records a row remapping (or page retirement) and 92 a high rate of corrected errors.
_HARMLESS_TO_PROCESSES = frozenset({THERMAL_THROTTLE, POWER_THROTTLE, MIG_ENABLED, xid_fault(63), xid_fault(92)})


def kills_processes(fault: str) -> bool:
    """Whether a process on a GPU with this fault may have died of it: a job that fails on such
    a GPU is requeued instead of failed."""
    return fault not in _HARMLESS_TO_PROCESSES


# XIDs after which the GPU should not take work until it is reset or drained:
# 48 double-bit ECC, 62 internal micro-controller halt, 63/64 row-remapping events and failures,
# 74 NVLink error, 79 fallen off the bus, 92 high single-bit ECC rate, 94/95 contained/uncontained
# ECC errors, 119/120 GSP RPC timeout and GSP error (the GPU System Processor of Hopper and later
# stopped answering), 140 unrecovered ECC error. Each calls for a GPU reset in NVIDIA's XID
# catalogue. Application XIDs (13, 31, 43, 45: a job's own fault) are not the GPU's fault and are
# ignored.
CRITICAL_XIDS = frozenset({48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})


class GpuInfo(BaseModel):
    # NVML's index (PCI bus order): CUDA_VISIBLE_DEVICES's number under CUDA_DEVICE_ORDER=PCI_BUS_ID
    index: int
    gpu_type: str  # short name the fleet uses: H100, H200, A100
    memory_gb: float
    uuid: str


class GpuHealth(BaseModel):
    index: int
    healthy: bool
    faults: list[str] = []


class DeviceBackend(Protocol):
    kind: str  # "nvml" or "fake", for logs

    def inventory(self) -> list[GpuInfo]: ...

    def health(self) -> list[GpuHealth]: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Fake devices


class FakeDevices:
    """``count`` identical GPUs; the faults of GPU i are ``fault_file[str(i)]``, read on every
    ``health()`` call (a missing file: all healthy)."""

    kind = "fake"

    def __init__(self, count: int, gpu_type: str = "H100", memory_gb: float = 80.0,
                 fault_file: Path | None = None):
        self.count = count
        self.gpu_type = gpu_type
        self.memory_gb = memory_gb
        self.fault_file = fault_file
        self._last_faults: dict[str, list[str]] = {}

    def inventory(self) -> list[GpuInfo]:
        return [
            GpuInfo(index=i, gpu_type=self.gpu_type, memory_gb=self.memory_gb,
                    uuid=f"GPU-fake-{i:02d}")
            for i in range(self.count)
        ]

    def health(self) -> list[GpuHealth]:
        faults = self._read_faults()
        out = []
        for i in range(self.count):
            words = sorted(set(faults.get(str(i), [])))
            out.append(GpuHealth(index=i, healthy=not words, faults=words))
        return out

    def close(self) -> None:
        pass

    def _read_faults(self) -> dict[str, list[str]]:
        if self.fault_file is None:
            return {}
        try:
            self._last_faults = _load_fault_file(self.fault_file)
        except (OSError, ValueError) as err:
            # Keep the last good reading: a hand-edited file that is briefly invalid must not
            # make every GPU look healthy for one heartbeat.
            log.warning("cannot read fault file %s: %s", self.fault_file, err)
        return self._last_faults


def _load_fault_file(path: Path) -> dict[str, list[str]]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text() or "{}")
    if not isinstance(data, dict):
        raise ValueError("expected an object of GPU index to fault list")
    return {str(k): [str(f) for f in v] for k, v in data.items()}


def _write_fault_file(path: Path, faults: dict[str, list[str]]) -> None:
    # Replace atomically: the agent reads this file on every heartbeat.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({k: v for k, v in sorted(faults.items()) if v}, indent=1) + "\n")
    tmp.replace(path)


def inject_fault(fault_file: Path, index: int, fault: str) -> None:
    """Give fake GPU ``index`` the fault ``fault`` (a word from the table above)."""
    faults = _load_fault_file(fault_file)
    words = faults.setdefault(str(index), [])
    if fault not in words:
        words.append(fault)
    _write_fault_file(fault_file, faults)


def clear_faults(fault_file: Path, index: int | None = None) -> None:
    """Heal fake GPU ``index``, or every GPU of the machine when ``index`` is None."""
    if index is None:
        _write_fault_file(fault_file, {})
        return
    faults = _load_fault_file(fault_file)
    faults.pop(str(index), None)
    _write_fault_file(fault_file, faults)


# ---------------------------------------------------------------------------------------------
# NVML


_VENDOR_WORDS = {"NVIDIA", "TESLA", "GEFORCE", "QUADRO"}


def short_gpu_type(name: str) -> str:
    """The fleet's name for a GPU model: ``NVIDIA H100 80GB HBM3`` → ``H100``,
    ``NVIDIA A100-SXM4-80GB`` → ``A100``, ``NVIDIA GeForce RTX 4090`` → ``RTX4090``."""
    words = [w for w in re.split(r"[\s-]+", name.strip()) if w and w.upper() not in _VENDOR_WORDS]
    if not words:
        return name.strip() or "unknown"
    if words[0].upper() in ("RTX", "GTX") and len(words) > 1:
        return words[0] + words[1]
    return words[0]


def nominal_memory_gb(gpu_type: str, total_bytes: int) -> float:
    """The memory a job's ``gpu_memory_gb`` is compared with. The driver reports a little less
    than the marketed size (an H100 80GB has 79.6 GiB), so a GPU within 5% of its SKU's common
    size reports that size; any other reports its GiB, rounded to one decimal."""
    from scheduler.fleet import GPU_MEMORY_GB

    gib = total_bytes / 2**30
    nominal = GPU_MEMORY_GB.get(gpu_type)
    if nominal and abs(gib - nominal) <= 0.05 * nominal:
        return nominal
    return round(gib, 1)


# A GPU that throttled under load cools as soon as it is idle and throttles again under the next
# job: counted healthy the moment it stops, it would have job after job moved off it. So a throttle
# that tripped keeps counting for a cool-down after it stops, doubled at each trip (10 min, 20,
# 40 ... at most a day), and forgotten after a day without one.
THROTTLE_COOL_DOWN = 600.0
THROTTLE_FORGIVEN = 86400.0
# A throttle trips after `throttle_after` throttled readings at least this far apart (the
# heartbeats'), not after readings taken moments apart between them.
THROTTLE_READING_GAP = 1.0


class NvmlDevices:
    """The machine's GPUs through NVML. Every query tolerates NVML_ERROR_NOT_SUPPORTED (that
    check is then skipped), and NVML_ERROR_NO_PERMISSION (logged); a GPU that answers
    NVML_ERROR_GPU_IS_LOST is ``lost`` for good; any other error of its health readings, on
    ``throttle_after`` heartbeats in a row, makes the GPU ``nvml_error`` while it lasts.

    ``nvml`` is the pynvml module, or a stand-in with the same names (tests)."""

    kind = "nvml"

    def __init__(self, nvml: ModuleType | None = None, gpu_type: str | None = None,
                 throttle_after: int = 3, max_events_per_poll: int = 256,
                 throttle_cool_down: float = THROTTLE_COOL_DOWN, clock: Callable[[], float] = time.monotonic,
                 xid_file: Path | None = None, boot_id: Callable[[], str | None] | None = None):
        if nvml is None:
            import pynvml as nvml
        self.nvml = nvml
        self.gpu_type_override = gpu_type
        self.throttle_after = max(1, throttle_after)
        self.throttle_cool_down = throttle_cool_down
        self.clock = clock
        # (GPU, fault): until when a throttle that tripped still counts, and how often it tripped
        self.throttled_until: dict[tuple[int, str], float] = {}
        self.trips: dict[tuple[int, str], int] = {}
        self.max_events_per_poll = max_events_per_poll
        nvml.nvmlInit()
        self.count = nvml.nvmlDeviceGetCount()
        self.sticky: dict[int, set[str]] = {i: set() for i in range(self.count)}
        # Critical XIDs seen since the machine booted, kept in ``xid_file``: a GPU that needs a
        # reset must not look healthy again because its agent restarted (a reboot resets it).
        self.xid_file, self.boot = xid_file, (boot_id or this_boot)()
        for i, codes in _load_xids(xid_file, self.boot).items():
            if i in self.sticky:
                self.sticky[i] |= codes
        self.throttle_streak: dict[tuple[int, str], int] = {}
        # When each (GPU, throttle or failing readings) streak last grew: readings between
        # heartbeats (a failing job's check, an immediate beat) come seconds apart or less, and
        # must not add up to a trip.
        self.throttle_counted_at: dict[tuple[int, str], float] = {}
        self.handles: dict[int, object] = {}
        self._warned: set[tuple[int, str]] = set()
        self._failing: set[int] = set()  # GPUs a health reading failed for in this poll
        self._reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        self.event_set: object | None = None
        self._events_unavailable = False
        for i in range(self.count):
            self._handle(i)

    def _handle(self, i: int) -> object | None:
        """GPU i's handle, fetched again while it could not be had (a transient driver error);
        a GPU's XID events are watched from when its handle is had."""
        if i not in self.handles and LOST not in self.sticky[i]:
            handle = self._query(i, self.nvml.nvmlDeviceGetHandleByIndex, i)
            if handle is not None:
                self.handles[i] = handle
                self._watch_xids(i, handle)
        return self.handles.get(i)

    # -- inventory --------------------------------------------------------------------------

    def inventory(self) -> list[GpuInfo]:
        out = []
        for i in range(self.count):
            name, total, uuid = "unknown", 0, f"GPU-index-{i}"
            handle = self._handle(i)
            if handle is not None:
                name = self._query(i, self.nvml.nvmlDeviceGetName, handle) or name
                memory = self._query(i, self.nvml.nvmlDeviceGetMemoryInfo, handle)
                total = int(memory.total) if memory is not None else 0
                uuid = self._query(i, self.nvml.nvmlDeviceGetUUID, handle) or uuid
            gpu_type = self.gpu_type_override or short_gpu_type(_text(name))
            out.append(GpuInfo(index=i, gpu_type=gpu_type,
                               memory_gb=nominal_memory_gb(gpu_type, total), uuid=_text(uuid)))
        return out

    # -- health -----------------------------------------------------------------------------

    def health(self) -> list[GpuHealth]:
        self._poll_xid_events()
        out = []
        for i in range(self.count):
            current: set[str] = set()
            handle = self._handle(i)
            if handle is None and LOST not in self.sticky[i]:
                current.add(NVML_ERROR)  # the driver will not even hand out the GPU
            if handle is not None and LOST not in self.sticky[i]:
                self._failing.discard(i)
                current |= self._ecc_faults(i, handle)
                current |= self._throttle_faults(i, handle)
                current |= self._mig_faults(i, handle)
                failing = i in self._failing and LOST not in self.sticky[i]
                if self._streak((i, NVML_ERROR), failing, self.clock()) >= self.throttle_after:
                    # Readings the driver fails (not those it does not support), heartbeat after
                    # heartbeat: a GPU that cannot be read is not called healthy, as one without
                    # a handle is not. One failed reading alone does not move its job.
                    current.add(NVML_ERROR)
            faults = sorted(self.sticky[i] | current)
            out.append(GpuHealth(index=i, healthy=not faults, faults=faults))
        return out

    def _mig_faults(self, i: int, handle: object) -> set[str]:
        get_mode = getattr(self.nvml, "nvmlDeviceGetMigMode", None)
        if get_mode is None:  # bindings older than MIG (which lack its constants too)
            return set()
        mode = self._query(i, get_mode, handle)  # not supported: a GPU without MIG
        current = mode[0] if isinstance(mode, (list, tuple)) else mode
        return {MIG_ENABLED} if mode is not None and current == self.nvml.NVML_DEVICE_MIG_ENABLE else set()

    def _ecc_faults(self, i: int, handle: object) -> set[str]:
        nvml = self.nvml
        count = self._query(i, nvml.nvmlDeviceGetTotalEccErrors, handle,
                            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
        return {ECC_UNCORRECTABLE} if count else set()

    def _throttle_faults(self, i: int, handle: object) -> set[str]:
        nvml = self.nvml
        reasons = None
        if self._reasons_fn is not None:
            try:
                reasons = self._query(i, self._reasons_fn, handle, fallible=True)
            except nvml.NVMLError_FunctionNotFound:
                # Drivers before 535 only have the older name for the same bits.
                self._reasons_fn = None
        if self._reasons_fn is None:
            reasons = self._query(i, nvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
        seen = set()
        if reasons is not None:
            if reasons & (_bit(nvml, "HwThermalSlowdown") | _bit(nvml, "SwThermalSlowdown")):
                seen.add(THERMAL_THROTTLE)
            if reasons & _bit(nvml, "HwPowerBrakeSlowdown"):
                seen.add(POWER_THROTTLE)
        faults = set()
        now = self.clock()
        for word in (THERMAL_THROTTLE, POWER_THROTTLE):
            key = (i, word)
            streak = self._streak(key, word in seen, now)
            until = self.throttled_until.get(key)
            if until is not None and now - until > THROTTLE_FORGIVEN:
                self.trips.pop(key, None)  # a day without it: the next trip starts over
            if streak == self.throttle_after:
                self.trips[key] = self.trips.get(key, 0) + 1
            if streak >= self.throttle_after:  # tripped: it counts until its cool-down after the last poll
                hold = min(THROTTLE_FORGIVEN, self.throttle_cool_down * 2 ** min(self.trips.get(key, 1) - 1, 20))
                self.throttled_until[key] = until = max(until or now, now + hold)
            if until is not None and now < until:
                faults.add(word)
        return faults

    def _streak(self, key: tuple[int, str], seen: bool, now: float) -> int:
        """For how many readings in a row, at least THROTTLE_READING_GAP apart, ``key`` (a GPU
        and what it showed) has been seen."""
        streak = self.throttle_streak.get(key, 0)
        if not seen:
            streak = 0
        elif now - self.throttle_counted_at.get(key, -math.inf) >= THROTTLE_READING_GAP:
            streak += 1
            self.throttle_counted_at[key] = now
        self.throttle_streak[key] = streak
        return streak

    # -- XID events -------------------------------------------------------------------------

    def _watch_xids(self, i: int, handle: object) -> None:
        """Register GPU i for critical XID events, on the event set made at the first."""
        nvml = self.nvml
        if self._events_unavailable:
            return
        if self.event_set is None:
            try:
                self.event_set = nvml.nvmlEventSetCreate()
            except nvml.NVMLError as err:
                log.warning("NVML events unavailable (%s): XIDs will not be watched", err)
                self._events_unavailable = True
                return
        supported = self._query(i, nvml.nvmlDeviceGetSupportedEventTypes, handle)
        if supported is not None and not supported & nvml.nvmlEventTypeXidCriticalError:
            return  # unknown (None): try registering anyway
        try:
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self.event_set)
        except nvml.NVMLError_GpuIsLost:
            self.sticky[i].add(LOST)
        except nvml.NVMLError_NotSupported:
            pass
        except nvml.NVMLError as err:
            log.warning("GPU %d: cannot watch XID events: %s", i, err)

    def _poll_xid_events(self) -> None:
        """Drain the XID events that arrived since the last poll, without blocking."""
        if self.event_set is None:
            return
        nvml = self.nvml
        for _ in range(self.max_events_per_poll):
            try:
                data = nvml.nvmlEventSetWait_v2(self.event_set, 0)
            except nvml.NVMLError_Timeout:
                return  # nothing (more) pending
            except nvml.NVMLError_GpuIsLost:
                return  # the lost GPU is found by its own queries
            except nvml.NVMLError as err:
                log.warning("NVML event wait failed: %s", err)
                return
            if not data.eventType & nvml.nvmlEventTypeXidCriticalError:
                continue
            code = int(data.eventData)
            index = self._index_of(data.device)
            log.warning("GPU %s: XID %d%s", index, code,
                        " (critical)" if code in CRITICAL_XIDS else " (ignored)")
            if code in CRITICAL_XIDS and index is not None and xid_fault(code) not in self.sticky[index]:
                self.sticky[index].add(xid_fault(code))
                _save_xids(self.xid_file, self.boot, self.sticky)

    def _index_of(self, handle: object) -> int | None:
        try:
            return int(self.nvml.nvmlDeviceGetIndex(handle))
        except self.nvml.NVMLError:
            return None

    # -- plumbing ---------------------------------------------------------------------------

    def _query(self, i: int, fn, *args, fallible: bool = False):
        """``fn(*args)``; None when NVML does not support it on this GPU; a lost GPU is marked.
        Other NVML errors are logged once per GPU and call, and read as None; with ``fallible``
        a missing function (old driver) is raised for the caller to fall back."""
        nvml = self.nvml
        try:
            return fn(*args)
        except nvml.NVMLError_NotSupported:
            return None
        except nvml.NVMLError_GpuIsLost:
            if LOST not in self.sticky[i]:
                log.error("GPU %d is lost (fell off the bus)", i)
            self.sticky[i].add(LOST)
            return None
        except nvml.NVMLError as err:
            if fallible and isinstance(err, nvml.NVMLError_FunctionNotFound):
                raise
            if not isinstance(err, getattr(nvml, "NVMLError_NoPermission", ())):
                self._failing.add(i)  # not for want of a privilege: what it says of the GPU is unknown
            name = getattr(fn, "__name__", str(fn))
            if (i, name) not in self._warned:
                self._warned.add((i, name))
                log.warning("GPU %d: %s failed: %s", i, name, err)
            return None

    def close(self) -> None:
        if self.event_set is not None:
            _free_event_set(self.nvml, self.event_set)
            self.event_set = None
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def _load_xids(path: Path | None, boot: str | None) -> dict[int, set[str]]:
    """The critical XIDs recorded in ``path`` during this boot; none from an earlier boot (the
    reboot reset the GPUs), nor where the boot is unknown."""
    if path is None or boot is None:
        return {}
    try:
        saved = json.loads(path.read_text())
        if saved.get("boot_id") != boot:
            return {}
        return {int(i): {str(f) for f in faults} for i, faults in saved.get("gpus", {}).items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, AttributeError) as err:
        log.warning("ignoring unreadable XID record %s: %s", path, err)
        return {}


def _save_xids(path: Path | None, boot: str | None, sticky: dict[int, set[str]]) -> None:
    if path is None or boot is None:
        return
    xids = {str(i): sorted(f for f in faults if f.startswith("xid:")) for i, faults in sticky.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"boot_id": boot, "gpus": {i: f for i, f in xids.items() if f}}))
        tmp.replace(path)
    except OSError as err:  # a full disk: the fault still holds for this agent's life
        log.warning("cannot record the XIDs in %s: %s", path, err)


def _bit(nvml: ModuleType, reason: str) -> int:
    return getattr(nvml, f"nvmlClocksEventReason{reason}", None) or \
        getattr(nvml, f"nvmlClocksThrottleReason{reason}", 0)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _free_event_set(nvml: ModuleType, event_set: object) -> None:
    try:
        nvml.nvmlEventSetFree(event_set)
    except nvml.NVMLError:
        pass


# ---------------------------------------------------------------------------------------------


def nvidia_gpus_present(dev: Path = Path("/dev"), proc: Path = Path("/proc/driver/nvidia/gpus"),
                        pci: Path = Path("/sys/bus/pci/devices")) -> bool:
    """Whether the machine shows NVIDIA GPUs, NVML or not: the driver's device nodes or list, or,
    where the driver is not loaded (a kernel updated without its module), the PCI bus itself."""
    try:
        if any(dev.glob("nvidia[0-9]*")) or (proc.is_dir() and any(proc.iterdir())):
            return True
        return any(_nvidia_display_controller(device) for device in pci.iterdir()) if pci.is_dir() else False
    except OSError:
        return False


def _nvidia_display_controller(device: Path) -> bool:
    # PCI vendor 0x10de is NVIDIA; class 0x03xxxx a display controller (VGA or 3D: every GPU
    # NVML serves), not one of NVIDIA's bridges, switches or audio functions.
    try:
        vendor = (device / "vendor").read_text().strip().lower()
        klass = (device / "class").read_text().strip().lower()
    except OSError:
        return False
    return vendor == "0x10de" and klass.startswith("0x03")


def detect_devices(fake: bool | None, count: int, gpu_type: str | None = None,
                   fault_file: Path | None = None, memory_gb: float | None = None,
                   xid_file: Path | None = None) -> DeviceBackend:
    """The machine's devices. ``fake=True``: ``count`` fake GPUs. ``fake=False``: NVML or an
    error. ``fake=None``: NVML when it initialises and finds GPUs; the fake (logged) only on a
    machine without NVIDIA GPUs. Where the kernel shows NVIDIA GPUs, an NVML that fails (a driver
    and library out of step after an upgrade, say) is an error: the machine must not offer fake,
    healthy GPUs in place of real ones it cannot watch.

    ``count`` matters only for the fake; NVML reports what is there. ``gpu_type``, when given,
    overrides the type NVML reports (to match a fleet that names its SKUs differently)."""
    if fake is not True:
        try:
            devices = NvmlDevices(gpu_type=gpu_type, xid_file=xid_file)
        except Exception as err:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
            if fake is False:
                raise
            if nvidia_gpus_present():
                raise RuntimeError(f"this machine has NVIDIA GPUs but NVML fails: {err} "
                                   f"(fix the driver, or pass --fake-devices to serve fake GPUs)") from err
            log.warning("NVML unavailable (%s): using %d fake GPUs (--nvml refuses to)", err, count)
        else:
            if devices.count > 0:
                return devices
            devices.close()
            if fake is False or nvidia_gpus_present():
                raise RuntimeError("NVML found no GPUs on this machine")
            log.warning("NVML found no GPUs: using %d fake GPUs (--nvml refuses to)", count)
    from scheduler.fleet import FALLBACK_GPU_MEMORY_GB, GPU_MEMORY_GB

    gpu_type = gpu_type or "H100"
    memory = memory_gb or GPU_MEMORY_GB.get(gpu_type, FALLBACK_GPU_MEMORY_GB)
    return FakeDevices(count, gpu_type=gpu_type, memory_gb=memory, fault_file=fault_file)


def main(argv: list[str] | None = None) -> int:
    """``python -m workers.devices [--nvml | --fake N] [--polls K]``: print what the agent would
    report (inventory and health, as JSON lines), to check a machine's NVML by hand."""
    import argparse
    import sys
    import time

    p = argparse.ArgumentParser(prog="python -m workers.devices", description=main.__doc__)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--nvml", action="store_true", help="require NVML")
    group.add_argument("--fake", type=int, metavar="N", help="N fake GPUs instead")
    p.add_argument("--polls", type=int, default=1, help="health polls, 1 s apart (default 1)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    fake = True if args.fake else (False if args.nvml else None)
    try:
        devices = detect_devices(fake, args.fake or 8)
    except Exception as err:
        print(f"error: NVML: {err}", file=sys.stderr)
        return 2
    try:
        print(json.dumps({"backend": devices.kind,
                          "inventory": [g.model_dump() for g in devices.inventory()]}))
        for poll in range(args.polls):
            if poll:
                time.sleep(1)
            print(json.dumps({"health": [h.model_dump() for h in devices.health()]}))
    finally:
        devices.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
