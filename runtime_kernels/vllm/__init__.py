"""vLLM integration: serve OSCAR artifacts with a 2-bit KV cache through vLLM's plugin API (docs/vllm.md).

- `layout`: the packed INT2 bytes of a vLLM block and their views as the kernels' pools (no vLLM import);
- `engine`: one step of the three-segment cache on vLLM's blocks: write, decode and prefill attention
  (no vLLM import, tested against `PagedKVCache` / `OscarCache`);
- `config`: the `oscar` entry of vLLM's `--additional-config` and the artifact load;
- `backend`, `plugin`: the vLLM classes and the `vllm.general_plugins` entry point (import vLLM).
"""
