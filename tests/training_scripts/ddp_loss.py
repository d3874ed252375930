"""Run under ``torch.distributed.run`` by tests/test_training_ddp.py: one ``fit`` step.

Rank ``r`` trains on rows ``SPLITS[r]`` of T4R's packaged sessions (16 and 32 rows:
ranks hold different numbers of targets) with plain SGD, lr 1, one step; the weights
after it are ``w - gradient``. Writes ``rank{R}.pt`` and ``rank{R}.json`` to ``--out``.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import t4r_training_factories as factories  # noqa: E402

from merlin_t4r_ops.training import fit, resolve_strategy  # noqa: E402

SPLITS = [(0, 16), (16, 48)]
SEED = 5


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--masking", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    state = resolve_strategy("auto")
    model = factories.testing_model(args.masking)
    start, stop = SPLITS[state.rank]
    batch = factories.testing_batch(factories.testing_frame().iloc[start:stop])
    history = fit(model, [(batch, {})], optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                  epochs=1, strategy=state, seed=SEED, progress=False)
    torch.save(model.state_dict(), os.path.join(args.out, f"rank{state.rank}.pt"))
    with open(os.path.join(args.out, f"rank{state.rank}.json"), "w") as fh:
        json.dump({"history": history}, fh)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
