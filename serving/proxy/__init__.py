"""The proxy: the fleet's only public ingress.

- :mod:`serving.proxy.router`: the OpenAI-compatible ASGI app in front of the vLLM replicas;
- :mod:`serving.proxy.routing`: its routing table and pure decisions (split, stickiness,
  ejection, least outstanding);
- :mod:`serving.proxy.access`: who may call it and how fast (product keys, a token bucket per key).
"""
