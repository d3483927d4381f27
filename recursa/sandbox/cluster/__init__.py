"""REPLs on a Ray cluster (`sandbox="ray"`): the node side (node.py), the driver side (pool.py, and
link.py for its stream to each node, whose frames wire.py defines; relay.py carries that stream over
Ray actor calls where the driver cannot reach the node), and the driver's stand-in for one REPL
(sandbox.py). Ray is an optional extra, imported on first use."""

from recursa.sandbox.cluster.link import NodeLost
from recursa.sandbox.cluster.pool import node_hosts, shutdown_hosts
from recursa.sandbox.cluster.sandbox import RaySandbox

__all__ = ["NodeLost", "RaySandbox", "node_hosts", "shutdown_hosts"]
