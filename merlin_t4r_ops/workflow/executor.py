"""Run a compiled workflow graph the way Merlin's ``LocalExecutor`` does, without its overhead.

``LocalExecutor`` re-resolves selectors, converts formats and re-runs a shared parent for
every child, on every call: at one session that is most of the fast path's time. Here each
node's selection and extra root columns are resolved once, every node runs once per call
(its output is the same for every child), and columns travel as a ``TensorTable``. The
merging of parents' columns is ``LocalExecutor._merge_upstream_columns``'s, so each op sees
the columns, in the order, it sees under Merlin.
"""

from merlin.dag import postorder_iter_nodes
from merlin.table import TensorTable


class GraphPlan:
    """The nodes of a graph in execution order, with what each reads resolved."""

    def __init__(self, output_node):
        self.nodes = list(postorder_iter_nodes(output_node))  # parents before children
        self.output_node = output_node
        self.output_names = list(dict.fromkeys(output_node.output_schema.column_names))
        self.steps = [_Step(node, self.nodes) for node in self.nodes]

    def transform(self, table: TensorTable) -> TensorTable:
        """The output node's columns for ``table``'s rows."""
        outputs = []
        for step in self.steps:
            outputs.append(step.run(table, outputs))
        last = outputs[-1]
        return TensorTable({name: last[name] for name in self.output_names}, _unsafe=True)


class _Step:
    def __init__(self, node, order):
        self.op = node.op
        self.parents = [order.index(parent) for parent in node.parents_with_dependencies]
        self.inputs = list(dict.fromkeys(node.input_schema.column_names))
        # Merlin takes a dependency's columns from the request unless the node's own input
        # columns, found upstream, already hold them.
        self.wanted = list(dict.fromkeys([*self.inputs, *node.dependency_columns.names]))
        self.selection = node.input_columns.resolve(node.input_schema) if node.op else None

    def run(self, table, outputs):
        upstream = [outputs[i] for i in self.parents if len(outputs[i]) > 0]
        present = {name for columns in upstream for name in self.inputs if name in columns}
        root = [name for name in self.wanted if name not in present]
        if root:
            upstream.append({name: table[name] for name in root})
        merged = TensorTable(_merge(upstream), _unsafe=True)
        return merged if self.op is None else self.op.transform(self.selection, merged)


def _merge(upstream):
    """``LocalExecutor._merge_upstream_columns`` on dicts: later parents win on overlap."""
    combined = {}
    for columns in upstream:
        if not combined:
            combined = dict(columns.items())
            continue
        new = dict(columns.items())
        combined = {**{k: v for k, v in combined.items() if k not in new},
                    **{k: v for k, v in new.items() if k in combined},
                    **{k: v for k, v in new.items() if k not in combined}}
    return combined
