"""The training arguments as Hugging Face's loop reads them: the user's, with a few flags set.

The Trainer runs Hugging Face's loop with two flags of its own (``logging_nan_inf_filter``
off where the filter runs on the device, ``ignore_data_skip`` on where the loader was placed
at a resume checkpoint). A copy of the arguments would do that, but Hugging Face writes to the
arguments it loops with (fractional ``logging_steps``, ``eval_steps`` and ``save_steps`` become
step counts), and a copy would keep those writes from the user's arguments, which the
checkpoints save. The loop's callbacks would also record the copy's flags (W&B, MLflow and
TensorBoard record ``args.to_dict()``).
"""

import copy

__all__ = ["loop_view"]


def loop_view(args, **loop_only):
    """``args`` with the fields in ``loop_only`` reading as given, for the loop alone.

    The view shares ``args``' attributes (its ``__dict__`` is the same object), so what the
    loop or a callback writes lands in ``args``, as it would in Hugging Face's Trainer (a
    write to a ``loop_only`` field too, though the loop keeps reading its own value). For
    everything that leaves the loop the view stands for ``args``: ``to_dict`` (what trackers
    record), and pickling and copying (W&B's ``WANDB_LOG_MODEL`` saves the callback's
    ``args`` with ``torch.save``), which give the user's arguments.
    """
    def flag(name, value):
        def write(self, new):
            self.__dict__[name] = new
        return property(lambda self: value, write)

    members = {name: flag(name, value) for name, value in loop_only.items()}
    members["to_dict"] = lambda self: args.to_dict()
    # Unpickled or copied, the view is a copy of ``args`` (``copy.copy``: no reference to
    # this package in a pickled file).
    members["__reduce_ex__"] = lambda self, protocol: (copy.copy, (args,))
    view_class = type(type(args).__name__, (type(args),), members)
    view = object.__new__(view_class)
    view.__dict__ = args.__dict__
    return view
