#!/usr/bin/env python3
"""Prints the device's L2 size, the most it lets be set aside for persisting
(evict_last-class) lines, and the set-aside now in force in a fresh context
(cudaLimitPersistingL2CacheSize), through libcudart by ctypes (no torch)."""
import ctypes
import glob

lib = next(iter(sorted(glob.glob("/usr/local/cuda/lib64/libcudart.so*"))), "libcudart.so")
rt = ctypes.CDLL(lib)
v = ctypes.c_int()
for name, attr in (("L2 cache size", 38), ("max persisting L2", 108)):
    rc = rt.cudaDeviceGetAttribute(ctypes.byref(v), attr, 0)
    print(f"{name}: {v.value} bytes ({v.value / 2**20:.2f} MiB), rc {rc}")
sz = ctypes.c_size_t()
rc = rt.cudaDeviceGetLimit(ctypes.byref(sz), 0x06)
print(f"persisting L2 limit in force: {sz.value} bytes ({sz.value / 2**20:.2f} MiB), rc {rc}")
