"""Engine replicas on Ray Serve, behind its HTTP proxy, routed by document affinity.

Design. Ray Serve's proxy speaks ASGI; the ragserve server is an aiohttp application.
Rather than port or fork the handlers, each replica runs the real application in-process:

- ``EngineReplica`` (:mod:`ragserve.cluster.replica`), one Ray Serve deployment per
  replica index (``replica-0`` … ``replica-{N-1}``, one replica each), builds the engine and
  ``create_app`` exactly as ``ragserve serve`` does and serves it with aiohttp on its own
  event loop thread, on a free port of its node. Its deployment methods only report that
  address, the process id and health.
- ``ClusterIngress`` (:mod:`ragserve.cluster.ingress`), the one deployment the proxy
  sees, takes every HTTP request, picks a replica with the router
  (:mod:`ragserve.cluster.router`) and forwards the request over HTTP to that replica's
  server, streaming the answer back chunk by chunk (server-sent events stay streamed).

NOTE: one deployment per index, not one deployment of N replicas: the router must name
the replica that holds a document, and a deployment handle picks replicas itself. Ray
Serve still owns each replica's life: it restarts one that dies, and the ingress asks the
new one for its address. The ingress counts the requests it has in flight on each
replica; that count is the load the router reads (exact while the ingress is one
replica, which it is).

NOTE: why not Ray Serve's custom request router: it chooses among the replicas of one
deployment inside a deployment handle, so the replicas would have to be reached through
handles, i.e. Ray's own transport instead of the real HTTP server, and the handlers would
need a second, non-aiohttp front. Routing in the ingress keeps one server code path and
streams over plain HTTP.

Replicas share the document registry through the remote KV tier's store
(``--kv-remote-url``: each replica publishes its rows there, see
:mod:`ragserve.server.store_registry`), or through a ``--registry-dir`` they all open (one
machine, or a shared filesystem), and share the KV in that store: a document uploaded
through one replica is learned by another at first use (or when listed), which then loads
its blocks from the store instead of computing them.
"""
