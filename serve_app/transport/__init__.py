"""Between the ingress and the engine replicas: the engine client, streams, delta channels and
queues, the router, rejections."""
