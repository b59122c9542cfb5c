"""The client's pure parts: what a verdict lets the engine count as loaded,
and the connection options."""

import os

import nkeys
import pytest

from kvtier import client, errors, wire


@pytest.mark.parametrize("verdict, loaded, failed", [
    (wire.RestoreVerdict("r", wire.VERDICT_COMPLETE, 4), 4, []),
    (wire.RestoreVerdict("r", wire.VERDICT_FAILED, 4, [2, 3], ["corrupt"]), 2, [2, 3]),
    (wire.RestoreVerdict("r", wire.VERDICT_FAILED, 4, [], ["deadline"]), 0, []),
    (wire.RestoreVerdict("r", wire.VERDICT_REFUSED, 0, reason="reader dead"), 0, []),
    (wire.RestoreVerdict("r", wire.VERDICT_PENDING, 4), 0, []),
    (wire.RestoreVerdict("other", wire.VERDICT_COMPLETE, 4), 0, [0, 1, 2, 3]),
    (None, 0, [0, 1, 2, 3]),
])
def test_restore_outcome_counts_only_confirmed_chunks(verdict, loaded, failed):
    out = client.restore_outcome(wire.RestorePlan("r", 4), verdict)
    assert (out.loaded, out.failed) == (loaded, failed)
    assert bool(out.problem) == (loaded < 4)


def _seed_file(path):
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
    path.write_text(seed + "\n")
    path.chmod(0o600)
    return seed


def test_connect_options_map_to_nats_py(tmp_path):
    ca = tmp_path / "ca.pem"
    seed = _seed_file(tmp_path / "engine.nk")
    opts = client.ConnectOptions(servers=["nats://a:4222"], nkey_seed_file=str(tmp_path / "engine.nk"),
                                 inbox_prefix="_INBOX.e0")
    kw = opts.nats_kwargs()
    assert kw["nkeys_seed_str"] == seed and kw["inbox_prefix"] == b"_INBOX.e0"
    assert kw["max_reconnect_attempts"] == -1 and "tls" not in kw
    with pytest.raises(ValueError, match="not both"):
        client.ConnectOptions(nkey_seed_file="a", credentials_file="b").validate()
    with pytest.raises(errors.CredentialsError, match="No such file"):
        client.ConnectOptions(tls_ca_file=str(ca)).nats_kwargs()


def test_connect_options_from_creds_dir(tmp_path):
    seed = _seed_file(tmp_path / "engine-engine0.nk")
    opts = client.ConnectOptions(servers=["nats://a:4222"], creds_dir=str(tmp_path), instance="engine0")
    opts.validate()
    kw = opts.nats_kwargs()
    assert kw["nkeys_seed_str"] == seed and opts.seed_file() == str(tmp_path / "engine-engine0.nk")
    assert kw["inbox_prefix"] == b"_INBOX.engine-engine0"
    assert "tls" not in kw  # no ca.pem in the directory
    assert opts.identity() == "engine-engine0"
    # An explicit seed, CA or inbox wins over the directory's.
    other = _seed_file(tmp_path / "x.nk")
    opts = client.ConnectOptions(creds_dir=str(tmp_path), instance="engine0", nkey_seed_file=str(tmp_path / "x.nk"),
                                 inbox_prefix="_INBOX.x")
    assert (opts.nats_kwargs()["nkeys_seed_str"], opts.nats_kwargs()["inbox_prefix"]) == (other, b"_INBOX.x")


def test_connect_options_are_secure_by_default():
    with pytest.raises(ValueError, match="no NATS credentials"):
        client.ConnectOptions().validate()
    with pytest.raises(ValueError, match="needs the engine instance"):
        client.ConnectOptions(creds_dir="/c").validate()
    with pytest.raises(ValueError, match="insecure connects without credentials"):
        client.ConnectOptions(creds_dir="/c", instance="e", insecure=True).validate()
    with pytest.raises(ValueError, match="instance name"):
        client.ConnectOptions(creds_dir="/c", instance="a.b").validate()
    anon = client.ConnectOptions(insecure=True, instance="engine0")
    anon.validate()
    kw = anon.nats_kwargs()
    assert "nkeys_seed" not in kw and "inbox_prefix" not in kw


