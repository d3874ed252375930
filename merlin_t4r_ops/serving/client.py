"""Send a pandas DataFrame of sessions to an exported ensemble and get a DataFrame back.

Merlin's ``convert_df_to_triton_input`` refuses CPU list columns ("this function doesn't
support CPU list values yet"), so on the CPU there is no way to send sessions with it. Here a
list column becomes the ``<name>__values`` and ``<name>__offsets`` inputs that the exported
executor model declares, with the dtypes the server's own model metadata asks for.
"""

from typing import Dict, List, Optional, Sequence

import numpy as np
import pandas as pd
from tritonclient.utils import triton_to_np_dtype

from merlin_t4r_ops.errors import InvalidRequestError

__all__ = ["arrays_to_inputs", "dataframe_arrays", "dataframe_to_inputs", "response_to_dataframe", "infer_dataframe"]

EXECUTOR_MODEL = "executor_model"
_VALUES, _OFFSETS = "__values", "__offsets"


def _input_dtypes(client, model_name: str) -> Dict[str, np.dtype]:
    metadata = client.get_model_metadata(model_name, as_json=True)
    return {spec["name"]: triton_to_np_dtype(spec["datatype"]) for spec in metadata["inputs"]}


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


def arrays_to_inputs(arrays: Dict[str, np.ndarray], protocol: str = "grpc"):
    """``tritonclient`` ``InferInput`` objects for named numpy arrays, sent as they are."""
    if protocol == "grpc":
        import tritonclient.grpc as triton
    else:
        import tritonclient.http as triton
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in arrays.items():
        infer_input = triton.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        infer_input.set_data_from_numpy(array)
        inputs.append(infer_input)
    return inputs


def dataframe_to_inputs(df: pd.DataFrame, dtypes: Dict[str, np.dtype], protocol: str = "grpc"):
    """``tritonclient`` ``InferInput`` objects for the rows of ``df``."""
    return arrays_to_inputs(dataframe_arrays(df, dtypes), protocol)


def _text(array: np.ndarray) -> np.ndarray:
    """Triton BYTES arrive as ``bytes`` objects; the ensemble sent ``str`` (UTF-8)."""
    if array.dtype != object:
        return array
    flat = [value.decode("utf-8") if isinstance(value, bytes) else value
            for value in array.reshape(-1)]
    return np.array(flat, dtype=object).reshape(array.shape)


def response_to_dataframe(response, output_names: Sequence[str]) -> pd.DataFrame:
    """A DataFrame of the outputs: 2-D outputs and ragged pairs become list columns.

    String outputs (Triton BYTES) come back as ``str``, the way the ensemble returned them.
    """
    columns = {}
    for name in output_names:
        if name.endswith(_OFFSETS):
            continue
        array = _text(response.as_numpy(name))
        if name.endswith(_VALUES):
            offsets = response.as_numpy(name[: -len(_VALUES)] + _OFFSETS)
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
    """
    import tritonclient.grpc as grpcclient

    dtypes = dtypes or _input_dtypes(client, model_name)
    if output_names is None:
        metadata = client.get_model_metadata(model_name, as_json=True)
        output_names = [spec["name"] for spec in metadata["outputs"]]
    response = client.infer(
        model_name,
        dataframe_to_inputs(df, dtypes),
        outputs=[grpcclient.InferRequestedOutput(name) for name in output_names],
    )
    return response_to_dataframe(response, output_names)
