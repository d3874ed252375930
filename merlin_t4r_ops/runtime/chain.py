"""Run a linear serving chain directly: workflow, then model, then decoding.

Merlin's ``LocalExecutor`` walks the graph on every request: it resolves each node's
selector, merges and converts the parents' columns, and runs a parent again for every child.
For the endpoint most shops serve, raw sessions >> ``TransformWorkflow`` (compiled by
:mod:`merlin_t4r_ops.workflow`) >> ``PredictT4RPyTorch`` >> ``DecodeItemIds``, every node has one
parent and the walk is pure overhead. :class:`LeanChain` resolves the selections once and
calls the operators' ``transform`` one after the other, on the same ``TensorTable`` objects
the executor would hand them, so the answer and its errors are the executor's. The workflow
and the decoding are optional: the model alone (encoded sessions in, encoded ids out) is a
chain too.

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

# The chain's operators in order; the workflow and the decoding may be left out.
CHAIN = (SelectionOp, CompiledWorkflow, PredictT4RPyTorch, DecodeItemIds)
OPTIONAL = (CompiledWorkflow, DecodeItemIds)


class LeanChain:
    """The operators of a linear chain, run one after the other on a request's table.

    Parameters
    ----------
    nodes : list of merlin.dag.Node
        The chain's nodes, parents first: the input selection, the compiled workflow if any,
        the model and the decoder if any (see :func:`lean_chain`).

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
        self.names = [type(node.op).__name__ for node in nodes[1:]]
        self._last_op = nodes[-1].op
        ops = [node.op for node in nodes[1:]]
        self.decodes_in_graph = False
        if isinstance(ops[-1], DecodeItemIds):
            decoding = ops[-2].decoding_copy(ops[-1].vocabulary)
            if decoding is not None:  # the model's node runs the copy; the decoder's, nothing
                ops, self.decodes_in_graph = ops[:-2] + [decoding], True
        self.steps = [(op, node.input_columns.resolve(node.input_schema))
                      for op, node in zip(ops, nodes[1:])]

    @property
    def decodes(self) -> bool:
        """Whether the chain answers the shop's raw ids (it ends with ``DecodeItemIds``)."""
        return isinstance(self._last_op, DecodeItemIds)

    def transform(self, table: TensorTable) -> TensorTable:
        """The ensemble's output columns for ``table``'s rows, as Merlin's executor gives them."""
        columns = TensorTable({name: table[name] for name in self.inputs}, _unsafe=True)
        for op, selection in self.steps:
            columns = op.transform(selection, columns)
        return columns


def _fits_the_chain(ops) -> bool:
    """Whether ``ops`` are :data:`CHAIN`'s operators in order, optional ones perhaps left out."""
    position = 0
    for op in ops:
        while position < len(CHAIN) and not isinstance(op, CHAIN[position]):
            if CHAIN[position] not in OPTIONAL:
                return False
            position += 1
        if position == len(CHAIN):
            return False
        position += 1
    return all(kind in OPTIONAL for kind in CHAIN[position:])


def why_not_a_chain(ensemble) -> Optional[str]:
    """Why ``ensemble``'s exported graph is not a lean chain; None when it is.

    A chain is the ensemble's inputs >> a compiled ``TransformWorkflow`` (optional) >>
    ``PredictT4RPyTorch`` >> ``DecodeItemIds`` (optional), each node with one parent and no
    other dependency (``DecodeItemIds`` itself refuses a parent without its ids column).
    """
    nodes = list(postorder_iter_nodes(ensemble.graph.output_node))
    if not _fits_the_chain([node.op for node in nodes]):
        found = [type(node.op).__name__ for node in nodes]
        expected = [op.__name__ + (" (optional)" if op in OPTIONAL else "") for op in CHAIN]
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
