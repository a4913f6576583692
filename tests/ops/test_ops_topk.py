"""ops.topk: the exact radix top-k (Triton, interpreter on CPU) against its torch.topk reference,
and the reference against a plain stable sort of the fp32 scores."""

import pytest
import torch

from hisparse.ops import switches
from hisparse.ops.topk import (
    INT32_MAX,
    INT32_MIN,
    TopkLaunch,
    TopkScratch,
    column_order,
    column_order_reference,
    orderable_keys,
    topk_select,
    topk_select_reference,
)

SENTINEL = -7


def random_scores(T, W, distinct, g):
    """fp32 scores with ``distinct`` values per row (heavy ties when small), some -inf, NaN,
    -0.0 and +inf."""
    vals = torch.randn(T, distinct, generator=g) * 3
    sc = vals.gather(1, torch.randint(0, distinct, (T, W), generator=g))
    special = torch.rand(T, W, generator=g)
    sc[special < 0.05] = float("-inf")
    sc[(special >= 0.05) & (special < 0.07)] = -0.0
    sc[(special >= 0.07) & (special < 0.08)] = 0.0
    sc[(special >= 0.08) & (special < 0.085)] = float("nan")
    sc[(special >= 0.085) & (special < 0.09)] = float("inf")
    return sc


def make_keys(T, W, distinct, lengths, seed, invalid=0.1):
    """Keys of random scores, ``invalid`` of the columns INT32_MIN, and every column past a
    row's length poisoned with the largest key (selected if it were ever read)."""
    g = torch.Generator().manual_seed(seed)
    keys = orderable_keys(random_scores(T, W, distinct, g))
    keys[torch.rand(T, W, generator=g) < invalid] = INT32_MIN
    lengths = torch.tensor(lengths, dtype=torch.int32)
    past = torch.arange(W)[None, :] >= lengths.clamp(min=0)[:, None]
    keys[past] = INT32_MAX
    return keys, lengths


def sort_spec(scores, valid, k):
    """The contract in words: valid columns by score descending (NaN first, -0.0 == 0.0),
    ties by the lower column, ``-1`` padding."""
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
    for t in range(scores.shape[0]):
        cols = valid[t].nonzero().squeeze(1)
        order = torch.sort(scores[t, cols], descending=True, stable=True).indices
        sel = cols[order][:k]
        out[t, :sel.numel()] = sel.to(torch.int32)
    return out


def test_orderable_keys_order_is_the_stable_float_sort():
    g = torch.Generator().manual_seed(0)
    sc = random_scores(4, 300, 40, g)
    sc[0, :5] = torch.tensor([-0.0, 0.0, float("nan"), -float("nan"), 1e-45])
    keys = orderable_keys(sc)
    assert not (keys == INT32_MIN).any()                  # no score collides with "invalid"
    for t in range(4):
        want = torch.sort(sc[t], descending=True, stable=True).indices
        got = torch.sort(keys[t], descending=True, stable=True).indices
        assert torch.equal(got, want)


@pytest.mark.parametrize("k", [1, 5, 64])
def test_reference_is_the_sort_spec(k):
    g = torch.Generator().manual_seed(k)
    T, W = 5, 120
    sc = random_scores(T, W, 6, g)
    keys = orderable_keys(sc)
    keys[torch.rand(T, W, generator=g) < 0.2] = INT32_MIN
    lengths = torch.tensor([0, 1, 50, 120, 400], dtype=torch.int32)
    valid = (keys != INT32_MIN) & (torch.arange(W)[None, :] < lengths[:, None])
    got = topk_select_reference(keys, lengths, k)
    assert torch.equal(got, sort_spec(sc, valid, k))


# (k, distinct values per row, row lengths, splits): heavy ties, k above and below the length,
# empty rows, a length past the width (clamped), several programs per row
CASES = [
    (16, 3, [0, 1, 16, 17, 300], 3),
    (64, 1000, [300, 64, 65, 2, 250], 2),
    (8, 2, [300, 8, 9, 120, 299], 1),
]


@pytest.mark.parametrize("k,distinct,lengths,splits", CASES)
def test_triton_matches_reference(triton_cpu, k, distinct, lengths, splits):
    W = 300
    keys, lens = make_keys(len(lengths), W, distinct, [min(n, 320) for n in lengths], seed=k)
    lens[-1] = 10_000 if lengths[-1] == W else lens[-1]          # past the width: clamped
    out = torch.full((len(lengths), k), SENTINEL, dtype=torch.int32)
    got = topk_select(keys, lens, k, out=out, scratch=TopkScratch(9, "cpu"), splits=splits)
    assert got.data_ptr() == out.data_ptr()
    want = topk_select_reference(keys, lens, k)
    assert torch.equal(got, want)
    n_valid = ((keys != INT32_MIN) & (torch.arange(W)[None, :] < lens[:, None])).sum(1)
    assert torch.equal((got >= 0).sum(1), n_valid.clamp(max=k).int())


def test_column_order_reference_is_the_ranked_set_sorted():
    """``ranked=False``'s spec: the ranked selection's columns ascending, ``-1`` last."""
    keys, lens = make_keys(4, 90, 6, [90, 0, 13, 57], seed=5)
    ranked = topk_select_reference(keys, lens, 20)
    cols = topk_select_reference(keys, lens, 20, ranked=False)
    for t in range(4):
        chosen = sorted(c for c in ranked[t].tolist() if c >= 0)
        assert cols[t].tolist() == chosen + [-1] * (20 - len(chosen))
    assert torch.equal(column_order_reference(ranked), cols)


