"""What tests (and benchmarks and demos) share; no test module imports another.

Fixture modules are registered once, in tests/conftest.py (``pytest_plugins``).

    server_harness     the gRPC server in process, block builders, ``harness`` (fixture)
    tenants            a server with tenants, channels that send bearer tokens
    bulk_wire          the bulk byte stream seen from the socket
    tls_ca             a throwaway CA issuing server and client certificates
    client_harness     the tiny model CacheClient tests store and fetch
    shm_client         the tiny model of the shared-memory tests (and their child processes)
    vllm_halves        the vLLM connector's two halves without vLLM
    waiting            one ``wait_until`` for async tests
    server_procs       cache server processes (fixtures)
    redis_procs        Redis processes (fixtures)
    engine_proc        a vLLM engine process
    machine            cores (round robin) and free memory for engines
    connector_prompts, demo_output, hf_store, local_model, sass_probe: see each module
"""
