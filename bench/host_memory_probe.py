"""Two ways a local server's rows could reach its client with one host copy fewer (not a test).

    python3 bench/host_memory_probe.py        # on a GPU host; on a CPU it checks the first only

Through the shared memory a client offers, a row is copied three times on the host: the engine's
device-to-host copy into pinned memory, the server's copy into the client's ring, the client's copy out
of it (docs/gpu-run-2026-12-07b-saelens-and-copies.md: at batch 256 that path carried 2.5 GB/s of rows
on an H100's host). Printed here, each with its speed:

1. whether another process can read the server's pinned memory itself (``process_vm_readv``, one
   system call for many ranges), which would take the server's copy away: plain memory, then torch's
   pinned memory (``cudaHostAlloc``);
2. whether the engine's device-to-host copies can land in a memfd mapped shared and registered with
   CUDA (``cudaHostRegister``), which a client maps: the same saving the other way round.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import numpy as np
import torch

SIZE = 256 << 20
PIECE = 16 << 20


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.process_vm_readv.restype = ctypes.c_ssize_t
_LIBC.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                                   ctypes.c_ulong, ctypes.c_ulong]


def read_from(pid: int, address: int, dest: np.ndarray) -> tuple[int, int, float]:
    """``SIZE`` bytes at ``address`` in process ``pid`` read into ``dest`` in one call, in ``PIECE``
    ranges: (bytes read or -1, errno, seconds)."""
    k = SIZE // PIECE
    local = (_IoVec * k)(*[_IoVec(dest.ctypes.data + i * PIECE, PIECE) for i in range(k)])
    remote = (_IoVec * k)(*[_IoVec(address + i * PIECE, PIECE) for i in range(k)])
    started = time.perf_counter()
    got = _LIBC.process_vm_readv(pid, local, k, remote, k, 0)
    return got, ctypes.get_errno(), time.perf_counter() - started


def child_reads(label: str, address: int, expected: np.ndarray) -> None:
    """A forked child reads this process's memory at ``address`` three times and says how it went."""
    parent, (r, w) = os.getpid(), os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        dest = np.ones(SIZE, np.uint8)  # its pages made before
        speeds = []
        for _ in range(3):
            got, err, seconds = read_from(parent, address, dest)
            speeds.append(f"{got / seconds / 1e9:.2f} GB/s" if got == SIZE else f"failed ({os.strerror(err)})")
        right = got == SIZE and np.array_equal(dest[:4096], expected[:4096])
        os.write(w, f"{label}: {', '.join(speeds)}; content {'right' if right else 'WRONG'}".encode())
        os._exit(0)
    os.close(w)
    print(os.read(r, 4096).decode(), flush=True)
    os.waitpid(child, 0)


def main() -> None:
    data = np.random.default_rng(0).integers(0, 255, SIZE, dtype=np.uint8)
    child_reads("another process reads plain memory", data.ctypes.data, data)
    if not torch.cuda.is_available():
        return
    print(torch.cuda.get_device_name(), flush=True)
    pinned = torch.empty(SIZE, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(torch.from_numpy(data))
    child_reads("another process reads torch's pinned memory", pinned.data_ptr(), data)
    fd = os.memfd_create("host-memory-probe")
    os.ftruncate(fd, SIZE)
    shared = torch.frombuffer(mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE), dtype=torch.uint8)
    print("cudaHostRegister on a shared memfd:", torch.cuda.cudart().cudaHostRegister(shared.data_ptr(), SIZE, 0),
          flush=True)
    device = torch.from_numpy(data).cuda()
    for name, host in (("torch's pinned memory", pinned), ("the shared memfd", shared)):
        seconds = []
        for _ in range(4):
            torch.cuda.synchronize()
            started = time.perf_counter()
            host.copy_(device, non_blocking=True)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        print(f"device to host into {name}: {SIZE / min(seconds) / 1e9:.2f} GB/s", flush=True)
    print("the shared memfd's content right:", torch.equal(shared[:4096], device[:4096].cpu()), flush=True)
    dest = np.ones(SIZE, np.uint8)
    started = time.perf_counter()
    np.copyto(dest, pinned.numpy())
    print(f"pinned memory copied by one thread (the server's copy): {SIZE / (time.perf_counter() - started) / 1e9:.2f} "
          "GB/s", flush=True)


if __name__ == "__main__":
    main()
