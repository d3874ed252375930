"""One crop-and-pad rule and one sequence width for training and serving (merlin_t4r_ops.sequence).

* ``fit``'s loader, the ``Trainer``'s loader and the operator show a model the same most
  recent items of a long session;
* a model built T4R's tutorial way (``XLNetConfig.build(...).to_torch_model(inputs, task)``,
  which leaves ``model.max_sequence_length=None``) is trained and served at its own width,
  in dense batches that DataParallel's split along dim 0 keeps whole;
* list columns of one session that disagree in length are refused, naming them and the row.
"""

import os
import sys

import numpy as np
import pandas as pd
import pytest
import torch
import transformers4rec.torch as tr
from merlin.schema import ColumnSchema, Schema, Tags
from merlin.schema.io.tensorflow_metadata import TensorflowMetadata
from merlin.table import TensorTable
from transformers4rec.config.transformer import BertConfig
from transformers4rec.data import tabular_sequence_testing_data

import t4r_factories as factories
from merlin_t4r_ops import InvalidRequestError, PredictT4RPyTorch, T4ROpsError
from merlin_t4r_ops.errors import SessionLengthError
from merlin_t4r_ops.ops.inputs import input_specs, to_model_inputs
from merlin_t4r_ops.sequence import (
    crop_and_pad,
    crop_and_pad_rows,
    pad_sessions,
    resolve_sequence_length,
)
from merlin_t4r_ops.training import DistributedState, Trainer, make_loader, resolve_strategy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_scripts"))
from trainer_common import make_args  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_launcher_env")

WIDTH = 10
LONG = list(range(1, 16))  # a 15-item session: width 10 must keep items 6-15
SESSIONS = [LONG, [1, 2, 3], list(range(20, 30)), list(range(30, 41)), [7]]
CPU = torch.device("cpu")


def _list_column(name, tags, domain, max_len):
    return ColumnSchema(
        name, dtype=np.int64, is_list=True, is_ragged=True,
        tags=[*tags, Tags.CATEGORICAL, Tags.LIST],
        properties={"domain": {"min": 0, "max": domain, "name": name},
                    "value_count": {"min": 1, "max": max_len}},
    )


def _most_recent(rows, width):
    """The rule, the slow obvious way: the last ``width`` values, right-padded with 0."""
    return [list(row)[-width:] + [0] * (width - len(row[-width:])) for row in rows]


@pytest.fixture(scope="module")
def long_sessions(tmp_path_factory):
    """Parquet sessions (one longer than the model), their schema, and a model of width 10."""
    path = tmp_path_factory.mktemp("long_sessions")
    schema = Schema([
        _list_column("item_id-list", [Tags.ITEM_ID, Tags.ITEM, Tags.ID], 50, max_len=20),
        _list_column("category-list", [], 8, max_len=20),
    ])
    df = pd.DataFrame({"item_id-list": SESSIONS,
                       "category-list": [[i % 7 + 1 for i in s] for s in SESSIONS]})
    df.to_parquet(path / "part_0.parquet", index=False)
    TensorflowMetadata.from_merlin_schema(schema).to_proto_text_file(str(path))
    torch.manual_seed(0)
    inputs = tr.TabularSequenceFeatures.from_schema(
        schema, max_sequence_length=WIDTH, masking="causal", d_output=16, aggregation="concat")
    config = tr.XLNetConfig.build(d_model=16, n_head=2, n_layer=1, total_seq_length=WIDTH)
    model = config.to_torch_model(inputs, tr.NextItemPredictionTask(weight_tying=True),
                                  max_sequence_length=WIDTH).eval()
    return {"path": str(path), "files": [str(path / "part_0.parquet")], "schema": schema,
            "df": df, "model": model}


def _trainer_batch(data, tmp_path, args_width):
    args = make_args(str(tmp_path), max_sequence_length=args_width)
    trainer = Trainer(model=data["model"], args=args, strategy="single", schema=data["schema"],
                      eval_dataset_or_path=data["files"])
    inputs, _ = next(iter(trainer.get_eval_dataloader()))
    return inputs


