"""Handle parsing: torch's shareable handle, fail closed on anything else."""

import mmap
import os
import re
import stat
import struct

import pytest

from kvtier import cuda, wire
from kvtier.errors import HandleError

IPC = bytes(range(64))
TORCH = bytes([2, ord("c")]) + IPC


def share(handle=TORCH, size=1 << 30, offset=2 << 20):
    # (device, handle, storage size, storage offset, ref counter handle,
    #  ref counter offset, event handle, event sync required)
    return (0, handle, size, offset, b"ref", 0, b"ev", True)


def test_torch_share_to_mem_handle():
    h = cuda.mem_handle_from_torch_share(share(), "GPU-x", view_offset=4096, view_size=561 * 16)
    assert (h.backend, h.device, h.raw, h.offset, h.size) == ("cuda", "GPU-x", IPC, (2 << 20) + 4096, 8976)
    # travels as Go's MemHandle: raw as base64
    assert wire.encode(h).startswith(b'{"backend":"cuda","device":"GPU-x","raw":"AAECAwQF')


@pytest.mark.parametrize("handle, words", [
    (bytes([2, ord("e")]) + IPC, "expandable segment"),
    (bytes([2, ord("e")]) + bytes(20), "expandable segment"),
    (bytes([1, ord("c")]) + IPC, "version 1"),
    (bytes([2, ord("x")]) + IPC, "type 0x78"),
    (IPC, "64 bytes, want 66"),
    (TORCH + b"\0", "67 bytes"),
    ("not bytes", "want bytes"),
])
def test_torch_handles_fail_closed(handle, words):
    with pytest.raises(HandleError, match=words):
        cuda.mem_handle_from_torch_share(share(handle), "GPU-x", 0, 16)


def test_torch_view_outside_storage():
    with pytest.raises(HandleError, match="outside"):
        cuda.mem_handle_from_torch_share(share(size=100), "GPU-x", 90, 20)
    with pytest.raises(HandleError, match="fields"):
        cuda.mem_handle_from_torch_share((0, TORCH), "GPU-x", 0, 1)


def test_default_host_uuid_is_fnv_of_hostname():
    u = cuda.default_host_uuid()
    assert u.startswith("HOST-") and len(u) == 21


def test_host_event_words(tmp_path):
    dev = cuda.HostDevice(str(tmp_path), "HOST-t")
    ev = dev.new_event()
    h = ev.export()
    name = h.raw.decode()
    assert name.startswith(f"kvtier-{os.getpid()}-") and name.endswith(".event")

    def words():
        with open(tmp_path / name, "rb") as f:
            m = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)
            try:
                return struct.unpack_from("<6Q", m)
            finally:
                m.close()

    assert words() == (0x31305456454B564B, 0, 0, 0, 0, os.getpid())
    ev.record(completed=False)
    assert words()[1:3] == (1, 0)
    ev.complete()
    assert words()[1:3] == (1, 1)
    ev.release()
    assert not (tmp_path / name).exists()
    with pytest.raises(HandleError, match="released"):
        ev.record()


def test_host_mem_export(tmp_path):
    dev = cuda.HostDevice(str(tmp_path), "HOST-t")
    m = dev.alloc(10000)
    h = m.export(123, 456)
    assert (h.backend, h.device, h.offset, h.size) == ("host", "HOST-t", 123, 456)
    assert (tmp_path / h.raw.decode()).stat().st_mode & 0o777 == 0o600
    with pytest.raises(HandleError):
        m.export(9999, 2)
    m.release()
    assert not (tmp_path / h.raw.decode()).exists()


def test_pointer_export_without_a_driver_is_a_clear_error():
    try:
        import ctypes.util
        if ctypes.util.find_library("cuda"):
            pytest.skip("a CUDA driver is installed here; this checks the error without one")
    except ImportError:
        pass
    with pytest.raises(HandleError, match="cannot load the CUDA driver"):
        cuda.mem_handle_from_pointer(0x1000, 16, "GPU-x")


def test_host_device_needs_a_private_dir(tmp_path):
    """The host backend's directory rules (C9), as rankd applies them."""
    assert cuda.default_host_dir() == f"/dev/shm/kvtier-{os.geteuid()}"
    with pytest.raises(HandleError, match=r"mode 0o1777.*bare /dev/shm"):
        cuda.HostDevice("/dev/shm")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(HandleError, match=re.escape("mode 0o755; it must grant nothing")):
        cuda.HostDevice(str(shared))
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(private)
    with pytest.raises(HandleError, match="is a symlink"):
        cuda.HostDevice(str(link))
    with pytest.raises(HandleError, match="No such file"):
        cuda.HostDevice(str(tmp_path / "missing"))
    dev = cuda.HostDevice(str(private), "HOST-x")
    m = dev.alloc(4096)
    assert stat.S_IMODE(os.stat(m.path).st_mode) == 0o600
    m.release()
    # The default directory is created 0700 when missing, and accepted.
    d = cuda.HostDevice()
    assert d.dir == cuda.default_host_dir()
    assert stat.S_IMODE(os.lstat(d.dir).st_mode) & 0o077 == 0


def test_dense_permuted_views():
    # vLLM 0.26's FlashAttention KV cache on a GPU: a (blocks, heads, tokens,
    # 2*dim) view with the NHD stride order (blocks, tokens, heads, 2*dim)
    # in memory, dense but not contiguous: shared as its numel bytes.
    b, h, n, d = 10, 8, 16, 256
    assert cuda.is_dense((b, h, n, d), (n * h * d, d, h * d, 1))
    assert cuda.is_dense((b, h, n, d), (h * n * d, n * d, d, 1))
    assert cuda.is_dense((b, 1, n, d), (n * d, 7, d, 1))  # a size-1 dim's stride is free
    assert not cuda.is_dense((b, h, n, d), (2 * n * h * d, d, h * d, 1))  # gaps between blocks
    assert not cuda.is_dense((2, 3), (1, 1))  # overlapping
