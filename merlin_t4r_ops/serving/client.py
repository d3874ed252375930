"""Send a pandas DataFrame of sessions to an exported ensemble and get a DataFrame back.

Merlin's ``convert_df_to_triton_input`` refuses CPU list columns ("this function doesn't
support CPU list values yet"), so on the CPU there is no way to send sessions with it. Here a
list column becomes the ``<name>__values`` and ``<name>__offsets`` inputs that the exported
executor model declares, with the dtypes and shapes the server's own model metadata asks for:
a scalar column goes as ``[rows]`` where the model declares ``[-1]`` (Merlin declares every
scalar column so), as ``[rows, 1]`` where it declares ``[-1, 1]``. Both ``tritonclient.grpc``
and ``tritonclient.http`` clients work.

A model exported with :class:`merlin_t4r_ops.runtime.BatchingTritonRuntime` has a batch
dimension (``max_batch_size > 0``): each request is one batch entry, so every array is sent
with a leading dimension of 1 and every output comes back with one, which is dropped.
"""

import importlib
from types import ModuleType
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd
from tritonclient.utils import triton_to_np_dtype

from merlin_t4r_ops.errors import InvalidRequestError

__all__ = [
    "arrays_to_inputs", "dataframe_arrays", "dataframe_to_inputs", "response_to_dataframe",
    "infer_dataframe", "model_metadata", "client_protocol", "protocol_module",
    "has_batch_dimension",
]

EXECUTOR_MODEL = "executor_model"
PROTOCOLS = ("grpc", "http")
_VALUES, _OFFSETS = "__values", "__offsets"


def protocol_module(name: str) -> ModuleType:
    """``tritonclient.grpc`` for ``"grpc"``, ``tritonclient.http`` for ``"http"``."""
    if name not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {name!r}")
    return importlib.import_module(f"tritonclient.{name}")


def client_protocol(client) -> ModuleType:
    """``tritonclient.grpc`` or ``tritonclient.http``: the module ``client`` comes from."""
    parts = type(client).__module__.split(".")
    if parts[0] != "tritonclient" or len(parts) < 2 or parts[1] not in PROTOCOLS or "aio" in parts:
        raise TypeError(
            "client must be a tritonclient.grpc or tritonclient.http InferenceServerClient, "
            f"got {type(client).__module__}.{type(client).__name__}"
        )
    return protocol_module(parts[1])


def model_metadata(client, model_name: str) -> dict:
    """The model's metadata as a dict (shapes as ints), from either flavour of client."""
    if client_protocol(client).__name__ == "tritonclient.grpc":
        metadata = client.get_model_metadata(model_name, as_json=True)
    else:  # the HTTP client always answers JSON, and has no as_json
        metadata = client.get_model_metadata(model_name)
    for spec in metadata.get("inputs", []) + metadata.get("outputs", []):
        spec["shape"] = [int(dim) for dim in spec.get("shape", [])]
    return metadata


def has_batch_dimension(client, model_name: str) -> bool:
    """Whether ``model_name`` takes each request as one batch entry (``max_batch_size > 0``)."""
    if client_protocol(client).__name__ == "tritonclient.grpc":
        config = client.get_model_config(model_name, as_json=True)["config"]
    else:  # the HTTP client answers the config itself, as JSON
        config = client.get_model_config(model_name)
    return int(config.get("max_batch_size", 0)) > 0


def _input_specs(metadata: dict) -> Tuple[Dict[str, np.dtype], Dict[str, List[int]]]:
    inputs = metadata["inputs"]
    return ({spec["name"]: triton_to_np_dtype(spec["datatype"]) for spec in inputs},
            {spec["name"]: spec["shape"] for spec in inputs})