@pytest.mark.parametrize("trainer_args_width", [WIDTH, None])
def test_fit_loader_trainer_loader_and_operator_keep_the_same_most_recent_items(
    long_sessions, tmp_path, trainer_args_width
):
    data, model = long_sessions, long_sessions["model"]
    fit_batch, _ = next(iter(make_loader(data["path"], model, resolve_strategy("single"),
                                         batch_size=len(SESSIONS), device_batches=False)))
    trainer_batch = _trainer_batch(data, tmp_path, trainer_args_width)
    op = PredictT4RPyTorch(model)
    served = to_model_inputs(TensorTable.from_df(data["df"]), input_specs(model.input_schema),
                             op.max_sequence_length, CPU)

    assert fit_batch["item_id-list"][0].tolist() == list(range(6, 16))
    for name in ("item_id-list", "category-list"):
        expected = _most_recent(data["df"][name], WIDTH)
        assert fit_batch[name].tolist() == expected, f"fit loader, {name}"
        assert trainer_batch[name].tolist() == expected, f"Trainer loader, {name}"
        assert served[name].tolist() == expected, f"operator, {name}"
    # So the served scores are the scores of the sessions the model was trained and evaluated on.
    with torch.inference_mode():
        trained_view = model(fit_batch, training=False, testing=False).numpy()
    np.testing.assert_allclose(op.predict(TensorTable.from_df(data["df"]))["next-item"],
                               trained_view, rtol=1e-6)


def test_right_padded_fixed_width_lists_are_cropped_alike_in_the_loader_and_the_operator(
    long_sessions, tmp_path
):
    """NVTabular's ``ListSlice(-n, pad=True)`` writes fixed-width lists right-padded with 0."""
    model, n = long_sessions["model"], 16
    padded = {name: np.array([list(s) + [0] * (n - len(s)) for s in long_sessions["df"][name]])
              for name in ("item_id-list", "category-list")}
    pd.DataFrame({k: list(v) for k, v in padded.items()}).to_parquet(tmp_path / "part.parquet")
    fixed = Schema([c.with_shape((None, n)) for c in long_sessions["schema"]])
    TensorflowMetadata.from_merlin_schema(fixed).to_proto_text_file(str(tmp_path))

    batch, _ = next(iter(make_loader(str(tmp_path), model, resolve_strategy("single"),
                                     batch_size=len(SESSIONS), device_batches=False)))
    served = to_model_inputs(TensorTable(padded), input_specs(model.input_schema), WIDTH, CPU)
    for name in padded:
        expected = _most_recent(long_sessions["df"][name], WIDTH)
        assert batch[name].tolist() == expected, f"fit loader, {name}"
        assert served[name].tolist() == expected, f"operator, {name}"


def test_trainer_with_the_pyarrow_engine_keeps_the_most_recent_items(long_sessions, tmp_path):
    """T4R's pyarrow loader keeps a long session's oldest items; the engine reads through ours."""
    args = make_args(str(tmp_path), max_sequence_length=WIDTH, data_loader_engine="pyarrow")
    trainer = Trainer(model=long_sessions["model"], args=args, strategy="single",
                      schema=long_sessions["schema"], eval_dataset_or_path=long_sessions["files"])
    batch, _ = next(iter(trainer.get_eval_dataloader()))
    for name in ("item_id-list", "category-list"):
        assert batch[name].tolist() == _most_recent(long_sessions["df"][name], WIDTH), name


def test_crop_and_pad_gives_torch_for_torch_and_numpy_for_numpy():
    values, lengths = np.arange(1, 16), np.array([12, 0, 3])
    expected = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [0] * 10, [13, 14, 15] + [0] * 7]
    padded = crop_and_pad(values, lengths, WIDTH)
    assert isinstance(padded, np.ndarray) and padded.tolist() == expected
    padded = crop_and_pad(torch.from_numpy(values), torch.from_numpy(lengths), WIDTH)
    assert isinstance(padded, torch.Tensor) and padded.tolist() == expected
    embeddings = crop_and_pad(torch.arange(30.0).reshape(15, 2), lengths, 2)
    assert embeddings.shape == (3, 2, 2) and embeddings[2].tolist() == [[26, 27], [28, 29]]


