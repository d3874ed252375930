"""Run the linear serving chain directly: workflow, then model, then decoding.

Merlin's ``LocalExecutor`` walks the graph on every request: it resolves each node's
selector, merges and converts the parents' columns, and runs a parent again for every child.
For the endpoint most shops serve, raw sessions >> ``TransformWorkflow`` (compiled by
:mod:`merlin_t4r_ops.workflow`) >> ``PredictT4RPyTorch`` >> ``DecodeItemIds``, every node has one
parent and the walk is pure overhead. :class:`LeanChain` resolves the selections once and
calls the three operators' ``transform`` one after the other, on the same ``TensorTable``
objects the executor would hand them, so the answer and its errors are the executor's.

Where the shop's item ids are signed integers (and ``PredictT4RPyTorch(decode_in_graph=True)``,
the default), the model's operator looks the raw ids up itself, on its device, right after
its top-k (inside its CUDA graph): ``DecodeItemIds``' one lookup table
(:attr:`~merlin_t4r_ops.ops.vocabulary.ItemVocabulary.lookup`) as a tensor. The chain then
skips ``DecodeItemIds``, whose answer would be the same. String ids are decoded on the host
by ``DecodeItemIds``, one ``take``.

Any other graph (branches, other operators, a workflow that fell back to NVTabular) is not
a chain: :func:`lean_chain` returns None and the executor keeps Merlin's.
"""

from typing import List, Optional

from merlin.dag import postorder_iter_nodes
from merlin.dag.ops import SelectionOp
from merlin.table import TensorTable

from merlin_t4r_ops.ops.decode import DecodeItemIds
from merlin_t4r_ops.ops.predict_t4r import PredictT4RPyTorch
from merlin_t4r_ops.workflow import CompiledWorkflow

__all__ = ["LeanChain", "lean_chain", "why_not_a_chain"]

CHAIN = (SelectionOp, CompiledWorkflow, PredictT4RPyTorch, DecodeItemIds)


class LeanChain:
    """The operators of a linear chain, run one after the other on a request's table.

    Parameters
    ----------
    nodes : list of merlin.dag.Node
        The chain's nodes, parents first: the input selection, the compiled workflow, the
        model and the decoder (see :func:`lean_chain`).

    Notes
    -----
    When the model's operator takes the decoding over (:attr:`decodes_in_graph`), it answers
    raw ids from then on. The chain hands the decoding to a shallow copy of the operator
    (``PredictT4RPyTorch.decoding_copy``: the model and its weights shared), so the graph's
    own operator still answers encoded ids and Merlin's executor over the same ensemble
    decodes them once.
    """

    def __init__(self, nodes):
        self.inputs = nodes[0].output_schema.column_names
        decoding = nodes[2].op.decoding_copy(nodes[3].op.vocabulary)
        self.decodes_in_graph = decoding is not None
        ops = [nodes[1].op, decoding] if decoding else [node.op for node in nodes[1:]]
        self.steps = [(op, node.input_columns.resolve(node.input_schema))
                      for op, node in zip(ops, nodes[1:])]

    def transform(self, table: TensorTable) -> TensorTable:
        """The ensemble's output columns for ``table``'s rows, as Merlin's executor gives them."""
        columns = TensorTable({name: table[name] for name in self.inputs}, _unsafe=True)
        for op, selection in self.steps:
            columns = op.transform(selection, columns)
        return columns


def why_not_a_chain(ensemble) -> Optional[str]:
    """Why ``ensemble``'s exported graph is not the lean chain; None when it is.

    The chain is the ensemble's inputs >> a compiled ``TransformWorkflow`` >>
    ``PredictT4RPyTorch`` >> ``DecodeItemIds``, each node with one parent and no other
    dependency (``DecodeItemIds`` itself refuses a parent without its ids column).
    """
    nodes = list(postorder_iter_nodes(ensemble.graph.output_node))
    found = [type(node.op).__name__ for node in nodes]
    expected = [op.__name__ for op in CHAIN]
    if len(nodes) != len(CHAIN) or not all(isinstance(n.op, op) for n, op in zip(nodes, CHAIN)):
        return f"its operators are {found}, not the chain {expected}"
    for parent, node in zip(nodes, nodes[1:]):
        if node.parents_with_dependencies != [parent]:
            return f"{type(node.op).__name__} reads more than its parent's columns"
    return None


def lean_chain(ensemble) -> Optional[LeanChain]:
    """A :class:`LeanChain` over ``ensemble``'s exported graph, or None when it is not one."""
    if why_not_a_chain(ensemble) is not None:
        return None
    nodes: List = list(postorder_iter_nodes(ensemble.graph.output_node))
    return LeanChain(nodes)
