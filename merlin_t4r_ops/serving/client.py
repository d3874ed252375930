"""Send a pandas DataFrame of sessions to an exported ensemble and get a DataFrame back.

Merlin's ``convert_df_to_triton_input`` refuses CPU list columns ("this function doesn't
support CPU list values yet"), so on the CPU there is no way to send sessions with it. Here a
list column becomes the ``<name>__values`` and ``<name>__offsets`` inputs that the exported
executor model declares, with the dtypes the server's own model metadata asks for.

A model exported with :class:`merlin_t4r_ops.runtime.BatchingTritonRuntime` has a batch
dimension (``max_batch_size > 0``): each request is one batch entry, so every array is sent
with a leading dimension of 1 and every output comes back with one, which is dropped.
"""

from typing import Dict, List, Optional, Sequence

import numpy as np
import pandas as pd
from tritonclient.utils import triton_to_np_dtype

from merlin_t4r_ops.errors import InvalidRequestError

__all__ = ["arrays_to_inputs", "dataframe_arrays", "dataframe_to_inputs", "response_to_dataframe",
           "infer_dataframe", "has_batch_dimension"]

EXECUTOR_MODEL = "executor_model"
_VALUES, _OFFSETS = "__values", "__offsets"


def _input_dtypes(client, model_name: str) -> Dict[str, np.dtype]:
    metadata = client.get_model_metadata(model_name, as_json=True)
    return {spec["name"]: triton_to_np_dtype(spec["datatype"]) for spec in metadata["inputs"]}


def has_batch_dimension(client, model_name: str) -> bool:
    """Whether ``model_name`` takes each request as one batch entry (``max_batch_size > 0``)."""
    config = client.get_model_config(model_name, as_json=True)["config"]
    return int(config.get("max_batch_size", 0)) > 0


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


def dataframe_arrays(df: pd.DataFrame, dtypes: Dict[str, np.dtype]) -> Dict[str, np.ndarray]:
    """The arrays a Triton model with inputs ``dtypes`` takes for the rows of ``df``."""
    arrays = {}
    for name, dtype in dtypes.items():
        if name.endswith(_VALUES) or name.endswith(_OFFSETS):
            column = name.rsplit("__", 1)[0]
            if column not in df.columns:
                raise InvalidRequestError(
                    f"column {column!r} is missing: the model takes {sorted(dtypes)}, "
                    f"the DataFrame has {list(df.columns)}"
                )
            if name.endswith(_VALUES):
                values, offsets = _ragged(
                    df[column], dtype, dtypes.get(column + _OFFSETS, np.int32)
                )
                arrays[name] = values
                arrays[column + _OFFSETS] = offsets
        else:
            if name not in df.columns:
                raise InvalidRequestError(
                    f"column {name!r} is missing: the model takes {sorted(dtypes)}, "
                    f"the DataFrame has {list(df.columns)}"
                )
            arrays[name] = df[name].to_numpy().astype(dtype, copy=False).reshape(len(df), -1)
    return arrays


def arrays_to_inputs(arrays: Dict[str, np.ndarray], protocol: str = "grpc", *,
                     batch_dimension: bool = False):
    """``tritonclient`` ``InferInput`` objects for named numpy arrays.

    With ``batch_dimension``, each array gets the leading dimension of 1 that a model with
    a batch dimension takes a request as; otherwise the arrays are sent as they are.
    """
    if protocol == "grpc":
        import tritonclient.grpc as triton
    else:
        import tritonclient.http as triton
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in arrays.items():
        if batch_dimension:
            array = array[None]
        infer_input = triton.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        infer_input.set_data_from_numpy(array)
        inputs.append(infer_input)
    return inputs


def dataframe_to_inputs(df: pd.DataFrame, dtypes: Dict[str, np.dtype], protocol: str = "grpc",
                        *, batch_dimension: bool = False):
    """``tritonclient`` ``InferInput`` objects for the rows of ``df``."""
    return arrays_to_inputs(dataframe_arrays(df, dtypes), protocol,
                            batch_dimension=batch_dimension)


def response_to_dataframe(response, output_names: Sequence[str], *,
                          batch_dimension: bool = False) -> pd.DataFrame:
    """A DataFrame of the outputs: 2-D outputs and ragged pairs become list columns.

    With ``batch_dimension``, the leading dimension of 1 of every output is dropped first.
    """
    def output(name):
        array = response.as_numpy(name)
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
    """Send ``df`` to ``model_name`` through a ``tritonclient.grpc`` client; return the outputs.

    Parameters
    ----------
    client : tritonclient.grpc.InferenceServerClient
    df : pandas.DataFrame
        One row per session; list columns hold each session's items.
    model_name : str
        The Triton model to call, ``executor_model`` for an exported ensemble.
    output_names : list of str, optional
        Outputs to ask for; all of the model's outputs by default.
    dtypes : dict, optional
        Input name to numpy dtype; read from the server's model metadata when omitted.
    batch_dimension : bool, optional
        Whether the model takes each request as one batch entry (exported with
        :class:`merlin_t4r_ops.runtime.BatchingTritonRuntime`); read from the server's model
        config when omitted.
    """
    import tritonclient.grpc as grpcclient

    dtypes = dtypes or _input_dtypes(client, model_name)
    if output_names is None:
        metadata = client.get_model_metadata(model_name, as_json=True)
        output_names = [spec["name"] for spec in metadata["outputs"]]
    if batch_dimension is None:
        batch_dimension = has_batch_dimension(client, model_name)
    response = client.infer(
        model_name,
        dataframe_to_inputs(df, dtypes, batch_dimension=batch_dimension),
        outputs=[grpcclient.InferRequestedOutput(name) for name in output_names],
    )
    return response_to_dataframe(response, output_names, batch_dimension=batch_dimension)