@pytest.mark.parametrize("kind", ["numpy", "torch", "torch-bfloat16"])
def test_crop_and_pad_keeps_the_rule_on_random_sessions(kind):
    """Empty, short, exact and long rows, ragged and right-padded, against the obvious way."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(0, 3 * WIDTH, 200)
    lengths[:3] = [0, WIDTH, WIDTH + 1]
    rows = [list(rng.integers(1, 256, n)) for n in lengths]  # exact in bfloat16
    n = int(lengths.max())
    matrix = np.array([row + [0] * (n - len(row)) for row in rows])
    values = np.concatenate(rows)
    if kind != "numpy":
        dtype = torch.bfloat16 if kind == "torch-bfloat16" else torch.int64
        values, matrix = torch.tensor(values, dtype=dtype), torch.tensor(matrix, dtype=dtype)
    expected = _most_recent(rows, WIDTH)
    assert _as_ints(crop_and_pad(values, lengths, WIDTH)) == expected
    assert _as_ints(crop_and_pad_rows(matrix, lengths, WIDTH)) == expected
    id_columns = [] if kind == "torch-bfloat16" else ["padded"]  # ids are never bfloat16
    padded = pad_sessions({"ragged": (values, lengths), "padded": (matrix, None)}, WIDTH,
                          id_columns)
    assert _as_ints(padded["ragged"]) == _as_ints(padded["padded"]) == expected


def _as_ints(padded):
    return padded.to(torch.int64).tolist() if isinstance(padded, torch.Tensor) else padded.tolist()


# ---- the width: model, input block, transformer config, schema ------------------------------

TESTING_SCHEMA = tabular_sequence_testing_data.schema  # T4R's own; value_count.max is 185


def _tutorial_model(config_cls=tr.XLNetConfig, seed=0, d_model=16):
    """Built as T4R's README and tutorials do: ``to_torch_model`` without max_sequence_length."""
    torch.manual_seed(seed)
    inputs = tr.TabularSequenceFeatures.from_schema(
        TESTING_SCHEMA, max_sequence_length=20, continuous_projection=d_model, d_output=d_model,
        masking="mlm" if config_cls is BertConfig else "causal")
    config = config_cls.build(d_model=d_model, n_head=2, n_layer=1, total_seq_length=24)
    return config.to_torch_model(inputs, tr.NextItemPredictionTask(weight_tying=True)).eval()


def _input_block(model):
    return model.heads[0].body.inputs


