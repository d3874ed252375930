"""Triton's statistics lag the reply; ``counts_since`` waits for them, with a bound.

A tiny real Python-backend model (``tests/triton_models/lagging_statistics``) answers, then
holds its ``execute`` call until the test releases it: Triton counts the request only then.
"""

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from merlin_t4r_ops.serving.statistics import Counts, counts, counts_since

MODEL = "lagging_statistics"
MODELS = Path(__file__).parent / "triton_models"


@pytest.fixture(scope="module")
def lagging_client(tmp_path_factory):
    from merlin_t4r_ops.serving import triton_server

    repository = tmp_path_factory.mktemp("lagging_repository")
    shutil.copytree(MODELS / MODEL, repository / MODEL)
    with triton_server(repository) as server:
        yield server.client()


def _ask(client, release: Path):
    path = grpcclient.InferInput("RELEASE", [1], "BYTES")
    path.set_data_from_numpy(np.array([str(release).encode()], dtype=np.object_))
    return client.infer(MODEL, [path]).as_numpy("ANSWER")


def test_counts_since_waits_for_statistics_that_lag_the_reply(lagging_client, tmp_path):
    release = tmp_path / "release"
    before = counts(lagging_client, MODEL)
    assert _ask(lagging_client, release).tolist() == [1]
    # The answer is here, its execute call is held: read once, the statistics show nothing.
    assert counts_since(lagging_client, MODEL, before, expect=1, timeout=0) == Counts(0, 0)

    releaser = threading.Timer(0.5, release.touch)
    releaser.start()
    try:
        assert counts_since(lagging_client, MODEL, before, expect=1) == Counts(1, 1)
    finally:
        releaser.cancel()
        release.touch()
