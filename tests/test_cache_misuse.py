"""Issue 54 items 3, 8, 9: misuse of the paged cache and the serve config is refused with one clear error.

`decode_step` / `write_layer` / `decode_attention` refuse a layer of `True`, duplicated seq_ids, a plan of another
cache, a plan applied twice (where that would corrupt the cache) or out of order, and a NaN sm_scale, before
anything is written; `PagedKVCache` refuses max_pages it cannot address and windows beyond the process's own memory
limit (ulimit -v, cgroup) with CacheTooLargeError, not the allocator's raw error; the vLLM serve config bounds its
numbers.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from format_helpers import served
from test_cache import HQ, D, H, P, R, S, random_artifact

from runtime_kernels.cache import PagedKVCache
from runtime_kernels.memory_budget import CacheTooLargeError, available_with_source

ROOT = Path(__file__).resolve().parents[1]


def make(art=None, **kw):
    art = art or random_artifact(num_layers=2)
    return PagedKVCache.from_artifact(art, max_pages=kw.pop("max_pages", 32), max_seqs=4, fmt=served(art, P, S, R),
                                      dtype=torch.float32, backend="torch", **kw)


def windows(cache):
    return [(p.k_win.clone(), p.v_win.clone(), p.k_codes.clone()) for p in cache.pools]


def unchanged(before, cache):
    return all(torch.equal(a, b) for old, pool in zip(before, cache.pools)
               for a, b in zip(old, (pool.k_win, pool.v_win, pool.k_codes)))


@pytest.fixture
def primed():
    cache = make()
    gen = torch.Generator().manual_seed(0)
    ids = [cache.add_sequence(), cache.add_sequence()]
    prompt = [[torch.randn(n, H, D, generator=gen) for n in (5, 7)] for _ in range(2)]
    cache.append(ids, prompt, prompt)
    return cache, ids, gen


def step(cache, ids, gen):
    plan = cache.plan_append(ids, [1] * len(ids))
    x = torch.randn(len(ids), H, D, generator=gen)
    q = torch.randn(len(ids), HQ, D, generator=gen)
    return plan, x, q


MISUSE = {
    "layer True": (lambda c, plan, q, x, ids: c.decode_step(True, plan, q, x, x, ids), TypeError,
                   "layer: expected an integer layer index, got True"),
    "layer 1.0": (lambda c, plan, q, x, ids: c.decode_step(1.0, plan, q, x, x, ids), TypeError,
                  "layer: expected an integer layer index"),
    "duplicated seq_ids": (lambda c, plan, q, x, ids: c.decode_step(0, plan, torch.cat([q[:1], q[:1]]), x, x,
                                                                    [ids[0], ids[0]]), ValueError,
                           "seq_ids: duplicate ids"),
    "NaN sm_scale": (lambda c, plan, q, x, ids: c.decode_step(0, plan, q, x, x, ids, sm_scale=float("nan")),
                     ValueError, "sm_scale: expected a finite positive softmax scale"),
    "negative sm_scale": (lambda c, plan, q, x, ids: c.decode_attention(0, q, ids, sm_scale=-1.0), ValueError,
                          "sm_scale: expected a finite positive"),
    "a plan from another cache": (lambda c, plan, q, x, ids: c.decode_step(0, _foreign_plan(ids), q, x, x, ids),
                                  ValueError, "plan: booked by another cache"),
    "not a plan": (lambda c, plan, q, x, ids: c.write_layer(0, "plan", x, x), TypeError,
                   "plan: expected an AppendPlan"),
}


def _foreign_plan(ids):
    other = make()
    for _ in ids:
        other.add_sequence()
    other.append(ids, [[torch.zeros(5, H, D), torch.zeros(7, H, D)]] * 2, [[torch.zeros(5, H, D),
                                                                              torch.zeros(7, H, D)]] * 2)
    return other.plan_append(ids, [1] * len(ids))


@pytest.mark.parametrize("case", list(MISUSE))
def test_decode_misuse_is_refused_before_anything_is_written(case, primed):
    cache, ids, gen = primed
    plan, x, q = step(cache, ids, gen)
    call, exc, message = MISUSE[case]
    before = windows(cache)
    with pytest.raises(exc, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(cache, plan, q, x, ids)
    assert unchanged(before, cache)
    out = cache.decode_step(0, plan, q, x, x, ids)  # the same step, used rightly, goes through
    assert torch.isfinite(out).all()


def test_a_plan_that_moves_rows_is_refused_the_second_time_and_stale_plans_always(primed):
    cache, ids, gen = primed
    plans = []
    while True:  # step until a plan demotes a page (gathers and moves window rows)
        plan, x, q = step(cache, ids, gen)
        for layer in range(cache.num_layers):
            cache.write_layer(layer, plan, x, x)
        plans.append((plan, x))
        if not plan.append_only:
            break
    before = windows(cache)
    with pytest.raises(ValueError, match="plan: already applied to layer 1"):
        cache.write_layer(1, plan, x, x)
    old, x_old = plans[0]
    with pytest.raises(ValueError, match=r"plan: layer 0 already applied a later plan \(step"):
        cache.write_layer(0, old, x_old, x_old)
    assert unchanged(before, cache)
    # An append-only step re-applied rewrites the same rows (what benchmarks and graph replays do): allowed.
    plan, x, q = step(cache, ids, gen)
    assert plan.append_only
    first = cache.decode_step(0, plan, q, x, x, ids)
    again = cache.decode_step(0, plan, q, x, x, ids)
    assert torch.equal(first, again)


def test_max_pages_it_cannot_address_is_one_value_error_not_a_memory_error():
    for bad in (10**12, 0, True):
        with pytest.raises((ValueError, CacheTooLargeError), match="max_pages: expected an integer in"):
            make(max_pages=bad)


def test_the_process_limit_is_the_budget_when_smaller(monkeypatch):
    """RLIMIT_AS below MemAvailable: the budget is the limit less what the process maps, and it is named."""
    import resource

    host = available_with_source(torch.device("cpu"))
    assert host is not None
    real = resource.getrlimit
    limit = 1 << 34  # 16 GiB of address space

    def fake(which):
        return (limit, resource.RLIM_INFINITY) if which == resource.RLIMIT_AS else real(which)

    monkeypatch.setattr(resource, "getrlimit", fake)
    with open("/proc/self/status", encoding="ascii") as handle:
        vm = next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmSize:"))
    free, source = available_with_source(torch.device("cpu"))
    if limit - vm < host[0]:
        assert source == "RLIMIT_AS (ulimit -v)" and abs(free - (limit - vm)) < 64 << 20


def test_windows_beyond_ulimit_v_are_one_line_not_the_allocators_error(tmp_path):
    """A real `ulimit -v`: a cache whose windows need 3 GiB under a limit that leaves ~1-2 GiB, in a child process."""
    script = textwrap.dedent(f"""
        import resource, sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
        import torch
        from format_helpers import served
        from test_cache import random_artifact, P
        from runtime_kernels.cache import PagedKVCache
        from runtime_kernels.memory_budget import CacheTooLargeError
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.RLIM_INFINITY))
        art = random_artifact(num_layers=2)
        try:
            PagedKVCache.from_artifact(art, max_pages=8, max_seqs=4096, fmt=served(art, P, 4096, 8192),
                                       dtype=torch.float32, backend="torch")
        except CacheTooLargeError as exc:
            print("REFUSED", exc)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "REFUSED" in run.stdout and "RLIMIT_AS (ulimit -v)" in run.stdout, run.stdout + run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("raw, message", [
    ({"window_reserve": 1e308}, "window_reserve: Input should be less than or equal to 64"),
    ({"window_reserve": 0.5}, "window_reserve: Input should be greater than or equal to 1"),
    ({"layers": [-1]}, "layers.0: Input should be greater than or equal to 0"),
    ({"layers": [10**12]}, "layers.0: Input should be less than or equal to 4095"),
    ({"model_id": "x" * 5000}, "model_id: String should have at most 4096 characters"),
    ({"expected_sha256": {f"f{i}": "a" * 64 for i in range(300)}}, "expected_sha256: Dictionary should have at most"),
])
def test_serve_config_numbers_are_bounded(raw, message):
    from runtime_kernels.vllm.config import parse_oscar_config

    with pytest.raises(ValueError) as info:
        parse_oscar_config({"oscar": {"path": "zoo/demo", **raw}})
    assert f"additional_config.oscar.{message}" in str(info.value) and "\n" not in str(info.value)


