"""Send sessions to an exported ensemble: a pandas DataFrame in and out (``infer_dataframe``),
or named flat arrays in and out (``infer_arrays``, for a client that holds them).

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
import weakref
from types import ModuleType
from typing import Dict, List, NamedTuple, Optional, Sequence

import numpy as np
import pandas as pd
from tritonclient.utils import triton_to_np_dtype

from merlin_t4r_ops.errors import InvalidRequestError

__all__ = [
    "arrays_to_inputs", "checked_arrays", "dataframe_arrays", "dataframe_to_inputs",
    "response_arrays", "response_to_dataframe", "infer_arrays", "infer_dataframe",
    "model_metadata", "model_spec", "ModelSpec", "client_protocol", "protocol_module",
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


class ModelSpec(NamedTuple):
    """What ``infer_dataframe`` needs to know of a model: read once per client and model."""

    dtypes: Dict[str, np.dtype]  # input name to numpy dtype
    shapes: Dict[str, List[int]]  # input name to the shape of one request
    output_names: List[str]
    batch_dimension: bool


# client -> model name -> ModelSpec; a client that is garbage collected takes its entries along.
_SPECS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def model_spec(client, model_name: str, *, refresh: bool = False) -> ModelSpec:
    """The model's inputs, outputs and batch dimension, from the server once per client.

    Parameters
    ----------
    client : tritonclient.grpc.InferenceServerClient or tritonclient.http.InferenceServerClient
    model_name : str
    refresh : bool
        Ask the server again (after the model was re-exported and reloaded), and keep that.
    """
    cached = _SPECS.setdefault(client, {})
    if refresh or model_name not in cached:
        metadata = model_metadata(client, model_name)
        batch_dimension = has_batch_dimension(client, model_name)
        inputs = metadata["inputs"]
        shapes = {spec["name"]: spec["shape"] for spec in inputs}
        if batch_dimension:  # the metadata's shapes start with the batch dimension
            shapes = {name: shape[1:] for name, shape in shapes.items()}
        cached[model_name] = ModelSpec(
            {spec["name"]: triton_to_np_dtype(spec["datatype"]) for spec in inputs}, shapes,
            [spec["name"] for spec in metadata["outputs"]], batch_dimension)
    return cached[model_name]


_LIST_TYPES = (np.ndarray, list, tuple)


def _list_rows(series: pd.Series) -> list:
    """The rows of a list column; a scalar or None in one is refused, naming it.

    The rows' types are read in one pass (``set(map(type, rows))`` runs in C): checking
    each row with ``isinstance`` in Python cost 0.1 ms of a 256-session request.
    """
    rows = series.tolist()
    types = set(map(type, rows))
    if all(issubclass(kind, _LIST_TYPES) for kind in types):
        return rows
    index = next(i for i, row in enumerate(rows) if not isinstance(row, _LIST_TYPES))
    row = rows[index]
    raise InvalidRequestError(
        f"column {series.name!r} row {index}: expected a list of values, "
        f"got {row!r} ({type(row).__name__})"
    )


def _cast(subject: str, values: np.ndarray, dtype, where) -> np.ndarray:
    """``values`` as ``dtype``. As integer ids, a float with a fraction, NaN or inf, a value
    outside ``dtype``'s range, and text that is no number are refused, naming ``subject``
    (``column 'x'``) and the place (``where(position)``: ``row 3``), not cast."""
    target = np.dtype(dtype)
    if target.kind not in "iu" or values.dtype == target:
        return values.astype(target, copy=False)
    if values.dtype.kind in "OUS":
        # Python ints as int64; floats, None (as NaN) or numbers as text as floats, checked below
        ints = all(isinstance(v, (int, np.integer)) for v in values.reshape(-1))
        try:
            values = values.astype(np.int64 if ints else np.float64)
        except (TypeError, ValueError, OverflowError) as error:
            raise InvalidRequestError(
                f"{subject}: expected integer ids ({target.name}), got values that are not "
                f"numbers of that range ({error})"
            ) from error
    flat = values.reshape(-1)
    if flat.dtype.kind == "f":
        bad = ~np.isfinite(flat)
        bad[~bad] = flat[~bad] != np.round(flat[~bad])
    else:
        bad = np.zeros(len(flat), dtype=bool)
    if flat.dtype.kind in "iuf" and len(flat):
        info = np.iinfo(target)
        bad |= (flat < info.min) | (flat > info.max)  # NaN compares False: caught above
    if bad.any():
        position = int(np.argmax(bad))
        shown = flat[position].item()
        raise InvalidRequestError(
            f"{subject} {where(position)}: expected integer ids ({target.name}), got {shown!r}")
    return values.astype(target, copy=False)


def _ragged(series: pd.Series, values_dtype, offsets_dtype):
    # Plain Python over the rows: pandas' map and a per-row asarray cost more than the
    # copy itself for the few short sessions of a request.
    rows = _list_rows(series)
    arrays_only = set(map(type, rows)) <= {np.ndarray}
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=offsets_dtype)
    np.cumsum(lengths, out=offsets[1:])
    if not rows:
        return np.array([], dtype=values_dtype), offsets
    if arrays_only:
        values = np.concatenate(rows)
    else:
        values = np.concatenate([np.asarray(row) for row in rows])

    def row_of(position):
        return f"row {int(np.searchsorted(offsets, position, side='right')) - 1}"

    return _cast(f"column {series.name!r}", values, values_dtype, row_of), offsets


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
        array = np.stack([np.asarray(row) for row in _list_rows(series)])
    else:
        array = series.to_numpy()
    width = max(1, array.size // max(1, len(array)))
    array = _cast(f"column {series.name!r}", array, dtype,
                  lambda position: f"row {position // width}")
    return _shaped(array, shape, f"column {series.name!r}", "the column gives")


def _shaped(array: np.ndarray, shape: Optional[List[int]], subject: str, gives: str
            ) -> np.ndarray:
    """``array`` in the declared ``shape``: ``[rows]`` becomes ``[rows, 1]`` where the model
    declares ``[-1, 1]``; any other difference in rank is refused, naming ``subject``."""
    if shape is None or len(shape) == array.ndim:
        return array
    if len(shape) == 2 and array.ndim == 1 and shape[1] in (1, -1):
        return array.reshape(len(array), 1)
    raise InvalidRequestError(
        f"{subject}: the model takes shape {shape}, {gives} {list(array.shape)}")


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


def response_arrays(response, output_names: Sequence[str], *,
                    batch_dimension: bool = False) -> Dict[str, np.ndarray]:
    """The outputs as named numpy arrays, as the model returned them.

    With ``batch_dimension``, the leading dimension of 1 of every output is dropped. String
    outputs (Triton BYTES) come back as ``str``, the way the ensemble returned them.
    """
    arrays = {}
    for name in output_names:
        array = _text(response.as_numpy(name))
        arrays[name] = array[0] if batch_dimension else array
    return arrays


def response_to_dataframe(response, output_names: Sequence[str], *,
                          batch_dimension: bool = False) -> pd.DataFrame:
    """A DataFrame of the outputs: 2-D outputs and ragged pairs become list columns.

    With ``batch_dimension``, the leading dimension of 1 of every output is dropped first.
    String outputs (Triton BYTES) come back as ``str``, the way the ensemble returned them.
    """
    outputs = response_arrays(response, output_names, batch_dimension=batch_dimension)
    columns = {}
    for name, array in outputs.items():
        if name.endswith(_OFFSETS):
            continue
        if name.endswith(_VALUES):
            offsets = outputs[name[: -len(_VALUES)] + _OFFSETS]
            columns[name[: -len(_VALUES)]] = np.split(array, offsets[1:-1])
        elif array.ndim > 1:  # a fixed-length list, of length 1 too (top_k=1)
            columns[name] = list(array)
        else:
            columns[name] = array.reshape(len(array))
    return pd.DataFrame(columns)


def _check_declared(names, declared: Dict[str, np.dtype], model_name: str,
                    argument: str = "dtypes") -> None:
    """Refuse a name in ``argument`` that is none of the model's inputs (Triton's own refusal
    of it runs to some 350 characters, and comes only after the request was built and sent)."""
    unknown = [name for name in names if name not in declared]
    if unknown:
        raise InvalidRequestError(
            f"{argument} names {unknown[0]!r}, which model {model_name!r} does not declare; "
            f"it declares {sorted(declared)}"
        )


def infer_dataframe(
    client,
    df: pd.DataFrame,
    *,
    model_name: str = EXECUTOR_MODEL,
    output_names: Optional[List[str]] = None,
    dtypes: Optional[Dict[str, np.dtype]] = None,
    batch_dimension: Optional[bool] = None,
    refresh_metadata: bool = False,
) -> pd.DataFrame:
    """Send ``df`` to ``model_name``; return the outputs as a DataFrame.

    The model's metadata and config are read from the server on the first call for a client
    and model (:func:`model_spec`) and kept: every later call is one RPC, the inference.

    Parameters
    ----------
    client : tritonclient.grpc.InferenceServerClient or tritonclient.http.InferenceServerClient
    df : pandas.DataFrame
        One row per session (list columns hold each session's items), or one row per
        event for a workflow whose ``Groupby`` builds the sessions. Integer ids may come as
        floats without a fraction; a fraction, NaN or inf in an id column is refused.
    model_name : str
        The Triton model to call, ``executor_model`` for an exported ensemble.
    output_names : list of str, optional
        Outputs to ask for; all of the model's outputs by default. A fixed-length list
        output comes back as a list column, of length 1 too.
    dtypes : dict, optional
        Input name to numpy dtype, in place of the dtype the model's metadata declares for
        that input (the others keep theirs); each name must be one of the model's inputs.
    batch_dimension : bool, optional
        Whether the model takes each request as one batch entry (exported with
        :class:`merlin_t4r_ops.runtime.BatchingTritonRuntime`); read from the server's model
        config when omitted.
    refresh_metadata : bool
        Read the model's metadata and config from the server again (after a reload).

    Raises
    ------
    InvalidRequestError
        Naming the ``dtypes`` entry that the model does not declare, with those it does;
        naming the column (and row): missing, a scalar or None where a list belongs, a
        fraction or NaN in an id column, lists of several lengths for a fixed-length input.
    """
    spec = model_spec(client, model_name, refresh=refresh_metadata)
    if dtypes is not None:
        _check_declared(dtypes, spec.dtypes, model_name)
    dtypes = {**spec.dtypes, **(dtypes or {})}
    output_names = output_names or spec.output_names
    batch_dimension, shapes = _batching(spec, batch_dimension)
    arrays = dataframe_arrays(df, dtypes, shapes)
    response = _infer(client, model_name, arrays, output_names, batch_dimension)
    return response_to_dataframe(response, output_names, batch_dimension=batch_dimension)


def infer_arrays(
    client,
    arrays: Dict[str, np.ndarray],
    *,
    model_name: str = EXECUTOR_MODEL,
    output_names: Optional[List[str]] = None,
    batch_dimension: Optional[bool] = None,
    refresh_metadata: bool = False,
) -> Dict[str, np.ndarray]:
    """Send named arrays to ``model_name``; return its outputs as named arrays.

    :func:`infer_dataframe` for a client that holds its sessions as flat arrays: a list
    column ``c`` as ``c__values`` (every session's items, one after another) and
    ``c__offsets`` (where each session starts, and the end). It skips the DataFrame's
    per-row work, which at 256 sessions costs more than the model's share of the call
    (docs/benchmarks.md). The model's metadata is read once per client and model, as there.

    Parameters
    ----------
    client : tritonclient.grpc.InferenceServerClient or tritonclient.http.InferenceServerClient
    arrays : dict
        Every input the model declares, by name; each is cast to the declared dtype (integer
        ids may come as floats without a fraction), and ``[rows]`` goes as ``[rows, 1]``
        where the model declares ``[-1, 1]``.
    model_name, output_names, batch_dimension, refresh_metadata
        As for :func:`infer_dataframe`.

    Returns
    -------
    dict
        Output name to numpy array (``str`` objects for string outputs), without the batch
        dimension of a model that has one.

    Raises
    ------
    InvalidRequestError
        Naming the array the model does not declare, or the declared input that is missing,
        with those the model takes; naming the input (and row) whose values are no integer
        ids, or whose rank differs from the declared shape.
    """
    spec = model_spec(client, model_name, refresh=refresh_metadata)
    output_names = output_names or spec.output_names
    batch_dimension, shapes = _batching(spec, batch_dimension)
    checked = checked_arrays(arrays, spec.dtypes, shapes, model_name)
    response = _infer(client, model_name, checked, output_names, batch_dimension)
    return response_arrays(response, output_names, batch_dimension=batch_dimension)


def checked_arrays(arrays: Dict[str, np.ndarray], dtypes: Dict[str, np.dtype],
                   shapes: Optional[Dict[str, List[int]]], model_name: str = EXECUTOR_MODEL,
                   ) -> Dict[str, np.ndarray]:
    """``arrays`` as ``model_name`` takes them: every declared input, in its dtype and shape."""
    _check_declared(arrays, dtypes, model_name, argument="arrays")
    missing = [name for name in dtypes if name not in arrays]
    if missing:
        raise InvalidRequestError(
            f"arrays lack {missing[0]!r}: model {model_name!r} takes {sorted(dtypes)}, "
            f"the arrays hold {sorted(arrays)}"
        )
    checked = {}
    for name, dtype in dtypes.items():
        array = np.asarray(arrays[name])
        if array.dtype != dtype:  # an array in the declared dtype costs one comparison
            array = _cast(f"input {name!r}", array, dtype, _where(name, array, arrays))
        checked[name] = _shaped(array, (shapes or {}).get(name), f"input {name!r}",
                                "the array is")
    return checked


def _where(name: str, array: np.ndarray, arrays: Dict[str, np.ndarray]):
    """Where a position of ``array`` is, for a refusal: the session of a ragged list's value
    (by its offsets), the row of a 2-D array, else the position itself."""
    if name.endswith(_VALUES) and name[: -len(_VALUES)] + _OFFSETS in arrays:
        offsets = np.asarray(arrays[name[: -len(_VALUES)] + _OFFSETS])
        return lambda p: f"session {int(np.searchsorted(offsets, p, side='right')) - 1}"
    if array.ndim == 2:
        return lambda p: f"row {p // max(1, array.shape[1])}"
    return lambda p: f"position {p}"


def _batching(spec: ModelSpec, batch_dimension: Optional[bool]):
    """Whether to send each request as one batch entry, and the shapes to send it in."""
    batch_dimension = spec.batch_dimension if batch_dimension is None else batch_dimension
    if not spec.batch_dimension and batch_dimension:
        return True, None  # the caller's choice: the declared shapes have no batch dimension
    return batch_dimension, spec.shapes


def _infer(client, model_name: str, arrays: Dict[str, np.ndarray], output_names, batch_dimension):
    protocol = client_protocol(client)
    return client.infer(
        model_name,
        arrays_to_inputs(arrays, protocol, batch_dimension=batch_dimension),
        outputs=[protocol.InferRequestedOutput(name) for name in output_names],
    )