def _ragged(series: pd.Series, values_dtype, offsets_dtype):
    # Plain Python over the rows: pandas' map and a per-row asarray cost more than the
    # copy itself for the few short sessions of a request.
    rows = series.tolist()
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=offsets_dtype)
    np.cumsum(lengths, out=offsets[1:])
    if not rows:
        return np.array([], dtype=values_dtype), offsets
    if all(isinstance(row, np.ndarray) for row in rows):
        values = np.concatenate(rows)
    else:
        values = np.concatenate([np.asarray(row) for row in rows])
    return values.astype(values_dtype, copy=False), offsets


def _column(df: pd.DataFrame, name: str, dtypes) -> pd.Series:
    if name not in df.columns:
        raise InvalidRequestError(
            f"column {name!r} is missing: the model takes {sorted(dtypes)}, "
            f"the DataFrame has {list(df.columns)}"
        )
    return df[name]


def _dense(series: pd.Series, dtype, shape: Optional[List[int]]) -> np.ndarray:
    """A scalar or fixed-length list column as the array of the declared ``shape``.

    Without a declared shape, scalars go as ``[rows]``, Merlin's declaration for them.
    """
    if len(series) and pd.api.types.is_list_like(series.iloc[0]):
        lengths = sorted({len(row) for row in series})
        if len(lengths) > 1:
            raise InvalidRequestError(
                f"column {series.name!r}: the model takes lists of one length {shape}, "
                f"the rows have lengths {lengths}"
            )
        array = np.stack([np.asarray(row) for row in series])
    else:
        array = series.to_numpy()
    array = array.astype(dtype, copy=False)
    if shape is None or len(shape) == array.ndim:
        return array
    if len(shape) == 2 and array.ndim == 1 and shape[1] in (1, -1):
        return array.reshape(len(array), 1)
    raise InvalidRequestError(
        f"column {series.name!r}: the model takes shape {shape}, the column gives "
        f"{list(array.shape)}"
    )


def dataframe_arrays(
    df: pd.DataFrame,
    dtypes: Dict[str, np.dtype],
    shapes: Optional[Dict[str, List[int]]] = None,
) -> Dict[str, np.ndarray]:
    """The arrays a Triton model with inputs ``dtypes`` (and ``shapes``) takes for ``df``.

    Parameters
    ----------
    df : pandas.DataFrame
        One row per session (or per event, for a workflow that groups them).
    dtypes : dict
        Input name to numpy dtype. A list column ``c`` is sent as ``c__values`` and
        ``c__offsets`` when the model has those inputs.
    shapes : dict, optional
        Input name to the shape the model declares (``-1`` for any length), as in its
        metadata; scalar columns go as ``[rows]`` without it.
    """
    shapes = shapes or {}
    arrays = {}
    for name, dtype in dtypes.items():
        if name.endswith(_OFFSETS):
            continue
        if name.endswith(_VALUES):
            column = name[: -len(_VALUES)]
            values, offsets = _ragged(_column(df, column, dtypes), dtype,
                                      dtypes.get(column + _OFFSETS, np.int32))
            arrays[name], arrays[column + _OFFSETS] = values, offsets
        else:
            arrays[name] = _dense(_column(df, name, dtypes), dtype, shapes.get(name))
    return arrays


def arrays_to_inputs(arrays: Dict[str, np.ndarray], protocol="grpc", *,
                     batch_dimension: bool = False):
    """``tritonclient`` ``InferInput`` objects for named numpy arrays.

    ``protocol`` is ``"grpc"``, ``"http"``, or the ``tritonclient`` module itself. With
    ``batch_dimension``, each array gets the leading dimension of 1 that a model with a batch
    dimension takes a request as; otherwise the arrays are sent as they are.
    """
    if isinstance(protocol, str):
        protocol = protocol_module(protocol)
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in arrays.items():
        if batch_dimension:
            array = array[None]
        infer_input = protocol.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        infer_input.set_data_from_numpy(array)
        inputs.append(infer_input)
    return inputs


