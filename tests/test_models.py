"""Models over synthetic blocks: shapes, masking, TGN memory semantics, growth and state."""

import pytest
import torch

from tidegraph.models import (
    APAN,
    JODIE,
    MODELS,
    TGN,
    ModelConfig,
    TGNMemory,
    TimeEncoder,
    build_model,
)
from tidegraph.models.base import LinkPredictor, link_roots
from tidegraph.models.layers import TemporalAttention, blocks_bottom_up
from tidegraph.ops import native_bf16
from tidegraph.sampling import Block, TemporalSampler
from tidegraph.storage.events import EventBatch
from tidegraph.storage.graph import DynamicGraph

SMALL = dict(dim=16, time_dim=8, memory_dim=16)


def _graph(device, n_nodes=40, n_edges=400, seed=0):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n_nodes, (n_edges,), generator=gen)
    dst = torch.randint(0, n_nodes, (n_edges,), generator=gen)
    t = torch.arange(n_edges, dtype=torch.float64)
    graph = DynamicGraph(device=str(device))
    graph.add_edges(src.to(device), dst.to(device), t.to(device))
    return graph, src.to(device), dst.to(device), t.to(device)


def _score(model, sampler, src, dst, t, q=3):
    b = src.shape[0]
    neg = torch.randint(0, 40, (b, q), device=src.device)
    roots, ts = link_roots(src, dst, neg, t)
    return model.score(src, dst, neg, t, sampler.sample(roots, ts))


@pytest.mark.parametrize("name", MODELS)
def test_every_model_scores_and_backpropagates(name, device):
    torch.manual_seed(0)
    graph, src, dst, t = _graph(device)
    cfg = ModelConfig(name=name, **SMALL)
    snaps = 3 if name == "dysat" else 1
    sampler = TemporalSampler(
        graph, [5] * cfg.num_layers, num_snapshots=snaps, snapshot_window=50.0 if snaps > 1 else 0
    )
    model = build_model(cfg, graph.num_nodes, num_snapshots=snaps, fanouts=[5] * cfg.num_layers).to(
        device
    )
    pos, neg = _score(model, sampler, src[200:232], dst[200:232], t[200:232])
    assert pos.shape == (32,) and neg.shape == (32, 3)
    assert torch.isfinite(pos).all() and torch.isfinite(neg).all()
    (pos.sum() - neg.sum()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", ["tgat", "sage", "dysat", "tgn"])
def test_deduplicated_hops_give_the_same_scores(name, device):
    # recent sampling: a deduplicated layout is the same neighbourhoods, so the same scores
    torch.manual_seed(0)
    graph, src, dst, t = _graph(device)
    cfg = ModelConfig(name=name, num_layers=2, **SMALL)
    snaps = 2 if name == "dysat" else 1
    kw = dict(num_snapshots=snaps, snapshot_window=50.0 if snaps > 1 else 0.0)
    model = build_model(cfg, graph.num_nodes, num_snapshots=snaps).to(device).eval()
    neg = torch.randint(0, 40, (32, 3), device=device)
    roots, ts = link_roots(src[200:232], dst[200:232], neg, t[200:232])
    scores = []
    for dedup in (False, True):
        blocks = TemporalSampler(graph, [5, 5], dedup=dedup, **kw).sample(roots, ts)
        with torch.no_grad():
            scores.append(model.score(src[200:232], dst[200:232], neg, t[200:232], blocks))
        model.discard()
    for a, b in zip(*scores, strict=True):
        torch.testing.assert_close(a, b)


def _block(dst_ids, nbr_ids, mask, t=10.0, dt=None):
    """A hop over `mask`; valid slot j of a row is 1 + j before the root's time, or `dt`."""
    r, k = nbr_ids.shape
    ts = torch.full((r,), t, dtype=torch.float64)
    dt = 1 + torch.arange(k, dtype=torch.float64) if dt is None else dt.double()
    nbr_ts = torch.where(mask, ts.unsqueeze(1) - dt, ts.unsqueeze(1))
    return Block(
        dst_ids=dst_ids,
        dst_ts=ts,
        nbr_ids=torch.where(mask, nbr_ids, -1),
        nbr_ts=nbr_ts,
        nbr_eids=torch.where(mask, torch.arange(r * k).view(r, k), -1),
        dt=(ts.unsqueeze(1) - nbr_ts).float(),
        mask=mask,
    )


def test_bottom_up_passes_the_next_hops_results_as_valid_slots():
    mask0 = torch.tensor([[True, False, True], [False, False, False]])
    b0 = _block(torch.tensor([5, 6]), torch.tensor([[1, 0, 2], [0, 0, 0]]), mask0)
    roots1, _ = b0.next_roots()  # 5, 6, 1, 2
    b1 = _block(roots1, torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2, dtype=torch.bool))
    seen = {}

    def h0(ids):
        return ids.float().unsqueeze(-1)

    def layer(i, block, h_root, h_nbr):
        seen[i] = (h_root.clone(), h_nbr.clone())
        return h_root * 10

    out = blocks_bottom_up([b0, b1], h0, layer)
    assert seen[0][1].shape == (0, 1)  # b1 has no valid slot
    assert seen[1][0].squeeze(-1).tolist() == [50.0, 60.0]
    assert seen[1][1].squeeze(-1).tolist() == [10.0, 20.0]  # slots (0, 0) and (0, 2)
    assert out.squeeze(-1).tolist() == [500.0, 600.0]


