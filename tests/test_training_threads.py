"""Nothing that reads ahead outlives a pass over the data, however the pass ends.

Merlin's ``Loader`` read ahead in a thread ("Thread-N (load_chunks)") that blocked on a
one-chunk queue, so a pass abandoned early (``max_steps``, the unused-parameter probe,
``eval_steps_on_train_set``) left it spinning for the life of the process. The columnar
loader reads ahead in ``DataLoader`` worker processes (and a pin-memory thread on CUDA):
they must end with the pass too. The data is T4R's packaged
``tabular_sequence_testing_data`` (1,000 sessions) in 4 partitions.
"""

import multiprocessing
import os
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import t4r_training_factories as factories
from merlin_t4r_ops.training import DistributedState, Trainer, evaluate, fit, make_loader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_scripts"))
from trainer_common import make_args  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_launcher_env")
MAX_LEN = factories.TESTING_MAX_LEN
SCHEMA = factories.testing_schema()
four_partitions = factories.testing_dataset
next_item_model = factories.testing_model


READ_AHEAD = ("load_chunks", "_pin_memory_loop")  # Merlin's reader, DataLoader's pinning


def reader_threads(before=()):
    """Threads and child processes that read ahead, alive now and not in ``before``."""
    threads = [t for t in threading.enumerate() if any(n in t.name for n in READ_AHEAD)]
    return [r for r in threads + multiprocessing.active_children() if r not in before]


def readers_gone(before, timeout=60.0):
    """Wait (bounded) until every reader started since ``before`` has ended; return those left."""
    deadline = time.monotonic() + timeout
    while reader_threads(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return reader_threads(before)


@pytest.fixture(scope="module")
def frame():
    return factories.testing_frame()


def test_trainer_max_steps_and_repeated_evaluation_leave_no_reader(frame, tmp_path):
    before = reader_threads()
    model, alive = next_item_model(), []
    # While the model runs, the pass's two workers read ahead.
    model.register_forward_pre_hook(lambda *_: alive.append(len(reader_threads(before))))
    trainer = Trainer(
        model=model,
        args=make_args(str(tmp_path), max_sequence_length=MAX_LEN, max_steps=3,
                       eval_steps_on_train_set=2, dataloader_num_workers=2),
        strategy="single",
        schema=SCHEMA,
        train_dataset_or_path=four_partitions(frame),
        eval_dataset_or_path=four_partitions(frame),
        compute_metrics=True,
    )
    trainer.train()  # stops after 3 of 63 batches
    assert readers_gone(before) == []
    for _ in range(2):
        trainer.evaluate()
    trainer.evaluate(four_partitions(frame), metric_key_prefix="train")  # 2 batches of 63
    assert readers_gone(before) == []
    assert max(alive) == 2, alive


def test_fit_probe_and_evaluate_leave_no_reader(frame, tmp_path):
    before = reader_threads()
    # A real gloo group of one rank, so that fit runs its unused-parameter probe (DDP only).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        state = DistributedState("ddp", 0, 0, 1, torch.device("cpu"), "one gloo rank")
        model, alive = next_item_model(), []
        model.register_forward_pre_hook(lambda *_: alive.append(len(reader_threads(before))))
        fit(model, four_partitions(frame), eval_data=four_partitions(frame), epochs=1,
            batch_size=128, strategy=state, seed=0, progress=False, num_workers=2)
        assert readers_gone(before) == []
        for _ in range(2):
            evaluate(model, four_partitions(frame), strategy=state, batch_size=128, num_workers=2)
        assert readers_gone(before) == []
        assert max(alive) == 2, alive
    finally:
        dist.destroy_process_group()


def test_an_abandoned_pass_ends_its_workers_when_closed_or_collected(frame):
    state = DistributedState("single", 0, 0, 1, torch.device("cpu"), "test")
    loader = make_loader(four_partitions(frame), next_item_model(), state, batch_size=16,
                         num_workers=2)
    before = reader_threads()
    with iter(loader) as batches:
        next(batches)
        assert len(reader_threads(before)) == 2  # the two workers
    assert readers_gone(before) == []

    batches = iter(loader)
    next(batches)
    del batches  # garbage-collected: closed too
    assert readers_gone(before) == []

    batches = iter(loader)
    next(batches)
    loader.close()  # every open pass of the loader
    assert readers_gone(before) == [] and next(batches, None) is None

    assert len(list(loader)) == len(loader)  # a pass read to its end leaves nothing either
    assert readers_gone(before) == []
