"""Can this machine's processes be sampled with perf? Opens one software cpu-clock event on itself through the
perf_event_open system call (what ``perf record`` needs) and prints the kernel's answer and perf_event_paranoid."""

import ctypes
import os
from pathlib import Path

PERF_EVENT_OPEN = 298  # x86-64
attr = (ctypes.c_uint8 * 128)()
ctypes.c_uint32.from_buffer(attr, 0).value = 1  # PERF_TYPE_SOFTWARE
ctypes.c_uint32.from_buffer(attr, 4).value = 128  # size
ctypes.c_uint64.from_buffer(attr, 8).value = 0  # PERF_COUNT_SW_CPU_CLOCK
ctypes.c_uint64.from_buffer(attr, 16).value = 1_000_000  # sample_period
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
fd = libc.syscall(PERF_EVENT_OPEN, attr, 0, -1, -1, 0)
err = ctypes.get_errno()
paranoid = Path("/proc/sys/kernel/perf_event_paranoid")
print(f"perf_event_paranoid {paranoid.read_text().strip() if paranoid.exists() else 'missing'}; "
      f"uid {os.getuid()}; perf_event_open: " + (f"fd {fd} (allowed)" if fd >= 0 else f"refused, {os.strerror(err)}"))
