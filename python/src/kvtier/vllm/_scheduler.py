"""The scheduler side of KvtierConnector: the lookup and the restore's
begin for each request (get_num_new_matched_tokens), the blocks vLLM
allocates for it, and the step's metadata (build_connector_meta): the
loads to hand the workers and the chunks that this step completes, to
store. Nothing here sends anything while the metadata is built."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

from kvtier import client as kvclient
from kvtier.client_plan import PackedPlan, PlanItems
from kvtier.errors import BadRequest, GeometryError, RequestTimeout, UnknownNamespace
from kvtier.vllm._core import _Core
from kvtier.vllm._state import NULL_BLOCK, KvtierConnectorMetadata, LoadSpec, SaveSpec, _Req, submit
from kvtier.vllm.spec import request_chunk_hashes

log = logging.getLogger("kvtier.vllm")


def _bypass_reason(request: Any) -> str:
    """Why a request's KV cannot be named by its tokens and salt alone: a
    LoRA adapter changes the K and V projections; multimodal inputs and
    prompt embeddings put the same placeholder token ids where different
    embeddings go (vLLM's own block hashes add each as an extra key). ""
    for a plain request."""
    if getattr(request, "lora_request", None) is not None:
        return "a LoRA adapter"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"  # their positions hold one placeholder token id
    for attr in ("mm_features", "mm_hashes", "mm_positions", "mm_inputs"):
        if getattr(request, attr, None):
            return "multimodal inputs"
    return ""


class _SchedulerSide(_Core):
    """vLLM's scheduler-side connector methods."""

    # Whether a restore.begin is also the lookup (PP 1): until a
    # coordinator that predates RestoreBeginRequest.Lookup refuses it.
    _begin_looks_up = True
    _bypass_logged = False

    def _setup_scheduler(self, c: kvclient.SyncClient) -> None:
        for r in self.stages:  # every pipeline stage's (one under PP 1)
            c.register_spec(r.spec)

    def _req(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            tokens = list(request.prompt_token_ids or [])
            # vLLM's per-request cache salt: salted requests share chunks
            # only with requests of the same salt (kvtier.vllm.spec).
            salt = getattr(request, "cache_salt", None)
            st = _Req(tokens, request_chunk_hashes(self.resolved, tokens, salt))
            st.bypass = _bypass_reason(request)
            if st.bypass:
                self.stats["requests_bypassed"] += 1
                if not self._bypass_logged:
                    self._bypass_logged = True
                    log.warning("kvtier neither restores nor stores requests with %s: their KV depends on more than "
                                "the tokens and cache_salt the chunk hashes cover (counted: requests_bypassed)",
                                st.bypass)
            if self.pp > 1:  # every stage its own namespace, so its own chain (kvtier.vllm.spec)
                st.stage_hashes = [st.hashes] + [request_chunk_hashes(r, tokens, salt) for r in self.stages[1:]]
            self._reqs[request.request_id] = st
        return st

    async def _lookup_and_begin(self, c: kvclient.SyncClient, st: _Req, first: int,
                                last: int) -> list[PackedPlan] | None:
        """The lookup and, on a hit, the restore's begin, of chunks
        [first, last) in every pipeline stage's namespace (one under PP 1):
        the plans come before vLLM is told of any tokens, so building the
        step's metadata sends nothing. A chunk is a hit only when every
        stage holds it, so the restore begins on the prefix all stages hold.
        None: nothing restorable."""
        t = self.cfg.lookup_timeout_s
        hashes = st.stage_hashes or [st.hashes]
        states = bool(self._state_groups())  # a Mamba group: its state at the prefix's end only (below)
        if len(self.stages) == 1 and self._begin_looks_up:
            # One round trip: the begin is the lookup (its prefix is the
            # longest restorable one; a miss is a plan of prefix 0).
            try:
                plan = await c.aio.restore_begin_packed(
                    self.stages[0].namespace, hashes[0][first:last], instance=self.instances[0],
                    deadline_ms=self.cfg.restore_deadline_ms, timeout=t, state_at_end=states, lookup=True)
            except BadRequest as e:
                if 'unknown field "lookup"' not in str(e):  # an older coordinator's JSON decoder
                    raise
                self._begin_looks_up = False
                log.warning("kvtier: the coordinator refuses a begin that is also the lookup (%s); looking up "
                            "before each begin until this engine restarts", e)
            else:
                return [plan] if plan.prefix > 0 else None
        reps = await asyncio.gather(*(
            c.aio.lookup(r.namespace, h[first:last], instance=inst, timeout=t, state_at_end=states)
            for r, h, inst in zip(self.stages, hashes, self.instances, strict=True)))
        n = min(rep.prefix for rep in reps)
        if any(rep.not_alive for rep in reps) or n <= 0:
            return None
        plans = list(await asyncio.gather(*(
            c.aio.restore_begin_packed(r.namespace, h[first:first + n], instance=inst,
                                deadline_ms=self.cfg.restore_deadline_ms, timeout=t, state_at_end=states)
            for r, h, inst in zip(self.stages, hashes, self.instances, strict=True))))
        if len({p.prefix for p in plans}) > 1:
            # An object went between a stage's lookup and its begin: the
            # stages' plans differ, and a stage's items past the common
            # prefix would name blocks vLLM does not allocate. A miss.
            log.info("kvtier restore not planned: the pipeline stages' plans cover %s chunks",
                     [p.prefix for p in plans])
            return None
        return plans

    @staticmethod
    def _joined(plans: list[PackedPlan]) -> PackedPlan:
        """One plan of the stages' (their prefixes equal): stage 0's
        restore id, every stage's ranks (each stage's instance its own)."""
        if len(plans) == 1:
            return plans[0]
        ranks: dict[str, PlanItems] = {}
        for p in plans:
            ranks.update(p.ranks)
        return PackedPlan(plans[0].restore_id, plans[0].prefix, ranks, "; ".join(p.reason for p in plans if p.reason))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._req(request)
        if st.load_issued or self.loads_off or st.bypass:
            return 0, False  # loaded once already, or no load this vLLM could take back (_Core.loads_off)
        # vLLM's own prefix cache may end inside a chunk (at a block of
        # it): the lookup starts at that chunk, and its blocks before the
        # prefix's end are vLLM's (shared with its other requests), never
        # written: the load skips them (wire.RetrieveItem.skip).
        first, held = divmod(num_computed_tokens, self.chunk)
        if held and not self._skippable(held):
            return 0, False
        last = max(0, (len(st.tokens) - 1) // self.chunk)  # vLLM must compute at least one token
        last = min(last, len(st.hashes), first + self._window_chunks(first, num_computed_tokens))
        if first >= last:
            return 0, False
        if st.lookup_first != first:
            # vLLM holds more of the prompt now (another request's load or
            # compute filled its prefix cache): the old lookup's restore is
            # not the one to load.
            self._abandon(st)
            st.lookup, st.lookup_first, st.matched_chunks, st.plan, st.stage_plans = None, first, None, None, []
        elif st.plan is not None and self._plan_stale(st):
            # The restore was begun with the lookup, and its deadline runs
            # at the coordinator from then: a request that waited for blocks
            # past half of it would load with too little left and fail late,
            # recomputing a hit. Look up and begin again (the old restore,
            # which no rankd was sent, is withdrawn: _cancel).
            self.stats["plans_renewed"] += 1
            self._cancel(st)
            st.lookup, st.matched_chunks, st.plan, st.stage_plans = None, None, None, []
        st.held_tokens = held  # vLLM asks again with the prefix it holds then: the last ask counts
        if st.matched_chunks is None:
            if st.lookup is None:
                c = self._client_now()
                if c is None:  # kvtier is down or not attached yet: a miss, at once (C11)
                    self.stats["lookups_skipped"] += 1
                    st.matched_chunks = 0
                    return 0, False
                st.lookup = submit(c, self._lookup_and_begin(c, st, first, last))
                st.lookup_since = time.monotonic()
                self.stats["lookups"] += 1
                self.stats["lookup_tokens"] += (last - first) * self.chunk
            # One wait budget per scheduler step, not per request: vLLM asks
            # every waiting request in a step, and a slow coordinator would
            # otherwise cost the step kvtier_lookup_wait_s for each (C11).
            t0 = time.monotonic()
            done, _ = concurrent.futures.wait([st.lookup], timeout=min(self.cfg.lookup_wait_s, self._wait_left))
            self._wait_left = max(0.0, self._wait_left - (time.monotonic() - t0))
            if not done:
                if time.monotonic() - st.lookup_since < self.cfg.lookup_timeout_s * 2 + 1:
                    return None, False  # not yet: vLLM asks again
                self._abandon(st)  # a begin it still makes is withdrawn
                st.lookup.cancel()  # its own timeouts did not fire: give up, a miss
                log.warning("kvtier lookup for %s: no answer in time; recomputing", request.request_id)
                self.stats["lookup_timeouts"] += 1
                st.matched_chunks = 0
            else:
                try:
                    plans = st.lookup.result()
                    st.stage_plans = plans or []
                    st.plan = None if plans is None else self._joined(plans)
                except Exception as e:  # a timed-out or failed lookup is a miss, never "not yet"
                    self._lookup_failed(request.request_id, e)
                    st.matched_chunks = 0
                else:
                    st.matched_chunks = 0 if st.plan is None else min(st.plan.prefix, last - first)
                    if st.plan is not None and st.plan.prefix < 1 and st.plan.reason:
                        log.info("kvtier restore for %s not planned: %s", request.request_id, st.plan.reason)
                self.stats["hit_tokens"] += max(0, st.matched_chunks * self.chunk - held)
        n = min(st.matched_chunks, last - first)
        if n <= 0:
            return 0, False
        return n * self.chunk - held, self.cfg.load_async

    def _cancel(self, st: _Req) -> None:
        """Withdraws the restore begun for st's hit, which no worker was
        handed (every stage's under PP): the coordinator decides it at once
        instead of failing it at its deadline, and frees its slot. Sent and
        not waited for; a coordinator that predates restore.cancel, or one
        that is down, fails it at the deadline as before."""
        self._cancel_plans(st.stage_plans or ([st.plan] if st.plan else []))

    def _cancel_plans(self, plans: list[PackedPlan]) -> None:
        c = self._client_now()
        if c is None:
            return
        for p, inst in zip(plans, self.instances, strict=False):
            if p is not None and p.restore_id and p.prefix > 0:
                with self._cancel_lock:  # also called on the client's loop thread (_abandon)
                    self.stats["restores_cancelled"] += 1
                submit(c, c.aio.restore_cancel(p.restore_id, instance=inst, timeout=self.cfg.lookup_timeout_s))

    def _abandon(self, st: _Req) -> None:
        """st's lookup will not be loaded: its restore is withdrawn, now if
        the plan is in, else once the lookup-begin in flight answers (a
        lookup cancelled before its answer may still have begun one, which
        then fails at its deadline)."""
        if st.plan is not None or st.stage_plans:
            self._cancel(st)
            return
        fut = st.lookup
        if fut is None or fut.done():
            return

        def done(f: concurrent.futures.Future[list[PackedPlan] | None]) -> None:
            if not f.cancelled() and f.exception() is None:
                self._cancel_plans(f.result() or [])

        fut.add_done_callback(done)

    def _plan_stale(self, st: _Req) -> bool:
        """Whether the restore begun for st's hit has used half of its
        deadline (counted from the lookup's start, before the begin) while
        the request waited to be scheduled."""
        return time.monotonic() - st.lookup_since > self.cfg.restore_deadline_ms / 2000

    def _skippable(self, held: int) -> bool:
        """Whether a chunk of which vLLM holds the first held tokens can be
        loaded from there: held must end on a block of every group (each
        rank, under DCP too, then skips the same number of its pages: one
        per scheduler block), and no group may keep a state per chunk
        (Mamba: the chunk's one state page is not split by blocks). With
        kvtier_verify_on_engine the worker sums the whole chunk's pages in
        vLLM's tensors, vLLM's own blocks among them, which need not be
        bitwise the stored ones (another batch computed them): such a load
        would fail its check, so it is not offered."""
        if self.cfg.verify_on_engine or self._state_groups():
            return False
        return all(held % g.span == 0 for g in self.resolved.geometry)

    def _window_chunks(self, first: int, local: int | None = None) -> int:
        """How many chunks from the first (whose head vLLM may hold) may be
        restored without vLLM putting its null block in a sliding-window
        group's place: vLLM skips the first (T - window + 1) // block
        blocks of a prefix of T tokens, which must lie inside the local
        prefix of local tokens (default: the chunks before first)."""
        if local is None:
            local = first * self.chunk
        best = 1 << 62
        for window, block in self._windows:
            m = 0
            while m < best:
                t = (first + m + 1) * self.chunk
                skipped = max(0, t - window + 1) // block * block
                if skipped > local:
                    break
                m += 1
            best = m
        return best

    # Mamba / linear-attention state (vLLM's mamba_cache_mode "align"). vLLM
    # keeps the state after token B in the request's block B // bs - 1 of
    # the Mamba group (bs: its Mamba block) only when B is a multiple of bs
    # and a step ends there, or B is the prompt's checkpoint, and its
    # prefix_cache_retention_interval retains it (by default only the
    # prompt's last); it names each such block in the step's
    # KVConnectorBlockState.boundary_state_offloads
    # (the block table alone can hold a stale state there). A chunk's Mamba
    # object is the state at its end: a chunk is stored only when vLLM
    # handed over that state. On a restore of T tokens vLLM allocates one
    # fresh block for the state, block T // bs - 1, and none for the states
    # inside the restored tokens. So the restore asks the coordinator for a
    # Mamba group's object of its last chunk only (lookup and restore_begin
    # with state_at_end: the plan, the expectations and the verdict leave
    # the inner chunks' states out), placed in that block; the attention
    # groups of every chunk as usual. A chunk whose state vLLM did not hand
    # over is stored without it (its attention only): a restore may span
    # it, and ends on the last chunk with its state.

    def _state_groups(self) -> list[int]:
        return [gi for gi, gl in enumerate(self.layers) if gl.recurrent]

    def _take_states(self, scheduler_output: Any) -> None:
        """Records the boundary states vLLM hands over this step."""
        bs = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(bs, "boundary_state_offloads", None) or {}
        for req_id, entries in offers.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            for group, block, tokens in entries:
                if int(block) != NULL_BLOCK:
                    st.states[(int(group), int(tokens))] = int(block)

    def _state_block(self, st: _Req, gi: int, c: int) -> int:
        """The block holding the state at chunk c's end, handed over by
        vLLM; NULL_BLOCK when vLLM kept none there."""
        return st.states.get((gi, (c + 1) * self.chunk), NULL_BLOCK)

    def _load_state_ids(self, st: _Req, gi: int, n_chunks: int) -> list[int]:
        """The Mamba group's targets of a load, one per chunk (kvtier's
        recurrent group has one page per chunk): the block vLLM allocated
        for the state at the chunk's end, NULL_BLOCK where it allocated
        none (a load into it is refused). Only the last one is loaded
        (state_at_end): vLLM allocates that one."""
        bs = self.layers[gi].block_size
        ids = st.block_ids[gi] if gi < len(st.block_ids) else []
        out = []
        for c in range(n_chunks):
            i = (c + 1) * self.chunk // bs - 1
            out.append(ids[i] if i < len(ids) else NULL_BLOCK)
        return out

    def _lookup_failed(self, req_id: str, e: BaseException) -> None:
        if isinstance(e, (RequestTimeout, TimeoutError)):
            self.stats["lookup_timeouts"] += 1
        else:
            self.stats["lookup_errors"] += 1
        if isinstance(e, UnknownNamespace) and self._link is not None:
            self._link.resetup("the coordinator does not know the namespace")
        log.warning("kvtier lookup for %s failed, recomputing: %s", req_id, e)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._req(request)
        st.block_ids = [list(b) for b in blocks.get_block_ids()]
        if num_external_tokens > 0:
            total = num_external_tokens + st.held_tokens
            if total % self.chunk or st.lookup_first < 0:
                raise GeometryError(f"request {request.request_id}: {num_external_tokens} external tokens after "
                                    f"{st.held_tokens} held, not whole chunks of {self.chunk} from a lookup")
            st.load = (st.lookup_first, total // self.chunk)

    def _chunk_blocks(self, st: _Req, c: int) -> list[list[int]] | None:
        """Chunk c's block ids of every group; [] when a group has vLLM's
        null block there (a sliding-window block out of the window: the
        chunk is not stored); None when the blocks are not allocated. A
        Mamba group without the state at the chunk's end has no block ids
        (the chunk's other groups are stored; with no other group, nothing
        is)."""
        out = []
        for gi, gl in enumerate(self.layers):
            if gl.recurrent:
                b = self._state_block(st, gi, c)  # the state at the chunk's end, or none
                out.append([] if b == NULL_BLOCK else [b])
                continue
            bpc = self.resolved.blocks_per_chunk(gi)
            ids = st.block_ids[gi] if gi < len(st.block_ids) else []
            if len(ids) < (c + 1) * bpc:
                return None
            out.append(ids[c * bpc:(c + 1) * bpc])
        if any(NULL_BLOCK in b for b in out) or not any(out):
            return []
        return out

    def build_connector_meta(self, scheduler_output: Any) -> KvtierConnectorMetadata:
        self._wait_left = self.cfg.lookup_wait_s  # the next step's lookup wait budget
        meta = KvtierConnectorMetadata()
        self._take_states(scheduler_output)
        # Requests vLLM computes in this step: a load that starts beside
        # them is paced (kvtier_load_pace_gbps), so their steps slow less.
        busy = bool(getattr(scheduler_output, "num_scheduled_tokens", None))
        for req_id, st in self._reqs.items():
            if st.load is None:
                continue
            first, n = st.load
            st.load = None
            load = self._load_spec(req_id, st, first, n)
            if self.cfg.load_pace_gbps and load.async_load and load.restore_id:
                load.pace = self.cfg.load_pace() if busy else 0
            meta.loads.append(load)
            if load.async_load:
                self._loads_in_flight.add(req_id)
            st.plan, st.stage_plans, st.load_issued = None, [], True  # a plan is used once, a request loads once
            st.saved_through = max(st.saved_through, first + n)
        meta.preempted = [r for r in getattr(scheduler_output, "preempted_req_ids", None) or ()
                          if (pst := self._reqs.get(r)) is not None and pst.saved_any]
        meta.no_send, self._no_send = self._no_send, []
        num_sched = dict(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
        for new in getattr(scheduler_output, "scheduled_new_reqs", []) or []:
            self._loads_in_flight.discard(new.req_id)  # computing: its load is done
            nst = self._reqs.get(new.req_id)
            if nst is None:
                continue  # never asked about (get_num_new_matched_tokens runs first)
            nst.block_ids = [list(b) for b in new.block_ids]
            self._plan_saves(meta, new.req_id, nst, new.num_computed_tokens + num_sched.get(new.req_id, 0))
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
            flags = getattr(cached, "resumed_from_preemption", None)
            for i, req_id in enumerate(cached.req_ids):
                self._loads_in_flight.discard(req_id)
                cst = self._reqs.get(req_id)
                if cst is None:
                    continue
                new_ids = cached.new_block_ids[i]
                if req_id in resumed or (flags is not None and flags[i]):
                    cst.block_ids = [list(b) for b in (new_ids or ())]
                elif new_ids is not None:
                    for gi, b in enumerate(new_ids):
                        while len(cst.block_ids) <= gi:
                            cst.block_ids.append([])
                        cst.block_ids[gi].extend(b)
                self._plan_saves(meta, req_id, cst, cached.num_computed_tokens[i] + num_sched.get(req_id, 0))
        return meta

    def _plan_saves(self, meta: KvtierConnectorMetadata, req_id: str, st: _Req, computed: int) -> None:
        if st.bypass:
            return
        done = min(computed, len(st.tokens)) // self.chunk
        chunks: list[tuple[bytes, list[list[int]]]] = []
        positions: list[int] = []
        stage_hashes: list[list[bytes]] = [[] for _ in st.stage_hashes]
        c = st.saved_through
        while c < done:
            blocks = self._chunk_blocks(st, c)
            if blocks is None:
                log.warning("request %s chunk %d: blocks not allocated; not stored", req_id, c)
                break
            if blocks:
                chunks.append((bytes(st.hashes[c]), blocks))
                positions.append(c)
                for k, hs in enumerate(st.stage_hashes):
                    stage_hashes[k].append(bytes(hs[c]))
            else:
                log.debug("request %s chunk %d: a group holds vLLM's null block (out of the window); not stored",
                          req_id, c)
            c += 1
        st.saved_through = c
        if chunks:
            meta.saves.append(SaveSpec(req_id, chunks, positions, stage_hashes))
            st.saved_any = True

    def _load_spec(self, req_id: str, st: _Req, first: int, n: int) -> LoadSpec:
        """The load of n chunks from first, from the plan the lookup began."""
        ids = [list(b) for b in st.block_ids]
        for gi in self._state_groups():
            while len(ids) <= gi:
                ids.append([])
            ids[gi] = self._load_state_ids(st, gi, first + n)
        spec = LoadSpec(req_id, "", first, n, 0, {}, ids, async_load=self.cfg.load_async, held_tokens=st.held_tokens)
        plan = st.plan
        if plan is None:
            spec.problem = "no restore plan"
            return spec
        if plan.prefix < n:
            spec.problem = f"plan covers {plan.prefix} of {n} chunks ({plan.reason})"
        if plan.prefix > n:
            # vLLM took fewer tokens than offered: items past n would name
            # blocks the request does not own. Not loaded; recomputed.
            spec.problem = f"vLLM took {n} of the {plan.prefix} planned chunks"
            self._cancel(st)
            return spec
        spec.restore_id, spec.planned = plan.restore_id, min(plan.prefix, n)
        if len(st.stage_plans) > 1:
            spec.stage_restore_ids = [p.restore_id for p in st.stage_plans]
        spec.items = {r: items.to_bytes() for r, items in plan.ranks.items()}
        return spec

    def update_connector_output(self, connector_output: Any) -> None:
        """vLLM hands the scheduler what the workers reported: a load
        reported (finished_recving) is no longer in flight."""
        for r in getattr(connector_output, "finished_recving", None) or ():
            self._loads_in_flight.discard(r)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Whether vLLM must keep the request's blocks until the workers
        report it finished_sending: while a store may read them. Not for a
        request whose asynchronous load still runs (aborted while it
        loaded): vLLM keeps those blocks until the load is reported, and one
        request must not be reported both ways (KvtierConnectorMetadata.no_send)."""
        st = self._reqs.pop(request.request_id, None)
        if st is not None and not st.load_issued:
            self._abandon(st)  # a restore begun for it was never handed to the workers
        if request.request_id in self._loads_in_flight:
            self._loads_in_flight.discard(request.request_id)
            if st is not None and st.saved_any:
                self._no_send.append(request.request_id)
            return False, None
        return (st is not None and st.saved_any), None

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's SupportsHMA: the request's blocks of every group are kept
        while its stores may read them, as with one group."""
        return self.request_finished(request, block_ids[0] if block_ids else [])
