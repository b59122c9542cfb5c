import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = REPO / "wire" / "testdata" / "golden"


@pytest.fixture
def golden_dir() -> pathlib.Path:
    return GOLDEN