def test_subjects_are_scoped_to_the_instance():
    s = wire.Subjects("kv")
    assert s.engine_coord("engine0", wire.COORD_LOOKUP) == "kv.coord.lookup.engine0"
    assert s.engine_coord("engine0", wire.COORD_REGISTER) == "kv.coord.ns.register.engine0"
    assert s.report(wire.Rank("engine0", 3)) == "kv.coord.restore.report.engine0.3"
    c = client.Client(None, client.ConnectOptions(prefix="kv", instance="e1", insecure=True))
    assert c.coord_subject(wire.COORD_RESTORE_WAIT) == "kv.coord.restore.wait.e1"
    assert c.coord_subject(wire.COORD_RESTORE_BEGIN, "e2") == "kv.coord.restore.begin.e2"
    with pytest.raises(ValueError, match="engine instance"):
        client.Client(None, client.ConnectOptions(insecure=True)).coord_subject(wire.COORD_LOOKUP)


def test_permission_refusal_is_parsed():
    m = client._PERMISSION_RE.search("nats: permissions violation for publish to \"kvtier.coord.lookup.e1\"")
    assert m is not None and m.group(1) == "kvtier.coord.lookup.e1"


def test_unavailable_carries_the_retry_hint():
    data = b'{"error":{"code":"unavailable","message":"index opening","retry_after_ms":250}}'
    with pytest.raises(errors.Unavailable) as ei:
        wire.decode_reply(wire.LookupReply, data, "kvtier.coord.lookup.e0")
    e = ei.value
    assert (e.code, e.message, e.retry_after_ms, e.retryable) == ("unavailable", "index opening", 250, True)
    assert e.retry_after(1.0) == 0.25
    with pytest.raises(errors.NotFound) as ei:
        wire.decode_reply(wire.LookupReply, b'{"error":{"code":"not_found","message":"x"}}', "s")
    assert (ei.value.retry_after_ms, ei.value.retryable, ei.value.retry_after(1.0)) == (0, False, 1.0)


def test_connect_options_take_a_comma_list_of_servers():
    opts = client.ConnectOptions(servers=["nats://a:4222, nats://b:4222", "nats://c:4222"], insecure=True)
    assert opts.servers == ["nats://a:4222", "nats://b:4222", "nats://c:4222"]
    assert opts.nats_kwargs()["servers"] == ["nats://a:4222", "nats://b:4222", "nats://c:4222"]
    assert client.ConnectOptions(servers="nats://a:4222,nats://b:4222", insecure=True).servers == [  # type: ignore[arg-type]
        "nats://a:4222", "nats://b:4222"]


class _MovingNC:
    """A connection whose first requests find no responder (it is moving
    to another server of the cluster), then one answers."""

    def __init__(self, misses: int) -> None:
        self.misses, self.calls = misses, 0

    async def request(self, subject: str, data: bytes, timeout: float) -> object:
        import nats.errors

        self.calls += 1
        if self.calls <= self.misses:
            raise nats.errors.NoRespondersError

        class Msg:
            pass

        m = Msg()
        m.data = b"answer"  # type: ignore[attr-defined]
        return m


def test_call_resends_a_request_nobody_received():
    import asyncio

    from kvtier.errors import Unavailable

    async def go(misses: int, window: float) -> tuple[object, int]:
        nc = _MovingNC(misses)
        c = client.Client(nc, client.ConnectOptions(insecure=True, no_responders_retry_s=window))
        try:
            got: object = await c.call("s", {}, bytes, decoder=lambda d, _s: d)
        except Unavailable as e:
            got = e
        return got, nc.calls

    got, calls = asyncio.run(go(3, 5.0))
    assert got == b"answer" and calls == 4
    got, calls = asyncio.run(go(1000, 0.2))
    assert isinstance(got, Unavailable) and "no responders on s" in str(got) and 1 < calls < 1000
    got, calls = asyncio.run(go(1, 0.0))
    assert isinstance(got, Unavailable) and calls == 1


def test_store_and_retrieve_go_binary_unless_json_requests():
    """RankSession sends store and retrieve requests in their binary form
    (KVS1/KVR1); ConnectOptions.json_requests sends the JSON message."""
    import asyncio

    from kvtier import cuda, dcp

    class _NC:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        async def request(self, subject: str, data: bytes, timeout: float) -> object:
            self.sent.append(data)

            class Msg:
                pass

            m = Msg()
            m.data = wire.encode_reply(ok=wire.StoreReply(stored=1))  # type: ignore[attr-defined]
            return m

    ns = dcp.Namespace(bytes(range(1, 17)))
    chunks = [wire.ChunkBlocks(dcp.ChunkHash(bytes(16)), [[1, 2]])]
    ev = cuda.EventHandle("host", "d", b"x")
    for json_requests, magic in ((False, b"KVS1"), (True, b'{"request_id"')):
        nc = _NC()
        c = client.Client(nc, client.ConnectOptions(insecure=True, json_requests=json_requests))
        s = client.RankSession(c, wire.Rank("engine0", 0), dcp.Spec(), ns, [], "d", "s" * 32)
        rep = asyncio.run(s.store("r", chunks, ev))
        assert rep.stored == 1 and nc.sent[0].startswith(magic)
        want = wire.StoreRequest("r", ns, "s" * 32, chunks, ev)
        assert nc.sent[0] == (wire.encode(want) if json_requests else want.to_binary())