def test_tutorial_model_is_served_at_its_own_width_not_the_schemas():
    model = _tutorial_model(seed=3)
    assert model.max_sequence_length is None
    op = PredictT4RPyTorch(model)
    assert op.max_sequence_length == 20

    df = pd.read_parquet(tabular_sequence_testing_data.path)
    df = df.iloc[np.argsort(-df["item_id/list"].map(len).to_numpy())[:6]]  # 63 items and down
    df = df[model.input_schema.column_names].reset_index(drop=True)
    served = op.predict(TensorTable.from_df(df))["next-item"]

    def scores_at(width):
        batch = {name: torch.tensor(_most_recent(df[name], width) if name.endswith("/list")
                                    else df[name].to_numpy())
                 for name in df.columns}
        with torch.inference_mode():
            return model(batch, training=False, testing=False).numpy()

    np.testing.assert_allclose(served, scores_at(20), rtol=1e-5, atol=1e-6)
    # The width matters: the schema's 185 gives other scores than the model's 20.
    assert not np.allclose(scores_at(185), scores_at(20), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("config_cls", [tr.XLNetConfig, tr.GPT2Config, BertConfig])
def test_width_is_the_models_then_the_input_blocks_then_the_configs_then_the_schemas(config_cls):
    model = _tutorial_model(config_cls)
    assert resolve_sequence_length(model) == 20  # the input block's
    model.max_sequence_length = 12
    assert resolve_sequence_length(model) == 12
    assert resolve_sequence_length(model, requested=16) == 16
    model.max_sequence_length = None
    del _input_block(model).input_size  # as if the block were built by hand
    # GPT2 keeps total_seq_length as n_positions, BERT as max_position_embeddings - 2; XLNet not.
    assert resolve_sequence_length(model) == (185 if config_cls is tr.XLNetConfig else 24)


def _without_any_width(model):
    """``model`` with every place a width could be read from emptied."""
    model.max_sequence_length = None
    block = _input_block(model)
    del block.input_size
    block._schema = Schema([  # T4R's schema setter keeps the first schema it was given
        ColumnSchema(c.name, dtype=c.dtype, tags=c.tags, is_list=True, is_ragged=True,
                     properties={k: v for k, v in c.properties.items() if k != "value_count"})
        if c.is_list else c
        for c in model.input_schema
    ])
    return model


def test_dp_loader_without_a_width_names_what_it_looked_at(t4r_testing_data):
    path, _ = t4r_testing_data
    model = _without_any_width(_tutorial_model())
    dp = DistributedState("dp", rank=0, local_rank=0, world_size=1, device=CPU, reason="test")
    looked_at = (r"looked at model.max_sequence_length, the input block's max_sequence_length, "
                 r"the transformer config's total_seq_length, the schema's value_count.max")
    with pytest.raises(T4ROpsError, match=rf"strategy 'dp' needs dense .*{looked_at}"):
        make_loader(path, model, dp, batch_size=4)
    with pytest.raises(T4ROpsError, match=rf"the operator pads every request .*{looked_at}"):
        PredictT4RPyTorch(model)


@pytest.fixture(scope="module")
def t4r_testing_data(tmp_path_factory):
    """T4R's own testing sessions as parquet with a schema.pbtxt, as NVTabular leaves them."""
    model = _tutorial_model(seed=5)
    path = tmp_path_factory.mktemp("t4r_testing_data")
    df = pd.read_parquet(tabular_sequence_testing_data.path)[model.input_schema.column_names]
    df.iloc[:96].to_parquet(path / "part_0.parquet", index=False)
    TensorflowMetadata.from_merlin_schema(model.input_schema).to_proto_text_file(str(path))
    return str(path), model


def test_tutorial_model_gets_dense_batches_that_a_dataparallel_split_keeps_whole(t4r_testing_data):
    path, model = t4r_testing_data
    loader = make_loader(path, model, resolve_strategy("single"), batch_size=32,
                         device_batches=False)
    batch, _ = next(iter(loader))
    lists = [c.name for c in model.input_schema if c.is_list]
    assert not [k for k in batch if k.endswith(("__values", "__offsets"))]
    assert {tuple(batch[name].shape) for name in lists} == {(32, 20)}

    with torch.inference_mode():
        whole = model(dict(batch), training=False, testing=False)
        # DataParallel's scatter chunks every tensor along dim 0, one chunk per GPU.
        chunks = [dict(zip(batch, parts))
                  for parts in zip(*(value.chunk(3, dim=0) for value in batch.values()))]
        replicas = torch.cat([model(chunk, training=False, testing=False) for chunk in chunks])
    np.testing.assert_allclose(replicas.numpy(), whole.numpy(), rtol=1e-5, atol=1e-6)


# ---- list columns of one session must agree in length ----------------------------------------

@pytest.fixture(scope="module")
def model():
    return factories.next_item_model("xlnet-causal", seed=11)


def test_ragged_lists_that_disagree_name_the_columns_and_the_row(model):
    df = pd.DataFrame({
        "item_id-list": [[1, 2], [4, 5, 6]],
        "category-list": [[1, 1], [1, 2, 3, 4, 5]],
        "price-list": [np.array([0.5, 0.5], np.float32), np.array([0.25], np.float32)],
    })
    expected = (r"row 1: the list inputs disagree on the session's length: "
                r"\{'item_id-list': 3, 'category-list': 5, 'price-list': 1\}")
    with pytest.raises(InvalidRequestError, match=expected):
        PredictT4RPyTorch(model).predict(TensorTable.from_df(df))


def test_right_padded_lists_that_disagree_name_the_columns_and_the_row(model):
    table = TensorTable({
        "item_id-list": np.array([[1, 2, 3, 4, 0], [4, 5, 6, 0, 0]], dtype=np.int64),
        "category-list": np.array([[1, 1, 1, 1, 0], [1, 2, 3, 4, 5]], dtype=np.int64),
        "price-list": np.ones((2, 5), dtype=np.float32),
    })
    expected = (r"row 1: the list inputs disagree on the session's length: "
                r"\{'item_id-list': 3, 'category-list': 5, 'price-list': 'at most 5'\}")
    with pytest.raises(InvalidRequestError, match=expected):
        PredictT4RPyTorch(model).predict(table)


# ---- one session-length rule: ids are the CATEGORICAL columns, as in T4R's from_schema -------

def _quantity_schema(n):
    """Items (ids) and an integer CONTINUOUS quantity per event, right-padded to ``n``."""
    return Schema([
        _list_column("item_id-list", [Tags.ITEM_ID, Tags.ITEM, Tags.ID], 50, max_len=n)
        .with_shape((None, n)),
        _list_column("category-list", [], 8, max_len=n).with_shape((None, n)),
        ColumnSchema("qty-list", dtype=np.int64, is_list=True, tags=[Tags.CONTINUOUS, Tags.LIST],
                     dims=(None, n)),
    ])


def _quantity_batches(tmp_path, columns):
    """The fit loader's batch and the operator's inputs of the same fixed-width sessions."""
    n = len(columns["item_id-list"][0])
    schema = _quantity_schema(n)
    pd.DataFrame({k: list(v) for k, v in columns.items()}).to_parquet(tmp_path / "part.parquet")
    TensorflowMetadata.from_merlin_schema(schema).to_proto_text_file(str(tmp_path))
    inputs = tr.TabularSequenceFeatures.from_schema(
        schema, max_sequence_length=n, continuous_projection=8, masking="causal", d_output=16)
    config = tr.XLNetConfig.build(d_model=16, n_head=2, n_layer=1, total_seq_length=n)
    model = config.to_torch_model(inputs, tr.NextItemPredictionTask(weight_tying=True))

    def trained():
        return next(iter(make_loader(str(tmp_path), model, resolve_strategy("single"),
                                     batch_size=8, device_batches=False)))[0]

    def served():
        table = TensorTable({k: np.array(v, dtype=np.int64) for k, v in columns.items()})
        return to_model_inputs(table, input_specs(schema), n, CPU)

    return trained, served


def test_integer_continuous_lists_are_numbers_alike_in_training_and_serving(tmp_path):
    """A real 0 quantity is not padding, and a negative one is not a bad id."""
    columns = {"item_id-list": [[5, 6, 7, 0], [8, 9, 0, 0]],
               "category-list": [[1, 2, 3, 0], [4, 5, 0, 0]],
               "qty-list": [[2, 1, 0, 0], [-1, 3, 0, 0]]}
    trained, served = _quantity_batches(tmp_path, columns)
    batch, inputs = trained(), served()
    for name, rows in columns.items():
        assert batch[name].tolist() == rows, f"fit loader, {name}"
        assert inputs[name].tolist() == rows, f"operator, {name}"
    assert inputs["qty-list"].dtype == torch.float32  # what T4R's continuous projection takes


def test_id_lists_that_disagree_are_refused_alike_in_training_and_serving(tmp_path):
    columns = {"item_id-list": [[5, 6, 7, 0], [8, 9, 0, 0]],
               "category-list": [[1, 2, 3, 0], [4, 0, 0, 0]],
               "qty-list": [[2, 1, 0, 0], [1, 1, 0, 0]]}
    trained, served = _quantity_batches(tmp_path, columns)
    expected = (r"row 1: the list inputs disagree on the session's length: "
                r"\{'item_id-list': 2, 'category-list': 1, 'qty-list': 'at most 4'\}")
    with pytest.raises(SessionLengthError, match=expected):
        trained()
    with pytest.raises(InvalidRequestError, match=expected):
        served()