def _ranked_selections(T, k, W, band, seed, device="cpu"):
    """``[T, k + band]`` int32 rows of distinct columns below ``W`` in random (rank) order,
    row ``t`` holding ``n_t <= k`` of them in its first ``k`` slots then ``-1`` (one row
    empty, one full), the band slots random: returns the ``[T, k]`` view of the first ``k``."""
    g = torch.Generator().manual_seed(seed)
    sel = torch.randint(0, W, (T, k + band), generator=g, dtype=torch.int32)
    counts = torch.randint(0, k + 1, (T,), generator=g)
    counts[0], counts[-1] = 0, k
    for t in range(T):
        n = int(counts[t])
        sel[t, :k] = -1
        sel[t, :n] = torch.randperm(W, generator=g)[:n].int()
    return sel.to(device)[:, :k]


@pytest.mark.parametrize("k,band", [(1, 0), (5, 3), (64, 64), (100, 7)])
def test_triton_column_order_kernel_matches_reference(triton_cpu, k, band):
    """The engine's sort of a ranked top k (a view of the k + band selection): every row's
    columns ascending, ``-1`` last, into a poisoned output; ``column_order`` takes the view."""
    from hisparse.ops._topk_triton import column_order_triton

    sel = _ranked_selections(6, k, 3 * k + 5, band, seed=k + band)
    want = column_order_reference(sel)
    for t in range(6):
        chosen = sorted(c for c in sel[t].tolist() if c >= 0)
        assert want[t].tolist() == chosen + [-1] * (k - len(chosen))
    out = torch.full((6, k), SENTINEL, dtype=torch.int32)
    assert torch.equal(column_order_triton(sel, out), want)
    assert torch.equal(column_order(sel), want)
    spaced = torch.full((6, 2 * k), SENTINEL, dtype=torch.int32)
    spaced[:, ::2] = sel                        # a column stride of 2: copied first
    assert torch.equal(column_order(spaced[:, ::2]), want)