def test_begin_and_lookup_go_binary_and_fall_back_to_json():
    """restore.begin and lookup go in their binary forms (KVG1, KVL1);
    json_requests sends JSON. A coordinator that refuses a binary begin as
    bad input and takes the same request as JSON (one from before KVG1)
    gets JSON begins from then on; a begin refused in both forms raises."""
    import asyncio

    from kvtier import client_plan, dcp

    plan = b"KVP1" + bytes([3]) + b"r-1" + bytes(4) + bytes(2) + bytes(16) + bytes(2) + bytes(2)

    class _NC:
        def __init__(self, old: bool) -> None:
            self.sent: list[bytes] = []
            self.old = old

        async def request(self, subject: str, data: bytes, timeout: float) -> object:
            self.sent.append(data)

            class Msg:
                pass

            m = Msg()
            if self.old and data.startswith(b"KVG1"):
                m.data = wire.encode_reply(  # type: ignore[attr-defined]
                    error=wire.Error("bad_request", "decode request: " + wire.NOT_JSON_REFUSAL))
            elif ".lookup" in subject:
                m.data = wire.encode_reply(ok=wire.LookupReply(prefix=0))  # type: ignore[attr-defined]
            else:
                m.data = plan  # type: ignore[attr-defined]
            return m

    ns = dcp.Namespace(bytes(range(1, 17)))
    chunks = [dcp.ChunkHash(bytes([i]) * 16) for i in range(3)]
    for json_requests, old in ((False, False), (True, False), (False, True)):
        nc = _NC(old)
        c = client.Client(nc, client.ConnectOptions(insecure=True, json_requests=json_requests))

        async def go(c: client.Client) -> None:
            p = await c.restore_begin_packed(ns, chunks, instance="engine0", lookup=True)
            assert p.restore_id == "r-1" and p.prefix == 0
            await c.restore_begin(ns, chunks, instance="engine0")
            await c.lookup(ns, chunks, instance="engine0")

        asyncio.run(go(c))
        want = client_plan.RestoreBeginBinary(wire.RestoreBegin(ns, chunks), "engine0", lookup=True)
        if json_requests:
            assert [d[:1] for d in nc.sent] == [b"{"] * 3 and nc.sent[0] == wire.encode(want)
        elif old:  # binary refused, JSON taken, then JSON only; lookups binary (older than KVG1)
            assert nc.sent[0] == want.to_binary() and nc.sent[1] == wire.encode(want)
            assert nc.sent[2].startswith(b"{") and nc.sent[3].startswith(b"KVL1") and c._json_begins
        else:
            assert nc.sent[0] == want.to_binary() and nc.sent[1].startswith(b"KVG1")
            assert nc.sent[2] == wire.LookupRequest(ns, chunks, "engine0").to_binary()

    # A coordinator that read the binary begin and refused it for what it
    # says: raised as it is, not sent again as JSON, begins stay binary.
    class _Refusing(_NC):
        async def request(self, subject: str, data: bytes, timeout: float) -> object:
            self.sent.append(data)

            class Msg:
                pass

            m = Msg()
            m.data = wire.encode_reply(error=wire.Error("bad_request", "deadline -1 ms must be >= 0"))  # type: ignore[attr-defined]
            return m

    nc = _Refusing(False)
    c = client.Client(nc, client.ConnectOptions(insecure=True))
    with pytest.raises(errors.BadRequest, match="deadline"):
        asyncio.run(c.restore_begin_packed(ns, chunks, instance="engine0", lookup=True))
    assert len(nc.sent) == 1 and nc.sent[0].startswith(b"KVG1") and not c._json_begins


