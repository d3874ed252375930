"""Hold the columns a graph gives a T4R model to what its input block was built for.

A schema describes a model's inputs; the model's modules are what it runs. They drift apart:
a ``merlin_standard_lib`` schema (as T4R's tutorials read ``schema.pbtxt``) comes through
T4R's conversion with ``int_domain`` instead of ``domain`` and without Categorify's
properties, a workflow refitted on other data encodes more ids than the embedding table has
rows, a column the schema calls scalar is a list to the input block. Each is a wrong answer
or, on CUDA, a device-side assert at the first request. The functions here read the truth
from the model (embedding rows, the block's ``input_size``) and refuse a schema that
disagrees, naming both sides.
"""

from typing import Dict, Optional

from merlin.schema import ColumnSchema, Schema
from merlin_t4r_ops.errors import SchemaMismatchError
from merlin_t4r_ops.sequence import input_block_sizes

__all__ = ["embedding_rows", "schema_cardinality", "check_columns_against_model"]


def embedding_rows(model) -> Dict[str, int]:
    """``{column: rows}`` of every categorical input's embedding table in ``model``."""
    from transformers4rec.torch.features.embedding import EmbeddingFeatures

    rows = {}
    for module in model.modules():
        if isinstance(module, EmbeddingFeatures):
            for name, feature in module.feature_config.items():
                table = module.embedding_tables[name] if name in module.embedding_tables else None
                weight = getattr(table, "weight", None)
                rows[name] = int(weight.shape[0] if weight is not None
                                 else feature.table.vocabulary_size)
    return rows


def schema_cardinality(column: ColumnSchema) -> Optional[int]:
    """How many ids the schema says ``column`` holds (``max + 1`` of its domain), or None.

    Merlin's schemas keep the range as ``domain``, ``merlin_standard_lib``'s (converted by
    T4R) as ``int_domain``.
    """
    properties = column.properties or {}
    domain = properties.get("domain") or properties.get("int_domain") or {}
    top = domain.get("max")
    return int(top) + 1 if top is not None else None


def _describe_shape(is_list: bool) -> str:
    return "a list" if is_list else "a scalar (one value per row)"


def check_columns_against_model(schema: Schema, model, source: str) -> None:
    """Raise unless every column of ``schema`` that the model reads agrees with its modules.

    A categorical column's range must equal its embedding table's rows, and a column is a
    list exactly where the model's input block takes ``[batch, width]``.

    Parameters
    ----------
    schema : merlin.schema.Schema
    model : transformers4rec.torch.Model
    source : str
        Who describes ``schema`` (``"the model's input schema"``, ``"the graph (the
        workflow's output schema)"``): the message names it beside the model.

    Raises
    ------
    SchemaMismatchError
    """
    rows, sizes = embedding_rows(model), input_block_sizes(model)
    for column in schema:
        ids = schema_cardinality(column)
        if column.name in rows and ids is not None and ids != rows[column.name]:
            raise SchemaMismatchError(
                f"column {column.name!r}: {source} says it holds ids 0 to {ids - 1} ({ids} "
                f"ids), the model's embedding table for it has {rows[column.name]} rows; "
                "serve the model with the workflow (and schema) it was trained on"
            )
        size = sizes.get(column.name)
        if size is not None and bool(column.is_list) != (len(size) > 1):
            raise SchemaMismatchError(
                f"column {column.name!r}: {source} declares {_describe_shape(column.is_list)}, "
                f"the model's input block takes {_describe_shape(len(size) > 1)} "
                f"(input_size {list(size)})"
            )
