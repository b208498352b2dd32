"""The slim runtime reads artifacts and runs the cache's torch path on a machine without Triton."""

import subprocess
import sys

BLOCK_TRITON = (
    "import sys\n"
    "class _NoTriton:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'triton' or name.startswith('triton.'):\n"
    "            raise ImportError(f'{name} is blocked for this test')\n"
    "sys.meta_path.insert(0, _NoTriton())\n"
)


def test_artifact_and_cache_torch_path_import_and_run_without_triton():
    code = BLOCK_TRITON + (
        "import torch\n"
        "import runtime_kernels.artifact\n"
        "from runtime_kernels import DEFAULT_FORMAT, PagedKVCache, identity_artifact\n"
        "art = identity_artifact(1, 2, 4, 16, fmt=DEFAULT_FORMAT.with_(centered=False))\n"
        "fmt = art.kv_format.with_(page_size=16, sink_tokens=4, recent_tokens=8)\n"
        "cache = PagedKVCache.from_artifact(art, max_pages=8, max_seqs=1, fmt=fmt, dtype=torch.float32,\n"
        "                                   backend='torch')\n"
        "sid = cache.add_sequence()\n"
        "x = torch.randn(40, 2, 16)\n"
        "cache.append([sid], [[x]], [[x]])\n"
        "o = cache.decode_attention(0, torch.randn(1, 4, 16), [sid])\n"
        "assert o.shape == (1, 4, 16) and torch.isfinite(o).all()\n"
        "assert not any(m == 'triton' or m.startswith('triton.') for m in sys.modules)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_block_really_blocks_triton():
    """The hook must make `import triton` fail, or the test above would pass on a machine with Triton anyway."""
    out = subprocess.run([sys.executable, "-c", BLOCK_TRITON + "import triton\n"], capture_output=True, text=True)
    assert out.returncode != 0 and "blocked for this test" in out.stderr