def test_retrieve_carries_the_engines_deadline():
    """RankSession.retrieve(deadline=t) sends t as Unix nanoseconds in the
    Kvtier-Deadline header (the rankd places nothing after it); without a
    deadline no header is sent."""
    import asyncio

    from kvtier import dcp

    class _NC:
        def __init__(self) -> None:
            self.headers: list[dict[str, str] | None] = []

        async def request(self, subject: str, data: bytes, timeout: float,
                          headers: dict[str, str] | None = None) -> object:
            self.headers.append(headers)

            class Msg:
                pass

            m = Msg()
            m.data = wire.encode_reply(ok=wire.RetrieveReply([]))  # type: ignore[attr-defined]
            return m

    nc = _NC()
    c = client.Client(nc, client.ConnectOptions(insecure=True))
    s = client.RankSession(c, wire.Rank("engine0", 0), dcp.Spec(), dcp.Namespace(bytes(range(1, 17))), [], "d",
                           "s" * 32)
    asyncio.run(s.retrieve([], "R1", deadline=1234.5))
    asyncio.run(s.retrieve([], "R2"))
    assert nc.headers == [{wire.HEADER_DEADLINE: "1234500000000"}, None]
    # retrieve_packed reads no results: it asks for the failed ones only.
    from kvtier import client_plan

    pl = client_plan.PlanItems(s.namespace, [wire.Rank("engine0", 0)], [(0, 0, False)], bytes(16),
                               client_plan._ITEM.pack(5, 0, 1))
    asyncio.run(s.retrieve_packed(pl, "R3", [[7]], [1], deadline=1234.5))
    asyncio.run(s.retrieve_packed(pl, "R4", [[7]], [1]))
    assert nc.headers[2:] == [{wire.HEADER_RESULTS: wire.RESULTS_FAILED, wire.HEADER_DEADLINE: "1234500000000"},
                              {wire.HEADER_RESULTS: wire.RESULTS_FAILED}]
    # A pace goes as Kvtier-Pace, bytes per second; 0 asks for full speed;
    # one under the rankd's least is refused before anything is sent.
    asyncio.run(s.retrieve_packed(pl, "R5", [[7]], [1], pace=20_000_000_000))
    asyncio.run(s.retrieve_packed(pl, "R6", [[7]], [1], pace=0))
    assert nc.headers[4:] == [{wire.HEADER_RESULTS: wire.RESULTS_FAILED, wire.HEADER_PACE: "20000000000"},
                              {wire.HEADER_RESULTS: wire.RESULTS_FAILED, wire.HEADER_PACE: "0"}]
    with pytest.raises(ValueError, match="pace"):
        asyncio.run(s.retrieve_packed(pl, "R7", [[7]], [1], pace=wire.MIN_PACE - 1))
    assert len(nc.headers) == 6


def test_store_carries_the_engines_deadline():
    """RankSession.store(deadline=t) sends t as Unix nanoseconds in the
    Kvtier-Deadline header (the rankd waits for L1 room only until then,
    issue 24), gather_limit=u as Kvtier-Gather-Limit (a copy ending later is
    not stored); without them no header is sent. deadline and timeout
    are keyword-only, on the sync facade too."""
    import asyncio
    import inspect

    from kvtier import cuda, dcp

    class _NC:
        def __init__(self) -> None:
            self.headers: list[dict[str, str] | None] = []

        async def request(self, subject: str, data: bytes, timeout: float,
                          headers: dict[str, str] | None = None) -> object:
            self.headers.append(headers)

            class Msg:
                pass

            m = Msg()
            m.data = wire.encode_reply(ok=wire.StoreReply(stored=1))  # type: ignore[attr-defined]
            return m

    nc = _NC()
    c = client.Client(nc, client.ConnectOptions(insecure=True))
    s = client.RankSession(c, wire.Rank("engine0", 0), dcp.Spec(), dcp.Namespace(bytes(range(1, 17))), [], "d",
                           "s" * 32)
    ev = cuda.EventHandle("host", "d", b"x")
    assert asyncio.run(s.store("r1", [], ev, deadline=1234.5)).stored == 1
    asyncio.run(s.store("r2", [], ev, timeout=3.0))
    asyncio.run(s.store("r3", [], ev, deadline=1234.5, gather_limit=1235.0))
    assert nc.headers == [{wire.HEADER_DEADLINE: "1234500000000"}, None,
                          {wire.HEADER_DEADLINE: "1234500000000", wire.HEADER_GATHER_LIMIT: "1235000000000"}]
    for f in (client.RankSession.store, client.SyncRankSession.store, client.SyncRankSession.store_async):
        params = inspect.signature(f).parameters
        assert params["deadline"].kind is inspect.Parameter.KEYWORD_ONLY, f
        assert params["gather_limit"].kind is inspect.Parameter.KEYWORD_ONLY, f
        assert params["timeout"].kind is inspect.Parameter.KEYWORD_ONLY, f


