"""Refuse a graph where an operator's output columns meet same-named columns of another node.

Merlin merges the schemas of a node's inputs by column name, so when two operators that
both write ``item_ids`` feed one node (``a + b``, ``[a, b] >> op``), the second one's column
silently replaces the first one's, in the exported config and in every answer.

Merlin hands an operator its schemas, never its node, and no hook sees the node where
inputs meet. The node that calls :meth:`validate_schemas` is the caller's ``self``;
:func:`calling_node` finds it on the stack, and :func:`refuse_colliding_outputs` checks
every consumer of that node once the whole graph's schemas are known.
"""

from typing import Iterable, Optional

from merlin.dag import Node
from merlin_t4r_ops.errors import SchemaMismatchError
from merlin_t4r_ops.ops.call_stack import search_callers

__all__ = ["calling_node", "refuse_colliding_outputs"]

_MAX_FRAMES = 8  # Node.validate_schemas calls op.validate_schemas directly


def calling_node(op) -> Optional[Node]:
    """The Merlin ``Node`` whose method is calling into ``op`` right now, if any."""

    def node_of_op(names):
        candidate = names.get("self")
        return candidate if isinstance(candidate, Node) and candidate.op is op else None

    return search_callers(node_of_op, _MAX_FRAMES)


def _describe(node: Node) -> str:
    label = getattr(node.op, "label", None) or type(node.op).__name__
    return f"{type(node.op).__name__} ({label})" if label != type(node.op).__name__ else label


def refuse_colliding_outputs(node: Node, names: Iterable[str]) -> None:
    """Raise if a consumer of ``node`` also receives one of ``names`` from another input.

    Raises
    ------
    SchemaMismatchError
        Naming the colliding columns and both producers.
    """
    names = list(names)
    for consumer in node.children:
        for other in consumer.parents_with_dependencies:
            if not isinstance(other, Node) or other is node or other.output_schema is None:
                continue
            clash = [name for name in names if name in other.output_schema.column_names]
            if clash:
                raise SchemaMismatchError(
                    f"output columns {clash} of {_describe(node)} collide with the same "
                    f"columns of {_describe(other)} at the input of {_describe(consumer)}: "
                    "Merlin would keep only one of them. Give one operator other output "
                    "names (PredictT4RPyTorch(..., output_prefix='cart_'))"
                )
