"""The prefill/decode proxy (same as the ``nopecache-pd-proxy`` entry point)::

    python examples/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

See ``nopecache/integrations/vllm/pd/proxy.py``; run it where vLLM (and so aiohttp) is
installed.
"""

from __future__ import annotations

from nopecache.integrations.vllm.pd.proxy import main

if __name__ == "__main__":
    main()