# --- issue 54 item 3: a forged mean is refused against the data, whatever the recorded eigenvalues say ---------------
def _centered(mean_scale: float, eig: float, h: int = 2, d: int = 16, seed: int = 0):
    from format_helpers import PAPER, restamp

    from runtime_kernels.artifact import identity_artifact

    gen = torch.Generator().manual_seed(seed)
    art = identity_artifact(1, h, 4, d, model_id="tiny/m", fmt=PAPER)
    direction = torch.randn(1, h, d, generator=gen)
    mu = direction / direction.norm(dim=-1, keepdim=True) * mean_scale * d ** 0.5  # data RMS norm is sqrt(d)
    art.k_mean, art.v_mean = mu.clone(), torch.zeros(1, h, d)
    art.k_eigenvalues = art.v_eigenvalues = torch.full((1, h, d), eig)
    art = restamp(art)
    art.validate()  # the load-time bound, relative to the recorded eigenvalues, lets it through
    fmt = PAPER.with_(sink_tokens=4, recent_tokens=8, centered=True)
    return PagedKVCache(art.k_rotation, art.v_rotation, art.k_clip_ratio, art.v_clip_ratio, fmt=fmt, max_pages=16,
                        max_seqs=2, backend="torch", k_mean=art.k_mean, v_mean=art.v_mean), gen