def test_attention_matches_a_dense_reference_and_handles_empty_rows():
    torch.manual_seed(0)
    enc = TimeEncoder(3)
    att = TemporalAttention(4, enc, 2, 8, heads=2)
    mask = torch.tensor([[True, False, True], [False, False, False], [True, True, True]])
    r, k = mask.shape
    h_root, h_all = torch.randn(r, 4), torch.randn(r, k, 4)
    dt_all, e_all = torch.rand(r, k) * 10, torch.randn(r, k, 2)
    block = _block(torch.arange(r), torch.zeros(r, k, dtype=torch.int64), mask, dt=dt_all)
    dt_all = block.dt  # as the block holds them (float32)
    out = att(h_root, h_all[mask], dt_all[mask], e_all[mask], block)
    assert torch.isfinite(out).all()
    # reference: keys/values = W [h] + (time and edge projection, added to both); softmax over
    # each row's valid slots
    w_edge = torch.cat([att.kv_time.weight, att.kv_edge.weight], 1)
    x_edge = torch.cat([enc(dt_all), e_all], -1)
    key = (att.key(h_all) + x_edge @ w_edge.T).view(r, k, 2, 4)
    val = (att.value(h_all) + x_edge @ w_edge.T).view(r, k, 2, 4)
    q_weight = torch.cat([att.q.weight, att.q_time.weight], 1)
    q = (torch.cat([h_root, enc(torch.zeros(r))], -1) @ q_weight.T + att.q.bias).view(r, 2, 4)
    rows = []
    for i in range(r):
        if not mask[i].any():
            rows.append(torch.zeros(8))
            continue
        s = torch.einsum("hd,khd->hk", q[i], key[i][mask[i]]) / 2.0
        rows.append(torch.einsum("hk,khd->hd", s.softmax(-1), val[i][mask[i]]).flatten())
    ref = att.norm(att.merge(torch.cat([torch.stack(rows), h_root], -1)))
    torch.testing.assert_close(out, ref)


def test_memory_keeps_latest_event_per_node_even_unsorted():
    mem = TGNMemory(6, 4, 4, 2)
    src = torch.tensor([0, 1, 0, 2])
    dst = torch.tensor([1, 2, 3, 0])
    t = torch.tensor([5.0, 3.0, 9.0, 9.0], dtype=torch.float64)
    feat = torch.arange(8, dtype=torch.float32).view(4, 2)
    mem.observe(src, dst, t, feat)
    # node 0: events at 9 (row 2, other 3) and 9 (row 3, other 2): ties go to the later row
    assert mem.has_msg.tolist() == [True, True, True, True, False, False]
    assert mem.msg_other[:4].tolist() == [2, 0, 0, 0]
    assert mem.msg_t[:4].tolist() == [9.0, 5.0, 9.0, 9.0]
    assert mem.msg_feat[0].tolist() == [6.0, 7.0]


