"""``ferry.autograd``: ``torch.distributed.autograd``'s API over Ferry.

``import ferry.autograd as dist_autograd`` in place of ``import
torch.distributed.autograd as dist_autograd``::

    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)  # {t1: ..., t2: ...}

Inside a context, every ``ferry.rpc`` call (``rpc_sync``, ``rpc_async``,
``remote``, ``RRef.to_here``, and the calls the functions they run make
in turn) records a send function on the sender and a recv function on the
receiver for each tensor that requires grad, in the same libtorch graph
that ``torch`` builds; ``backward`` runs Ferry's distributed engine over
it (PyTorch's FAST mode) and returns when every worker that took part has
finished. Gradients accumulate per context, never in ``.grad``. Functions
that run on a callee run inside the caller's context.

Errors are ``RuntimeError``s with PyTorch's messages (an unknown context
id, nested contexts, a root that is not a scalar or does not require
grad, an error on another worker as ``Error on Node <rank>: ...``).
"""

from ferry import _ferry

_autograd = _ferry.autograd

__all__ = ["context", "backward", "get_gradients"]


class context:
    """A distributed autograd context, as ``with`` opens it: ``with
    ferry.autograd.context() as context_id:``. The ``with`` block's thread
    is inside the context; leaving the block releases the context on
    every worker that took part. Contexts do not nest on a thread."""

    def __init__(self):
        self._handle = None

    def __enter__(self):
        self._handle = _autograd.ContextHandle()
        return self._handle.id

    def __exit__(self, exc_type, exc_value, traceback):
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.release()
        return False


def backward(context_id, roots, retain_graph=False):
    """Runs the distributed backward pass of context ``context_id`` from
    ``roots`` (a list of scalar tensors that require grad, computed on
    this worker in that context), seeding each with 1, and returns when
    every worker the graph reaches has finished. Gradients of leaves
    accumulate in the context on the worker that holds them
    (``get_gradients``). ``retain_graph=True`` keeps the graph for another
    backward in the same context; otherwise a second one raises."""
    _autograd.backward(context_id, roots, bool(retain_graph))


def get_gradients(context_id):
    """The gradients that context ``context_id`` accumulated on this
    worker: a dict from each leaf tensor (the very tensor objects this
    worker holds, e.g. a module's parameters) to its gradient."""
    return _autograd.get_gradients(context_id)


class DistAutogradContext:
    """The context this thread is in, as ``_current_context()`` returns
    it (PyTorch's ``DistAutogradContext``)."""

    __slots__ = ("_id",)

    def __init__(self, context_id):
        self._id = context_id

    def _context_id(self):
        """The context's id."""
        return self._id

    def _send_functions(self):
        """The send functions this context recorded on this worker, by
        message id (increasing), as PyTorch's accessor returns them.

        Ferry records one per tensor that left requiring grad (PyTorch one
        ``SendRpcBackward`` per message): each is a :class:`SendFunction`
        whose ``next_functions`` is that tensor's gradient edge, where the
        gradient coming back from the receiver enters this worker's
        graph."""
        sends, _, _ = _autograd.context_info(self._id)
        return {message_id: SendFunction(t) for message_id, t in sends}

    def _recv_functions(self):
        """The recv functions this context recorded on this worker, by
        message id (increasing): for each tensor that arrived in the
        context, the autograd node its gradient reaches (Ferry's received
        tensor is a leaf: its ``AccumulateGrad``, from which the gradient
        goes back to the sender; PyTorch has a ``RecvRpcBackward`` node)."""
        _, recvs, _ = _autograd.context_info(self._id)
        return {
            message_id: _gradient_edge(leaf)[0] for message_id, _sender, leaf in recvs
        }

    def _known_worker_ids(self):
        """The ranks of the workers this context exchanged messages with
        (where its release goes)."""
        _, _, known = _autograd.context_info(self._id)
        return set(known)

    def __repr__(self):
        return f"DistAutogradContext(id={self._id})"


class SendFunction:
    """A send function of a context (``DistAutogradContext._send_functions``):
    a tensor that left this worker requiring grad. ``next_functions`` is
    ``((node, output_nr),)``, the tensor's gradient edge (its ``grad_fn``,
    or a leaf's ``AccumulateGrad``), as an autograd node lists the nodes
    its gradient flows to."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    @property
    def next_functions(self):
        return (_gradient_edge(self.tensor),)

    def name(self):
        """The kind of node, as autograd nodes name themselves."""
        return "ferry::autograd::SendFunction"

    def __repr__(self):
        return f"SendFunction(shape={tuple(self.tensor.shape)})"


def _gradient_edge(tensor):
    """``(node, output_nr)``: where ``tensor``'s gradient goes (its
    ``grad_fn``, or a leaf's ``AccumulateGrad``), as
    ``torch.autograd.graph.get_gradient_edge`` gives it for strided
    tensors; for a sparse leaf, which that cannot take (it views the
    tensor), the node a product of it lists first."""
    import torch

    if tensor.layout == torch.strided or tensor.grad_fn is not None:
        edge = torch.autograd.graph.get_gradient_edge(tensor)
        return (edge.node, edge.output_nr)
    with torch.enable_grad():
        return (tensor * 1).grad_fn.next_functions[0]


def _get_max_id():
    """The largest context id this worker can hand out: its rank in the top
    16 bits, a counter in the low 48 (PyTorch's ``_get_max_id``)."""
    return _autograd.max_context_id()


def _current_context():
    """The context this thread is inside (one it opened, or, in a function
    run by an RPC made inside a context, the caller's); raises
    ``RuntimeError`` outside any."""
    return DistAutogradContext(_autograd.current_context_id())


def _is_valid_context(context_id):
    """Raises ``RuntimeError`` (PyTorch's "Could not find autograd
    context") unless context ``context_id`` lives on this worker."""
    if not _autograd.is_valid_context(context_id):
        raise RuntimeError(f"Could not find autograd context with id: {context_id}")


def _retrieve_context(context_id):
    """The context ``context_id`` of this worker, as a
    ``DistAutogradContext``; raises ``RuntimeError`` if it does not live
    here."""
    _is_valid_context(context_id)
    return DistAutogradContext(context_id)


def _get_debug_info():
    """This worker's distributed autograd state, as PyTorch's
    ``_get_debug_info()`` names it (values are strings, as there):
    ``num_autograd_contexts``."""
    return {"num_autograd_contexts": str(len(_autograd.context_ids()))}


def _wait_until_no_contexts(timeout):
    """Waits until no distributed autograd context lives on this worker
    (each released here, by the worker that created it or by messages),
    at most ``timeout`` seconds; whether none is left."""
    return _autograd.wait_until_no_contexts(float(timeout))
