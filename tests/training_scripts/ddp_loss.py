"""Run under ``torch.distributed.run`` by tests/test_training_ddp.py: one training step.

``fit``: rank ``r`` trains on rows ``SPLITS[r]`` of T4R's packaged sessions (16 and 32
rows: ranks hold different numbers of targets). ``--trainer``: the ``Trainer`` on the
first 48 sessions, 24 rows per rank as its loader shards them. Plain SGD, lr 1, one
step: the weights after it are ``w - gradient``. Writes ``rank{R}.pt`` and
``rank{R}.json`` to ``--out``.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "trainer_scripts"))
import t4r_training_factories as factories  # noqa: E402
from torchrun_launch import write_rank_results  # noqa: E402

from merlin_t4r_ops.training import Trainer, fit, resolve_strategy  # noqa: E402

SPLITS = [(0, 16), (16, 48)]
SEED = 5


def train_one_step(model, optimizer, out):
    from trainer_common import make_args

    trainer = Trainer(
        model=model,
        args=make_args(os.path.join(out, "hf"), max_sequence_length=factories.TESTING_MAX_LEN,
                       per_device_train_batch_size=24, max_steps=1, max_grad_norm=0.0),
        schema=factories.testing_schema(),
        train_dataset_or_path=factories.testing_dataset(factories.testing_frame().iloc[:48], 2),
        optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)),
    )
    trainer.train()
    return trainer.state.log_history


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--masking", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--trainer", action="store_true")
    args = parser.parse_args()

    state = resolve_strategy("auto")
    model = factories.testing_model(args.masking)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    if args.trainer:
        history = train_one_step(model, optimizer, args.out)
    else:
        start, stop = SPLITS[state.rank]
        batch = factories.testing_batch(factories.testing_frame().iloc[start:stop])
        history = fit(model, [(batch, {})], optimizer=optimizer, epochs=1, strategy=state,
                      seed=SEED, progress=False)
    write_rank_results(args.out, state.rank, {"history": history}, model.state_dict())
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
