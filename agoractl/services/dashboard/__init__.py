"""The Dashboard (report §3.6.4): ``agoractl launch dashboard``, a FastAPI app with a JSON API under ``/api/`` and
a page at ``/`` for contributors and the public. It reads the Health Monitor's database (and the Authorizer's
``nodes`` table when it shares that database) and Prometheus, never the DHT; every API response is cached for
``dashboard.cache_s`` (ETag, 304). Imported only by ``agoractl launch dashboard`` (the ``services`` extra)."""
