"""Warnings of the Merlin stack that say nothing wrong about a run of this package.

Each is silenced where this package (or its examples) triggers it, by its message, so that
any other warning still reaches the user:

* merlin-core registers TensorFlow's dtypes when it is imported, and warns when TensorFlow is
  not installed. The PyTorch path never needs those dtypes.
* Every ``merlin.io.Dataset`` built without cuDF warns that "CPU mode" is experimental.
  This package runs NVTabular workflows and Merlin's loaders on pandas by design (in
  training, in the examples and inside Triton), and its tests check those results against
  the in-process ones.
"""

import warnings
from contextlib import contextmanager

TENSORFLOW_DTYPES = "Tensorflow dtype mappings did not load successfully"
CPU_DATASET = "Initializing an NVTabular Dataset in CPU mode"


def ignore_tensorflow_dtypes_warning() -> None:
    """Drop merlin-core's "no TensorFlow" import warning; call before the first Merlin import."""
    warnings.filterwarnings("ignore", message=TENSORFLOW_DTYPES, category=UserWarning)


@contextmanager
def cpu_datasets_quiet():
    """Within the block (or the decorated function), CPU-mode ``Dataset``\\ s do not warn."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=CPU_DATASET, category=UserWarning)
        yield
