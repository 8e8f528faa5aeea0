"""The update log's record format: raw tensor bytes behind a JSON header, read back exactly.

Replay is exact only if a record gives back every tensor with its dtype, shape and bits and
the nesting of the node-state updates (dicts, lists, tuples, None); records written with
`torch.save` by earlier versions are still read.
"""

from __future__ import annotations

import torch

from tidegraph.recovery.updatelog import UpdateLog, drop_steps_before, logged_steps, read_step


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return (torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))  # fmt: skip
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _updates(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "rows": [[torch.randint(0, 99, (40,), generator=g), torch.randn(40, 7, generator=g),
                      torch.rand(40, generator=g, dtype=torch.float64)]],
            "events": [torch.arange(5), torch.arange(5), torch.rand(5, dtype=torch.float64), None],
            3: (torch.empty(0, 4), torch.tensor(True), torch.randn(3, generator=g).bfloat16()),
            ("a", 1): torch.tensor(2.5, dtype=torch.float16),
        }
        for _ in range(2)
    ]  # fmt: skip


def test_records_read_back_bitwise_with_their_nesting(tmp_path):
    log = UpdateLog(tmp_path, every=2)
    grad = torch.randn(1001)  # not a multiple of the 8-byte alignment
    want = {}
    for step in range(5):
        if log.wants(step):
            updates = _updates(step)
            log.record(step, grad, updates, loss=1 / 3 + step)
            want[step] = (grad.clone(), updates)
        grad.mul_(1.5)  # the buffer is reused by the next step: the record holds a copy
    log.close()
    assert logged_steps(tmp_path) == [0, 2, 4] and logged_steps(tmp_path, since=1) == [2, 4]
    assert log.records == 3 and log.bytes == sum(p.stat().st_size for p in tmp_path.iterdir())
    for step, (g, updates) in want.items():
        record = read_step(tmp_path, step)
        assert record["step"] == step and record["loss"] == 1 / 3 + step
        assert _same(record["grad"], g) and _same(record["updates"], updates)


def test_records_of_the_earlier_torch_save_format_are_read(tmp_path):
    old = {"step": 3, "grad": torch.randn(10), "updates": _updates(0), "loss": 0.5}
    torch.save(old, tmp_path / "step-000000003.pt")
    log = UpdateLog(tmp_path, every=1)
    log.record(4, torch.ones(3), [None], 0.25)
    log.close()
    (tmp_path / "step-000000005.tmp").write_bytes(b"half a record")  # never renamed in
    assert logged_steps(tmp_path) == [3, 4]
    assert _same(read_step(tmp_path, 3), old)
    assert _same(read_step(tmp_path, 4)["updates"], [None])
    # steps before a kept checkpoint's are dropped, whatever their format
    assert drop_steps_before(tmp_path, 4) == 1 and logged_steps(tmp_path) == [4]
    assert drop_steps_before(tmp_path / "none", 4) == 0
