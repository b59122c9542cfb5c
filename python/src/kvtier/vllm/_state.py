"""The data the connector's two sides hand each other and keep: the
metadata the scheduler builds for each step (LoadSpec, SaveSpec), a
request's scheduler-side state, and the worker's bookkeeping of the stores
and loads in flight."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvtier import client, dcp, errors, wire
from kvtier.client_plan import PackedPlan
from kvtier.vllm._base import KVConnectorMetadata

# NULL_BLOCK is vLLM's null block: BlockPool takes block 0 first as the
# placeholder of skipped blocks (sliding window) in every group; it is never
# a request's own block, is never stored and never written.
NULL_BLOCK = 0


@dataclass
class LoadSpec:
    """One restore for one request: the coordinator's plan (each rank's
    items, kvtier.client_plan.PlanItems.to_bytes) and the request's block ids."""

    req_id: str
    restore_id: str
    first_chunk: int  # chunk index in the request of the plan's chunk 0
    chunks: int  # chunks vLLM was told are loaded
    planned: int  # chunks the plan covers (<= chunks)
    items: dict[str, bytes]  # by str(Rank): its items, kvtier.client_plan.PlanItems.to_bytes
    block_ids: list[list[int]]  # [group][block] of the whole request
    problem: str = ""
    async_load: bool = True  # vLLM was told the load is asynchronous (get_finished reports it)
    # Tokens of the first chunk that vLLM's own prefix cache holds (a whole
    # number of every group's blocks): those blocks are not written, and
    # the first chunk counts only its other tokens.
    held_tokens: int = 0
    # PP > 1: each stage's restore, by stage (restore_id is stage 0's); a
    # worker loads its stage's (kvtier.vllm.spec).
    stage_restore_ids: list[str] = field(default_factory=list)
    # Bytes per second the rankd's copies of this load are bounded to (the
    # Kvtier-Pace header; 0: full speed; None: the rankd's own pace). With
    # kvtier_load_pace_gbps set, an asynchronous load that starts while vLLM
    # runs other requests gets that pace, and one that starts alone 0.
    pace: int | None = None


@dataclass
class SaveSpec:
    """Chunks of one request that this step completes, to store."""

    req_id: str
    chunks: list[tuple[bytes, list[list[int]]]]  # (chunk hash, [group][block])
    # Each chunk's index in the request's tokens (wire.ChunkBlocks.pos; empty:
    # 0 for all). A request's stores run concurrently and reach the rankd in
    # any order: a rank whose L2 bound is smaller than the prompt keeps its
    # lowest positions there.
    positions: list[int] = field(default_factory=list)
    # PP > 1: each stage's chunk hashes, by stage then chunk (every stage
    # has its own namespace, so its own hash chain); a worker stores its
    # stage's. Empty under PP 1: chunks' hashes are the one stage's.
    stage_hashes: list[list[bytes]] = field(default_factory=list)


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Requests vLLM preempted since the last step that had stores sent: vLLM
    # freed their blocks without asking the connector, and another request
    # may write them in this step's forward, so the worker waits for their
    # stores first, each until its gather limit (handle_preemptions; a
    # gather ending later stores nothing, C1).
    preempted: list[str] = field(default_factory=list)
    # Requests that finished while their asynchronous load ran (an abort):
    # vLLM frees their blocks when the load is reported (finished_recving),
    # so the worker never reports them finished_sending too. Reported
    # earlier, vLLM would free blocks the rankd still writes (C10); later,
    # it would find the request gone and fail its assertion.
    no_send: list[str] = field(default_factory=list)


@dataclass
class _Req:
    tokens: list[int]
    hashes: list[dcp.ChunkHash]
    lookup: concurrent.futures.Future[list[PackedPlan] | None] | None = None  # every stage's plan
    lookup_since: float = 0.0
    lookup_first: int = -1
    matched_chunks: int | None = None  # lookup answer, chunks from lookup_first
    held_tokens: int = 0  # tokens of chunk lookup_first vLLM holds (its prefix ends inside it)
    plan: PackedPlan | None = None  # the restore begun for the hit (PP: stage 0's, prefix the least)
    stage_plans: list[PackedPlan] = field(default_factory=list)  # PP > 1: every stage's, by stage
    stage_hashes: list[list[dcp.ChunkHash]] = field(default_factory=list)  # PP > 1: by stage, then chunk
    # A request is offered kvtier tokens once: after its load is handed to
    # the workers every later ask (vLLM asks again after an asynchronous
    # load failed, or after a preemption) is a miss, so a chunk that fails
    # to load can never be offered, loaded and failed in a loop.
    load_issued: bool = False
    load: tuple[int, int] | None = None  # (first chunk, chunks) to load
    block_ids: list[list[int]] = field(default_factory=list)
    saved_through: int = 0  # chunks [0, saved_through) are stored or being stored
    # Mamba "align": the state blocks vLLM handed the connector,
    # (group, tokens before the state) -> block id (kvtier.vllm._scheduler).
    states: dict[tuple[int, int], int] = field(default_factory=dict)
    saved_any: bool = False
    # Why kvtier neither restores nor stores this request ("" when it
    # does): its KV depends on more than its tokens and salt (a LoRA
    # adapter, multimodal inputs), which the chunk hashes do not cover.
    bypass: str = ""


@dataclass
class _Pending:
    fut: concurrent.futures.Future[wire.StoreReply]
    event: Any  # released once the store has answered (C1)
    chunks: tuple[bytes, ...] = ()  # names the store in a BlocksFreed
    in_use: bool = False  # answered blocks_in_use: held until BlocksFreed (C10)
    limit: float = 0.0  # the gather limit sent (time.time() seconds): a gather ending later stores nothing
    deadline: float = 0.0  # the deadline sent (time.time() seconds): a cut bounded by it cuts this store


@dataclass
class _LoadResult:
    loaded: int  # chunks confirmed from the load's first chunk
    bad_bytes_chunks: int  # failed chunks whose bytes did not match the recorded sum
    problem: str = ""


@dataclass
class _Loading:
    fut: concurrent.futures.Future[_LoadResult]
    load: LoadSpec
    since: float
    step: int  # the connector's engine step count when the load started
    # The wall-clock time (time.time()) after which the rankd places
    # nothing (wire.HeaderDeadline); 0: none was sent.
    deadline: float = 0.0


T = TypeVar("T")


def submit(c: client.SyncClient, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """c.submit(coro), or a future failed with the reason when the client
    was closed after the caller found it usable (the link closing on a
    shutdown or a lost connection, between _usable() and here): the
    caller's usual failure path takes it (a load recomputed, a store
    counted failed, a lookup a miss), never an exception out of vLLM's
    step (C11)."""
    try:
        return c.submit(coro)
    except (errors.NotConnected, RuntimeError) as e:  # RuntimeError: the loop itself is closed
        coro.close()
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        fut.set_exception(e)
        return fut
