"""Multi-neighbour state replication: the state stream, its wire, the donor and the joiner.

Modules, each with one job:

* :mod:`chaos.replication.state`: the canonical training-state stream (layout, digests);
* :mod:`chaos.replication.wire`: the typed, versioned shard messages and their checks;
* :mod:`chaos.replication.server`: the donor's shard server;
* :mod:`chaos.replication.donor_requests`: a joiner's requests to one donor (manifests, step logs);
* :mod:`chaos.replication.pull`: the joiner's parallel pull from several donors.

Import from the module that owns a name; this package re-exports nothing.
"""
