"""The per-program timeline summary of `bench/program_timeline.py` on hand-made records (start ns, end ns, SM, kind),
against numbers worked out by hand."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import program_timeline  # noqa: E402


def test_summary_of_a_hand_made_wave():
    # Two SMs with two slots each. History programs: SM 0 runs [0, 100] and [0, 50], SM 1 runs [10, 60]; a window
    # program runs [50, 90] on SM 1, and an odd-page tail program (kind 2, counted with the history) [20, 80] on SM 1.
    rec = torch.tensor([[1000, 1100, 0, 0], [1000, 1050, 0, 0], [1010, 1060, 1, 0], [1050, 1090, 1, 1],
                        [1020, 1080, 1, 2]])
    s = program_timeline.summarize(rec, slots_per_sm=2, n_sm=2)
    assert s["history_programs"] == 4 and s["window_programs"] == 1
    assert s["history_span_us"] == pytest.approx(0.1)
    assert s["history_start_last_us"] == pytest.approx(0.02)
    assert s["history_duration_us"] == pytest.approx({"mean": 0.065, "min": 0.05, "max": 0.1})
    assert s["history_end_us"]["first"] == pytest.approx(0.05)
    assert s["history_end_us"]["last"] == pytest.approx(0.1)
    # Busy 100 + 50 + 50 + 60 = 260 ns of 2 SMs x 2 slots x 100 ns.
    assert s["history_idle_share"] == pytest.approx(1 - 260 / 400)
    assert s["window"] == pytest.approx({"first_start_us": 0.05, "end_us": 0.09, "tail_after_history_us": 0.0,
                                         "mean_duration_us": 0.04})
    assert s["sm_last_end_us"] == pytest.approx({"min": 0.08, "median": 0.1, "max": 0.1})


def test_a_window_tail_after_the_history_wave_is_reported():
    rec = torch.tensor([[0, 100, 0, 0], [100, 130, 0, 1]])
    s = program_timeline.summarize(rec, slots_per_sm=1, n_sm=1)
    assert s["window"]["tail_after_history_us"] == pytest.approx(0.03)
    assert s["history_idle_share"] == pytest.approx(0.0)
