import pathlib

import pytest

from cluster import build_binaries

pytest_plugins = ["watchdog"]

REPO = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = REPO / "wire" / "testdata" / "golden"


@pytest.fixture
def golden_dir() -> pathlib.Path:
    return GOLDEN


@pytest.fixture(scope="session")
def binaries(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The daemons (coordinator, rankd), built once for every test that
    starts them (cluster.build_binaries; $KVTIER_BIN_DIR overrides)."""
    return build_binaries(tmp_path_factory.mktemp("bin"))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Keeps each phase's report on the test item (item.rep_setup,
    rep_call, rep_teardown): pytest does not throw a failed test into its
    yield fixtures, so a fixture that must print the daemons' logs when the
    test failed asks call_failed(request) instead."""
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    return rep
