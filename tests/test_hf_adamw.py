"""``MultiTensorAdamW``: Hugging Face's ``AdamW`` (T4R's default ``optim``) bit for bit.

The optimizer is checked apart from the model: each step's gradients come from one real
T4R model's loss and are given, as copies, to both optimizers' parameters, so a
nondeterministic backward on a GPU cannot tell them apart.
"""

import copy

import pytest
import torch
from transformers.optimization import AdamW as HuggingFaceAdamW

import t4r_training_factories as factories
from merlin_t4r_ops.training.hf_adamw import MultiTensorAdamW, multi_tensor

GPU = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _groups(model, weight_decay):
    """Hugging Face's two groups: decay on weights, none on biases and LayerNorms; one
    parameter without a gradient (a frozen table), which both optimizers skip."""
    named = [(n, p) for n, p in model.named_parameters()]
    decay = [p for n, p in named if "bias" not in n and "layer_norm" not in n]
    rest = [p for n, p in named if not any(p is q for q in decay)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def _state_equal(a, b):
    for pa, pb in zip(a.param_groups, b.param_groups):
        for x, y in zip(pa["params"], pb["params"]):
            sa, sb = a.state[x], b.state[y]
            assert sa.keys() == sb.keys()
            if sa:
                assert sa["step"] == sb["step"]
                assert torch.equal(sa["exp_avg"], sb["exp_avg"])
                assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[GPU, needs_cuda])])
@pytest.mark.parametrize("weight_decay, correct_bias, dtype", [
    (0.0, True, torch.float32), (0.01, True, torch.float32), (0.01, False, torch.float32),
    # A model cast to half precision: its parameters are stepped one by one (torch's list ops
    # round 0.9 to bfloat16 on the CPU, where mul_ does not).
    (0.01, True, torch.bfloat16), (0.0, True, torch.float16),
])
def test_the_same_values_as_hugging_faces_adamw(device, weight_decay, correct_bias, dtype):
    source = factories.testing_model("clm", d_model=32).to(device)
    theirs_model, ours_model = (copy.deepcopy(source).to(dtype) for _ in range(2))
    frozen = [n for n, _ in source.named_parameters()][1]
    settings = dict(lr=5e-3, eps=1e-6, correct_bias=correct_bias, no_deprecation_warning=True)
    theirs = HuggingFaceAdamW(_groups(theirs_model, weight_decay), **settings)
    ours = MultiTensorAdamW(_groups(ours_model, weight_decay), **settings)
    frame = factories.testing_frame()
    for step in range(6):
        batch = {k: v.to(device) for k, v in
                 factories.testing_batch(frame.iloc[64 * step: 64 * (step + 1)]).items()}
        source.zero_grad(set_to_none=True)
        source(batch, training=True)["loss"].backward()
        grads = {n: p.grad for n, p in source.named_parameters()}
        for model in (theirs_model, ours_model):
            for name, p in model.named_parameters():
                unused = name == frozen or grads[name] is None  # T4R leaves some unused
                p.grad = None if unused else grads[name].to(dtype, copy=True)
        theirs.step()
        ours.step()
        for (name, a), b in zip(theirs_model.named_parameters(), ours_model.parameters()):
            assert torch.equal(a, b), f"step {step}: {name} differs"
        _state_equal(theirs, ours)
    assert not theirs.state[dict(theirs_model.named_parameters())[frozen]]


def test_multi_tensor_keeps_the_groups_settings_and_state():
    model = factories.testing_model("clm")
    original = HuggingFaceAdamW(_groups(model, 0.01), lr=3e-3, betas=(0.8, 0.99), eps=1e-7,
                                correct_bias=False, no_deprecation_warning=True)
    model(factories.testing_batch(factories.testing_frame().iloc[:32]),
          training=True)["loss"].backward()
    original.step()
    expected = copy.deepcopy(original.state_dict())
    replacement = multi_tensor(original)
    assert type(replacement) is MultiTensorAdamW
    assert replacement.defaults == original.defaults
    got = replacement.state_dict()
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for key, state in expected["state"].items():
        assert got["state"][key]["step"] == state["step"]
        assert torch.equal(got["state"][key]["exp_avg"], state["exp_avg"])


def test_the_trainer_steps_hugging_faces_default_with_it(tmp_path):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_scripts"))
    from trainer_common import make_args

    from merlin_t4r_ops.training import Trainer

    def trainer(optimizers=(None, None), **args):
        return Trainer(model=factories.testing_model("clm"), args=make_args(str(tmp_path), **args),
                       strategy="single", schema=factories.testing_schema(),
                       optimizers=optimizers)

    assert trainer().args.optim == "adamw_hf"  # T4R's default, from Hugging Face 4.30
    default = trainer().create_optimizer()
    assert type(default) is MultiTensorAdamW
    assert [g["weight_decay"] for g in default.param_groups] == [0.0, 0.0]  # T4R's default
    assert type(trainer(optim="adamw_torch").create_optimizer()) is torch.optim.AdamW
    given = HuggingFaceAdamW(factories.testing_model("clm").parameters(),
                             no_deprecation_warning=True)
    assert trainer(optimizers=(given, None)).create_optimizer() is given  # the user's, as is
