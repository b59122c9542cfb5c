"""The worker side of KvtierConnector: the pools it registers with its
rankd (register_kv_caches; on the host backend, moved into host-backend
memory), the stores sent after each forward (wait_for_save) and held until
they answer, the loads of each step (start_load_kv) settled by their
verdicts, and what get_finished and get_block_ids_with_load_errors report
back to vLLM."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import logging
import time
from typing import Any, cast

from kvtier import client as kvclient
from kvtier import client_plan, cuda, dcp, wire
from kvtier.errors import GeometryError, UnknownNamespace, UnknownSession
from kvtier.vllm import _verify
from kvtier.vllm._base import KVConnectorTransferResults
from kvtier.vllm._core import _Core
from kvtier.vllm._state import (
    NULL_BLOCK,
    KvtierConnectorMetadata,
    LoadSpec,
    SaveSpec,
    _Loading,
    _LoadResult,
    _Pending,
    submit,
)
from kvtier.vllm.attach import Check

log = logging.getLogger("kvtier.vllm")


class _WorkerSide(_Core):
    """vLLM's worker-side connector methods, and the seams (_tp_rank,
    _pool_handles, _new_event) that tests replace."""

    def _tp_rank(self) -> int:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())

    def _check_layout(self, gi: int, layer: str, tensor: Any) -> None:
        """Refuses a layer tensor whose layout is not the configured one:
        block-major with the declared page as the block stride, or K/V split
        (2, num_blocks, ...) with half pages."""
        gl = self.layers[gi]
        isz = tensor.element_size()
        nbytes = tensor.numel() * isz
        shape = tuple(tensor.shape)
        if gl.kv_split:
            ok = (len(shape) >= 2 and shape[0] == 2 and shape[1] == self.num_blocks
                  and tensor.stride(1) * isz == gl.page_bytes // 2
                  and tensor.stride(0) * isz == self.num_blocks * gl.page_bytes // 2)
            want = f"(2, {self.num_blocks}, ...) K/V halves of {gl.page_bytes // 2} B pages"
        else:
            ok = len(shape) >= 1 and shape[0] == self.num_blocks and tensor.stride(0) * isz == gl.page_bytes
            want = (f"{self.num_blocks} blocks of page_size_bytes {gl.page_bytes} B, block-major "
                    "(FlashInfer/MLA/Mamba; FlashAttention's K/V split needs kvtier_pool_layout=kv_split)")
        if ok and gl.recurrent and len(shape) > 1:
            # vLLM's Mamba layer tensor is its states' bytes of each block,
            # (num_blocks, 1, 1, state bytes) rows a page apart: a padded
            # page leaves a gap after each row (_pool_handles registers the
            # whole pages).
            row = sum((n - 1) * tensor.stride(d) for d, n in enumerate(shape) if d) * isz + isz
            if row <= gl.page_bytes:
                nbytes = self.num_blocks * gl.page_bytes
        if not ok or nbytes != self.num_blocks * gl.page_bytes:
            strides = tuple(tensor.stride(d) * isz for d in range(len(shape)))
            raise GeometryError(f"layer {layer} (group {gi}): tensor of shape {shape}, {nbytes} B, byte strides "
                                f"{strides}; kvtier needs {want}")

    def _pool_handles(self, gi: int, layer: str, tensor: Any) -> list[cuda.MemHandle]:
        """The MemHandles of one layer's pools (one, or K then V) after
        checking the layout."""
        self._check_layout(gi, layer, tensor)
        if self.layers[gi].recurrent:
            return self._state_pool_handles(gi, layer, tensor)
        if self.cfg.device == "host":
            return self._host_pool_handles(layer, tensor, self.layers[gi].kv_split)
        if self.layers[gi].kv_split:
            return [cuda.mem_handle_from_torch(tensor[0]), cuda.mem_handle_from_torch(tensor[1])]
        return [cuda.mem_handle_from_torch(tensor)]

    def _state_pool_handles(self, gi: int, layer: str, tensor: Any) -> list[cuda.MemHandle]:
        """A Mamba layer's pool: its whole pages (num_blocks x page bytes)
        from the first block's. With kvtier_device=host the pages move into
        host-backend memory (as _host_pool_handles) and vLLM's layer binds
        its state views again from the moved tensor: it cut them from the
        tensor before the connector saw it, so they would keep the old
        memory."""
        import torch

        page = self.layers[gi].page_bytes
        pages = tensor.view(torch.uint8).as_strided((self.num_blocks, page), (page, 1))
        if self.cfg.device != "host":
            return [cuda.mem_handle_from_torch(pages)]
        hs = self._host_pool_handles(layer, pages, False)
        with torch.no_grad():
            tensor.set_(pages.untyped_storage(), 0, tuple(tensor.shape), tuple(tensor.stride()))
        ctx = getattr(getattr(self, "_vllm_config", None), "compilation_config", None)
        mod = getattr(ctx, "static_forward_context", {}).get(layer)
        if mod is None or not hasattr(mod, "bind_kv_cache"):
            raise GeometryError(f"layer {layer} (group {gi}): no vLLM layer to bind the moved Mamba states to")
        mod.bind_kv_cache(tensor)
        return hs

    def _host_dev(self) -> cuda.HostDevice:
        if self._host is None:
            self._host = self.cfg.host_device()
        return self._host

    def _host_pool_handles(self, layer: str, tensor: Any, kv_split: bool) -> list[cuda.MemHandle]:
        """kvtier_device=host (vLLM's CPU backend): moves a CPU layer tensor
        into a host-backend allocation, in place, so that the rankd reads and
        writes the very pages vLLM computes with. The contents are copied
        and the tensor keeps its shape and strides (``set_`` swaps its
        storage: every reference vLLM holds to the tensor sees the new
        memory). _check_layout has made sure the tensor is dense."""
        import torch

        if tensor.device.type != "cpu":
            raise GeometryError(f"layer {layer}: kvtier_device=host needs CPU tensors (vLLM's CPU backend), "
                                f"got a tensor on {tensor.device}; use kvtier_device=cuda on a GPU")
        nbytes = tensor.numel() * tensor.element_size()
        mem = self._host_dev().alloc(nbytes)
        if not self._host_mems:
            # vLLM's tensors live in these files: they go when the process
            # ends (shutdown, or the interpreter's exit on SIGTERM).
            atexit.register(self._unlink_host_files)
        self._host_mems.append(mem)
        raw = torch.frombuffer(mem.buf, dtype=torch.uint8, count=nbytes)
        moved = torch.as_strided(raw.view(tensor.dtype), tuple(tensor.shape), tuple(tensor.stride()), 0)
        moved.copy_(tensor)
        with torch.no_grad():
            tensor.set_(moved.untyped_storage(), 0, tuple(tensor.shape), tuple(tensor.stride()))
        if kv_split:
            return [mem.export(0, nbytes // 2), mem.export(nbytes // 2, nbytes // 2)]
        return [mem.export(0, nbytes)]

    def _new_event(self) -> tuple[Any, cuda.EventHandle]:
        """A fresh interprocess event recorded after the forward on the
        current stream, and its handle. The object is kept until the store
        answers, then dropped (release() when it has one). On the host
        backend the forward has finished when wait_for_save runs (CPU work
        is synchronous), so the event is recorded completed."""
        if self.cfg.device == "host":
            hev = self._host_dev().new_event()
            hev.record()
            return hev, hev.export()
        import torch

        ev = torch.cuda.Event(interprocess=True)
        ev.record(torch.cuda.current_stream())
        return ev, cuda.event_handle_from_torch(ev, self._device_uuid)

    def _setup_worker(self, c: kvclient.SyncClient) -> None:
        """Registers the pools with this worker's rankd (again after it
        restarted), and learns its incarnation."""
        sess = c.register(self._rank, self.spec, self._device_uuid, self._pools)
        if self._freed_sub is not c:
            sess.on_freed(self._on_freed)
            self._freed_sub = c
        inc = int(c.status(self._rank, timeout=self.cfg.lookup_timeout_s).incarnation)
        if self._session is not None:
            self.stats["reregistered"] += 1
        self._session, self._incarnation = sess, inc
        log.info("kvtier: registered %d pools with rankd %s (incarnation %d)", len(self._pools), self._rank, inc)

    def _check_worker(self, c: kvclient.SyncClient) -> Check:
        """Whether the rankd still holds this worker's registration: a new
        incarnation forgot it."""
        inc = int(c.status(self._rank, timeout=self.cfg.lookup_timeout_s).incarnation)
        return "ok" if inc == self._incarnation else "setup"

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Checks every layer's pool and starts registering them with this
        worker's rankd in the background: vLLM starts whether or not the
        rankd is up (C11); the pools are registered when it answers."""
        self._rank = wire.Rank(self.instances[self.pp_stage], self._tp_rank())
        pools: list[wire.PoolRegistration] = []
        for gi, gl in enumerate(self.layers):
            for li, name in enumerate(gl.layer_names):
                if name not in kv_caches:
                    raise GeometryError(f"kv_caches has no tensor for layer {name} of group {gi}")
                hs = self._pool_handles(gi, name, kv_caches[name])
                want = 2 if gl.kv_split else 1
                if len(hs) != want:
                    raise GeometryError(f"layer {name} (group {gi}): {len(hs)} pools, want {want}")
                for j, h in enumerate(hs):
                    pools.append(wire.PoolRegistration(gi, li * want + j, h))
        uuids = {p.handle.device for p in pools}
        if len(uuids) != 1:
            raise GeometryError(f"pools on {len(uuids)} devices {sorted(uuids)}, want one")
        self._device_uuid = uuids.pop()
        self._pools = pools
        if self.cfg.verify_on_engine:
            self._engine_pools = _verify.engine_pools(self.layers, kv_caches)
        self._start_link(f"worker {self._rank}", self._setup_worker, self._check_worker)
        self._wait_at_start()

    def _usable(self) -> tuple[kvclient.SyncClient, kvclient.SyncRankSession] | None:
        c, s = self._client_now(), self._session
        return None if c is None or s is None else (c, s)

    def _store_chunks(self, save: SaveSpec) -> list[wire.ChunkBlocks]:
        tp = self._rank.tp_rank
        out = []
        # Under PP each stage stores under its own namespace's hashes.
        stage_hashes = save.stage_hashes[self.pp_stage] if save.stage_hashes else None
        for i, (h, blocks) in enumerate(save.chunks):
            if stage_hashes is not None:
                h = stage_hashes[i]
            per_group = [blocks[gi] if self.resolved.store_shard(gi, tp) is not None else []
                         for gi in range(len(self.spec.groups))]
            if any(per_group) and any(gl.recurrent and not blocks[gi] for gi, gl in enumerate(self.layers)):
                self.stats["stored_without_state"] += 1
            if any(per_group):
                pos = save.positions[i] if i < len(save.positions) else 0
                out.append(wire.ChunkBlocks(dcp.ChunkHash(h), per_group, pos))
        return out

    async def _store(self, s: kvclient.SyncRankSession, req_id: str, chunks: list[wire.ChunkBlocks],
                     handle: cuda.EventHandle, deadline: float, gather_limit: float | None) -> wire.StoreReply:
        try:
            return await s.aio.store(req_id, chunks, handle, timeout=self.cfg.timeout_s, deadline=deadline,
                                     gather_limit=gather_limit)
        except (UnknownNamespace, UnknownSession):
            # A restarted rankd forgot the registration: the link registers
            # again. (Never on StaleSession: another process of the instance
            # took the pools; registering again would take them back.)
            if self._link is not None:
                self._link.resetup(f"rankd {self._rank} does not know the session")
            raise

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata() or self._link is None:
            return
        meta = cast(KvtierConnectorMetadata, self._get_connector_metadata())
        waits: list[tuple[str, concurrent.futures.Future[wire.StoreReply], float]] = []
        for save in meta.saves:
            self._saving.add(save.req_id)  # reported finished by get_finished, stored or not
            chunks = self._store_chunks(save)
            if not chunks:
                continue  # this rank stores no shard of these chunks (MLA)
            use = self._usable()
            if use is None:
                self.stats["stores_skipped"] += 1  # kvtier is down: nothing waits on it (C11)
                continue
            c, s = use
            ev, handle = self._new_event()
            # The store's deadline: vLLM holds the blocks until the answer,
            # so the rankd may wait for L1 room (a disk slower than the
            # saves) only kvtier_store_wait_s; then the objects not yet
            # copied fail and it answers (a copy already begun still ends
            # first: C1). An older rankd ignores the header and answers
            # within its store timeout.
            deadline = time.time() + self.cfg.store_wait_s
            # vLLM frees out-of-window blocks, and Mamba state blocks behind
            # the request's last state, at a later schedule without asking
            # the connector: the rankd must read them before this step ends.
            # The step waits for that only until the gather limit (the
            # deadline plus kvtier_store_grace_s for a copy already begun),
            # never the request timeout (C11); a copy that ends after the
            # limit may have read reused blocks, so the rankd stores none of
            # it. Full attention: vLLM keeps the blocks until the request is
            # reported finished, so nothing waits here; but a preemption frees
            # them at once, so every store has the limit, and the worker waits
            # for a preempted request's stores before the next forward
            # (handle_preemptions).
            held = bool(self._windows) or any(gl.recurrent for gl in self.layers)
            limit = deadline + self.cfg.store_grace_s
            fut = submit(c, self._store(s, save.req_id, chunks, handle, deadline, limit))
            key = tuple(bytes(ch.chunk) for ch in chunks)
            self._pending.setdefault(save.req_id, []).append(_Pending(fut, ev, key, limit=limit, deadline=deadline))
            self.stats["stores"] += 1
            if held:
                waits.append((save.req_id, fut, limit))
        # Every store is sent before the step waits, so the step waits
        # until the latest limit, not one limit per store.
        for req_id, fut, limit in waits:
            self._wait_store(req_id, fut, limit)

    def _wait_store(self, req_id: str, fut: concurrent.futures.Future[wire.StoreReply], limit: float) -> None:
        """Waits for a store's answer until limit (time.time() seconds) by
        the wall clock, the one the rankd compares a gather's end with (the
        engine and its rankd share a host): a wait cut earlier by another
        clock would hand vLLM blocks that a gather ending just before the
        limit may still be reading."""
        while not fut.done():
            left = limit - time.time()
            if left <= 0:
                self.stats["store_waits_cut"] += 1
                log.warning("kvtier store for %s has not answered by its gather limit (kvtier_store_wait_s %.3g s "
                            "+ kvtier_store_grace_s %.3g s): vLLM goes on; a copy ending later is not stored",
                            req_id, self.cfg.store_wait_s, self.cfg.store_grace_s)
                return
            concurrent.futures.wait([fut], timeout=left)

    def _on_freed(self, msg: wire.BlocksFreed) -> None:
        with self._freed_lock:
            self._freed.add((msg.request_id, tuple(bytes(c) for c in msg.chunks)))

    def _take_freed(self, req_id: str, chunks: tuple[bytes, ...]) -> bool:
        with self._freed_lock:
            if (req_id, chunks) in self._freed:
                self._freed.discard((req_id, chunks))
                return True
            return False

    def _reap(self) -> None:
        for req_id, pend in list(self._pending.items()):
            keep = []
            for p in pend:
                if not p.fut.done():
                    keep.append(p)
                    continue
                if p.in_use:
                    if not self._take_freed(req_id, p.chunks):
                        keep.append(p)
                        continue
                else:
                    try:
                        rep = p.fut.result()
                    except Exception as e:
                        self.stats["store_failures"] += 1
                        log.warning("kvtier store for %s failed: %s", req_id, e)
                    else:
                        self.stats["stored_objects"] += rep.stored
                        if rep.failed:
                            self.stats["store_failures"] += 1
                            log.warning("kvtier store for %s: failed objects %s", req_id, rep.failed)
                        if rep.blocks_in_use and not self._take_freed(req_id, p.chunks):
                            # C10: the device may still read the blocks. The
                            # request keeps them (vLLM does not free them) and
                            # the event lives until the rankd says BlocksFreed.
                            log.warning("kvtier store for %s: blocks still in use; held until freed", req_id)
                            self.stats["blocks_in_use"] += 1
                            p.in_use = True
                            keep.append(p)
                            continue
                rel = getattr(p.event, "release", None)
                if callable(rel):
                    rel()
            if keep:
                self._pending[req_id] = keep
            else:
                del self._pending[req_id]

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """vLLM calls this before a step's forward. A preempted request's
        blocks were freed without asking the connector and may be written
        by this forward: its stores are waited for, each until its gather
        limit (a gather ending later stores nothing), so no object is
        committed from bytes another request wrote (C1). So that the step
        does not wait for a store waiting on L1 room (a slow disk) until its
        deadline, the rankd is first told to cut them (rankd.CutRequest),
        bounded by their latest deadline: a store that has not begun its
        gather then answers at once, also one the cut overtook on the way to
        the rankd, and the request's later stores (once vLLM resumes it,
        with later deadlines) are not cut."""
        waiting = {r: max(p.deadline for p in cut) for r in getattr(kv_connector_metadata, "preempted", None) or ()
                   if (cut := [p for p in self._pending.get(r, ()) if p.limit and not p.in_use and not p.fut.done()])}
        use = self._usable() if waiting else None
        if use is not None:
            c, s = use
            for req_id, through in waiting.items():
                submit(c, self._cut(s, req_id, through))
        for req_id in getattr(kv_connector_metadata, "preempted", None) or ():
            for p in list(self._pending.get(req_id, ())):
                if p.limit and not p.in_use:
                    self._wait_store(req_id, p.fut, p.limit)

    async def _cut(self, s: kvclient.SyncRankSession, req_id: str, through: float) -> None:
        try:
            await s.aio.cut(req_id, through=through or None, timeout=self.cfg.timeout_s)
        except Exception as e:  # an older rankd: the wait is bounded by the gather limit anyway
            log.debug("kvtier cut of %s's stores: %s", req_id, e)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata():
            # Finished while their load ran: vLLM frees them on the load's
            # report, never on finished_sending (KvtierConnectorMetadata.no_send).
            for r in cast(KvtierConnectorMetadata, self._get_connector_metadata()).no_send:
                self._saving.discard(r)
                self._finishing.discard(r)
        self._finishing |= {r for r in finished_req_ids if r in self._saving}
        self._reap()
        done = {r for r in self._finishing if r not in self._pending}
        self._finishing -= done
        self._saving -= done
        loaded = self._finish_loads()
        self._step += 1
        return (done or None), (loaded or None)

    def _load_bound_s(self) -> float:
        """How long one load may take, start to verdict, before it is
        given up and its chunks recomputed."""
        return self.cfg.restore_deadline_ms / 1000 + self.cfg.lookup_timeout_s + 1

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Starts this step's loads on the client's loop and returns: an
        asynchronous load is reported by get_finished when its verdict is
        in (vLLM runs the other requests meanwhile); a synchronous one
        (kvtier_load_async false) is waited for here, bounded."""
        if not self.has_connector_metadata() or self._link is None:
            return
        meta = cast(KvtierConnectorMetadata, self._get_connector_metadata())
        sync: list[str] = []
        for load in meta.loads:
            if load.stage_restore_ids:  # PP: this stage's restore (kvtier.vllm.spec)
                load = dataclasses.replace(load, restore_id=load.stage_restore_ids[self.pp_stage])
            self.stats["restores"] += 1
            use = self._usable()
            fut: concurrent.futures.Future[_LoadResult]
            deadline = 0.0
            if use is None or not load.restore_id:
                fut = concurrent.futures.Future()
                if use is None:
                    self.stats["loads_skipped"] += 1
                    load.problem = load.problem or "kvtier not attached"
                fut.set_result(_LoadResult(0, 0, load.problem))
            else:
                c, s = use
                # The rankd places nothing after this wall-clock time; the
                # load is given up (its blocks back to vLLM) only at
                # _load_bound_s, kvtier_lookup_timeout_s + 1 s later.
                deadline = time.time() + self.cfg.restore_deadline_ms / 1000
                fut = submit(c, self._load(c, s, load, deadline))
            self._loading[load.req_id] = _Loading(fut, load, time.monotonic(), self._step, deadline)
            if not load.async_load:
                sync.append(load.req_id)
        if sync:
            # A load resolves by its bound, or up to one more while the wall
            # clock has not passed the rankd's deadline (_load).
            concurrent.futures.wait([self._loading[r].fut for r in sync], timeout=2 * self._load_bound_s() + 1)
            self._finish_loads(only=set(sync), force=True)

    def _finish_loads(self, only: set[str] | None = None, force: bool = False) -> set[str]:
        """Settles every load that is done (or, with force, every one of
        only): the chunks not confirmed go to the load errors, in the same
        step as the request is reported finished. Returns the requests of
        asynchronous loads settled."""
        out: set[str] = set()
        now = time.monotonic()
        for req_id, ld in list(self._loading.items()):
            if only is not None and req_id not in only:
                continue
            if not ld.fut.done():
                if not force and not self._past_bound(ld, now):
                    continue
                ld.fut.cancel()
                res = _LoadResult(0, 0, "no verdict in time")
            else:
                try:
                    res = ld.fut.result()
                except BaseException as e:  # a failed load is a recompute, whatever the cause
                    res = _LoadResult(0, 0, str(e) or type(e).__name__)
            del self._loading[req_id]
            self._settle(ld.load, res, now - ld.since, self._step - ld.step)
            if ld.load.async_load:
                out.add(req_id)
        return out

    def _past_bound(self, ld: _Loading, now: float) -> bool:
        """Whether a load without its verdict may be given up (its blocks
        back to vLLM): _load_bound_s after it started, by the monotonic
        clock, and past the wall-clock deadline the rankd compares with
        (the engine and its rankd share a host). A wall clock stepped back
        meanwhile (NTP) would let the rankd still place pages after the
        monotonic bound: the blocks are held until the wall clock passes
        the deadline too, for at most one more bound (the load is given
        up then whatever the clocks say, C11)."""
        waited = now - ld.since
        bound = self._load_bound_s()
        if waited < bound:
            return False
        return time.time() >= ld.deadline or waited >= 2 * bound

    def _settle(self, load: LoadSpec, res: _LoadResult, took_s: float, steps: int) -> None:
        """Counts one load's verdict and hands its unconfirmed chunks' blocks
        to the load errors; steps: the engine steps that ran between its
        start and this report (0: reported in the step that started it)."""
        if self.cfg.verify_on_engine:
            # What the load's future found (_load), counted before anything
            # counts the chunks loaded.
            res = _verify.verify_load(self, load, res)
        self.stats["loads"] += 1
        self.stats["load_ms"] += int(took_s * 1000)
        self.stats["load_steps"] += steps
        self.stats["load_steps_max"] = max(self.stats["load_steps_max"], steps)
        loaded = min(res.loaded, load.chunks)
        if loaded < load.chunks and self.multi_group:
            loaded = 0  # several groups: vLLM recomputes the whole request (failed_recving)
        self.recent_loads.append({"req": load.req_id, "restore": load.restore_id, "steps": steps,
                                  "ms": int(took_s * 1000), "loaded": loaded, "chunks": load.chunks,
                                  "problem": res.problem if loaded < load.chunks else ""})
        # The first chunk's tokens that vLLM held were neither loaded nor
        # failed: they count on the side the chunk fell on, less those.
        held = load.held_tokens
        if loaded < load.chunks:
            self.stats["restore_failures"] += 1
            self.stats["load_failed_tokens"] += (load.chunks - loaded) * self.chunk - (held if loaded == 0 else 0)
            log.warning("kvtier restore %s for %s: %d of %d chunks loaded, recomputing the rest (%s)",
                        load.restore_id or "-", load.req_id, loaded, load.chunks, res.problem or "verdict failed")
        self.stats["recomputed_bad_bytes_tokens"] += res.bad_bytes_chunks * self.chunk
        self.stats["loaded_tokens"] += loaded * self.chunk - (held if loaded > 0 else 0)
        if loaded < load.chunks and self.multi_group:
            # vLLM refuses block ids without a group: the request fails as
            # a whole and is recomputed (get_transfer_results).
            self._failed_recving.add(load.req_id)
            self.stats["load_error_blocks"] += sum(len(b) for b in load.block_ids)
            return
        for c in range(load.first_chunk + loaded, load.first_chunk + load.chunks):
            for gi in range(len(self.spec.groups)):
                bpc = self.resolved.blocks_per_chunk(gi)
                ids = load.block_ids[gi][c * bpc:(c + 1) * bpc]
                if c == load.first_chunk:
                    ids = ids[self._held_blocks(load, gi):]  # vLLM's own blocks are valid: never reported
                self._load_errors.update(ids)
                self.stats["load_error_blocks"] += len(ids)

    def _held_blocks(self, load: LoadSpec, gi: int) -> int:
        """The first chunk's blocks of group gi that vLLM's own prefix
        holds (the scheduler offers a load only when held_tokens ends on a
        block of every group)."""
        return load.held_tokens // self.resolved.geometry[gi].span

    async def _load(self, c: kvclient.SyncClient, s: kvclient.SyncRankSession, load: LoadSpec,
                    deadline: float) -> _LoadResult:
        """This rank's part of one restore, bounded by _load_bound_s: the
        chunks confirmed by the verdict (only a complete verdict confirms
        all of them)."""
        bound = self._load_bound_s()
        try:
            res = await asyncio.wait_for(self._load_inner(c, s, load, deadline), bound)
        except TimeoutError:
            # The rankd places nothing after deadline by the wall clock;
            # one stepped back meanwhile (NTP) leaves it time the monotonic
            # bound does not see: the blocks stay vLLM's only once the
            # wall clock has passed it too, at most one more bound later.
            if (left := min(deadline - time.time(), bound)) > 0:
                await asyncio.sleep(left)
            return _LoadResult(0, 0, f"no verdict within {bound:.1f} s")
        if self.cfg.verify_on_engine:
            # The pages are summed here, before the future resolves, on a
            # thread of its own (a CUDA stream of its own), not on vLLM's
            # step nor on the client's loop; _settle only applies the result.
            res = await asyncio.to_thread(_verify.check_off_step, self, load, res)
        return res

    async def _load_inner(self, c: kvclient.SyncClient, s: kvclient.SyncRankSession, load: LoadSpec,
                          deadline: float) -> _LoadResult:
        bound = self._load_bound_s()
        raw = load.items.get(str(self._rank))
        problem = ""
        # The verdict's wait goes out beside the retrieve (kvtier.client
        # restore), on this stage's instance, which began it (PP:
        # kvtier.vllm.spec).
        wait = asyncio.ensure_future(c.aio.restore_wait(load.restore_id, timeout=bound, instance=self._rank.instance))
        try:
            problem = await self._retrieve(s, load, raw, bound, deadline)
        except BaseException:  # cancelled (the load's bound): so is the wait
            wait.cancel()
            raise
        verdict = await wait
        plan = wire.RestorePlan(load.restore_id, load.planned)
        out = kvclient.restore_outcome(plan, verdict, problem)
        return _LoadResult(out.loaded, out.bytes_wrong, out.problem)

    async def _retrieve(self, s: kvclient.SyncRankSession, load: LoadSpec, raw: bytes | None, bound: float,
                        deadline: float) -> str:
        """This rank's retrieve of its items of load; the problem, if any
        (the verdict decides either way)."""
        problem = ""
        if raw:
            # The request is written from the packed items directly: no
            # Python object per item on the way (issue 25.4). Item (chunk
            # i, group g) gets the request's blocks of its chunk; when
            # vLLM's prefix ends inside the first chunk, its blocks before
            # the end are vLLM's own (maybe shared): the rankd places only
            # the later ones and still verifies the whole object. Every
            # rank holds a page of every scheduler block (DCP too), so all
            # skip alike.
            groups = len(self.spec.groups)
            bpc = [self.resolved.blocks_per_chunk(g) for g in range(groups)]
            skip = [self._held_blocks(load, g) for g in range(groups)] if load.held_tokens else []
            try:
                items = client_plan.PlanItems.from_bytes(raw)
                nulls = items.holding(NULL_BLOCK, load.block_ids, bpc, load.first_chunk, skip)
                if nulls:  # never write into vLLM's null block (it reads as zeros)
                    raise GeometryError(f"(group, chunk) {nulls[:4]} land in vLLM's null block {NULL_BLOCK}")
                await s.aio.retrieve_packed(items, load.restore_id, load.block_ids, bpc, first_chunk=load.first_chunk,
                                            skip=skip, timeout=bound, deadline=deadline, pace=load.pace)
            except (UnknownNamespace, UnknownSession) as e:
                # A restarted rankd forgot the registration: the link
                # registers again for the next restore; the verdict decides.
                if self._link is not None:
                    self._link.resetup(f"rankd {self._rank} does not know the session")
                problem = f"retrieve: {e}"
            except Exception as e:  # the verdict decides
                problem = f"retrieve: {e}"
                log.warning("kvtier retrieve of %s on %s: %s", load.restore_id, self._rank, e)
        return problem

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole requests: start_load_kv / get_finished

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole chunks are stored after the forward (wait_for_save)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """get_finished's sets, and (several groups) the requests whose load
        failed: vLLM recomputes each of them from its first token."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._failed_recving & set(recving or ())
        self._failed_recving -= failed
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def _unlink_host_files(self) -> None:
        """kvtier_device=host: removes the pool files from the host
        directory; the mappings (vLLM's tensors) stay valid."""
        for mem in self._host_mems:
            mem.unlink()

