"""``fit``'s step options on the CPU: ``amp``, ``compile``, and unwrapping a compiled model.

The loss curve of the default step (fp32, fixed seed) is pinned against a plain eager
loop over the same batches. On T4R's packaged ``tabular_sequence_testing_data``.
"""

import pytest
import torch

import t4r_training_factories as factories
from merlin_t4r_ops.errors import StrategyError
from merlin_t4r_ops.training import (
    DistributedState,
    evaluate,
    fit,
    load_checkpoint,
    save_checkpoint,
    unwrap_model,
)
from merlin_t4r_ops.training.step import compile_model

CPU_SINGLE = DistributedState("single", 0, 0, 1, torch.device("cpu"), "tests run on CPU")
BATCH = 20


@pytest.fixture(scope="module")
def batches():
    """T4R's 1,000 testing sessions as 50 padded batches of 20 (next-item: no targets)."""
    frame = factories.testing_frame()
    return [(factories.testing_batch(frame.iloc[i:i + BATCH]), None)
            for i in range(0, len(frame), BATCH)]


def record_losses(model):
    """The loss of every training forward of ``model``, as a list that fills as it runs."""
    losses = []

    def hook(module, args, output):
        if module.training:
            losses.append(float(output["loss"].detach()))

    model.register_forward_hook(hook)
    return losses


def record_autocast(model, device_type="cpu"):
    """The autocast dtype (or None) in force at every forward of ``model``."""
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(
        torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None))
    return seen


def test_fp32_losses_of_the_first_50_steps_equal_a_plain_eager_loop(batches):
    """fit's default step changes nothing in fp32: T4R's loss, Adam(lr), one step a batch."""
    reference_model = factories.testing_model("clm", seed=0)
    optimizer = torch.optim.Adam(reference_model.parameters(), lr=1e-3)
    reference = []
    for x, y in batches:
        loss = reference_model(x, targets=y, training=True)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference.append(float(loss.detach()))

    model = factories.testing_model("clm", seed=0)
    losses = record_losses(model)
    fit(model, batches, epochs=1, batch_size=BATCH, lr=1e-3, strategy=CPU_SINGLE, seed=0,
        progress=False)
    assert len(losses) == len(reference) == 50
    assert losses == pytest.approx(reference, rel=1e-5, abs=1e-6)
    assert reference[-1] < reference[0]


def test_bf16_trains_under_bfloat16_autocast_on_the_cpu_without_a_grad_scaler(batches, tmp_path):
    model = factories.testing_model("clm")
    seen = record_autocast(model)
    history = fit(model, batches[:10], epochs=2, batch_size=BATCH, amp="bf16",
                  strategy=CPU_SINGLE, seed=0, progress=False, checkpoint_dir=str(tmp_path))
    assert seen == [torch.bfloat16] * 20
    assert history[1]["train_loss"] < history[0]["train_loss"]
    assert load_checkpoint(str(tmp_path))["scaler"] is None


def test_evaluate_bf16_runs_the_forward_in_bfloat16_on_the_cpu(batches):
    model = factories.testing_model("clm")
    seen = record_autocast(model)
    metrics = evaluate(model, batches[:2], amp="bf16", strategy=CPU_SINGLE)
    assert seen == [torch.bfloat16] * 2 and "loss" in metrics


@pytest.mark.parametrize("amp", ["fp32", "bfloat16", 1, "FP16"])
def test_an_unknown_amp_is_refused_by_name(amp, batches):
    with pytest.raises(ValueError, match=r"amp must be one of False, True, 'fp16' or 'bf16', "
                                         rf"got {amp!r}"):
        fit(factories.testing_model(), batches[:1], amp=amp, strategy=CPU_SINGLE)


def test_fp16_on_the_cpu_is_refused_and_points_to_bf16(batches):
    with pytest.raises(StrategyError, match=r"amp='fp16' expects a CUDA device .* trains on "
                                            r"cpu .* Pass amp=False or amp='bf16' on CPU"):
        fit(factories.testing_model(), batches[:1], amp="fp16", strategy=CPU_SINGLE)


def test_compile_is_refused_under_dataparallel_and_must_be_a_bool(batches):
    dp = DistributedState("dp", 0, 0, 1, torch.device("cpu"), "two GPUs, stated", n_devices=2)
    with pytest.raises(StrategyError, match=r"compile=True cannot compile a DataParallel model "
                                            r".* strategy 'dp' on 2 GPUs"):
        fit(factories.testing_model(), batches[:1], compile=True, strategy=dp)
    with pytest.raises(ValueError, match=r"compile must be a bool, got 'max-autotune'"):
        fit(factories.testing_model(), batches[:1], compile="max-autotune", strategy=CPU_SINGLE)


def test_unwrap_model_sees_through_torch_compile_and_parallel_wrappers():
    model = factories.testing_model()
    assert unwrap_model(torch.compile(model)) is model
    assert unwrap_model(torch.compile(torch.nn.DataParallel(model))) is model


@pytest.mark.parametrize("device, strategy, drop_last, graphs", [
    ("cuda:0", "single", True, True),  # every batch one shape: CUDA graphs
    ("cuda:0", "single", False, False),  # a short last batch: no graphs
    ("cuda:0", "ddp", True, False),
    ("cpu", "single", True, False),
])
def test_compile_takes_cuda_graphs_only_for_static_shapes_and_skips_the_dynamic_graphs(
        device, strategy, drop_last, graphs):
    # T4R's next-item head keeps each batch's non-padded positions, a count that changes
    # from batch to batch: recorded anew for every count, CUDA graphs made the compiled step
    # 0.22-0.30 of the cached loop's pace on an H100 (docs/benchmarks.md). torch.compile is
    # lazy: nothing is compiled here, so this runs on the CPU.
    from torch._inductor import config as inductor

    state = DistributedState(strategy, 0, 0, 1, torch.device(device), "stated")
    compiled = compile_model(factories.testing_model(), state, drop_last=drop_last)
    config = compiled.get_compiler_config()
    assert config["triton.cudagraphs"] is (graphs or inductor.triton.cudagraphs)
    if graphs:
        assert config["triton.cudagraph_skip_dynamic_graphs"] is True


def test_a_checkpoint_of_a_compiled_model_loads_into_a_plain_one(tmp_path):
    model = factories.testing_model(seed=1)
    optimizer = torch.optim.Adam(model.parameters())
    save_checkpoint(str(tmp_path), CPU_SINGLE, model=torch.compile(model), optimizer=optimizer,
                    epoch=1, history=[])
    saved = load_checkpoint(str(tmp_path))["model"]
    assert not [key for key in saved if "_orig_mod" in key]
    plain = factories.testing_model(seed=2)
    plain.load_state_dict(saved)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


@pytest.mark.slow  # inductor compiles the forward and backward on the CPU: about 80 s
def test_compiled_training_follows_the_eager_loss_curve_on_the_cpu(batches):
    eager = factories.testing_model("clm", seed=0)
    eager_losses = record_losses(eager)
    fit(eager, batches[:10], epochs=1, batch_size=BATCH, strategy=CPU_SINGLE, seed=0,
        progress=False)
    model = factories.testing_model("clm", seed=0)
    history = fit(model, batches[:10], epochs=1, batch_size=BATCH, strategy=CPU_SINGLE, seed=0,
                  progress=False, compile=True)
    assert unwrap_model(model) is model  # fit returns the user's model, not the compiled one
    mean = sum(eager_losses) / len(eager_losses)
    assert history[0]["train_loss"] == pytest.approx(mean, rel=1e-4)
