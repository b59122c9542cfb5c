"""The client's pure parts: what a verdict lets the engine count as loaded,
and the connection options."""

import pytest

from kvtier import client, wire


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


def test_connect_options_map_to_nats_py(tmp_path):
    ca = tmp_path / "ca.pem"
    opts = client.ConnectOptions(servers=["nats://a:4222"], nkey_seed_file="/s/engine.nk", inbox_prefix="_INBOX.e0")
    kw = opts.nats_kwargs()
    assert kw["nkeys_seed"] == "/s/engine.nk" and kw["inbox_prefix"] == b"_INBOX.e0"
    assert kw["max_reconnect_attempts"] == -1 and "tls" not in kw
    with pytest.raises(ValueError, match="not both"):
        client.ConnectOptions(nkey_seed_file="a", credentials_file="b").validate()
    with pytest.raises(FileNotFoundError):
        client.ConnectOptions(tls_ca_file=str(ca)).nats_kwargs()