@pytest.mark.parametrize("scale", [10.0, 100.0])
def test_a_forged_mean_far_from_the_data_is_refused_at_the_first_prefill(scale):
    from runtime_kernels.artifact import ArtifactError

    cache, gen = _centered(scale, eig=1e10)  # eigenvalues x 1e10: the recorded spread says anything goes
    sid = cache.add_sequence()
    data = torch.randn(64, 2, 16, generator=gen)  # the model's keys: mean ~0, RMS norm ~4
    before = windows(cache)
    with pytest.raises(ArtifactError, match=r"field 'k_mean': \|mean\| = .* at layer 0, KV head \d is (\d+\.?\d*) x "
                                            r"the root mean square norm"):
        cache.append([sid], [[data]], [[data]])
    assert cache.seq_len(sid) == 0 and unchanged(before, cache)
    # The layer-by-layer path (transformers' attention): refused there too, the step's sequences marked broken.
    plan = cache.plan_append([sid], [64])
    with pytest.raises(ArtifactError, match="field 'k_mean'"):
        cache.write_layer(0, plan, data, data)
    with pytest.raises(ValueError, match="had a write refused"):
        cache.plan_append([sid], [1])


def test_a_mean_the_data_has_is_accepted_and_checked_once():
    cache, gen = _centered(3.0, eig=1.0)  # |mu| = 3 x the noise's RMS norm: the data below really has that mean
    sid = cache.add_sequence()
    mu = cache.pools[0].k_mean[None]  # rotated basis = model basis (identity rotations)
    data = torch.randn(64, 2, 16, generator=gen) + mu
    cache.append([sid], [[data]], [[data - mu]])
    assert cache._means_checked == {0} and cache.seq_len(sid) == 64


@pytest.mark.parametrize("name", ["k_mean", "v_mean"])
def test_a_forged_mean_is_refused_at_load_by_the_sides_own_rms_whatever_the_eigenvalues(name):
    """With `calibration.kv_rms` (every calibration records it), a mean at 10x the side's own RMS norm is refused
    when the artifact is read, even with the recorded eigenvalues x 1e10 (which lift the spread bound)."""
    import json

    from format_helpers import PAPER, restamp

    from runtime_kernels.artifact import ArtifactError, identity_artifact
    from runtime_kernels.contract import OWN_RMS_RATIO

    a, h, d = 2, 2, 16
    art = identity_artifact(a, h, 4, d, model_id="tiny/m", fmt=PAPER)
    gen = torch.Generator().manual_seed(1)
    direction = torch.randn(a, h, d, generator=gen)
    unit = direction / direction.norm(dim=-1, keepdim=True)
    rms = 4.0  # the data's own RMS norm, as a calibration records it
    art.metadata["calibration"] = json.dumps({"kv_rms": {"k": [[rms] * h] * a, "v": [[rms] * h] * a}})
    art.k_eigenvalues = art.v_eigenvalues = torch.full((a, h, d), 1e10)
    art.k_mean, art.v_mean = unit * rms * 0.9, unit * rms * 0.9  # honest: inside the data's own norm
    restamp(art).validate()
    setattr(art, name, unit * rms * 10)  # forged: 10x
    with pytest.raises(ArtifactError, match=rf"field '{name}': \|mean\| = 40 at layer row 0, KV head 0 is more than "
                                            rf"{OWN_RMS_RATIO:g} x the RMS norm 4 of that side's own data"):
        restamp(art).validate()
    art.metadata["calibration"] = json.dumps({"kv_rms": {"k": [[rms] * h] * a, "v": [[-1.0] * h] * a}})
    with pytest.raises(ArtifactError, match=r"field 'calibration.kv_rms.v': expected 2 rows of 2 positive numbers"):
        restamp(art).validate()