def test_package_exports_its_public_names_without_importing_nats():
    """STYLE 34: the public names at the top of the package, loaded on use,
    so importing kvtier still starts nothing and imports no NATS."""
    import subprocess
    import sys

    code = ("import sys, kvtier; assert 'nats' not in sys.modules and 'torch' not in sys.modules; "
            "c = kvtier.SyncClient; e = kvtier.RequestTimeout; assert 'nats' not in sys.modules; "
            "assert issubclass(e, kvtier.KvtierError); print(len(kvtier.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) >= 30
    import kvtier

    for name in kvtier.__all__:
        assert getattr(kvtier, name) is not None
    with pytest.raises(AttributeError):
        kvtier.NoSuchThing  # noqa: B018


def test_sync_and_async_clients_have_the_same_signatures():
    """STYLE 34 (httpx): every request of the async client exists on the
    sync one with the same parameters; options are keyword-only, None
    when absent."""
    import inspect

    pairs = [(client.Client, client.SyncClient, n) for n in ("lookup", "restore_begin", "restore_begin_packed",
                                                             "restore_wait", "register_spec", "register", "status")]
    pairs += [(client.RankSession, client.SyncRankSession, n) for n in ("store", "retrieve", "retrieve_packed")]
    for acls, scls, name in pairs:
        a = inspect.signature(getattr(acls, name))
        s = inspect.signature(getattr(scls, name))
        assert list(a.parameters) == list(s.parameters), name
        for p in a.parameters.values():
            if p.name in ("instance", "timeout", "detail", "deadline_ms"):
                assert p.kind is inspect.Parameter.KEYWORD_ONLY, (name, p.name)
            if p.name in ("instance", "timeout"):
                assert p.default is None, (name, p.name)
    r = inspect.signature(client.restore).parameters
    assert r["instance"].kind is inspect.Parameter.KEYWORD_ONLY and r["instance"].default is None


def test_async_client_closes_with_async_with():
    import asyncio

    class NC:
        is_closed, is_connected, closed = False, True, 0

        async def close(self):
            self.closed += 1
            self.is_closed = True

    nc = NC()

    async def main():
        async with client.Client(nc, client.ConnectOptions(insecure=True)) as c:
            assert c.connected
        return nc.closed

    assert asyncio.run(main()) == 1


def test_restore_outcome_names_every_failed_group():
    """Issue 27: chunk 1 failed in group 1 (missing) and group 2 (corrupt),
    chunk 2 only in group 0 (missing). The problem names both of chunk 1's
    groups, and chunk 1 counts as wrong bytes though its first reason (the
    one reasons[] carries, as before) was only a missing object."""
    v = wire.decode(wire.RestoreVerdict, (
        b'{"restore_id":"r","state":"failed","prefix":3,"failed":[1,2],'
        b'"reasons":["chunk 1: rank 0 group 1 shard 0: missing","chunk 2: rank 0 group 0 shard 0: missing"],'
        b'"group_reasons":[["rank 0 group 1 shard 0: missing","rank 0 group 2 shard 0: corrupt"],'
        b'["rank 0 group 0 shard 0: missing"]]}'))
    v.validate()
    out = client.restore_outcome(wire.RestorePlan("r", 3), v)
    assert (out.loaded, out.failed, out.bytes_wrong) == (1, [1, 2], 1)
    assert out.problem == ("verdict failed: chunk 1: rank 0 group 1 shard 0: missing; rank 0 group 2 shard 0: corrupt, "
                           "chunk 2: rank 0 group 0 shard 0: missing")
    # A verdict from a coordinator that sends no group reasons reads as
    # before: one reason per chunk, classified alone.
    reasons = ["chunk 1: rank 0 group 1 shard 0: corrupt", "chunk 2: rank 1 group 0 shard 0: checksum mismatch"]
    old = wire.RestoreVerdict("r", wire.VERDICT_FAILED, 3, [1, 2], reasons)
    out = client.restore_outcome(wire.RestorePlan("r", 3), old)
    assert out.bytes_wrong == 2 and out.problem == "verdict failed: " + ", ".join(old.reasons)
    assert old.chunk_reasons(1) == ["rank 1 group 0 shard 0: checksum mismatch"] and old.chunk_reasons(2) == []
    v.group_reasons = v.group_reasons[:1]
    with pytest.raises(errors.MalformedError):
        v.validate()