def test_memory_update_matches_a_per_node_reference():
    torch.manual_seed(0)
    mem = TGNMemory(5, 4, 3, 0)
    mem.memory.normal_()
    mem.observe(torch.tensor([0, 1]), torch.tensor([1, 3]), torch.tensor([2.0, 4.0]), None)
    ids = torch.tensor([0, 1, 2, 3])
    before = mem.state_tensors()
    new, last = mem.updated(ids)
    for name, value in mem.state_tensors().items():  # updated() has no side effects
        assert torch.equal(value, before[name]), name
    for row, v in enumerate(ids.tolist()):
        if not before["has_msg"][v]:
            assert torch.equal(new[row], before["memory"][v])
            continue
        other = int(before["msg_other"][v])
        dt = before["msg_t"][v] - before["last_update"][v]
        msg = torch.cat(
            [before["memory"][v], before["memory"][other], mem.time_enc(dt.float().view(1))[0]]
        )
        ref = mem.updater(msg.unsqueeze(0), before["memory"][v].unsqueeze(0))[0]
        torch.testing.assert_close(new[row], ref)
        assert float(last[row]) == float(before["msg_t"][v])
    mem.commit(ids, new, last)
    assert not mem.has_msg[ids].any()


def test_tgn_state_dict_carries_memory_and_grows(device):
    torch.manual_seed(0)
    model = TGN(10, **SMALL).to(device)
    model.memory.memory.normal_()
    model.grow(25)
    assert model.memory.num_nodes == 25
    state = model.state_dict()
    assert state["memory.memory"].shape == (25, 16)
    fresh = TGN(10, **SMALL).to(device)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.memory.memory, model.memory.memory)


def test_tgn_commit_records_events_and_discard_leaves_state(device):
    torch.manual_seed(0)
    graph, src, dst, t = _graph(device)
    sampler = TemporalSampler(graph, [5], seed=0)
    model = TGN(graph.num_nodes, **SMALL).to(device)
    ev = EventBatch(src[:20], dst[:20], t[:20] + 400, torch.arange(20, device=device))
    _score(model, sampler, ev.src, ev.dst, ev.t)
    model.discard()
    assert not model.memory.has_msg.any()
    _score(model, sampler, ev.src, ev.dst, ev.t)
    model.commit(ev)
    assert model.memory.has_msg[ev.src].all() and model.memory.has_msg[ev.dst].all()
    _score(model, sampler, ev.src, ev.dst, ev.t + 1)
    model.commit(None)
    assert not model.memory.has_msg.any()
    assert (model.memory.memory[ev.src].abs().sum(1) > 0).all()


def test_tgn_static_memory_starts_as_tgn_learns_and_stays_out_of_node_state(device):
    # built last, the zero table leaves every other parameter as plain TGN's: same scores
    graph, src, dst, t = _graph(device)
    sampler = TemporalSampler(graph, [5], seed=0)
    ev = EventBatch(src[:20], dst[:20], t[:20] + 400, torch.arange(20, device=device))
    models = []
    for static in (False, True):
        torch.manual_seed(0)
        models.append(TGN(graph.num_nodes, **SMALL, static_memory=static).to(device))
    plain, static = models
    torch.manual_seed(1)
    first = _score(plain, sampler, ev.src, ev.dst, ev.t)
    torch.manual_seed(1)
    pos, neg = _score(static, sampler, ev.src, ev.dst, ev.t)
    assert torch.equal(first[0], pos) and torch.equal(first[1], neg)
    (pos.sum() - neg.sum()).backward()
    table = static.static.table
    touched = torch.zeros(graph.num_nodes, dtype=torch.bool, device=device)
    touched[static._stash[0]] = True
    assert table.grad[touched].abs().sum(1).gt(0).any() and not table.grad[~touched].any()
    with torch.no_grad():
        table.add_(1.0)
    static.commit(ev)  # node state is the memory alone, never memory plus the table
    plain.commit(ev)
    assert torch.equal(static.memory.memory, plain.memory.memory)
    static.grow(graph.num_nodes + 7)
    assert table.shape[0] < static.static.table.shape[0] == graph.num_nodes + 7
    fresh = TGN(5, **SMALL, static_memory=True).to(device)
    fresh.load_state_dict(static.state_dict())
    assert torch.equal(fresh.static.table, static.static.table)