def dataframe_to_inputs(df: pd.DataFrame, dtypes: Dict[str, np.dtype], protocol="grpc",
                        shapes: Optional[Dict[str, List[int]]] = None, *,
                        batch_dimension: bool = False):
    """``tritonclient`` ``InferInput`` objects for the rows of ``df``.

    ``shapes`` are the shapes of one request, without the batch dimension.
    """
    return arrays_to_inputs(dataframe_arrays(df, dtypes, shapes), protocol,
                            batch_dimension=batch_dimension)


def _text(array: np.ndarray) -> np.ndarray:
    """Triton BYTES arrive as ``bytes`` objects; the ensemble sent ``str`` (UTF-8)."""
    if array.dtype != object:
        return array
    flat = [value.decode("utf-8") if isinstance(value, bytes) else value
            for value in array.reshape(-1)]
    return np.array(flat, dtype=object).reshape(array.shape)


def response_to_dataframe(response, output_names: Sequence[str], *,
                          batch_dimension: bool = False) -> pd.DataFrame:
    """A DataFrame of the outputs: 2-D outputs and ragged pairs become list columns.

    With ``batch_dimension``, the leading dimension of 1 of every output is dropped first.
    String outputs (Triton BYTES) come back as ``str``, the way the ensemble returned them.
    """
    def output(name):
        array = _text(response.as_numpy(name))
        return array[0] if batch_dimension else array

    columns = {}
    for name in output_names:
        if name.endswith(_OFFSETS):
            continue
        array = output(name)
        if name.endswith(_VALUES):
            offsets = output(name[: -len(_VALUES)] + _OFFSETS)
            columns[name[: -len(_VALUES)]] = np.split(array, offsets[1:-1])
        elif array.ndim > 1 and array.shape[1] > 1:
            columns[name] = list(array)
        else:
            columns[name] = array.reshape(len(array))
    return pd.DataFrame(columns)


def infer_dataframe(
    client,
    df: pd.DataFrame,
    *,
    model_name: str = EXECUTOR_MODEL,
    output_names: Optional[List[str]] = None,
    dtypes: Optional[Dict[str, np.dtype]] = None,
    batch_dimension: Optional[bool] = None,
) -> pd.DataFrame:
    """Send ``df`` to ``model_name``; return the outputs as a DataFrame.

    Parameters
    ----------
    client : tritonclient.grpc.InferenceServerClient or tritonclient.http.InferenceServerClient
    df : pandas.DataFrame
        One row per session (list columns hold each session's items), or one row per
        event for a workflow whose ``Groupby`` builds the sessions.
    model_name : str
        The Triton model to call, ``executor_model`` for an exported ensemble.
    output_names : list of str, optional
        Outputs to ask for; all of the model's outputs by default.
    dtypes : dict, optional
        Input name to numpy dtype. When given, and ``output_names`` too, no metadata is
        fetched and scalar columns go as ``[rows]``; otherwise the model's metadata gives
        every input's dtype and shape.
    batch_dimension : bool, optional
        Whether the model takes each request as one batch entry (exported with
        :class:`merlin_t4r_ops.runtime.BatchingTritonRuntime`); read from the server's model
        config when omitted.
    """
    protocol = client_protocol(client)
    shapes = None
    if dtypes is None or output_names is None:
        metadata = model_metadata(client, model_name)
        known_dtypes, shapes = _input_specs(metadata)
        dtypes = dtypes or known_dtypes
        if output_names is None:
            output_names = [spec["name"] for spec in metadata["outputs"]]
    if batch_dimension is None:
        batch_dimension = has_batch_dimension(client, model_name)
    if batch_dimension and shapes:  # the metadata's shapes start with the batch dimension
        shapes = {name: shape[1:] for name, shape in shapes.items()}
    response = client.infer(
        model_name,
        dataframe_to_inputs(df, dtypes, protocol, shapes, batch_dimension=batch_dimension),
        outputs=[protocol.InferRequestedOutput(name) for name in output_names],
    )
    return response_to_dataframe(response, output_names, batch_dimension=batch_dimension)