def _poisoned_bits(rows, width, seed):
    """Bitmap scratch for :func:`column_order` (``2 * ceil(width / 32)`` words a row, and
    some spare), full of garbage: the count must clear what it reads."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (rows, 2 * -(-width // 32) + 5), generator=g,
                         dtype=torch.int32)


@pytest.mark.parametrize("k,band,W", [(1, 0, 1), (5, 3, 32), (64, 64, 197), (100, 7, 4096),
                                      (33, 0, 33), (64, 4, 64)])
def test_triton_column_order_by_count_matches_reference(triton_cpu, k, band, W):
    """The bitmap count (no sort) over poisoned scratch: every row's columns ascending,
    ``-1`` last, into a poisoned output, in place (the engine's use), and from a view of the
    k + band selection; columns at word edges (0, 31, 32, W - 1) included by the widths."""
    sel = _ranked_selections(6, k, W, band, seed=k + W)
    want = column_order_reference(sel)
    bits = _poisoned_bits(7, W, seed=k)
    out = torch.full((6, k), SENTINEL, dtype=torch.int32)
    assert torch.equal(column_order(sel, out, bits, W), want)
    whole = torch.cat([sel, torch.randint(0, W, (6, band), dtype=torch.int32)], 1)  # k + band
    band_before = whole[:, k:].clone()
    view = whole[:, :k]
    assert torch.equal(column_order(view, view, _poisoned_bits(6, W, seed=k + 1), W), want)
    assert torch.equal(whole[:, :k], want) and torch.equal(whole[:, k:], band_before)


def test_column_order_by_count_refuses_small_scratch(triton_cpu):
    sel = _ranked_selections(3, 8, 100, 0, seed=1)
    with pytest.raises(ValueError, match="column_order_triton: bits must be"):
        column_order(sel, None, torch.zeros(3, 7, dtype=torch.int32), 100)   # needs 8 words
    with pytest.raises(ValueError, match="column_order_triton: bits must be"):
        column_order(sel, None, torch.zeros(2, 8, dtype=torch.int32), 100)   # 3 rows
    with pytest.raises(ValueError, match="column_order_triton: bits must be"):   # rows overlap
        column_order(sel, None, torch.zeros(40, dtype=torch.int32).as_strided((3, 8), (4, 1)),
                     100)
    with pytest.raises(ValueError, match="column_order: out must be"):
        column_order(sel, torch.zeros(3, 9, dtype=torch.int32))


def test_column_order_refuses_other_shapes_and_dtypes():
    with pytest.raises(ValueError, match="column_order: selection must be"):
        column_order(torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="column_order: selection must be"):
        column_order(torch.zeros(4, dtype=torch.int32))


@pytest.mark.parametrize("mode", ["fused", "legacy"])
@pytest.mark.parametrize("k,distinct,lengths,splits", CASES + [(40, 2, [160, 39, 41, 0], 4)])
def test_triton_column_order_matches_reference(triton_cpu, kernel_switches, mode, k, distinct,
                                               lengths, splits):
    """``ranked=False``: the same selection in column order, the ties taken by lower column
    across the programs of a row (one launch where a row has one program, else one a phase:
    count, then collect), ``-1`` past it into a poisoned output; ``legacy`` runs as
    ``phased``."""
    kernel_switches(topk=mode)
    W = 300
    keys, lens = make_keys(len(lengths), W, distinct, lengths, seed=k + splits)
    out = torch.full((len(lengths), k), SENTINEL, dtype=torch.int32)
    scratch = TopkScratch(9, "cpu")
    scratch.counts.fill_(-977)                  # written before read by each call
    got = topk_select(keys, lens, k, out=out, scratch=scratch, splits=splits,
                      launch=TopkLaunch(block=32), ranked=False)
    assert torch.equal(got, topk_select_reference(keys, lens, k, ranked=False))


@pytest.mark.parametrize("splits", [1, 3])
def test_triton_column_order_later_digits_and_all_ties(triton_cpu, splits):
    """Thresholds resolved at later digits and rows of one repeated key (every column a tie,
    split over three programs): the ties kept are the lowest columns, in column order."""
    T, W, k = 5, 150, 40
    keys = bucket_keys(T, W, seed=9)
    keys[3] = 4242
    lens = torch.tensor([150, 150, 131, 150, 97], dtype=torch.int32)
    got = topk_select(keys, lens, k, scratch=TopkScratch(T, "cpu"), splits=splits,
                      launch=TopkLaunch(block=16), ranked=False)
    assert torch.equal(got, topk_select_reference(keys, lens, k, ranked=False))
    assert got[3].tolist() == list(range(k))


@pytest.mark.parametrize("ranked", [True, False])
@pytest.mark.parametrize("sparse,splits", [(0, 3), (5, 1), (5, 4), (16, 3)])
def test_triton_sparse_blocks_add_one_by_one(triton_cpu, sparse, splits, ranked):
    """``TopkLaunch(sparse=n)``: past the first digit a block with at most ``n`` columns in
    the threshold bucket adds them into the histograms by atomics, the others by a histogram
    (rows with few and with many such columns a block, both in one program): the same
    selection and order, into split histograms poisoned first (each sparse level zeroes its
    slot before adding)."""
    T, W, k = 5, 150, 40
    keys = bucket_keys(T, W, seed=sparse + splits)
    keys[4, ::7] = INT32_MIN
    lens = torch.tensor([150, 150, 131, 150, 97], dtype=torch.int32)
    scratch = TopkScratch(T, "cpu")
    scratch.split_hist.fill_(7919)
    out = torch.full((T, k), SENTINEL, dtype=torch.int32)
    got = topk_select(keys, lens, k, out=out, scratch=scratch, splits=splits,
                      launch=TopkLaunch(block=16, sort_chunk=16, sparse=sparse), ranked=ranked)
    assert torch.equal(got, topk_select_reference(keys, lens, k, ranked=ranked))


@pytest.mark.parametrize("mode", ["fused", "phased"])
@pytest.mark.parametrize("short,k", [(64, 40), (256, 40), (64, 7), (256, 130), (1024, 40)])
def test_triton_short_rows_in_registers(triton_cpu, kernel_switches, mode, short, k):
    """``TopkLaunch(short_rows=n)``: rows of at most ``n`` columns by the one-program kernel
    (empty, shorter than k, decided at every digit, heavy ties, invalid keys), the longer ones
    by the launch after it, into one poisoned output: column order as the reference's, the
    long rows' lengths handed over in the scratch (poisoned first). 1024: past the table's
    width, every row is short (the kernel holds ``next_pow2(W)`` columns, not 1024)."""
    kernel_switches(topk=mode)
    T, W = 8, 300
    keys = torch.cat([bucket_keys(5, W, seed=short + k), make_keys(3, W, 3, [W] * 3, seed=k)[0]])
    keys[4, ::7] = INT32_MIN
    # row 2 (three lower-digit values) and row 7 (three scores) short: ties past what is needed
    lens = torch.tensor([short, 150, short, short - 1, W, min(k - 2, short), short + 1, short],
                        dtype=torch.int32)
    lens[6 if short > 64 else 5] = 0                            # an empty row
    scratch = TopkScratch(T, "cpu")
    scratch.long_lengths.fill_(-31)
    out = torch.full((T, k), SENTINEL, dtype=torch.int32)
    got = topk_select(keys, lens, k, out=out, scratch=scratch, splits=3,
                      launch=TopkLaunch(block=32, short_rows=short), ranked=False)
    assert torch.equal(got, topk_select_reference(keys, lens, k, ranked=False))
    row = min(short, 512)                                       # next_pow2(W)
    assert scratch.long_lengths.tolist() == [min(n, W) if min(n, W) > row else 0
                                             for n in lens.tolist()]


def test_short_rows_limit_checked(triton_cpu):
    """``short_rows`` not a power of two in 16..16384 is refused, naming the field."""
    keys = torch.zeros((1, 64), dtype=torch.int32)
    lens = torch.tensor([64], dtype=torch.int32)
    for bad in (8, 100, 32768):
        with pytest.raises(ValueError, match="short_rows must be 0 or a power of two"):
            topk_select(keys, lens, 4, launch=TopkLaunch(short_rows=bad), ranked=False)


def test_sparse_limit_checked(triton_cpu):
    """A negative ``sparse`` is refused, naming the field and the limit."""
    keys = torch.zeros((1, 64), dtype=torch.int32)
    lens = torch.tensor([64], dtype=torch.int32)
    with pytest.raises(ValueError, match="sparse must be >= 0"):
        topk_select(keys, lens, 4, launch=TopkLaunch(block=16, sparse=-1))


def bucket_keys(T, W, seed):
    """Keys whose top digit is shared by many columns, so that most of a row lands in the
    top digit's threshold bucket and later digits decide:
    row 0 one top digit, ties in the last two; row 1 a quarter of the columns in a higher
    bucket; row 2 one top digit with every lower digit drawn from 3 values (ties at the last
    digit, by column); the rest random full keys."""
    g = torch.Generator().manual_seed(seed)
    low = torch.randint(0, 1 << 24, (T, W), generator=g, dtype=torch.int64)
    top = torch.full((T, W), 0x40, dtype=torch.int64)
    low[0] = (low[0] >> 16) << 16
    top[1, torch.rand(W, generator=g) < 0.25] = 0x41
    low[2] = torch.tensor([0x010101, 0x010102, 0x020101])[torch.randint(0, 3, (W,), generator=g)]
    top[3:] = torch.randint(0, 256, (T - 3, W), generator=g)
    u = (top << 24) | low                                       # unsigned order
    return (u - (1 << 31)).to(torch.int32)                      # signed key, same order


@pytest.mark.parametrize("splits,block", [(1, 16), (3, 16), (4, 32)])
@pytest.mark.parametrize("k", [7, 40, 130])
def test_triton_later_digits_decide(triton_cpu, splits, block, k):
    """Rows decided by the later digits (the threshold bucket spread over several programs'
    chunks, blocks partly tied) give the reference's selection and order."""
    T, W = 5, 150
    keys = bucket_keys(T, W, seed=k + splits)
    keys[4, ::7] = INT32_MIN
    lens = torch.tensor([150, 150, 131, 150, 97], dtype=torch.int32)
    out = torch.full((T, k), SENTINEL, dtype=torch.int32)
    got = topk_select(keys, lens, k, out=out, scratch=TopkScratch(T, "cpu"), splits=splits,
                      launch=TopkLaunch(block=block, sort_chunk=16))
    assert torch.equal(got, topk_select_reference(keys, lens, k))


# (k, distinct, row lengths, sort chunk): the split sort over several chunks per row, k not a
# multiple of the chunk, selections filling part of a chunk or none, heavy ties, k above a row's
# length (-1 tails), many distinct values
SORT_CASES = [
    (50, 2, [160, 1, 49, 51, 0], 16),
    (40, 1 << 20, [150, 39, 40, 7, 41], 16),
    (1, 2, [0, 1, 160], 16),
]


# the interpreter runs "fused" with two programs a row as one launch per phase ("phased"): the
# GPU tests cover both
@pytest.mark.parametrize("mode,case", [("fused", c) for c in SORT_CASES]
                         + [("legacy", SORT_CASES[0])])
def test_triton_sort_modes_match_reference(triton_cpu, kernel_switches, mode, case):
    k, distinct, lengths, chunk = case
    kernel_switches(topk=mode)
    W = 160
    keys, lens = make_keys(len(lengths), W, distinct, lengths, seed=k + chunk)
    out = torch.full((len(lengths), k), SENTINEL, dtype=torch.int32)
    got = topk_select(keys, lens, k, out=out, scratch=TopkScratch(8, "cpu"), splits=2,
                      launch=TopkLaunch(sort_chunk=chunk, block=64))
    assert torch.equal(got, topk_select_reference(keys, lens, k))


@pytest.mark.parametrize("splits", [1, 3])
def test_triton_sort_over_many_chunks(triton_cpu, kernel_switches, splits):
    """Rows of 0 to 600 selected entries of heavy ties, sorted in up to ten chunks over one or
    three programs (the packed entries the collect wrote, sorted in place, then merged): the
    reference's order, in one launch (one program a row) or one launch a phase."""
    kernel_switches(topk="fused")
    W, k = 700, 600
    lengths = [700, 20, 130, 129, 385, 0]
    keys, lens = make_keys(len(lengths), W, 5, lengths, seed=splits, invalid=0.02)
    out = torch.full((len(lengths), k), SENTINEL, dtype=torch.int32)
    scratch = TopkScratch(8, "cpu")
    scratch.sorted.fill_(2**63 - 1)             # a slot the collect missed would rank first
    scratch.split_hist.fill_(977)
    got = topk_select(keys, lens, k, out=out, scratch=scratch, splits=splits,
                      launch=TopkLaunch(sort_chunk=64, block=128))
    assert torch.equal(got, topk_select_reference(keys, lens, k))


@pytest.mark.parametrize("mode", ["fused", "legacy"])
@pytest.mark.parametrize("lengths", [[150, 0, 97, 0, 0, 1, 0, 0], [150, 0, 0, 0, 0, 0, 0, 120],
                                     [0, 0, 0, 0], [0, 120, 0], [150, 97, 120], [150]])
def test_triton_padding_rows_give_their_programs_to_the_live_rows(triton_cpu, kernel_switches,
                                                                   mode, lengths):
    """Empty rows (a graph bucket's padding) take no program: the launch's T programs serve
    the live rows (here 1-3 live rows of up to 8: 2-4 splits each where the caller's launch
    gave one), each live row's splits in consecutive split slots from 0 (the slots past them
    keep a marker), the empty rows still come out all -1 into a poisoned output."""
    import triton

    from hisparse.ops._common import MAX_SPLITS
    from hisparse.ops._topk_triton import LEGACY_SPLITS, LIVE_MAX_ROWS

    kernel_switches(topk=mode)
    T, W, k, block = len(lengths), 150, 40, 16
    assert T <= LIVE_MAX_ROWS
    keys, lens = make_keys(T, W, 7, lengths, seed=T + sum(lengths))
    out = torch.full((T, k), SENTINEL, dtype=torch.int32)
    scratch = TopkScratch(T, "cpu")
    scratch.split_hist.fill_(-5)
    got = topk_select(keys, lens, k, out=out, scratch=scratch,
                      launch=TopkLaunch(block=block, sort_chunk=16))
    assert torch.equal(got, topk_select_reference(keys, lens, k))
    assert (got[lens == 0] == -1).all()
    n_live = int((lens > 0).sum())
    most = min(MAX_SPLITS if mode == "fused" else LEGACY_SPLITS, triton.cdiv(W, block))
    used = n_live * min(most, T // max(n_live, 1))      # the interpreter: one program a row
    assert (scratch.split_hist[used:] == -5).all()
    assert used == 0 or (scratch.split_hist[:used] != -5).any()


def test_triton_one_launch_skips_resolved_digits(triton_cpu, kernel_switches, kernel_launches):
    """The fused mode's one launch (run by the interpreter where each row has one program):
    the reference's result, and a row's programs pass the barrier of a digit only while its
    threshold is unresolved (the arrival counters in the row's hist state): distinct top
    digits resolve at digit 0, pairs of top digits with k odd at digit 1, one key repeated
    only at the last digit, and a row of fewer valid columns than k at digit 0."""
    from hisparse.ops import _topk_triton as tk

    kernel_switches(topk="fused")
    T, W, k = 5, 150, 41
    g = torch.Generator().manual_seed(3)
    col = torch.arange(W, dtype=torch.int64)
    distinct = torch.randperm(256, generator=g)[:W].to(torch.int64)
    pairs = torch.randperm(W // 2, generator=g).repeat(2).to(torch.int64)
    second = (col << 16) | torch.randint(0, 1 << 16, (W,), generator=g, dtype=torch.int64)
    keys = torch.empty(T, W, dtype=torch.int32)
    keys[0] = (((distinct << 24) | second) - (1 << 31)).to(torch.int32)
    keys[1] = (((pairs << 24) | second) - (1 << 31)).to(torch.int32)
    keys[2] = 777
    keys[3] = keys[0]
    keys[4] = bucket_keys(5, W, seed=4)[2]
    lens = torch.tensor([W, W, W, k - 5, W], dtype=torch.int32)
    launches = kernel_launches(tk, "_topk_select_kernel", "FIRST", "LAST")
    scratch = TopkScratch(T, "cpu")
    out = torch.full((T, k), SENTINEL, dtype=torch.int32)
    got = topk_select(keys, lens, k, out=out, scratch=scratch, splits=1,
                      launch=TopkLaunch(block=32, sort_chunk=16))
    assert torch.equal(got, topk_select_reference(keys, lens, k))
    assert launches == [(0, tk.RADIX_LEVELS + 2)]
    bars = scratch.hist[:, tk.BAR_OFFSET:tk.BAR_OFFSET + tk.RADIX_LEVELS + 2].tolist()
    assert bars[0] == [1, 0, 0, 0, 1, 1]
    assert bars[1] == [1, 1, 0, 0, 1, 1]
    assert bars[2] == [1, 1, 1, 1, 1, 1]
    assert bars[3] == [1, 0, 0, 0, 1, 1]
    assert bars[4] == [1, 1, 1, 1, 1, 1]        # three low keys: ties to the last digit


def test_sort_mode_and_chunk_refused(triton_cpu, monkeypatch):
    keys, lens = make_keys(2, 40, 5, [40, 20], seed=1)
    with pytest.raises(ValueError, match="sort_chunk"):
        topk_select(keys, lens, 8, launch=TopkLaunch(sort_chunk=24))
    monkeypatch.setenv("HISPARSE_TOPK", "bitonic")
    with pytest.raises(ValueError, match="HISPARSE_TOPK='bitonic'"):
        switches.reload()


def test_triton_all_equal_and_all_invalid(triton_cpu):
    """Every key equal (the threshold is resolved only at the last digit: ties by column) and
    rows of invalid keys only; the scratch is reused across calls (zeroed by each)."""
    T, W, k = 3, 120, 20
    keys = torch.full((T, W), 12345, dtype=torch.int32)
    keys[1] = INT32_MIN
    keys[2, ::3] = INT32_MIN
    lens = torch.tensor([120, 120, 90], dtype=torch.int32)
    scratch = TopkScratch(4, "cpu")
    for _ in range(2):
        got = topk_select(keys, lens, k, scratch=scratch, splits=2)
        assert got[0].tolist() == list(range(k))
        assert (got[1] == -1).all()
        assert got[2].tolist() == [c for c in range(W) if c % 3][:k]


def test_bad_arguments():
    keys = torch.zeros(4, 10, dtype=torch.int32)
    lens = torch.full((4,), 10, dtype=torch.int32)
    with pytest.raises(ValueError, match="k must be"):
        topk_select(keys, lens, 0)
    with pytest.raises(ValueError, match="out must be"):
        topk_select(keys, lens, 3, out=torch.empty(4, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        topk_select(keys.long(), lens, 3)


def test_scratch_too_small(triton_cpu):
    keys = torch.zeros(4, 10, dtype=torch.int32)
    lens = torch.full((4,), 10, dtype=torch.int32)
    with pytest.raises(ValueError, match="scratch"):
        topk_select(keys, lens, 3, scratch=TopkScratch(2, "cpu"))


def test_triton_largest_block_all_ties(triton_cpu):
    """Blocks of 16,384 tied columns (the largest block): both counts share one int32 scan
    (ties in its upper half) and must still rank the ties in column order; a larger block is
    refused by name."""
    T, W, k = 2, 32768, 8
    keys = torch.full((T, W), 7, dtype=torch.int32)
    lens = torch.tensor([W, W - 5], dtype=torch.int32)
    scratch = TopkScratch(T, "cpu")
    scratch.sorted.fill_(123)
    got = topk_select(keys, lens, k, scratch=scratch, launch=TopkLaunch(block=16384))
    assert torch.equal(got, topk_select_reference(keys, lens, k))
    with pytest.raises(ValueError, match="block must be"):
        topk_select(keys, lens, k, scratch=scratch, launch=TopkLaunch(block=32768))


def test_fits_per_sm_counts_each_limit():
    """Programs an SM holds (H100 limits: 65,536 registers, 2,048 threads, 228 KiB shared),
    each limit in turn the binding one."""
    from hisparse.ops._topk_triton import _fits_per_sm
    assert _fits_per_sm(128, 8192, 4) == 4        # 4 x 128 threads x 128 registers
    assert _fits_per_sm(129, 8192, 4) == 3        # 136 registers a thread allocated
    assert _fits_per_sm(64, 60_000, 4) == 3       # shared memory (plus 1 KiB a program)
    assert _fits_per_sm(32, 0, 16) == 4           # threads
    assert _fits_per_sm(255, 0, 16) == 0          # does not fit at all
    assert _fits_per_sm(200, 0, 2) == 4           # registers per sub-partition: 6 warps each


def test_per_sm_default_by_the_busiest_sm():
    """4 programs an SM, or 3 or 2 where 4 would put PER_SM_MARGIN times the key blocks on the
    busiest SM; a given value stays. The picks the H100 measured (132 SMs, blocks of 1024,
    rows as long as the table), then the margin's two sides."""
    from hisparse.ops import _topk_triton as tk
    from hisparse.ops.topk import SPLIT_SLOTS
    sms, launch = 132, TopkLaunch(block=1024)

    def pick(T, W, cfg=launch):
        return tk._per_sm(T, W, sms, cfg, T + SPLIT_SLOTS)

    for T, W in [(8, 32768), (16, 32768), (32, 32768), (48, 32768), (8, 65536), (24, 65536),
                 (8, 131072), (16, 131072), (64, 2304), (96, 2304)]:
        assert pick(T, W) == 4, (T, W)
    # 24 rows of 32 blocks: 11 programs a row at 2 an SM (3 blocks each, 2 on an SM: 6 blocks
    # on the busiest), 16 at 3 (2 blocks, 3 on an SM: 6), 22 at 4 (2 blocks, 4 on an SM: 8)
    assert pick(24, 32768) == 3
    # 33 blocks (a 32k prompt and its outputs): 3 at 3 an SM (9), 2 at 2 (6), 4 at 4 (8)
    assert pick(24, 33280) == 2
    # 37 rows of 32 blocks: 10 at 2 an SM, 12 at 3 and 4: within the margin, 4
    assert pick(37, 32768) == 4
    assert pick(96, 2304, TopkLaunch(block=1024, per_sm=2)) == 2


def test_per_sm_model_splits_are_the_launch_splits():
    """The model counts the splits the fused launch takes (``_launch_config``) for the rows."""
    import triton

    from hisparse.ops import _topk_triton as tk
    from hisparse.ops.topk import SPLIT_SLOTS
    sms, cfg = 132, TopkLaunch(block=1024)
    for T, W in [(8, 32768), (24, 33280), (96, 2304), (200, 131072), (512, 4096)]:
        for p in (2, 3, 4):
            got = tk._launch_config(T, W, torch.device("cuda"), cfg, T + SPLIT_SLOTS, "fused",
                                    True, p * sms)
            want = max(1, min(p * sms // T, tk.MAX_SPLITS, triton.cdiv(W, 1024),
                              (T + SPLIT_SLOTS) // T))
            assert got == want, (T, W, p)


# ---------------------------------------------------------------------------------- GPU
def _gpu_keys(T, W, k, seed, distinct):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(W // 2, W + 1, (T,), generator=g)
    lengths[0], lengths[1], lengths[2] = 1, k - 3, 0
    lengths[3] = W
    keys, lens = make_keys(T, W, distinct, lengths.tolist(), seed, invalid=0.02)
    return keys.cuda(), lens.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("W", [32768, 131072])
@pytest.mark.parametrize("T", [8, 64])
@pytest.mark.parametrize("distinct", [4, 1 << 20])
@pytest.mark.parametrize("k", [2048, 2560])
def test_gpu_matches_reference(W, T, distinct, k):
    keys, lens = _gpu_keys(T, W, k, seed=T + W + distinct, distinct=distinct)
    out = torch.full((T, k), SENTINEL, dtype=torch.int32, device="cuda")
    got = topk_select(keys, lens, k, out=out, scratch=TopkScratch(T, "cuda"))
    want = topk_select_reference(keys, lens, k)
    assert torch.equal(got, want)


def _gpu_rows(T, W, k, seed, distinct):
    """Keys built on the GPU (fast at the real shapes): ``distinct`` values per row (ties when
    few), 2 % invalid, past-length columns poisoned with INT32_MAX, and row lengths covering
    empty, 1, k - 1, k, k + 1, the full width and random ones."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    sc = torch.randn(T, W, generator=g, device="cuda")
    if distinct < W:                            # ties: each score one of ``distinct`` values
        vals = torch.randn(T, distinct, generator=g, device="cuda")
        sc = vals.gather(1, torch.randint(0, distinct, (T, W), generator=g, device="cuda"))
    keys = orderable_keys(sc)
    keys[torch.rand(T, W, generator=g, device="cuda") < 0.02] = INT32_MIN
    lens = torch.randint(1, W + 1, (T,), generator=g, device="cuda").int()
    fixed = torch.tensor([W, 0, 1, k - 1, k, k + 1], dtype=torch.int32, device="cuda")
    n = min(T, fixed.numel())
    lens[:n] = fixed[:n].clamp(max=W)
    keys[torch.arange(W, device="cuda")[None, :] >= lens[:, None]] = INT32_MAX
    return keys, lens


# k: the selection (2048), the score policy's 2 x index_topk, odd sizes, and one beyond the
# sort scratch (the legacy ranking); rows: few (split rows, a fused launch's row barriers) to
# more than two per SM (one program per row)
GPU_SHAPES = [(8, 32768, 2048), (24, 32768, 4096), (1, 131072, 2048), (64, 32768, 2049),
              (300, 4096, 3000), (8, 131072, 4097)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode,T,W,k", [("fused", *s) for s in GPU_SHAPES]
                         + [(m, *s) for m in ("phased", "legacy") for s in GPU_SHAPES[:2]])
@pytest.mark.parametrize("distinct", [3, 1 << 30])
def test_gpu_modes_match_reference(kernel_switches, mode, T, W, k, distinct):
    kernel_switches(topk=mode)
    keys, lens = _gpu_rows(T, W, k, seed=T + k + distinct, distinct=distinct)
    scratch = TopkScratch(T, "cuda")
    want = topk_select_reference(keys, lens, k)
    for i in range(2):                          # the scratch reused: zeroed by each call
        if i:   # what a call writes before it reads, poisoned: stale values would be read
            scratch.split_hist.fill_(977)
            scratch.sorted.fill_(2**63 - 1)
        out = torch.full((T, k), SENTINEL, dtype=torch.int32, device="cuda")
        got = topk_select(keys, lens, k, out=out, scratch=scratch)
        assert torch.equal(got, want)
    assert scratch.stalls.item() == 0           # no row barrier gave up waiting


@pytest.mark.gpu
@pytest.mark.parametrize("mode,T,W,k", [("fused", *s) for s in GPU_SHAPES]
                         + [("phased", *s) for s in GPU_SHAPES[:2]])
@pytest.mark.parametrize("distinct", [3, 1 << 30])
def test_gpu_column_order_matches_reference(kernel_switches, mode, T, W, k, distinct):
    """``ranked=False`` at the real shapes (split rows: the per-split counts exchanged at a
    row barrier), twice on one scratch with what a call writes before it reads poisoned."""
    kernel_switches(topk=mode)
    keys, lens = _gpu_rows(T, W, k, seed=T + k + distinct + 1, distinct=distinct)
    scratch = TopkScratch(T, "cuda")
    want = topk_select_reference(keys, lens, k, ranked=False)
    for i in range(2):
        if i:
            scratch.split_hist.fill_(977)
            scratch.counts.fill_(-977)
        out = torch.full((T, k), SENTINEL, dtype=torch.int32, device="cuda")
        assert torch.equal(topk_select(keys, lens, k, out=out, scratch=scratch, ranked=False),
                           want)
    assert scratch.stalls.item() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("T,k,W,band", [(8, 2048, 32768, 2048), (96, 2048, 2304, 0),
                                        (42, 2048, 131072, 2048), (3, 2176, 32768, 0),
                                        (5, 100, 1000, 7), (4, 1, 9, 0), (6, 2048, 2048, 8),
                                        (4, 33, 33, 0)])
def test_gpu_column_order_kernel_matches_reference(T, k, W, band):
    """The one-launch sort of a ranked top k at the engine's shapes (a view of k + band
    selected columns; the MTP union's k) and at small k, into a poisoned output; the count
    over a bitmap the same, over poisoned scratch and in place."""
    from hisparse.ops._topk_triton import column_order_triton

    sel = _ranked_selections(T, k, W, band, seed=T + k, device="cuda")
    want = column_order_reference(sel)
    out = torch.full((T, k), SENTINEL, dtype=torch.int32, device="cuda")
    assert torch.equal(column_order_triton(sel, out), want)
    assert torch.equal(column_order(sel), want)
    out.fill_(SENTINEL)
    bits = _poisoned_bits(T, W, seed=T).cuda()
    assert torch.equal(column_order(sel, out, bits, W), want)   # by count
    whole = torch.cat([sel, torch.randint(0, W, (T, band), dtype=torch.int32, device="cuda")],
                      1)                   # in place on the k view of k + band (the engine's)
    band_before = whole[:, k:].clone()
    view = whole[:, :k]
    assert torch.equal(column_order(view, view, _poisoned_bits(T, W, seed=T + 1).cuda(), W),
                       want)
    assert torch.equal(whole[:, :k], want) and torch.equal(whole[:, k:], band_before)


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [TopkLaunch(sort_chunk=64), TopkLaunch(sort_chunk=1024),
                                    TopkLaunch(splits=8, warps=8), TopkLaunch(block=256),
                                    TopkLaunch(per_sm=4), TopkLaunch(stages=4),
                                    TopkLaunch(per_sm=4, stages=3), TopkLaunch(sparse=0),
                                    TopkLaunch(sparse=1024)])
@pytest.mark.parametrize("distinct", [50, 1 << 30])
def test_gpu_launch_hints_are_exact(launch, distinct):
    """Every launch hint selects exactly, in both orders, with heavy ties (50 values a row:
    dense threshold buckets) and without (randn: sparse ones past the first digit)."""
    T, W, k = 24, 32768, 2048
    keys, lens = _gpu_rows(T, W, k, seed=7, distinct=distinct)
    scratch = TopkScratch(T, "cuda")
    for ranked in (True, False):
        got = topk_select(keys, lens, k, scratch=scratch, launch=launch, ranked=ranked)
        assert torch.equal(got, topk_select_reference(keys, lens, k, ranked=ranked))
    assert scratch.stalls.item() == 0


@pytest.mark.gpu
def test_gpu_fused_launch_asks_no_more_than_fits():
    """Many rows take 4 programs an SM, checked against what the compiled kernel fits (all of
    a fused launch's programs must be resident); a hint beyond it is refused by name."""
    from hisparse.ops import _topk_triton as tk
    T, W, k = 96, 4096, 2048
    keys, lens = _gpu_rows(T, W, k, seed=11, distinct=1 << 20)
    scratch = TopkScratch(T, "cuda")
    assert tk._per_sm(T, W, tk._num_sms(keys.device.index or 0), TopkLaunch(block=1024),
                      scratch.split_hist.shape[0]) == 4
    tk._OCCUPANCY.clear()
    got = topk_select(keys, lens, k, scratch=scratch)
    assert torch.equal(got, topk_select_reference(keys, lens, k))
    assert scratch.stalls.item() == 0
    assert len(tk._OCCUPANCY) == 1 and min(tk._OCCUPANCY.values()) >= 4
    with pytest.raises(ValueError, match="per_sm=8"):
        topk_select(keys, lens, k, scratch=scratch, launch=TopkLaunch(per_sm=8, warps=16))


@pytest.mark.gpu
@pytest.mark.parametrize("ranked", [True, False])
def test_gpu_table_wider_than_its_rows(kernel_switches, ranked):
    """A graph's launch over a ``max_model_len``-wide table whose rows are much shorter (1k to
    32k of 160k columns, some empty): at every programs-an-SM count the fused launch's graphs,
    replayed with other lengths and ties, give the reference's selection, and no row barrier
    stalls."""
    kernel_switches(topk="fused")
    W, k, T = 163840, 2048, 24
    keys = torch.empty((T, W), dtype=torch.int32, device="cuda")
    lens = torch.zeros(T, dtype=torch.int32, device="cuda")
    out = torch.empty((T, k), dtype=torch.int32, device="cuda")
    scratch = TopkScratch(T, "cuda")
    graphs = {}
    for per_sm in (2, 3, 4):
        launch = TopkLaunch(per_sm=per_sm)
        topk_select(keys, lens, k, out=out, scratch=scratch, launch=launch, ranked=ranked)
        graphs[per_sm] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[per_sm]):
            topk_select(keys, lens, k, out=out, scratch=scratch, launch=launch, ranked=ranked)
    for i, longest in enumerate([32768, 2048, 20000, 1024, 32768]):
        kb, lb = _gpu_rows(T, longest, k, seed=40 + i, distinct=6 if i % 2 else 1 << 20)
        keys.fill_(INT32_MAX)                   # past every row's length: never selected
        keys[:, :longest].copy_(kb)
        lens.copy_(lb)
        want = topk_select_reference(keys, lens, k, ranked=ranked)
        for per_sm, graph in graphs.items():
            out.fill_(SENTINEL)
            graph.replay()
            assert torch.equal(out, want), (i, longest, per_sm)
    assert scratch.stalls.item() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("short", [4096, 8192])
def test_gpu_short_rows_in_graphs(kernel_switches, short):
    """``TopkLaunch(short_rows=n)`` in column order over a ``max_model_len``-wide table: graphs
    captured for 96 and 24 rows (ascending, as the engine captures), replayed with rows all
    short, all long, mixed and some empty, give the reference's selection; no row barrier
    stalls."""
    kernel_switches(topk="fused")
    W, k = 163840, 2048
    launch = TopkLaunch(short_rows=short)
    keys = torch.empty((96, W), dtype=torch.int32, device="cuda")
    lens = torch.zeros(96, dtype=torch.int32, device="cuda")
    out = torch.empty((96, k), dtype=torch.int32, device="cuda")
    scratch = TopkScratch(96, "cuda")
    graphs = {}
    for T in (24, 96):
        topk_select(keys[:T], lens[:T], k, out=out[:T], scratch=scratch, launch=launch,
                    ranked=False)
        graphs[T] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[T]):
            topk_select(keys[:T], lens[:T], k, out=out[:T], scratch=scratch, launch=launch,
                        ranked=False)
    for i, longest in enumerate([2304, short, 32768, short + 1, 2112]):
        kb, lb = _gpu_rows(96, longest, k, seed=70 + i, distinct=5 if i % 2 else 1 << 20)
        keys.fill_(INT32_MAX)                   # past every row's length: never selected
        keys[:, :longest].copy_(kb)
        lens.copy_(lb)
        for T in (96, 24):
            want = topk_select_reference(keys[:T], lens[:T], k, ranked=False)
            out.fill_(SENTINEL)
            graphs[T].replay()
            assert torch.equal(out[:T], want), (i, longest, T)
    assert scratch.stalls.item() == 0


@pytest.mark.gpu
def test_gpu_batch_invariant():
    """A row's selection does not depend on the other rows of the call (nor on how many)."""
    W, k = 32768, 2048
    keys, lens = _gpu_rows(64, W, k, seed=3, distinct=1000)
    scratch = TopkScratch(64, "cuda")
    full = topk_select(keys, lens, k, scratch=scratch).clone()
    for b in (1, 8, 24):
        assert torch.equal(topk_select(keys[:b], lens[:b], k, scratch=scratch), full[:b]), b


@pytest.mark.gpu
@pytest.mark.parametrize("mode,ranked", [("fused", True), ("phased", True), ("fused", False)])
def test_gpu_cuda_graph_buckets(kernel_switches, mode, ranked):
    """Graphs captured in ascending batch-bucket order (one scratch, as the caches own it),
    replayed growing and shrinking on fresh data: the eager reference's selections (ranked,
    or in column order). 24 rows of 32k take 3 programs an SM, the others 4."""
    kernel_switches(topk=mode)
    W, k = 32768, 2048
    buckets = [8, 16, 24, 32, 64]
    scratch = TopkScratch(max(buckets), "cuda")
    keys = torch.empty((max(buckets), W), dtype=torch.int32, device="cuda")
    lens = torch.zeros(max(buckets), dtype=torch.int32, device="cuda")
    outs = {b: torch.empty((b, k), dtype=torch.int32, device="cuda") for b in buckets}
    graphs = {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for b in buckets:       # warm-up compiles outside the capture
            topk_select(keys[:b], lens[:b], k, out=outs[b], scratch=scratch, ranked=ranked)
    torch.cuda.current_stream().wait_stream(stream)
    for b in buckets:
        graphs[b] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[b]):
            topk_select(keys[:b], lens[:b], k, out=outs[b], scratch=scratch, ranked=ranked)
    for i, b in enumerate([8, 32, 64, 24, 16, 8, 64, 24]):
        kb, lb = _gpu_keys(b, W, k, seed=100 + i, distinct=8 if i % 2 else 1 << 20)
        keys[:b].copy_(kb)
        lens[:b].copy_(lb)
        outs[b].fill_(SENTINEL)
        graphs[b].replay()
        assert torch.equal(outs[b], topk_select_reference(kb, lb, k, ranked=ranked)), (i, b)
    assert scratch.stalls.item() == 0