def test_a_steps_slices_commit_at_once_as_one_after_another(device):
    # W slices' rows (ids overlapping across slices, values differing): one batched commit
    # leaves what committing them in slice order leaves, the last slice's row winning
    torch.manual_seed(0)
    models = [TGN(30, **SMALL).to(device) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    models[0].memory.has_msg[::3] = True
    models[1].memory.has_msg[::3] = True
    gen = torch.Generator().manual_seed(1)
    rows = []
    for n in (12, 7, 15):
        ids = torch.randperm(30, generator=gen)[:n].to(device)
        rows.append((ids, torch.randn(n, 16, generator=gen).to(device),
                     torch.rand(n, generator=gen, dtype=torch.float64).to(device)))  # fmt: skip
    updates = [{"rows": rows[:2]}, None, {"rows": rows[2:]}]
    commits = []
    write = models[0].memory.commit
    models[0].memory.commit = lambda *a: commits.append(len(a[0])) or write(*a)
    models[0].apply_updates(updates)
    assert len(commits) == 1  # one write of the distinct nodes, whatever the slices
    assert commits[0] == len(torch.unique(torch.cat([r[0] for r in rows])))
    for ids, mem, last in rows:
        models[1].memory.commit(ids, mem, last)
    for name, table in models[1].memory.tables().items():
        assert torch.equal(models[0].memory.tables()[name], table), name


def test_static_memory_is_a_tgn_option():
    assert build_model(ModelConfig(name="tgn", static_memory=True, **SMALL), 4).static is not None
    with pytest.raises(ValueError, match="model.static_memory.*'tgat'"):
        ModelConfig(name="tgat", static_memory=True)


def test_jodie_projects_memory_over_time_since_last_update(device):
    torch.manual_seed(0)
    model = JODIE(6, dim=8, memory_dim=8, time_dim=4).to(device)
    model.memory.memory.normal_()
    model.memory.last_update.copy_(torch.tensor([0.0, 5, 10, 0, 0, 0], dtype=torch.float64))
    ids = torch.tensor([1, 2, 1], device=device)
    ts = torch.tensor([5.0, 30.0, 105.0], dtype=torch.float64, device=device)
    z = model.embed(ids, ts, [])
    dt = torch.tensor([0.0, 20.0, 100.0], device=device)
    w, b = model.time_proj.weight.squeeze(1), model.time_proj.bias
    projected = model.memory.memory[ids] * (1 + torch.log1p(dt).unsqueeze(1) * w + b)
    ref = model.out(torch.cat([projected, model.static.table[ids]], -1))
    torch.testing.assert_close(z, ref)
    # an event between updates: its message is folded in (RNN) and dt restarts from its time
    ev = EventBatch(ids[:1], ids[1:2], torch.tensor([50.0], device=device), ids[:1])
    model.commit(ev)
    model.embed(ids[:1], ts[2:], [])
    n_id, mem, last = model._stash
    assert float(last[0]) == 50.0 and not torch.equal(mem[0], model.memory.memory[1])
    with pytest.raises(ValueError, match="num_layers must be 0 for jodie"):
        ModelConfig(name="jodie", num_layers=1)


def test_link_predictor_pairs_equal_two_calls():
    torch.manual_seed(0)
    pred = LinkPredictor(6)
    z_src, z_dst, z_neg = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 3, 6)
    pos, neg = pred.pairs(z_src, z_dst, z_neg)
    torch.testing.assert_close(pos, pred(z_src, z_dst))
    torch.testing.assert_close(neg, pred(z_src, z_neg))


def test_apan_mailboxes_keep_the_newest_mails_and_reach_neighbours():
    torch.manual_seed(0)
    model = APAN(6, dim=4, time_dim=4, mailbox_size=2).eval()
    # one forward pass over 3 events (0->1 at t=1, 2, 3); node 0's sampled neighbours: 4 and 5
    src, dst = torch.tensor([0, 0, 0]), torch.tensor([1, 1, 1])
    t = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, True], [True, False]] + [[False, False]] * 6)
    nbr = torch.tensor([[4, 5], [4, 5], [5, 0]] + [[0, 0]] * 6)
    block = _block(torch.cat([src, dst, dst]), nbr, mask)
    model.score(src, dst, dst.view(3, 1), t, [block])
    model.commit(None)  # evaluation chunks queue their rows until the events are recorded
    model.commit(EventBatch(src, dst, t, torch.arange(3)))
    assert model.mail_count.tolist() == [3, 3, 0, 0, 2, 3]
    # rings of size 2 keep the two newest mails; node 4 got mails at t=1, 2, node 5 at 1, 2, 3
    assert sorted(model.mail_t[0].tolist()) == [2.0, 3.0]
    assert sorted(model.mail_t[4].tolist()) == [1.0, 2.0]
    assert sorted(model.mail_t[5].tolist()) == [2.0, 3.0]
    assert model.mail_t[2].tolist() == [-torch.inf, -torch.inf]
    assert model.last_update[:2].tolist() == [3.0, 3.0]
    # a mail is [z_self, z_other]: node 1's newest holds z_dst of the last event first
    newest = int(model.mail_t[1].argmax())
    torch.testing.assert_close(model.mail[1, newest, :4], model.memory[1])
    # only mails older than a root's time are read
    model.mail[0] = torch.randn(2, model.mail_dim)
    model.mail_t[0] = torch.tensor([2.0, 3.0], dtype=torch.float64)
    at = lambda t: model.embed(torch.tensor([0]), torch.tensor([t], dtype=torch.float64), [])
    before, after = at(2.5), at(3.5)
    model.mail_t[0, 1] = -torch.inf  # empty the newer slot: nothing changes at t=2.5
    torch.testing.assert_close(at(2.5), before)
    assert not torch.allclose(at(3.5), after)


