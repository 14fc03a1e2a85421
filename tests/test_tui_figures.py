"""The dashboard's arithmetic (tui/figures.py) on plain stats maps."""
from __future__ import annotations

import pytest

from ridge.tui import feed
from ridge.tui import figures as F
from test_tui_harness import recorded_frames


def test_split_cells_fills_the_width_and_keeps_slivers_visible():
    assert F.split_cells([1, 1, 2], 8) == [2, 2, 4]
    assert sum(F.split_cells([3, 5, 7], 13)) == 13
    assert F.split_cells([1, 10_000, 0], 10) == [1, 9, 0]  # a non-zero sliver gets a cell, zero gets none
    assert F.split_cells([0, 0], 5) == [0, 0] and F.split_cells([1], 0) == [0]


def test_device_segments_sum_to_the_device():
    mem = {"device_total": 100, "weights": 10, "kv_pool": 30, "activations": 5, "reserve": 8, "device_free": 40}
    segs = {s.key: s.bytes for s in F.device_segments(mem)}
    assert segs == {"weights": 10, "kv": 30, "act": 5, "other": 15, "reserve": 8, "free": 32}
    assert sum(segs.values()) == 100
    host = F.host_segments({"host_total": 100, "host_available": 60, "host_rss": 25})
    assert [(s.key, s.bytes) for s in host] == [("ridge", 25), ("other", 15), ("free", 60)]


def test_kv_forecast_is_free_blocks_over_blocks_per_request():
    st = {"kv_blocks_total": 1000, "kv_blocks_used": 300, "kv_blocks_free": 700, "kv_blocks_cached": 50,
          "kv_block_size": 16, "kv_bytes_per_token": 46080}
    kv = F.kv_figures(st, 8192)
    assert (kv.context, kv.fits, kv.empty) == (4096, 700 // 256, 650)  # 4096 tokens = 256 blocks of 16
    assert kv.free_bytes == 700 * 16 * 46080
    short = F.kv_figures(st, 256)  # a model whose context is below 4K: the forecast uses its own
    assert (short.context, short.fits) == (256, 700 // 16)
    assert F.context_label(4096) == "4K" and F.context_label(256) == "256"


def test_throughput_counts_token_deltas_and_nothing_across_a_restart():
    tp = F.Throughput()
    tp.add(100.0, 1, {"prefill_tokens": 1000, "decode_tokens": 500}, 0, 0)  # the first sample counts nothing
    tp.add(101.0, 1, {"prefill_tokens": 1100, "decode_tokens": 530}, 0, 0)
    tp.add(102.0, 1, {"prefill_tokens": 1100, "decode_tokens": 560}, 0, 0)
    tp.add(103.0, 2, {"prefill_tokens": 7, "decode_tokens": 3}, 0, 0)  # a new daemon (pid 2): reset
    tp.add(104.0, 2, {"prefill_tokens": 7, "decode_tokens": 33}, 12.5, 30.0)
    prefill, decode = tp.series(60)
    width = 60 / len(decode.points)
    assert sum(prefill.points) * width == pytest.approx(100)
    assert sum(decode.points) * width == pytest.approx(90)
    assert (prefill.current, decode.current) == (12.5, 30.0)
    assert decode.peak == pytest.approx(30 / width) and decode.average == pytest.approx(90 / 4)


def test_throughput_takes_a_snapshot_that_arrives_out_of_time_order():
    """A CI run drew the series from a deque whose newest sample was older than one before it."""
    tp = F.Throughput()
    tp.add(100.0, 1, {"prefill_tokens": 0, "decode_tokens": 0}, 0, 0)
    tp.add(101.2, 1, {"prefill_tokens": 10, "decode_tokens": 20}, 0, 0)
    tp.add(100.9, 1, {"prefill_tokens": 10, "decode_tokens": 50}, 0, 0)  # late: counted at 101.2
    prefill, decode = tp.series(60)
    width = 60 / len(decode.points)
    assert sum(decode.points) * width == pytest.approx(50) and sum(prefill.points) * width == pytest.approx(10)
    assert [t for t, _, _ in tp.samples] == sorted(t for t, _, _ in tp.samples)


def test_recorded_frames_decode_through_the_protocol():
    frames = recorded_frames()
    assert len(frames) >= 60
    seqs = [f.reply["seq"] for f in frames]
    assert seqs == sorted(seqs)
    busy = [f for f in frames if f.reply["stats"]["running"] > 0 and f.reply["stats"]["waiting"] > 0]
    assert busy and frames[-1].reply["stats"]["speculative"]["proposer"] == "ngram"


def test_record_then_replay_gives_the_same_frames(tmp_path):
    frames = recorded_frames()[:5]
    out = tmp_path / "rec.msgpack"
    for f in frames:
        feed.record(out, f.raw)
    assert [f.reply for f in feed.replay(out)] == [f.reply for f in frames]
