"""Node-state rows from shards as int8 (`comm.rows_int8` with `cluster.memory: sharded`):
float tables of rows (TGN's memory) travel as int8 codes with a scale per row, times and
flags as they are; in-process and actor shards send the same codes, so the local and the Ray
group still compute the same bits."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tidegraph.training import RunConfig, load_stream
from tidegraph.training.state import decode_state_rows, encode_state_rows

sys.path.insert(0, str(Path(__file__).parent))
import reference_run  # noqa: E402
from test_comm_wiring import run, same_history, same_state  # noqa: E402


def test_float_tables_go_int8_within_half_a_step_and_the_rest_exactly():
    g = torch.Generator().manual_seed(0)
    rows = {
        "memory": torch.randn(6, 64, generator=g) * torch.rand(6, 1, generator=g) * 5,
        "mail": torch.randn(6, 3, 8, generator=g),  # [N, slots, D]: a scale per slot row
        "last_update": torch.rand(6, dtype=torch.float64, generator=g) * 1e9,
        "has_msg": torch.rand(6, generator=g) > 0.5,
        "empty": torch.zeros(0, 8),
    }
    rows["memory"][2] = 0.0
    sent = encode_state_rows(rows)
    assert sent["memory"][0].dtype == torch.int8 and sent["memory"][1].shape == (6,)
    assert sent["mail"][0].shape == (18, 8)
    got = decode_state_rows(sent)
    for name in ("last_update", "has_msg", "empty"):
        assert torch.equal(got[name], rows[name]), name
    for name in ("memory", "mail"):
        x, y = rows[name], got[name]
        assert y.shape == x.shape and y.dtype == x.dtype
        half_step = x.abs().amax(dim=-1, keepdim=True) / 254
        assert ((y - x).abs() <= half_step * (1 + 1e-6)).all(), name
    assert torch.equal(got["memory"][2], torch.zeros(64))
    wire = lambda r: sum(v.numel() * v.element_size() for v in r)  # noqa: E731
    assert wire(sent["memory"][:2]) < 0.27 * wire([rows["memory"]])  # (64 + 4) / 256


def _config(backend: str, rows_int8: bool) -> RunConfig:
    raw = reference_run.reference_config("tgn")
    raw["model"].update(dim=32, memory_dim=32)
    raw["model"]["slot_precision"] = "fp32"
    raw["cluster"] = {"backend": backend, "shards": 2, "trainers": 2, "memory": "sharded"}
    raw["comm"] = {"rows_int8": rows_int8}
    raw["run_name"] = "tidegraph-rows-int8-test"
    return RunConfig.from_dict(raw)


def test_sharded_memory_rows_int8_local_and_ray_agree_and_stay_close(ray_session):
    wiki = load_stream("wikipedia", 1500)
    remote = run(_config("ray", True), wiki)
    local = run(_config("local", True), wiki)
    assert same_state(local[0], remote[0]) and same_history(local[1], remote[1])
    assert same_state(remote[3][0], remote[3][1])
    exact = run(_config("local", False), wiki)
    assert not same_history(exact[1], local[1])  # the memory rows were rounded
    aps = lambda h: [r["ap"] for r in h if r["phase"] == "increment"]  # noqa: E731
    for a, b in zip(aps(exact[1]), aps(local[1]), strict=True):
        assert abs(a - b) < 0.02