def test_bf16_slot_projections_stay_close_to_fp32_and_auto_follows_the_device(device):
    torch.manual_seed(0)
    att = TemporalAttention(16, TimeEncoder(8), 12, 16, heads=2).to(device)
    mask = torch.rand(50, 10) < 0.7
    r, k = mask.shape
    h_root, h_all = torch.randn(r, 16), torch.randn(r, k, 16)
    dt_all, e_all = torch.rand(r, k) * 100, torch.randn(r, k, 12)
    ids = torch.zeros_like(mask, dtype=torch.int64)
    block = _block(torch.arange(r), ids, mask, dt=dt_all).to(device)
    dt_all = block.dt.cpu()
    args = [x.to(device) for x in (h_root, h_all[mask], dt_all[mask], e_all[mask])] + [block]
    out = {}
    for precision in ("fp32", "bf16", "auto"):
        att.slot_precision = precision
        att.zero_grad()
        out[precision] = att(*args)
        out[precision].square().sum().backward()
        out[precision] = (out[precision].detach(), att.kv_time.weight.grad.clone())
    assert out["fp32"][0].dtype == out["bf16"][0].dtype == torch.float32
    assert not torch.equal(out["fp32"][0], out["bf16"][0])  # the bf16 path did run
    torch.testing.assert_close(out["bf16"][0], out["fp32"][0], atol=0.05, rtol=0.05)
    # the weight gradient of the projection, computed in bf16, keeps its direction
    g32, g16 = out["fp32"][1].flatten(), out["bf16"][1].flatten()
    assert torch.nn.functional.cosine_similarity(g32, g16, 0) > 0.999
    native = native_bf16(device.type, device.index)
    # the same path (CUDA's index_add sums in any order: equal up to rounding there)
    torch.testing.assert_close(out["auto"][0], out["bf16" if native else "fp32"][0])


def test_build_model_sets_slot_precision_and_rejects_unknown_ones():
    model = build_model(ModelConfig(name="tgat", slot_precision="bf16", **SMALL), 10)
    atts = [m for m in model.modules() if isinstance(m, TemporalAttention)]
    assert len(atts) == 2 and all(a.slot_precision == "bf16" for a in atts)
    with pytest.raises(ValueError, match="model.slot_precision"):
        ModelConfig(slot_precision="fp8")


def test_unknown_model_is_rejected_naming_the_field():
    with pytest.raises(ValueError, match="model.name"):
        ModelConfig(name="gcnx")


def test_node_table_rows_depend_on_the_id_alone_not_on_how_the_table_grew():
    from tidegraph.models.layers import NodeInput

    torch.manual_seed(3)
    a = NodeInput(0, 4)
    torch.manual_seed(3)
    b = NodeInput(10, 4)
    global_state = torch.get_rng_state()
    for n in (7, 4100, 5000, 9000):
        a.grow(n)
    b.grow(9000)
    assert torch.equal(torch.get_rng_state(), global_state)  # growth draws nothing global
    assert torch.equal(a.table, b.table) and a.table.shape == (9000, 4)
    assert a.table[4096:4100].std() > 0.05  # a second block of real draws, not zeros
    c = NodeInput(0, 4)
    c.load_state_dict(a.state_dict())  # the seed travels: growing further stays the same
    c.grow(9500)
    a.grow(9500)
    assert torch.equal(a.table, c.table)
