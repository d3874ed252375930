"""The training arguments as Hugging Face's loop reads them: the user's, with a few flags set.

The Trainer runs Hugging Face's loop with two flags of its own (``logging_nan_inf_filter``
off where the filter runs on the device, ``ignore_data_skip`` on where the loader was placed
at a resume checkpoint). A copy of the arguments would do that, but Hugging Face writes to the
arguments it loops with (fractional ``logging_steps``, ``eval_steps`` and ``save_steps`` become
step counts), and a copy would keep those writes from the user's arguments, which the
checkpoints save. The loop's callbacks would also record the copy's flags (W&B, MLflow and
TensorBoard record ``args.to_dict()``).
"""

__all__ = ["loop_view"]


def loop_view(args, **loop_only):
    """``args`` with the fields in ``loop_only`` reading as given, for the loop alone.

    The view shares ``args``' attributes (its ``__dict__`` is the same object), so what the
    loop writes lands in ``args``, as it would in Hugging Face's Trainer. ``to_dict`` answers
    for ``args``: trackers record the user's arguments, not the loop's flags.
    """
    members = {name: property(lambda self, value=value: value) for name, value in loop_only.items()}
    members["to_dict"] = lambda self: args.to_dict()
    view_class = type(type(args).__name__, (type(args),), members)
    view = object.__new__(view_class)
    view.__dict__ = args.__dict__
    return view
