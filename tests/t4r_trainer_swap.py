"""pytest plugin: run Transformers4Rec's own tests with this project's ``Trainer`` in T4R's place.

Loaded into a pytest run of T4R's test files with ``-p t4r_trainer_swap`` (this
directory on ``PYTHONPATH``). ``--trainer ours`` rebinds every module-level name
under which ``transformers4rec`` or the tests hold T4R's Trainer class
(``transformers4rec.torch.Trainer``, and any name a test module imported itself) to
``merlin_t4r_ops.training.Trainer``, except in the module that defines the class
(``transformers4rec.torch.trainer``), whose ``Trainer`` T4R's own methods read;
``--trainer t4r`` leaves them alone. Either way the run records, per test, the class
of every Trainer built, so the caller can check that the substitution happened
rather than trust it: ``--trainer-record PATH`` writes
``{"trainer", "rebound", "built": {nodeid: [class path, ...]}}`` as JSON.
"""

import functools
import json
import sys

import pytest

# Modules whose module-level ``Trainer`` names are rebound: T4R itself and its tests.
_SWAPPED_PACKAGES = ("transformers4rec", "tests")


def pytest_addoption(parser):
    group = parser.getgroup("t4r-trainer-swap")
    group.addoption("--trainer", choices=("t4r", "ours"), default="t4r",
                    help="whose Trainer the T4R tests build")
    group.addoption("--trainer-record", default=None,
                    help="JSON file for the Trainer classes each test built")


def pytest_configure(config):
    from transformers4rec.torch.trainer import Trainer as T4RTrainer

    replacement = None
    if config.getoption("--trainer") == "ours":
        from merlin_t4r_ops.training import Trainer as replacement
    recorder = TrainerRecorder(config, T4RTrainer, replacement)
    config.pluginmanager.register(recorder, "t4r-trainer-recorder")


def class_path(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class TrainerRecorder:
    """Rebinds T4R's Trainer names (when given a replacement) and records every Trainer built."""

    def __init__(self, config, t4r_trainer, replacement):
        self.path = config.getoption("--trainer-record")
        self.mode = config.getoption("--trainer")
        self.t4r_trainer = t4r_trainer
        self.replacement = replacement
        self.rebound = set()
        self.built = {}
        self.current = None
        self._record_constructions()
        self._rebind()

    def _record_constructions(self):
        # Our Trainer subclasses T4R's and calls its __init__, so every Trainer of either passes here.
        original_init = self.t4r_trainer.__init__

        @functools.wraps(original_init)
        def recording_init(trainer, *args, **kwargs):
            if self.current is not None:
                self.built.setdefault(self.current, []).append(class_path(type(trainer)))
            return original_init(trainer, *args, **kwargs)

        self.t4r_trainer.__init__ = recording_init

    def _rebind(self):
        if self.replacement is None:
            return
        for name, module in list(sys.modules.items()):
            if module is None or name.split(".")[0] not in _SWAPPED_PACKAGES:
                continue
            if name == self.t4r_trainer.__module__:
                # T4R's class reads its own module's ``Trainer`` in ``super(Trainer, self)``:
                # rebound there, our subclass's __init__ would call T4R's twice.
                continue
            for attribute, value in list(vars(module).items()):
                if value is self.t4r_trainer:
                    setattr(module, attribute, self.replacement)
                    self.rebound.add(f"{name}.{attribute}")

    def pytest_collection_finish(self, session):
        """Test modules are imported now: rebind the names they took at import too."""
        self._rebind()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.current = item.nodeid
        yield
        self.current = None

    def pytest_sessionfinish(self, session, exitstatus):
        if not self.path:
            return
        with open(self.path, "w") as out:
            json.dump(
                {"trainer": self.mode, "rebound": sorted(self.rebound), "built": self.built},
                out, indent=1,
            )
