"""Feature stores: the host store against the in-memory fake, precisions and their error."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegraph.storage.features import (
    PRECISIONS,
    FeatureConfig,
    HostFeatureStore,
    InMemoryFeatureStore,
    decode,
    encode,
    quantization_error,
)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ---- encoding -------------------------------------------------------------------------------


def test_fp32_round_trip_is_exact():
    x = torch.randn(20, 7)
    assert torch.equal(decode(encode(x, "fp32")), x)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_lower_precision_error_is_bounded(precision, stochastic):
    x = torch.randn(200, 32)
    gen = torch.Generator().manual_seed(0)
    err = (decode(encode(x, precision, stochastic, gen)) - x).abs()
    if precision == "int8":  # at most one quantization step of the row's scale
        step = x.abs().amax(1, keepdim=True) / 127
        assert bool((err <= step * (1 + 1e-5)).all())
    else:  # within one unit in the last place, relative
        eps = {"fp16": 2**-10, "bf16": 2**-7}[precision]
        assert bool((err <= x.abs() * eps + 1e-6).all())


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_stochastic_rounding_is_unbiased(precision):
    x = torch.randn(1, 64).expand(4000, 64).contiguous()
    x[:, 0] = 1.0  # keep the int8 scale away from the tested values
    gen = torch.Generator().manual_seed(1)
    mean = decode(encode(x, precision, True, gen)).mean(0)
    nearest = decode(encode(x[:1], precision, False)).squeeze(0)
    bias = (mean - x[0]).abs()
    assert bool((bias <= 0.02 * x[0].abs().clamp(min=0.05)).all())
    assert (mean - x[0]).abs().mean() < (nearest - x[0]).abs().mean()


def test_int8_zero_rows_and_zero_width():
    assert torch.equal(decode(encode(torch.zeros(3, 4), "int8")), torch.zeros(3, 4))
    assert decode(encode(torch.zeros(3, 0), "int8")).shape == (3, 0)


def test_quantization_error_report():
    x = torch.randn(500, 172)
    assert quantization_error(x, "fp32")["rmse"] == 0.0
    errs = [quantization_error(x, p)["relative_rmse"] for p in ("fp16", "bf16", "int8")]
    assert 0 < errs[0] < errs[1] < errs[2] < 0.05


# ---- host store -----------------------------------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
def test_host_store_reads_back_what_was_written(precision):
    store = HostFeatureStore(dim=5, precision=precision, seed=3)
    x = torch.randn(10, 5)
    assert torch.equal(store.append(x), torch.arange(10))
    expected = decode(encode(x, precision, True, torch.Generator().manual_seed(3)))
    got = store.get(ids(9, 0, 9, 4))
    assert torch.allclose(got, expected[[9, 0, 9, 4]])
    assert store.num_rows == 10
    if precision == "fp32":
        assert torch.equal(got, x[[9, 0, 9, 4]])


def test_missing_rows_read_as_default_not_error():
    store = HostFeatureStore(dim=3, default=-1.5)
    assert torch.equal(store.get(ids(0, 7)), torch.full((2, 3), -1.5))
    store.put(ids(4), torch.ones(1, 3))
    got = store.get(ids(2, 4, 100))
    assert torch.equal(got, torch.tensor([[-1.5] * 3, [1.0] * 3, [-1.5] * 3]))
    assert store.num_rows == 5


def test_zero_width_store():
    store = HostFeatureStore(dim=0)
    store.append(torch.empty(4, 0))
    assert store.get(ids(0, 3, 10)).shape == (3, 0)
    assert store.row_bytes == 0


def test_empty_requests():
    store = HostFeatureStore(dim=3)
    assert store.get(ids()).shape == (0, 3)
    store.put(ids(), torch.empty(0, 3))
    assert store.num_rows == 0


def test_duplicate_ids_in_put_last_write_wins():
    store = HostFeatureStore(dim=2)
    store.put(ids(3, 1, 3), torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]))
    assert torch.equal(store.get(ids(3, 1)), torch.tensor([[3.0, 3.0], [2.0, 2.0]]))


def test_growth_keeps_rows():
    store = HostFeatureStore(dim=2)
    x = torch.randn(3000, 2)
    for lo in range(0, 3000, 700):
        store.append(x[lo : lo + 700])
    assert torch.equal(store.get(torch.arange(3000)), x)


def test_bad_input_is_named():
    store = HostFeatureStore(dim=2)
    with pytest.raises(ValueError, match="position 1 is negative"):
        store.get(ids(0, -4))
    with pytest.raises(ValueError, match="shape"):
        store.put(ids(0), torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"row 1 \(id 8\)"):
        store.put(ids(7, 8), torch.tensor([[0.0, 0.0], [float("nan"), 0.0]]))
    with pytest.raises(ValueError, match="1-D integer"):
        store.get(torch.tensor([0.5]))


@pytest.mark.parametrize(
    "kwargs, field",
    [({"dim": -1}, "dim"), ({"dim": 2, "precision": "int4"}, "precision"),
     ({"dim": 2, "default": float("nan")}, "default")],
)  # fmt: skip
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"FeatureConfig.{field}"):
        FeatureConfig(**kwargs)


def test_error_stats():
    exact = HostFeatureStore(dim=8)
    exact.append(torch.randn(50, 8))
    assert exact.error_stats()["max_abs_error"] == 0.0
    low = HostFeatureStore(FeatureConfig(dim=8, precision="int8"))
    low.append(torch.randn(50, 8))
    report = low.error_stats()
    assert report["rows"] == 50 and 0 < report["relative_rmse"] < 0.02


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_state_dict_round_trip(precision):
    store = HostFeatureStore(dim=4, precision=precision)
    store.append(torch.randn(30, 4))
    copy = HostFeatureStore(dim=4, precision=precision)
    copy.load_state_dict(store.state_dict())
    assert torch.equal(copy.get(torch.arange(35)), store.get(torch.arange(35)))
    assert copy.error_stats() == store.error_stats()
    copy.append(torch.randn(2, 4))
    assert copy.num_rows == 32


def test_fetch_reports_encoded_bytes():
    store = HostFeatureStore(dim=10, precision="int8")
    store.append(torch.randn(5, 10))
    rows = store.fetch(ids(0, 1, 2))
    assert rows.data.dtype == torch.int8
    assert rows.nbytes == 3 * store.row_bytes == 3 * (10 + 4)


@pytest.mark.gpu
def test_pinned_store_fetches_into_pinned_memory():
    store = HostFeatureStore(dim=4, pin_memory=True)
    store.append(torch.randn(10, 4))
    assert store.fetch(ids(1, 2)).data.is_pinned()


# ---- fake -----------------------------------------------------------------------------------

_writes = st.lists(
    st.tuples(st.lists(st.integers(0, 40), max_size=8), st.integers(0, 2**16)), max_size=6
)


@settings(max_examples=40, deadline=None)
@given(writes=_writes, reads=st.lists(st.integers(0, 60), max_size=20))
def test_host_store_matches_fake(writes, reads):
    host, fake = HostFeatureStore(dim=3, default=0.5), InMemoryFeatureStore(dim=3, default=0.5)
    for where, seed in writes:
        rows = torch.randn(len(where), 3, generator=torch.Generator().manual_seed(seed))
        host.put(ids(*where), rows)
        fake.put(ids(*where), rows)
    assert host.num_rows == fake.num_rows
    assert torch.equal(host.get(ids(*reads)), fake.get(ids(*reads)))


def test_fake_records_fetches_and_appends():
    fake = InMemoryFeatureStore(dim=2)
    assert torch.equal(fake.append(torch.ones(3, 2)), torch.arange(3))
    fake.get(ids(2, 0))
    assert [f.tolist() for f in fake.fetched] == [[2, 0]]
    copy = InMemoryFeatureStore(dim=2)
    copy.load_state_dict(fake.state_dict())
    assert torch.equal(copy.get(torch.arange(4)), fake.get(torch.arange(4)))


def test_values_beyond_the_store_precision_are_refused_and_nothing_is_written():
    store = HostFeatureStore(FeatureConfig(dim=2, precision="fp16"))
    store.put(ids(0), torch.tensor([[1.0, 2.0]]))
    with pytest.raises(
        ValueError,
        match=r"put: id 1: feature value 100000.0 \(column 0\) is beyond the fp16",
    ):
        store.put(ids(0, 1), torch.tensor([[3.0, 4.0], [1e5, 0.0]]))
    assert store.get(ids(0)).tolist() == [[1.0, 2.0]] and store.num_rows == 1
    with pytest.raises(ValueError, match="beyond the fp32 range"):
        encode(torch.tensor([[1e39]], dtype=torch.float64), "fp32")
    # an infinity the caller gave is not an overflow
    assert encode(torch.tensor([[float("inf")]], dtype=torch.float64), "fp16").data.isinf().all()

    # rows are deduplicated before encoding: the message names the caller's id
    with pytest.raises(ValueError, match=r"put: id 5: feature value 100000.0"):
        store.put(ids(5, 0, 0), torch.tensor([[1e5, 0.0], [1.0, 1.0], [2.0, 2.0]]))
    # bf16 keeps float32's exponent but rounds the largest values up to infinity
    with pytest.raises(ValueError, match="beyond the bf16 range"):
        encode(torch.tensor([[3.4e38]]), "bf16", stochastic=False)
    with pytest.raises(ValueError, match="FeatureConfig.default 100000.0 is beyond the fp16"):
        FeatureConfig(dim=2, precision="fp16", default=1e5)
