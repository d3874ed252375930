"""Transformers4Rec 23.12.0's own Trainer tests, with its Trainer and with ours in its place.

The tests are fetched in the test step from T4R's sdist on the package registry
(:mod:`upstream_t4r`; a failed download fails, it does not skip) and run twice in
a pytest subprocess: once as released, once with ``transformers4rec.torch.Trainer``
(every name T4R and the tests reach it by) bound to ``merlin_t4r_ops.training.Trainer``
by the ``t4r_trainer_swap`` plugin. They read the test data that T4R's wheel ships
(``transformers4rec.data.testing``). Every test that passes with T4R's Trainer must
pass with ours, and every Trainer the second run built must be ours.
"""

from pathlib import Path

import pytest

import upstream_t4r as upstream

TRAINER_TESTS = ["tests/unit/torch/test_trainer.py"]
TRAINERS = ("t4r", "ours")


@pytest.fixture(scope="module")
def t4r_tests(request, tmp_path_factory) -> Path:
    """T4R's ``tests/`` package, from the sdist downloaded once per pytest cache."""
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("t4r-sdist") if cache else tmp_path_factory.mktemp("t4r-sdist")
    sdist = upstream.fetch_sdist(Path(folder))
    return upstream.extract_tests(sdist, tmp_path_factory.mktemp("t4r-src"))


@pytest.fixture(scope="module")
def trainer_runs(t4r_tests, tmp_path_factory):
    """``{"t4r": run, "ours": run}`` of T4R's Trainer tests (see :func:`upstream_t4r.run_tests`)."""
    runs = {}
    for trainer in TRAINERS:
        runs[trainer] = upstream.run_tests(
            t4r_tests, TRAINER_TESTS, trainer, tmp_path_factory.mktemp(f"trainer-{trainer}")
        )
        print(f"{trainer}'s Trainer: {upstream.counts(runs[trainer]['outcomes'])} "
              f"of {len(runs[trainer]['outcomes'])}\n  {runs[trainer]['command']}")
    return runs


@pytest.mark.timeout(3600)  # two runs of T4R's 39 Trainer tests on CI's 2 busy cores
def test_every_t4r_trainer_test_that_passes_with_t4rs_trainer_passes_with_ours(trainer_runs):
    theirs = trainer_runs["t4r"]["outcomes"]
    ours = trainer_runs["ours"]["outcomes"]
    assert theirs, "T4R's Trainer tests collected nothing"
    assert set(ours) == set(theirs)
    regressions = {
        test: ours[test] for test, outcome in theirs.items()
        if outcome == "passed" and ours[test] != "passed"
    }
    assert not regressions, (
        f"{len(regressions)} of T4R's Trainer tests pass with T4R's Trainer only: {regressions}\n"
        + trainer_runs["ours"]["output"][-8000:]
    )


def test_t4r_trainer_tests_built_our_trainer_in_place_of_t4rs(trainer_runs):
    for trainer, expected in (("t4r", upstream.T4RS), ("ours", upstream.OURS)):
        built = trainer_runs[trainer]["record"]["built"]
        classes = {cls for classes in built.values() for cls in classes}
        assert classes == {expected}, f"with --trainer={trainer}: {built}"
    rebound = trainer_runs["ours"]["record"]["rebound"]
    assert "transformers4rec.torch.Trainer" in rebound
    # Every test that built T4R's Trainer built ours in the second run.
    assert set(trainer_runs["t4r"]["record"]["built"]) <= set(
        trainer_runs["ours"]["record"]["built"]
    )
