"""Probe: cudaHostRegister of a fresh memfd mapping with and without faulting its pages first."""
import ctypes, mmap, os, time
import numpy as np
import torch

torch.zeros(1, device="cuda")
size = 8 * 40 << 20
for rep in range(3):
    for touch in (True, False):
        fd = os.memfd_create("probe"); os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        t0 = time.perf_counter()
        if touch:
            flat = np.frombuffer(mm, dtype=np.uint8); flat[::mmap.PAGESIZE] = 0; del flat
        t1 = time.perf_counter()
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 1)
        t2 = time.perf_counter()
        host = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
        dev = torch.empty(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize(); t3 = time.perf_counter()
        host.copy_(dev, non_blocking=True); torch.cuda.synchronize(); t4 = time.perf_counter()
        print(f"touch={touch} touch {t1-t0:.3f} register {t2-t1:.3f} (err {int(err)}) first copy {t4-t3:.3f} s "
              f"({size / (t4 - t3) / 1e9:.1f} GB/s) pinned {host.is_pinned()}")
        torch.cuda.cudart().cudaHostUnregister(ptr); del host; mm.close(); os.close(fd)
