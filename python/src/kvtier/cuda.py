"""Device handles, as the Go package cuda defines them.

:class:`MemHandle` and :class:`EventHandle` are the plain-data handles a
rankd imports: raw backend bytes plus the view's offset and size, never a
pickle. Three ways to make them:

- CUDA, from torch: :func:`mem_handle_from_torch_share` parses what
  ``tensor.untyped_storage()._share_cuda_()`` returns, defensively: the
  66-byte handle must be version 2, type ``c`` (a cudaMalloc block) and a
  64-byte ``cudaIpcMemHandle_t``; an expandable segment (type ``e``) or
  anything else is refused with :class:`kvtier.errors.HandleError`.
- CUDA, from the driver: :func:`mem_handle_from_pointer` asks libcuda
  (ctypes, no torch) for the base allocation and its IPC handle, which does
  not depend on torch's private format at all.
- The host backend (the Go simulator of a GPU): :class:`HostDevice` makes
  shared-memory "device" allocations and interprocess events in the same
  files the Go host backend uses (cuda/host_shm.go), so a Python engine can
  drive real rankds on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import secrets
import stat
import struct
import threading
from dataclasses import dataclass
from typing import Annotated, Any

from kvtier._codec import field
from kvtier.errors import HandleError

u64 = Annotated[int, "u64"]

BACKEND_CUDA = "cuda"
BACKEND_HOST = "host"

CUDA_IPC_HANDLE_BYTES = 64
_TORCH_HANDLE_VERSION = 2
_TORCH_TYPE_CUDAMALLOC = ord("c")
_TORCH_TYPE_EXPANDABLE = ord("e")


@dataclass
class MemHandle:
    """Exported device memory (Go cuda.MemHandle): a legacy CUDA IPC handle
    names the whole base allocation, so the view's offset and size travel
    with it."""

    backend: str = field("backend", default="")
    device: str = field("device", default="")
    raw: bytes = field("raw", default=b"")
    offset: u64 = field("offset", default=0)
    size: u64 = field("size", default=0)


@dataclass
class EventHandle:
    """An exported interprocess event (Go cuda.EventHandle)."""

    backend: str = field("backend", default="")
    device: str = field("device", default="")
    raw: bytes = field("raw", default=b"")


# ---------------------------------------------------------------- CUDA / torch


def parse_torch_ipc_handle(handle: bytes) -> bytes:
    """Returns the 64-byte cudaIpcMemHandle_t inside torch's shareable
    handle: a version byte (2), a type byte (``c``: cudaMalloc block) and
    the 64 handle bytes, as measured with torch 2.11 on the H200.

    Raises HandleError for an expandable segment (``e``: its memory is not a
    cudaMalloc block and a legacy IPC handle cannot name it; run torch with
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False``), for another
    version or type, or for a length other than 66."""
    if not isinstance(handle, (bytes, bytearray)):
        raise HandleError(f"torch IPC handle is a {type(handle).__name__}, want bytes")
    b = bytes(handle)
    want = 2 + CUDA_IPC_HANDLE_BYTES
    if len(b) >= 2 and b[0] == _TORCH_HANDLE_VERSION and b[1] == _TORCH_TYPE_EXPANDABLE:
        raise HandleError(
            "torch IPC handle names an expandable segment (type 'e'): kvtier imports only cudaMalloc "
            "blocks through legacy CUDA IPC; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")
    if len(b) != want:
        raise HandleError(f"torch IPC handle is {len(b)} bytes, want {want} (version 2, type 'c', 64-byte handle)")
    if b[0] != _TORCH_HANDLE_VERSION:
        raise HandleError(f"torch IPC handle version {b[0]}, this client understands only {_TORCH_HANDLE_VERSION}")
    if b[1] != _TORCH_TYPE_CUDAMALLOC:
        raise HandleError(f"torch IPC handle type {b[1]:#04x}, want 'c' (a cudaMalloc block)")
    return b[2:]


def mem_handle_from_torch_share(share: tuple[Any, ...], device_uuid: str, view_offset: int,
                                view_size: int) -> MemHandle:
    """Builds the MemHandle of a view of a torch CUDA storage.

    share is ``storage._share_cuda_()``: (device, handle, storage size,
    storage offset in the base allocation, ...). view_offset and view_size
    are the view's bytes inside the storage (``tensor.storage_offset() *
    tensor.element_size()`` and ``tensor.nbytes``). The handle's offset is
    the storage's offset in the base allocation plus view_offset."""
    if not isinstance(share, tuple) or len(share) < 4:
        raise HandleError(f"torch _share_cuda_() result has {len(share) if isinstance(share, tuple) else '?'} "
                          "fields, want at least 4 (device, handle, size, offset)")
    _, handle, storage_size, storage_offset = share[:4]
    for name, v in (("storage size", storage_size), ("storage offset", storage_offset),
                    ("view offset", view_offset), ("view size", view_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise HandleError(f"torch share: {name} {v!r} is not a non-negative integer")
    if view_size == 0 or view_offset + view_size > storage_size:
        raise HandleError(f"view [{view_offset}, +{view_size} B) outside the {storage_size} B storage")
    raw = parse_torch_ipc_handle(handle)
    return MemHandle(BACKEND_CUDA, device_uuid, raw, storage_offset + view_offset, view_size)


def is_dense(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether a tensor of these sizes and element strides covers exactly
    numel consecutive elements from its first one: a contiguous tensor or a
    permutation of one. vLLM's GPU KV caches are such permuted views
    (FlashAttention's NHD stride order over a (blocks, heads, tokens, 2*dim)
    shape)."""
    dims = sorted((st, sz) for sz, st in zip(shape, strides, strict=True) if sz != 1)
    want = 1
    for st, sz in dims:
        if st != want:
            return False
        want *= sz
    return True


def mem_handle_from_torch(tensor: Any) -> MemHandle:
    """The MemHandle of a dense CUDA tensor's bytes (contiguous, or a
    permutation of a contiguous tensor; needs torch)."""
    import torch  # deferred: torch is optional

    if not tensor.is_cuda or not (tensor.is_contiguous()
                                  or is_dense(tuple(tensor.shape), tuple(tensor.stride()))):
        raise HandleError("kvtier shares dense CUDA tensors only (contiguous or a permutation of a contiguous one)")
    props = torch.cuda.get_device_properties(tensor.device)
    uuid = "GPU-" + str(props.uuid)
    share = tensor.untyped_storage()._share_cuda_()
    return mem_handle_from_torch_share(share, uuid, tensor.storage_offset() * tensor.element_size(),
                                       tensor.numel() * tensor.element_size())


def event_handle_from_torch(event: Any, device_uuid: str) -> EventHandle:
    """The EventHandle of a ``torch.cuda.Event(interprocess=True)`` that
    has been recorded (torch creates the CUDA event lazily on record)."""
    raw = bytes(event.ipc_handle())
    if len(raw) != CUDA_IPC_HANDLE_BYTES:
        raise HandleError(f"CUDA IPC event handle is {len(raw)} bytes, want {CUDA_IPC_HANDLE_BYTES}")
    return EventHandle(BACKEND_CUDA, device_uuid, raw)


class _LibCUDA:
    """The few driver entry points mem_handle_from_pointer needs."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("cuda") or "libcuda.so.1"
        try:
            self.lib = ctypes.CDLL(name)
        except OSError as e:
            raise HandleError(f"cannot load the CUDA driver ({name}): {e}") from None
        self.lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                     ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        self.lib.cuIpcGetMemHandle.argtypes = [ctypes.c_char_p, ctypes.c_uint64]

    def check(self, what: str, rc: int) -> None:
        if rc != 0:
            raise HandleError(f"{what} failed with CUresult {rc}"
                              + (" (memory not from cudaMalloc, e.g. an expandable segment?)" if rc == 1 else ""))


_libcuda: _LibCUDA | None = None
_libcuda_lock = threading.Lock()


def mem_handle_from_pointer(ptr: int, size: int, device_uuid: str) -> MemHandle:
    """The MemHandle of [ptr, ptr+size) of device memory, asked of the CUDA
    driver: cuMemGetAddressRange finds the base allocation and
    cuIpcGetMemHandle names it. The calling thread must have the device's
    context current (any torch CUDA call on it does that)."""
    global _libcuda
    with _libcuda_lock:
        if _libcuda is None:
            _libcuda = _LibCUDA()
    cu = _libcuda
    base, length = ctypes.c_uint64(), ctypes.c_size_t()
    cu.check("cuMemGetAddressRange", cu.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(length), ptr))
    if ptr + size > base.value + length.value:
        raise HandleError(f"view [{ptr:#x}, +{size} B) runs past its allocation "
                          f"[{base.value:#x}, +{length.value} B)")
    raw = ctypes.create_string_buffer(CUDA_IPC_HANDLE_BYTES)
    cu.check("cuIpcGetMemHandle", cu.lib.cuIpcGetMemHandle(raw, base.value))
    return MemHandle(BACKEND_CUDA, device_uuid, raw.raw, ptr - base.value, size)


# ---------------------------------------------------------------- host backend

_SHM_PREFIX = "kvtier-"
_EVENT_SUFFIX = ".event"
_EVENT_FILE_SIZE = 4096
_EVENT_MAGIC = 0x31305456454B564B  # "KVKEVT01", little-endian bytes
# Offsets of the Go eventWords (cuda/host_event.go), little-endian u64s.
_W_MAGIC, _W_RECORDED, _W_COMPLETED, _W_POISONED, _W_DESTROYED, _W_OWNER = 0, 8, 16, 24, 32, 40


def default_host_uuid() -> str:
    """The Go host backend's default device UUID: "HOST-" and 16 hex digits
    of FNV-1a 64 of the host name (cuda.DefaultHostConfig)."""
    h = 0xCBF29CE484222325
    for c in os.uname().nodename.encode():
        h = ((h ^ c) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"HOST-{h:016x}"


def _shm_name(event: bool) -> str:
    return f"{_SHM_PREFIX}{os.getpid()}-{secrets.token_hex(8)}{_EVENT_SUFFIX if event else ''}"


def _create(dir_: str, name: str, size: int) -> int:
    path = os.path.join(dir_, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (95, 38):  # EOPNOTSUPP, ENOSYS
                raise
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


class HostMem:
    """A host-backend "device" allocation: a shared file mapping."""

    def __init__(self, dev: HostDevice, size: int) -> None:
        if size <= 0:
            raise HandleError(f"allocation of {size} B")
        self.dev, self.size = dev, size
        self.name = _shm_name(False)
        self.path = os.path.join(dev.dir, self.name)
        fd = _create(dev.dir, self.name, size)
        try:
            self.buf: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    @property
    def view(self) -> memoryview:
        if self.buf is None:
            raise HandleError(f"allocation {self.name} was released")
        return memoryview(self.buf)

    def export(self, offset: int, size: int) -> MemHandle:
        if size <= 0 or offset < 0 or offset + size > self.size:
            raise HandleError(f"export view [{offset}, +{size} B) of a {self.size} B allocation")
        if self.buf is None:
            raise HandleError(f"allocation {self.name} was released")
        return MemHandle(BACKEND_HOST, self.dev.uuid, self.name.encode(), offset, size)

    def unlink(self) -> None:
        """Removes the allocation's file and keeps the mapping: tensors on
        it stay valid, rankds that imported it keep their views, no new
        process can import it. Idempotent."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def release(self) -> None:
        """Frees the allocation; rankds that imported it keep their views."""
        if self.buf is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.buf.close()
        self.buf = None


class HostEvent:
    """An interprocess event of the host backend, owned by this process.

    Python's host "device" work is synchronous (writes into the mapping are
    done when they return), so :meth:`record` marks a record both issued and
    completed. The rankd waits for it like any Go host event; after
    :meth:`release` its waits fail (C1)."""

    def __init__(self, dev: HostDevice) -> None:
        self.dev = dev
        self.name = _shm_name(True)
        self.path = os.path.join(dev.dir, self.name)
        fd = _create(dev.dir, self.name, _EVENT_FILE_SIZE)
        try:
            self._m: mmap.mmap | None = mmap.mmap(fd, _EVENT_FILE_SIZE, mmap.MAP_SHARED,
                                                   mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._put(_W_OWNER, os.getpid())
        self._put(_W_MAGIC, _EVENT_MAGIC)
        self._records = 0

    def _put(self, off: int, v: int) -> None:
        assert self._m is not None
        struct.pack_into("<Q", self._m, off, v)

    def record(self, completed: bool = True) -> None:
        """Records a record; completed (the default, the work being
        synchronous) also completes it. With completed=False a rankd's wait
        blocks until :meth:`complete`: an engine still writing its pages."""
        if self._m is None:
            raise HandleError(f"event {self.name} was released")
        self._records += 1
        self._put(_W_RECORDED, self._records)
        if completed:
            self.complete()

    def complete(self) -> None:
        """Completes every record so far."""
        if self._m is None:
            raise HandleError(f"event {self.name} was released")
        self._put(_W_COMPLETED, self._records)

    def export(self) -> EventHandle:
        if self._m is None:
            raise HandleError(f"event {self.name} was released")
        return EventHandle(BACKEND_HOST, self.dev.uuid, self.name.encode())

    def release(self) -> None:
        """Destroys the event: importers' later waits fail."""
        if self._m is None:
            return
        self._put(_W_DESTROYED, 1)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._m.close()
        self._m = None


def default_host_dir() -> str:
    """The host backend's default directory (Go cuda.DefaultHostDir): a
    private directory under /dev/shm per effective uid."""
    return f"/dev/shm/kvtier-{os.geteuid()}"


def check_private_dir(dir: str) -> None:
    """Raises HandleError unless dir is a directory (not a symlink) owned by
    this uid granting nothing to group or others: what rankd accepts as
    --host-dir (C9). Bare /dev/shm (mode 1777) is refused."""
    try:
        st = os.lstat(dir)
    except OSError as e:
        raise HandleError(f"host backend directory {dir}: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise HandleError(f"host backend directory {dir} is a symlink; give the directory itself")
    if not stat.S_ISDIR(st.st_mode):
        raise HandleError(f"host backend directory {dir} is not a directory")
    if st.st_uid != os.geteuid():
        raise HandleError(f"host backend directory {dir} is owned by uid {st.st_uid}, this process runs as uid "
                          f"{os.geteuid()}; it must be the process's own")
    perm = stat.S_IMODE(st.st_mode)
    if perm & 0o077:
        raise HandleError(f"host backend directory {dir} has mode {perm:#o}; it must grant nothing to group or "
                          f"others (0700), not be a shared directory such as bare /dev/shm")


class HostDevice:
    """The host backend's device, as seen by an engine: allocations and
    interprocess events in dir (the rankds' ``--host-dir``, default
    :func:`default_host_dir`, created 0700 when missing) under uuid (their
    ``--host-uuid``, default :func:`default_host_uuid`). The directory must
    be private (:func:`check_private_dir`), as rankd requires."""

    def __init__(self, dir: str | None = None, uuid: str | None = None) -> None:
        dir = dir or default_host_dir()
        if dir == default_host_dir():
            with contextlib.suppress(FileExistsError):
                os.mkdir(dir, 0o700)
        check_private_dir(dir)
        self.dir = dir
        self.uuid = uuid or default_host_uuid()

    def alloc(self, size: int) -> HostMem:
        return HostMem(self, size)

    def new_event(self) -> HostEvent:
        return HostEvent(self)
