"""What runs only on the elected scheduler: commits, failure detection, plans, trainer registry.

The *scheduler* is the role of the node the members elect (see :mod:`chaos.daemon.election`);
:mod:`chaos.scheduling` is the pure shard-planner library it calls.
"""
